"""Continuous-batching engine: requests, scheduler, KV-cache accounting (plain Python),
and the runner (the one module here that imports TensorFlow)."""
