"""GGUF block types: their sizes, which ones a compiled kernel reads as stored, and how a layer
made of rows of several types is written in a model config. Plain Python (no TensorFlow): the
importer, the config and the layers all read it.

ggml stores a weight [N, K] as N rows of blocks; a block of `values` weights takes `nbytes`:

    Q4_0  32 values, 18 bytes (fp16 scale, 16 bytes of nibbles)        4.5 bits a weight
    Q4_1  32 values, 20 bytes (fp16 scale and min, 16 bytes of nibbles) 5.0
    Q5_0  32 values, 22 bytes (fp16 scale, 32 fifth bits, 16 of nibbles) 5.5
    Q8_0  32 values, 34 bytes (fp16 scale, 32 int8)                     8.5
    Q4_K 256 values, 144 bytes; Q5_K 176; Q6_K 210 (super-blocks)       4.5, 5.5, 6.6

A layer's blocks spec (TransformerConfig.gguf_block_types) is one type ("q4_1": every row) or
comma-separated parts "type*rows" in row order ("q4_k*576,q6_k*192": a fused q/k/v projection
whose v rows are Q6_K), or "int8" (no kernel for a part: the layer is int8 instead).
"""

from __future__ import annotations

from tokenserve.errors import ConfigError

BLOCK_SIZES = {"q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q8_0": (32, 34),
               "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}
"""type -> (values a block, bytes a block)."""

KERNEL_TYPES = ("q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q5_k", "q6_k")
"""The types whose blocks a compiled kernel (kernels/gguf_matmul.cc) reads as stored."""

INT8 = "int8"


def type_name(block_type) -> str:
    """"q4_1" from "Q4_1", "q4_1" or a gguf.GGMLQuantizationType."""
    return str(getattr(block_type, "name", block_type)).lower()


EXPERT_KERNEL_TYPES = ("q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k")
"""The types the mixture-of-experts op (kernels/moe_gguf.h) reads as stored: not Q5_0 yet."""


def has_kernel(block_type, experts: bool = False) -> bool:
    """Whether a compiled kernel reads `block_type` as stored: the dense ops', or with
    experts=True the mixture-of-experts op's."""
    return type_name(block_type) in (EXPERT_KERNEL_TYPES if experts else KERNEL_TYPES)


def row_bytes(block_type, k: int) -> int:
    """Bytes of one row of K values; raises ConfigError when K does not divide into blocks."""
    name = type_name(block_type)
    if name not in BLOCK_SIZES:
        raise ConfigError(f"unknown GGUF block type {name!r}; known: {', '.join(BLOCK_SIZES)}")
    values, nbytes = BLOCK_SIZES[name]
    if k % values:
        raise ConfigError(f"{k} values a row do not divide into {name} blocks of {values}")
    return k // values * nbytes


def format_spec(parts: list[tuple[str, int]]) -> str:
    """The spec of a layer whose rows are `parts` [(type, rows), ...] in order; parts of one
    type throughout are one type."""
    names = [type_name(t) for t, _ in parts]
    if len(set(names)) == 1:
        return names[0]
    return ",".join(f"{name}*{rows}" for name, (_, rows) in zip(names, parts))


def parse_spec(spec: str, units: int) -> list[tuple[str, int]]:
    """[(type, rows), ...] of a layer of `units` output rows; raises ConfigError when the spec
    names an unknown type or its rows do not add up to `units`."""
    if "*" not in spec:
        parts = [(spec, units)]
    else:
        try:
            parts = [(name, int(rows)) for name, rows in
                     (part.split("*") for part in spec.split(","))]
        except ValueError:
            raise ConfigError(f"unreadable GGUF blocks spec {spec!r}") from None
    for name, _ in parts:
        if name not in BLOCK_SIZES:
            raise ConfigError(f"GGUF blocks spec {spec!r} names unknown type {name!r}")
    if sum(rows for _, rows in parts) != units:
        raise ConfigError(f"GGUF blocks spec {spec!r} covers "
                          f"{sum(rows for _, rows in parts)} rows of {units}")
    return parts


def layer_format(config, layer: str) -> str:
    """"float", "int8" or a blocks spec: how `layer` ("block_3/qkv", "token_embedding",
    "head") of a TransformerConfig holds its weights."""
    if config.weight_format != "gguf":
        return config.weight_format
    return dict(config.gguf_block_types).get(layer, INT8)
