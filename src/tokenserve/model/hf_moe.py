"""Mixture-of-experts checkpoints from Hugging Face: Mixtral, Qwen2-MoE and Qwen3-MoE.

Mixtral and Qwen2-MoE are the Llama (Qwen2) architecture with each block's MLP replaced by
a router and SwiGLU experts stored one tensor set per expert: Mixtral's
`block_sparse_moe.experts.{e}.w1` (gate), `w3` (up) and `w2` (down); Qwen2-MoE's
`mlp.experts.{e}.gate_proj/up_proj/down_proj` plus `mlp.shared_expert.*` and its sigmoid
gate `mlp.shared_expert_gate`. `hf.py` reads the rest of the checkpoint; this module gives
the config fields and the experts' tensor names.
Qwen3-MoE (Qwen3-30B-A3B) is Qwen3's attention (QK-norm, no qkv bias: model/families/) with
Qwen2-MoE's expert layout and no shared expert; its config and dense tensor names come from
the families' Qwen3 reading, the experts' from here. Qwen-MoE layers listed in
`mlp_only_layers`, or skipped by `decoder_sparse_step`, keep one dense MLP (`mlp.gate_proj`,
...; TransformerConfig.dense_layers).
OLMoE (`OlmoeForCausalLM`) is Llama's layout with QK-norm over the whole q and k projections
(`self_attn.q_norm` [hidden], `k_norm` [kv width]) and Qwen2-MoE's expert names, its top-k
not renormalised unless `norm_topk_prob`.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from tokenserve.config import TransformerConfig
from tokenserve.errors import ConfigError, ModelLoadError

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                     "OlmoeForCausalLM")

# where a layer's experts live, by architecture: (router, expert prefix, gate, up, down)
_LAYOUT = {
    "MixtralForCausalLM": ("block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2"),
    "Qwen2MoeForCausalLM": ("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj"),
    "Qwen3MoeForCausalLM": ("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj"),
    "OlmoeForCausalLM": ("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj"),
}
_QWEN3 = "Qwen3ForCausalLM"  # the dense family whose attention Qwen3-MoE keeps


class UnsupportedMoEError(ConfigError):
    """A mixture-of-experts layout tokenserve does not import (named in the message)."""


def moe_fields(hf: dict, arch: str) -> dict:
    """The TransformerConfig fields of a MoE config.json ({} for a dense architecture)."""
    if arch == "MixtralForCausalLM":
        window = hf.get("sliding_window")
        if window and window < hf["max_position_embeddings"]:
            raise UnsupportedMoEError(f"Mixtral sliding_window {window} is not supported")
        return dict(num_experts=hf["num_local_experts"],
                    num_experts_per_token=hf["num_experts_per_tok"],
                    expert_intermediate_size=hf["intermediate_size"],
                    normalize_expert_weights=True)
    if arch == "OlmoeForCausalLM":
        if hf.get("clip_qkv") is not None:
            raise UnsupportedMoEError(f"OLMoE clip_qkv {hf['clip_qkv']} is not supported")
        # QK-norm over the whole q and k projections; experts intermediate_size wide
        return dict(num_experts=hf["num_experts"], num_experts_per_token=hf["num_experts_per_tok"],
                    expert_intermediate_size=hf["intermediate_size"],
                    normalize_expert_weights=bool(hf.get("norm_topk_prob", False)),
                    qk_norm=True, qk_norm_scope="projection")
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        family = "Qwen2-MoE" if arch == "Qwen2MoeForCausalLM" else "Qwen3-MoE"
        if hf.get("use_sliding_window"):
            raise UnsupportedMoEError(f"{family} use_sliding_window is not supported")
        # transformers 5 saves Qwen3-MoE's num_experts as num_local_experts
        experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
        return dict(num_experts=experts, num_experts_per_token=hf["num_experts_per_tok"],
                    expert_intermediate_size=hf["moe_intermediate_size"],
                    normalize_expert_weights=bool(hf.get("norm_topk_prob", False)),
                    shared_expert_size=hf.get("shared_expert_intermediate_size") or 0,
                    dense_layers=dense_layers(hf, family))
    return {}


def dense_layers(hf: dict, family: str) -> tuple[int, ...]:
    """Qwen-MoE's layers with one dense MLP instead of experts, as transformers builds them:
    those in mlp_only_layers, and those whose (index + 1) is not a multiple of
    decoder_sparse_step."""
    step = hf.get("decoder_sparse_step")
    step = 1 if step is None else int(step)
    if step < 1:
        raise UnsupportedMoEError(f"{family} decoder_sparse_step {step} is not positive")
    only = {int(i) for i in hf.get("mlp_only_layers") or ()}
    return tuple(i for i in range(hf["num_hidden_layers"]) if i in only or (i + 1) % step)


def qwen3_moe_config(hf: dict) -> TransformerConfig:
    """Qwen3-MoE's TransformerConfig: Qwen3's as the families read it (head_dim, QK-norm,
    RoPE scaling), its MLPs mixtures of experts but the dense layers'. Its config.json's
    intermediate_size is the dense layers' width; moe_intermediate_size stands in if absent."""
    from tokenserve.model import families

    fields = moe_fields(hf, "Qwen3MoeForCausalLM")  # refuses what it must before anything
    dense = dict(hf, architectures=[_QWEN3],
                 intermediate_size=hf.get("intermediate_size") or hf["moe_intermediate_size"])
    return dataclasses.replace(families.hf_config(dense), **fields)


