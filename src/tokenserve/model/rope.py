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


def linear_rope_factors(rotary_dim: int, factor: float) -> tuple[float, ...]:
    """Linear ("position interpolation") scaling: every pair turns `factor` times slower."""
    return (float(factor),) * (rotary_dim // 2)


def yarn_attention_factor(factor: float, mscale: float | None = None,
                          mscale_all_dim: float | None = None) -> float:
    """YaRN's scale of cos and sin when the config gives none: 0.1 ln(factor) + 1 (or the
    ratio of two such, with DeepSeek's mscale and mscale_all_dim)."""
    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * float(np.log(scale)) + 1.0
    if mscale and mscale_all_dim:
        return get(factor, mscale) / get(factor, mscale_all_dim)
    return get(factor)


def yarn_rope_factors(rotary_dim: int, theta: float, factor: float, original_context: float,
                      beta_fast: float = 32.0, beta_slow: float = 1.0,
                      truncate: bool = True) -> tuple[float, ...]:
    """YaRN's frequencies as divisors of each pair's: pairs that turn more than beta_fast
    times over original_context keep theirs, those under beta_slow turn `factor` times
    slower, the ones between blend the two along a linear ramp (as transformers computes
    them)."""
    def correction_dim(rotations: float) -> float:
        return (rotary_dim * np.log(original_context / (rotations * 2 * np.pi))
                / (2 * np.log(theta)))
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(rotary_dim // 2) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # share of each pair's own (unscaled) frequency
    multiplier = (1 - extrapolation) / factor + extrapolation
    return tuple(float(1.0 / m) for m in multiplier)
