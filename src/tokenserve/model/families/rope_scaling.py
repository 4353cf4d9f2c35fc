"""RoPE scaling as a config reads it: (theta, per-pair divisors, attention factor) from a
Hugging Face rope_parameters / rope_scaling dict or a GGUF file's `rope.scaling.*` keys.
Implemented: none, linear, llama3 and yarn, and Phi-3's longrope (two tables of divisors,
chosen by the sequence's length: hf_longrope from config.json, gguf_longrope from the
tables llama.cpp stores as tensors); anything else is refused by name (dynamic NTK, whose
frequencies change with every length)."""

from __future__ import annotations

import math

import numpy as np

from tokenserve.errors import ConfigError, UnsupportedGGUFError
from tokenserve.model.rope import (linear_rope_factors, llama3_rope_factors,
                                   yarn_attention_factor, yarn_rope_factors)

SUPPORTED = ("default", "linear", "llama3", "yarn")
"""What hf_rope reads; longrope's two tables are hf_longrope's (the families that use it)."""


class UnsupportedRopeScalingError(ConfigError):
    """A RoPE scaling type tokenserve does not implement."""


RopeParameters = tuple[float, tuple[float, ...], float]
"""(rope_theta, rope_freq_factors, rope_attention_factor)."""

LongRope = tuple[tuple[float, ...], tuple[float, ...], int, float]
"""(short divisors, long divisors, original context, attention factor): the config's
rope_freq_factors, rope_long_freq_factors, rope_original_context, rope_attention_factor."""

LONGROPE_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")
"""Where convert_hf_to_gguf writes a LongRoPE model's two tables (float32 [rotary_dim / 2])."""


def _longrope_attention(factor: float, original: int) -> float:
    """LongRoPE's scale of cos and sin, as transformers and convert_hf_to_gguf compute it
    when the config gives none: sqrt(1 + ln(factor) / ln(original)), 1 up to factor 1."""
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def hf_rope(scaling: dict, theta: float, rotary_dim: int,
            max_position_embeddings: int) -> RopeParameters:
    """One rope_parameters (or legacy rope_scaling) dict as our three RoPE fields."""
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return theta, (), 1.0
    factor = scaling.get("factor")
    if kind == "linear":
        return theta, linear_rope_factors(rotary_dim, float(factor)), 1.0
    if kind == "llama3":
        return theta, llama3_rope_factors(
            theta, rotary_dim, factor=float(factor),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_context=float(scaling["original_max_position_embeddings"])), 1.0
    if kind == "yarn":
        original = float(scaling.get("original_max_position_embeddings")
                         or max_position_embeddings)
        if factor is None:
            factor = max_position_embeddings / original
        factor = float(factor)
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = yarn_attention_factor(factor, scaling.get("mscale"),
                                              scaling.get("mscale_all_dim"))
        factors = yarn_rope_factors(rotary_dim, theta, factor, original,
                                    float(scaling.get("beta_fast") or 32),
                                    float(scaling.get("beta_slow") or 1),
                                    bool(scaling.get("truncate", True)))
        return theta, factors, float(attention)
    if kind == "longrope":
        raise UnsupportedRopeScalingError("rope scaling 'longrope' is read for Phi-3 "
                                          "checkpoints only")
    raise UnsupportedRopeScalingError(f"rope scaling {kind!r} is not supported; supported: "
                                      f"{', '.join(SUPPORTED)}")


def hf_longrope(scaling: dict, rotary_dim: int, max_position_embeddings: int,
                original: int | None = None) -> LongRope:
    """A "longrope" rope_parameters dict as (short divisors, long divisors, original context,
    attention factor), as transformers computes them: original_max_position_embeddings from
    the config's top level first (Phi-3 keeps it there), the factor max / original where the
    dict has none, and the attention factor sqrt(1 + ln(factor) / ln(original)) (1 for a
    factor up to 1) where it has none."""
    original = int(original or scaling.get("original_max_position_embeddings")
                   or max_position_embeddings)
    tables = []
    for key in ("short_factor", "long_factor"):
        table = tuple(float(f) for f in scaling.get(key) or ())
        if len(table) != rotary_dim // 2:
            raise UnsupportedRopeScalingError(
                f"longrope {key} has {len(table)} entries; the rotated width {rotary_dim} "
                f"turns {rotary_dim // 2} pairs")
        tables.append(table)
    factor = float(scaling.get("factor") or max_position_embeddings / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = _longrope_attention(factor, original)
    return tables[0], tables[1], original, float(attention)


def gguf_longrope(file, rotary_dim: int) -> LongRope | None:
    """A Phi-3 file's LongRoPE as hf_longrope gives it from config.json, or None when the file
    has no tables. convert_hf_to_gguf (Phi3MiniModel) writes the short and long tables as
    LONGROPE_TENSORS, the original context as `rope.scaling.original_context_length` and the
    attention factor as `rope.scaling.attn_factor` (computed from context_length / original
    here where a file lacks it). Raises UnsupportedGGUFError naming a table that is missing
    or of the wrong length."""
    present = [name for name in LONGROPE_TENSORS if name in file.tensors]
    if not present:
        return None
    tables = []
    for name in LONGROPE_TENSORS:
        if name not in file.tensors:
            raise UnsupportedGGUFError(f"{file.path.name}: rope scaling 'longrope' needs "
                                       f"{name} beside {present[0]}")
        tensor = file.tensors[name]
        if tensor.tensor_type.name not in ("F32", "F16"):  # the converter writes F32
            raise UnsupportedGGUFError(f"{file.path.name}: {name} has type "
                                       f"{tensor.tensor_type.name}; a LongRoPE table is F32")
        table = tuple(float(f) for f in np.asarray(tensor.data).ravel())
        if len(table) != rotary_dim // 2:
            raise UnsupportedGGUFError(
                f"{file.path.name}: {name} has {len(table)} entries; the rotated width "
                f"{rotary_dim} turns {rotary_dim // 2} pairs")
        tables.append(table)
    original = int(file.require("rope.scaling.original_context_length"))
    attention = file.get("rope.scaling.attn_factor")
    if attention is None:
        attention = _longrope_attention(int(file.require("context_length")) / original,
                                        original)
    return tables[0], tables[1], original, float(attention)


def gguf_rope(file, theta: float, rotary_dim: int) -> RopeParameters:
    """The file's `rope.scaling.*` keys as our three RoPE fields (llama.cpp's names)."""
    kind = file.get("rope.scaling.type")
    if kind in (None, "none"):
        return theta, (), 1.0
    if kind not in ("linear", "yarn"):
        raise UnsupportedGGUFError(f"rope scaling {kind!r} is not supported; supported: "
                                   f"none, linear, yarn")
    factor = float(file.require("rope.scaling.factor"))
    if kind == "linear":
        return theta, linear_rope_factors(rotary_dim, factor), 1.0
    original = float(file.require("rope.scaling.original_context_length"))
    factors = yarn_rope_factors(rotary_dim, theta, factor, original,
                                float(file.get("rope.scaling.yarn_beta_fast", 32.0)),
                                float(file.get("rope.scaling.yarn_beta_slow", 1.0)))
    # llama.cpp's attn_factor multiplies the 0.1 ln(factor) + 1 it always applies
    attention = float(file.get("rope.scaling.attn_factor") or 1.0)
    return theta, factors, attention * yarn_attention_factor(factor)
