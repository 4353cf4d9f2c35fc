"""Mixture-of-experts GGUF files: Mixtral (`llama` with `llama.expert_count`), `qwen2moe`,
`qwen3moe` (Qwen3's attention, with `attn_q_norm`/`attn_k_norm`, and no shared expert) and
`olmoe` (QK-norm over the whole q and k projections, experts `feed_forward_length` wide, top-k
not renormalised unless `expert_weights_norm`).

llama.cpp's convert_hf_to_gguf stacks each layer's experts into one tensor per role,
`blk.{i}.ffn_{gate,up,down}_exps.weight` (NumPy [E, out, in] once read), next to the router
`blk.{i}.ffn_gate_inp.weight` [E, D]; Qwen2-MoE's shared expert is `ffn_{gate,up,down}_shexp`
with its gate `ffn_gate_inp_shexp` ([D] or [1, D]). Here they are split back into the
Hugging Face checkpoint's per-expert tensors, so `hf.assign_weights` places them as it
places a Mixtral or Qwen2-MoE checkpoint's (model/hf_moe.py). A layer's tensors are checked
first: a missing one, or one holding another number of experts than the file's
`expert_count`, is refused by its GGUF name. A `qwen2moe` or `qwen3moe` layer with a dense
MLP (`ffn_up`, no router: Qwen-MoE's mlp_only_layers) is read as one.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from tokenserve.config import TransformerConfig
from tokenserve.errors import ModelLoadError

_ROUTED = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_SHARED = ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
_PATTERN = re.compile(r"blk\.(\d+)\.(" + "|".join(_ROUTED + _SHARED) + r")\.weight")


def hf_architecture(file) -> str | None:
    """The Hugging Face architecture a MoE file's tensors are named for, or None."""
    if file.architecture == "qwen2moe":
        return "Qwen2MoeForCausalLM"
    if file.architecture == "qwen3moe":
        return "Qwen3MoeForCausalLM"
    if file.architecture == "olmoe":
        return "OlmoeForCausalLM"
    if file.architecture == "llama" and file.get("expert_count"):
        return "MixtralForCausalLM"
    return None


def moe_fields(file) -> dict:
    """The TransformerConfig fields of a MoE file's metadata ({} for a dense file)."""
    if hf_architecture(file) is None:
        return {}
    fields = dict(num_experts=int(file.require("expert_count")),
                  num_experts_per_token=int(file.require("expert_used_count")))
    if file.architecture == "llama":  # Mixtral: experts as wide as feed_forward_length
        return dict(fields, expert_intermediate_size=int(file.require("feed_forward_length")),
                    normalize_expert_weights=True)
    if file.architecture == "olmoe":  # as Mixtral's widths; llama.cpp does not renormalise
        return dict(fields, expert_intermediate_size=int(file.require("feed_forward_length")),
                    normalize_expert_weights=bool(file.get("expert_weights_norm", False)),
                    qk_norm=True, qk_norm_scope="projection")
    fields["dense_layers"] = tuple(
        i for i in range(int(file.require("block_count")))
        if f"blk.{i}.ffn_gate_inp.weight" not in file.tensors
        and f"blk.{i}.ffn_up.weight" in file.tensors)
    if file.architecture == "qwen3moe":  # llama.cpp always renormalises its top-k
        return dict(fields,
                    expert_intermediate_size=int(file.require("expert_feed_forward_length")),
                    normalize_expert_weights=bool(file.get("expert_weights_norm", True)))
    return dict(fields,
                expert_intermediate_size=int(file.require("expert_feed_forward_length")),
                shared_expert_size=int(file.get("expert_shared_feed_forward_length", 0)),
                normalize_expert_weights=bool(file.get("expert_weights_norm", False)))


def qwen3_moe_config(file, context: int | None = None) -> TransformerConfig:
    """A `qwen3moe` file's config: Qwen3's as the families read it, every MLP a mixture of
    experts. QK-norm is the family's: a file without blk.0.attn_q_norm is refused by that
    name (when its weights are assigned), not run without it."""
    from tokenserve.model import families

    if file.get("expert_shared_feed_forward_length"):
        raise ModelLoadError(f"{file.path.name}: qwen3moe has no shared expert, but "
                             f"qwen3moe.expert_shared_feed_forward_length is "
                             f"{file.get('expert_shared_feed_forward_length')}")
    return dataclasses.replace(families.gguf_config(file, context), qk_norm=True,
                               **moe_fields(file))


def is_expert_tensor(name: str) -> bool:
    return _PATTERN.fullmatch(name) is not None


def check_experts(file, config: TransformerConfig) -> None:
    """Refuses a file missing any layer's router or expert tensor, whose stacked experts
    number other than `expert_count`, or with a shared expert its config has none of,
    naming the tensor."""
    roles = _ROUTED + (_SHARED if config.shared_expert_size else ())
    if not config.shared_expert_size:
        stray = sorted(n for n in file.tensors
                       if (m := _PATTERN.fullmatch(n)) and m[2] in _SHARED)
        if stray:
            raise ModelLoadError(f"{file.path.name} has tensor {stray[0]}, a shared expert's, "
                                 f"but {file.architecture} files here have no shared expert")
    for layer in filter(config.layer_has_experts, range(config.num_layers)):
        for role in roles:
            name = f"blk.{layer}.{role}.weight"
            tensor = file.tensors.get(name)
            if tensor is None:
                raise ModelLoadError(f"{file.path.name} is missing tensor {name} "
                                     f"({file.architecture}.expert_count = "
                                     f"{config.num_experts})")
            if role.endswith("_exps"):
                count = int(tensor.shape[-1])  # GGUF lists the outermost (expert) axis last
            elif role == "ffn_gate_inp":
                count = int(tensor.shape[-1])  # [D, E] in GGUF order
            else:
                continue
            if count != config.num_experts:
                raise ModelLoadError(
                    f"{file.path.name}: tensor {name} holds {count} experts but "
                    f"{file.architecture}.expert_count is {config.num_experts}")


def hf_tensors(name: str, value: np.ndarray, arch: str) -> dict[str, np.ndarray]:
    """One GGUF expert tensor as the Hugging Face checkpoint's tensors (experts split)."""
    layer, role = _PATTERN.fullmatch(name).groups()
    h = f"model.layers.{layer}."
    mixtral = arch == "MixtralForCausalLM"
    if role == "ffn_gate_inp":
        return {h + ("block_sparse_moe.gate" if mixtral else "mlp.gate") + ".weight": value}
    if role.endswith("_exps"):
        kind = role.removeprefix("ffn_").removesuffix("_exps")
        if mixtral:
            prefix, suffix = "block_sparse_moe.experts", {"gate": "w1", "up": "w3", "down": "w2"}
        else:
            prefix, suffix = "mlp.experts", {k: f"{k}_proj" for k in ("gate", "up", "down")}
        return {f"{h}{prefix}.{e}.{suffix[kind]}.weight": value[e] for e in range(len(value))}
    if role == "ffn_gate_inp_shexp":
        return {h + "mlp.shared_expert_gate.weight": value.reshape(1, -1)}
    kind = role.removeprefix("ffn_").removesuffix("_shexp")
    return {f"{h}mlp.shared_expert.{kind}_proj.weight": value}
