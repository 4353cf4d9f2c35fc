"""Which LoRA targets a mixture-of-experts model serves (no TF).

An adapter of a MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) is served on the attention
projections (q_proj, k_proj, v_proj, o_proj), batched per row as on a dense model, and on
the MLP of a layer that is dense (Qwen-MoE's mlp_only_layers). The experts, the shared
expert and the router are refused: their deltas would have to run inside the grouped
experts' op, per expert, which the step does not do, and an adapter served without them
would give other tokens than the model it was trained as. PEFT names them

    model.layers.3.mlp.experts.5.gate_proj        (Qwen-MoE, OLMoE; transformers 4)
    model.layers.3.block_sparse_moe.experts.5.w1  (Mixtral; transformers 4)
    model.layers.3.mlp.experts[.base_layer]       (transformers 5's stacked experts)
    model.layers.3.mlp.shared_expert.up_proj, mlp.shared_expert_gate, mlp.gate
"""

from __future__ import annotations

import re

from tokenserve.config import TransformerConfig

_EXPERT_MODULE = re.compile(r"^(?:mlp|block_sparse_moe)\.(?:experts|shared_expert|gate\b)")
SERVED_ON_EXPERT_MODELS = ("q_proj", "k_proj", "v_proj", "o_proj")


def is_expert_module(module: str) -> bool:
    """Whether `module` (a torch path inside a block) is an expert, shared expert or router
    of a mixture of experts."""
    return _EXPERT_MODULE.match(module) is not None


def moe_target_problem(module: str, role: str | None, layer: int,
                       config: TransformerConfig) -> str | None:
    """Why a MoE model does not serve a factor of `module` at `layer` (role: the fused
    matrix it would change, None for a module no family has), or None where it does: an
    expert, shared expert or router; a dense MLP's module on a layer of experts."""
    if is_expert_module(module):
        return (f"targets {module!r}, part of a mixture of experts: LoRA on experts, shared "
                f"experts and routers is not served (on this model adapters may target "
                f"{', '.join(SERVED_ON_EXPERT_MODELS)}, and the MLP of its dense layers)")
    if role in ("up", "down") and config.layer_has_experts(layer):
        return (f"targets {module!r}, but layer {layer}'s MLP is a mixture of experts "
                f"without that module (an adapter for a dense model?)")
    return None
