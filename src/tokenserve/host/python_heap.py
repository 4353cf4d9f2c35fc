"""Start-up without Python's cycle collector walking what the imports built.

Importing TensorFlow (with Keras and tf.keras) creates about 270,000 objects that the cycle
collector tracks, and the web stack adds more; none of them is garbage, yet while they
are created the collector's full passes walk all of them again and again as the heap grows.
On a 2-core EPYC `import tensorflow` took 5.4-5.9 s with the collector on and 4.2-4.8 s with
it off. Pausing it for the imports, then freezing what they made (`gc.freeze`: moved to a
permanent generation that later passes skip) also makes every later collection, during
loading, warm-up and serving, cheaper. The engine freezes its own start-up objects the
same way when it starts (observability.memory.freeze_python_heap); CPython's documentation
recommends this pattern for servers that build a large heap before they serve.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collector_paused():
    """Runs the block with the cycle collector off, then freezes every tracked object (the
    block's and any before it) and turns the collector back on if it was. Cycles of garbage
    made inside the block are frozen too, so use it around imports, not around work that
    churns objects."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
