"""A GGUF import that keeps the file's quantized blocks as stored (weight_format "gguf").

Each linear layer, the token embedding and an untied LM head take their GGUF tensors' bytes as
they are, uint8 rows of blocks (no dequantize, no requantize), where a compiled kernel reads
their type (kernels/gguf_types.KERNEL_TYPES); the step multiplies by them with the block ops
(kernels/gguf_matmul), the embedding dequantizes only the rows it looks up, and a tied head
reads the embedding's blocks. A layer with any tensor of another type (F16, F32, or a type
without a kernel) is dequantized and re-quantized to int8, one scale a row, as
`--quantize int8` does, and the load log names its tensors. Norms, biases and position
embeddings are float32 (they are F32 in the files llama.cpp writes).

Our fused layers take several GGUF tensors: q, k, v rows in one projection, gate and up rows
in one. Rows of one type are concatenated; rows of several types stay one variable a tensor.
llama.cpp's interleaved Q/K rows are put back in Hugging Face order a whole row at a time.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from tokenserve.config import TransformerConfig
from tokenserve.errors import ModelLoadError
from tokenserve.kernels.gguf_types import (INT8, format_spec, has_kernel, parse_spec,
                                           row_bytes, type_name)
from tokenserve.model import gguf_moe_stored, gguf_stored_names
from tokenserve.model.families.rope_scaling import LONGROPE_TENSORS
from tokenserve.model.gguf_file import GGUFFile, dequantize, supported_tensor_types

log = logging.getLogger(__name__)


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undoes convert_hf_to_gguf's `permute` of Q/K rows; works on whole rows of any width
    (float values or a row's blocks)."""
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def layer_sources(file: GGUFFile, config: TransformerConfig) -> dict[str, list[str]]:
    """Our layer ("block_3/qkv", "token_embedding", "head") -> its GGUF tensors, in row order."""
    return gguf_stored_names.layer_sources(file.architecture, config)


def _tensor(file: GGUFFile, name: str):
    tensor = file.tensors.get(name)
    if tensor is None:
        raise ModelLoadError(f"{file.path.name} has no tensor {name}")
    return tensor


def _rows(file: GGUFFile, config: TransformerConfig, name: str, blocks: bool) -> np.ndarray:
    """A tensor's rows [N, ...]: its stored blocks (uint8 [N, row bytes]) or its values
    dequantized (float32 [N, K]); Q/K rows of llama files in Hugging Face order."""
    tensor = _tensor(file, name)
    shape = [int(n) for n in reversed(tensor.shape)]  # GGUF lists the innermost first
    if blocks:
        want = (shape[0], row_bytes(tensor.tensor_type, shape[-1]))
        if len(shape) != 2 or tuple(tensor.data.shape) != want:
            raise ModelLoadError(
                f"{file.path.name}: tensor {name} ({tensor.tensor_type.name}, shape "
                f"{shape}) holds {tuple(tensor.data.shape)} bytes of blocks, not {want}: "
                f"truncated, or a shape that does not divide into its blocks")
        rows = np.asarray(tensor.data)
    else:
        rows = dequantize(tensor)
    if file.architecture == "llama" and ".attn_q." in name:
        rows = _unpermute(rows, config.num_heads)
    elif file.architecture == "llama" and ".attn_k." in name:
        rows = _unpermute(rows, config.num_kv_heads)
    return rows


def stored_config(file: GGUFFile, config: TransformerConfig) -> TransformerConfig:
    """`config` with weight_format "gguf" and each layer's blocks spec (or int8, logged)."""
    specs, readable = [], set(supported_tensor_types())
    for tensor in file.tensors.values():  # refuse an unreadable type before reading any
        if not has_kernel(tensor.tensor_type) and tensor.tensor_type.name not in readable:
            dequantize(tensor)  # raises, naming the tensor and its type
    for layer, names in layer_sources(file, config).items():
        tensors = [_tensor(file, name) for name in names]
        kinds = [type_name(t.tensor_type) for t in tensors]
        if all(has_kernel(kind) for kind in kinds) and (layer != "token_embedding"
                                                        or len(set(kinds)) == 1):
            parts = [(kind, int(t.shape[-1])) for kind, t in zip(kinds, tensors)]
            specs.append((layer, format_spec(parts)))
        else:
            log.info("%s: %s has no block kernel: %s as int8 (one scale a row)", file.path.name,
                     ", ".join(f"{n} ({t.tensor_type.name})" for n, t in zip(names, tensors)),
                     layer)
            specs.append((layer, INT8))
    if config.num_experts:  # each expert's slice of the stacked tensors (gguf_moe_stored.py)
        specs += gguf_moe_stored.expert_specs(file, config)
    return dataclasses.replace(config, weight_format="gguf", gguf_block_types=tuple(specs))


