"""The KV cache of an io-mode .tflite Transformer, as its signatures and the runner share it
(numpy only, so the LiteRT runner does not import TensorFlow).

The cache is one float32 [Hkv, S, Dh] input per layer and K/V (`k_cache_0`, `v_cache_0`, ...).
A `prefill` or `decode` call reads them and returns only its new entries (`kv`,
[L, 2, Hkv, T, Dh]); the caller writes those rows into the caches.
"""

from __future__ import annotations

import numpy as np


def cache_names(num_layers: int) -> list[str]:
    """The per-layer cache inputs, in signature order: k_cache_0, v_cache_0, k_cache_1, ..."""
    return [f"{kind}_cache_{layer}" for layer in range(num_layers) for kind in ("k", "v")]


def write_entries(caches: list[np.ndarray], entries: np.ndarray, start: int) -> None:
    """Writes a call's new entries [L, 2, Hkv, T, Dh] into `caches` ([Hkv, S, Dh] each,
    ordered as `cache_names`) at rows start .. start+T-1, in place."""
    length = entries.shape[3]
    for index, cache in enumerate(caches):
        cache[:, start:start + length] = entries[index // 2, index % 2]
