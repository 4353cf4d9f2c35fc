"""Rotary position embedding's frequencies, in NumPy (no TensorFlow): the one definition the
model's layers, the LiteRT graph and the checkpoint importers share.

Pair i of every head turns rope_theta ** (-2i / head_dim) radians per position, divided by
the config's rope_freq_factors when it has them (Llama 3.1+'s "llama3" scaling, which
llama3_rope_factors computes from config.json and llama.cpp stores as `rope_freqs.weight`).
"""

from __future__ import annotations

import numpy as np


def rope_inverse_frequencies(head_dim: int, theta: float,
                             freq_factors: tuple[float, ...] = ()) -> np.ndarray:
    """Radians per position of each rotated pair, float64 [head_dim / 2]."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2) / head_dim))
    if freq_factors:
        inv_freq = inv_freq / np.asarray(freq_factors, np.float64)
    return inv_freq


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_context: float
                        ) -> tuple[float, ...]:
    """Llama 3.1's RoPE scaling as divisors of each pair's frequency: pairs whose wavelength
    is shorter than original_context / high_freq_factor keep theirs (1), those longer than
    original_context / low_freq_factor turn `factor` times slower, and the ones between
    blend the two linearly in original_context / wavelength."""
    wavelength = 2 * np.pi / rope_inverse_frequencies(head_dim, theta)
    smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor
                                                                   - low_freq_factor)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelength < original_context / high_freq_factor, 1.0,
                        np.where(wavelength > original_context / low_freq_factor, factor,
                                 blended))
    return tuple(float(d) for d in divisors)