def _float_sources(file: GGUFFile, config: TransformerConfig) -> dict[str, tuple[list[str], str]]:
    return gguf_stored_names.float_sources(file.architecture, config)


def assign_stored(model, config: TransformerConfig, file: GGUFFile) -> None:
    """Copies the file's tensors into a model built from `stored_config`: blocks as stored,
    int8 layers re-quantized, the rest float32. Names any missing or misshapen tensor."""
    from tokenserve.kernels.int8_matmul import quantize_weight

    _refuse_unused(file, config)
    variables = {w.path.split("/", 1)[1]: w for w in model.weights}

    def put(path: str, value: np.ndarray, what: str) -> None:
        variable = variables.pop(path)
        if tuple(value.shape) != tuple(variable.shape):
            raise ModelLoadError(f"{file.path.name}: {what} gives {path} the shape "
                                 f"{tuple(value.shape)}, the config expects "
                                 f"{tuple(variable.shape)}")
        variable.assign(value)

    sources = layer_sources(file, config)
    for layer, spec in config.gguf_block_types:
        if layer not in sources:
            continue  # an expert's projection: gguf_moe_stored.assign_experts below
        names = sources[layer]
        what = ", ".join(names)
        base = "token_embedding" if layer == "token_embedding" else layer + "/kernel"
        if spec == INT8:
            rows = np.concatenate([_rows(file, config, n, blocks=False) for n in names])
            q, scale = quantize_weight(rows.T)  # takes [in, out]: rows are [out, in]
            put(base + "_q", q, what)
            put(base + "_scale", scale, what)
            continue
        parts = [_rows(file, config, n, blocks=True) for n in names]
        units = sum(int(p.shape[0]) for p in parts)
        num_parts = len(parse_spec(spec, units))
        if num_parts == 1:
            put(base + "_blocks", np.concatenate(parts), what)
        else:
            for i, part in enumerate(parts):
                put(f"{base}_blocks_{i}", part, what)
    for path, (names, combine) in _float_sources(file, config).items():
        if path not in variables:
            continue
        missing = [n for n in names if n not in file.tensors]
        if missing:
            raise ModelLoadError(f"{file.path.name} has no tensor {missing[0]} (for {path})")
        values = [_rows(file, config, n, blocks=False) for n in names]
        value = np.concatenate(values) if combine == "cat" else values[0]
        if combine == "positions":
            value = value[:config.max_seq_len]  # a shorter context reads fewer positions
        put(path, value, ", ".join(names))
    if config.num_experts:
        gguf_moe_stored.assign_experts(file, config, put)
    if variables:
        raise ModelLoadError(f"{file.path.name}: nothing in the file for {sorted(variables)[0]}")


def _refuse_unused(file: GGUFFile, config: TransformerConfig) -> None:
    """Refuses a file with a tensor that no weight of the model takes, before reading any."""
    used = {"rope_freqs.weight", *LONGROPE_TENSORS}  # read into the config
    for names in layer_sources(file, config).values():
        used.update(names)
    for names, _ in _float_sources(file, config).values():
        used.update(names)
    if config.num_experts:
        used.update(gguf_moe_stored.tensor_names(config))
    if config.tie_embeddings:
        used.add("output.weight")  # the embedding again (a tied head saved explicitly)
    extra = sorted(set(file.tensors) - used)
    if extra:
        raise ModelLoadError(
            f"{file.path.name} has tensor {extra[0]}, which the {file.architecture} "
            f"architecture does not use" + (f" (and {len(extra) - 1} more)" if len(extra) > 1
                                             else ""))


def tie_if_same_blocks(file: GGUFFile, config: TransformerConfig) -> TransformerConfig:
    """A separate output.weight with the embedding's type and bytes (GPT-2 files repeat it)
    is tied, as gguf._tie_if_equal does for float imports."""
    head, embedding = file.tensors.get("output.weight"), file.tensors.get("token_embd.weight")
    if (not config.tie_embeddings and head is not None and embedding is not None
            and head.tensor_type == embedding.tensor_type
            and np.array_equal(np.asarray(head.data), np.asarray(embedding.data))):
        return dataclasses.replace(config, tie_embeddings=True)
    return config
