"""What tokenserve reads from the machine it runs on: the CPUs it may use (affinity and
cgroup quota), the CPU's feature flags, the user cache directory, and the Python heap's
cycle collector at start-up. Plain Python (standard library only), so every layer may
import it."""
