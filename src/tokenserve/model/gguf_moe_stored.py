"""A mixture of experts' layers in a GGUF import that keeps blocks as stored (gguf_stored.py).

llama.cpp stacks a layer's experts per role, `blk.{i}.ffn_{gate,up,down}_exps.weight`, whose
quantized bytes read as uint8 [E, rows, row bytes]: expert e's rows are [e], a contiguous
slice of the file. Each expert keeps them as they are: `expert_{e}_up` holds two parts, the
gate's rows then the up's (`kernel_blocks_0`, `kernel_blocks_1`, the types of the two
stacked tensors, which may differ), `expert_{e}_down` the down's rows. Qwen2-MoE's shared
expert (`ffn_{gate,up,down}_shexp`) is kept the same way as `shared_up` / `shared_down`.
A role whose stacked tensor has no block kernel (F16, Q5_0, ...) is re-quantized to int8,
one scale a row, as gguf_stored does for a dense layer, and named in the load log. The
router (`ffn_gate_inp`) and the shared expert's gate (`ffn_gate_inp_shexp`) are float32:
routing decides which weights are read, and they are small.

Shapes: D hidden, F an expert's width, E experts; the router kernel [D, E], the shared
gate [D, 1].
"""

from __future__ import annotations

import logging

import numpy as np

from tokenserve.config import TransformerConfig
from tokenserve.kernels.gguf_types import INT8, has_kernel, type_name
from tokenserve.model import gguf_moe
from tokenserve.model.gguf_file import dequantize

log = logging.getLogger(__name__)


def _layers(config: TransformerConfig) -> list[int]:
    return [i for i in range(config.num_layers) if config.layer_has_experts(i)]


def _roles(config: TransformerConfig) -> list[tuple[str, str, int]]:
    """(our layer's prefix, the GGUF tensors' suffix, its expert count) per expert group."""
    roles = [("expert_{e}", "exps", config.num_experts)]
    if config.shared_expert_size:
        roles.append(("shared", "shexp", 1))
    return roles


def tensor_names(config: TransformerConfig) -> set[str]:
    """Every GGUF tensor the MoE layers take (the router and shared gate included)."""
    names = set()
    for i in _layers(config):
        names.add(f"blk.{i}.ffn_gate_inp.weight")
        if config.shared_expert_size:
            names.add(f"blk.{i}.ffn_gate_inp_shexp.weight")
        for _, suffix, _ in _roles(config):
            names.update(f"blk.{i}.ffn_{role}_{suffix}.weight" for role in ("gate", "up", "down"))
    return names


def expert_specs(file, config: TransformerConfig) -> list[tuple[str, str]]:
    """(our layer, blocks spec or "int8") for every expert projection of the file: checks the
    experts first (gguf_moe.check_experts: a missing tensor or another expert count is
    refused by name)."""
    gguf_moe.check_experts(file, config)
    specs = []
    for i in _layers(config):
        for ours, suffix, count in _roles(config):
            gate, up, down = (file.tensors[f"blk.{i}.ffn_{role}_{suffix}.weight"]
                              for role in ("gate", "up", "down"))
            width = int(gate.shape[1])  # GGUF lists [in, out, experts]: out is F
            if all(has_kernel(t.tensor_type, experts=True) for t in (gate, up)):
                up_spec = (f"{type_name(gate.tensor_type)}*{width},"
                           f"{type_name(up.tensor_type)}*{width}")
            else:
                up_spec = _int8(file, gate, up)
            down_spec = (type_name(down.tensor_type)
                         if has_kernel(down.tensor_type, experts=True) else _int8(file, down))
            for e in range(count):
                name = f"block_{i}/" + ours.format(e=e)
                specs += [(name + "_up", up_spec), (name + "_down", down_spec)]
    return specs


def _int8(file, *tensors) -> str:
    log.info("%s: %s has no block kernel: those experts as int8 (one scale a row)",
             file.path.name, ", ".join(f"{t.name} ({t.tensor_type.name})" for t in tensors))
    return INT8


def assign_experts(file, config: TransformerConfig, put) -> None:
    """Copies the MoE layers' tensors into a model built from a config with `expert_specs`:
    put(path below the model, value, the GGUF names it came from) assigns one variable."""
    from tokenserve.kernels.int8_matmul import quantize_weight

    specs = dict(config.gguf_block_types)
    for i in _layers(config):
        b, p = f"blk.{i}.", f"block_{i}/"
        router = file.tensors[b + "ffn_gate_inp.weight"]
        put(p + "router/kernel", dequantize(router).reshape(config.num_experts, -1).T,
            router.name)
        if config.shared_expert_size:
            gate = file.tensors[b + "ffn_gate_inp_shexp.weight"]
            put(p + "shared_gate/kernel", dequantize(gate).reshape(-1, 1), gate.name)
        for ours, suffix, count in _roles(config):
            tensors = {role: file.tensors[f"{b}ffn_{role}_{suffix}.weight"]
                       for role in ("gate", "up", "down")}
            stacked = {role: _stacked(t, count) for role, t in tensors.items()}
            values = {}  # role -> float32 [E, rows, in], for the int8 roles only
            for e in range(count):
                name = p + ours.format(e=e)
                for role, parts in (("up", ("gate", "up")), ("down", ("down",))):
                    what = ", ".join(f"{tensors[r].name}[{e}]" for r in parts)
                    base = f"{name}_{role}/kernel"
                    if specs[f"{name}_{role}"] == INT8:
                        for r in parts:
                            if r not in values:
                                values[r] = _values(tensors[r], count)
                        rows = np.concatenate([values[r][e] for r in parts])
                        q, scale = quantize_weight(rows.T)  # takes [in, out]: rows are [out, in]
                        put(base + "_q", q, what)
                        put(base + "_scale", scale, what)
                    elif len(parts) == 1:
                        put(base + "_blocks", stacked[parts[0]][e], what)
                    else:
                        for j, r in enumerate(parts):
                            put(f"{base}_blocks_{j}", stacked[r][e], what)


def _stacked(tensor, count: int) -> np.ndarray:
    """A stacked expert tensor's bytes (or values) as [E, rows, ...]; a shared expert's 2-D
    tensor as [1, rows, ...]."""
    data = np.asarray(tensor.data)
    return data.reshape(count, *data.shape[-2:]) if data.ndim == 2 else data


def _values(tensor, count: int) -> np.ndarray:
    """A stacked expert tensor dequantized: float32 [E, rows, in]."""
    values = dequantize(tensor)
    return values.reshape(count, *values.shape[-2:])