def qwen3_moe_names(config: TransformerConfig) -> dict:
    """our weight name -> (hf tensor names, combine) for Qwen3-MoE: Qwen3's attention and
    norms (the families' names, less the dense MLP's), then the experts'."""
    from tokenserve.model import families

    routed = {f"block_{i}/" for i in range(config.num_layers) if config.layer_has_experts(i)}
    names = {ours: found for ours, found in families.hf_tensor_names(config, _QWEN3).items()
             if not (ours.split("/", 1)[0] + "/" in routed
                     and ours.endswith(("/up/kernel", "/down/kernel")))}
    return names | expert_names(config, "Qwen3MoeForCausalLM")


def check_expert_count(config: TransformerConfig, arch: str, tensors: dict) -> None:
    """Refuses a checkpoint whose layers hold another number of experts than the config
    says, naming the layer and both counts."""
    _, experts, *_ = _LAYOUT[arch]
    pattern = re.compile(rf"model\.layers\.(\d+)\.{re.escape(experts)}\.(\d+)\.")
    found: dict[int, set[int]] = {}
    for name in tensors:
        if match := pattern.match(name):
            found.setdefault(int(match[1]), set()).add(int(match[2]))
    for layer in filter(config.layer_has_experts, range(config.num_layers)):
        count = len(found.get(layer, ()))
        if count != config.num_experts:
            raise ModelLoadError(
                f"checkpoint layer {layer} has {count} experts ({experts}.N) but the config "
                f"says {config.num_experts} (num_experts)")


def expert_names(config: TransformerConfig, arch: str) -> dict:
    """our weight name -> (hf tensor names, how to combine them), as hf._llama_names."""
    fuse = lambda *ws: np.concatenate([w.T for w in ws], axis=1)  # noqa: E731
    transpose = lambda w: w.T  # noqa: E731
    router, experts, gate, up, down = _LAYOUT[arch]
    names = {}
    for i in filter(config.layer_has_experts, range(config.num_layers)):
        p, h = f"block_{i}/", f"model.layers.{i}."
        names[p + "router/kernel"] = ([h + router + ".weight"], transpose)
        for e in range(config.num_experts):
            x = f"{h}{experts}.{e}."
            names[p + f"expert_{e}_up/kernel"] = ([x + gate + ".weight", x + up + ".weight"], fuse)
            names[p + f"expert_{e}_down/kernel"] = ([x + down + ".weight"], transpose)
        if config.shared_expert_size:
            x = h + "mlp.shared_expert."
            names[p + "shared_up/kernel"] = ([x + "gate_proj.weight", x + "up_proj.weight"], fuse)
            names[p + "shared_down/kernel"] = ([x + "down_proj.weight"], transpose)
            names[p + "shared_gate/kernel"] = ([h + "mlp.shared_expert_gate.weight"], transpose)
    return names
