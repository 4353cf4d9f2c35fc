"""LoRA factors of a mixture of experts: the experts, the shared expert and the router (no TF).

An adapter of a MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) may change, besides the
attention projections and a dense layer's MLP (lora_adapter.py), each layer's

    router       logits [M, E] += (h @ A) @ B              A [D, r]    B [r, E]
    experts      expert e's gate|up and down, per (row, expert) pair the row is routed to
    shared       Qwen2-MoE's shared expert's gate|up and down, and its sigmoid gate [D, 1]

PEFT writes them (inside `model.layers.{i}.`) as

    mlp.experts[.base_layer]                  transformers 5's stacked experts (peft's
                                              target_parameters gate_up_proj / down_proj):
                                              A [E r, in], B [out, E r]; expert e's factors
                                              A.reshape(E, r, in)[e], B.reshape(out, r, E)[..., e]
    mlp.experts.5.gate_proj | up_proj | down_proj     transformers 4's per-expert modules
    block_sparse_moe.experts.5.w1 | w3 | w2           (Mixtral: w1 gate, w3 up, w2 down)
    mlp.shared_expert.gate_proj ..., mlp.shared_expert_gate, mlp.gate | block_sparse_moe.gate

A stacked parameter's wrapper does not say which parameter it wraps (peft nests them in its
config's order); their shapes do: gate_up is [D] -> [2F], down [F] -> [D], never equal.
Per layer they become these roles of LoraWeights.layers, the scale folded into B:

    expert_up   (A [E, D, R], B [E, R, 2F])   R: the ranks of gate and up (or of gate_up)
    expert_down (A [E, F, r], B [E, r, D])
    shared_up   (A [D, R], B [R, 2Fs]), shared_down (A [Fs, r], B [r, D])
    shared_gate (A [D, r], B [r, 1]), router (A [D, r], B [r, E])
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from tokenserve.config import TransformerConfig
from tokenserve.engine.lora_errors import (LoraBaseMismatchError, LoraRankError,
                                           LoraShapeError, LoraTargetError)

_STACKED = re.compile(r"^(?:mlp|block_sparse_moe)\.experts(?:\.base_layer)*$")
_PER_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)$")
_SHARED = {"mlp.shared_expert.gate_proj": ("shared_up", "gate"),
           "mlp.shared_expert.up_proj": ("shared_up", "up"),
           "mlp.shared_expert.down_proj": ("shared_down", "all"),
           "mlp.shared_expert_gate": ("shared_gate", "all"),
           "mlp.gate": ("router", "all"), "block_sparse_moe.gate": ("router", "all")}
_PROJ = {"gate_proj": ("expert_up", "gate"), "w1": ("expert_up", "gate"),
         "up_proj": ("expert_up", "up"), "w3": ("expert_up", "up"),
         "down_proj": ("expert_down", "all"), "w2": ("expert_down", "all")}

MOE_ROLES = ("router", "expert_up", "expert_down", "shared_up", "shared_down", "shared_gate")
"""The roles of a mixture of experts' layer that adapters change, in the slot table's order."""
EXPERT_ROLES = ("expert_up", "expert_down")
"""The roles with one factor pair per expert (A [E, in, R], B [E, R, out])."""


def is_moe_module(module: str) -> bool:
    """Whether `module` (a torch path inside a block) is part of a mixture of experts: an
    expert, the stacked experts, the shared expert or its gate, the router."""
    return (module in _SHARED or _STACKED.match(module) is not None
            or _PER_EXPERT.match(module) is not None)


def moe_role_shapes(config: TransformerConfig) -> dict[str, tuple[int, int, int]]:
    """role -> (factor pairs per layer, in, out) on this model (no shared roles without a
    shared expert)."""
    d, e, f = config.hidden_size, config.num_experts, config.expert_intermediate_size
    shapes = {"router": (1, d, e), "expert_up": (e, d, 2 * f), "expert_down": (e, f, d)}
    if config.shared_expert_size:
        fs = config.shared_expert_size
        shapes.update(shared_up=(1, d, 2 * fs), shared_down=(1, fs, d), shared_gate=(1, d, 1))
    return shapes


def moe_role_ranks(config: TransformerConfig, max_rank: int) -> dict[str, int]:
    """role -> its rank in a slot: max_rank per module the role fuses (gate and up: 2)."""
    return {role: max_rank * (2 if role in ("expert_up", "shared_up") else 1)
            for role in moe_role_shapes(config)}


def _parts(role: str, width_out: int) -> dict[str, tuple[int, int]]:
    half = width_out // 2
    if role in ("expert_up", "shared_up"):
        return {"gate": (0, half), "up": (half, width_out), "all": (0, width_out)}
    return {"all": (0, width_out)}


class MoeFactors:
    """Collects one adapter's MoE factors (`add`), then fuses them per layer (`layers`)."""

    def __init__(self, config: TransformerConfig, max_rank: int):
        self.config, self.max_rank = config, max_rank
        self.shapes = moe_role_shapes(config)
        # (layer, role) -> list of (part, A [E, r, in], B [E, out_part, r], scale)
        self._pieces: dict[tuple[int, str], list] = {}

    def add_pairs(self, pairs: dict, scale_of: Callable[[int, str], float]) -> int:
        """Adds every (layer, module) -> {"A": (name, lora_A), "B": (name, lora_B)} pair
        (`add`; scale_of(r, path from model.layers)); returns their largest rank."""
        ranks = [0]
        for (layer, module), pair in sorted(pairs.items()):
            if set(pair) != {"A", "B"}:
                raise LoraShapeError(f"layer {layer} {module} has lora_{next(iter(pair))} "
                                     f"but not its other factor")
            (name, a), (_, b) = pair["A"], pair["B"]
            if a.ndim != 2 or b.ndim != 2:
                raise LoraShapeError(f"adapter tensor {name!r}'s factors are not 2-D")
            self.add(name, layer, module, a, b,
                     lambda r, path, layer=layer: ranks.append(r) or scale_of(
                         r, f"model.layers.{layer}.{path}"))
        return max(ranks)

    def add(self, name: str, layer: int, module: str, a: np.ndarray, b: np.ndarray,
            scale_of: Callable[[int, str], float]) -> None:
        """One module's factor pair (PEFT's lora_A [r, in] / [E r, in], lora_B [out, r] /
        [out, E r]) from adapter tensor `name`; scale_of(r, path): its scale (alpha / r,
        alpha from PEFT's alpha_pattern where a key matches `path`, the torch module's path
        in the block, a stacked parameter's own: mlp.experts.gate_up_proj).

        A stacked gate_up_proj takes a rank up to 2 x max_rank: peft 0.21 turns target_modules
        gate_proj and up_proj of transformers 5's Qwen3-MoE and OLMoE into gate_up_proj at
        twice the rank (its rank_pattern and alpha_pattern), the two modules' rank.

        Raises:
            LoraTargetError: a layer without experts, or a module this model lacks.
            LoraBaseMismatchError: an expert index beyond the model's.
            LoraShapeError, LoraRankError: factors that do not fit, a rank over max_rank.
        """
        c = self.config
        if not c.layer_has_experts(layer):
            raise LoraTargetError(f"adapter tensor {name!r} targets {module!r}, but layer "
                                  f"{layer} is dense: it has no experts")
        path = module
        if (stacked := _STACKED.match(module)) is not None:
            role, part, expert = self._stacked_role(name, a, b), "all", None
            path = module.split(".")[0] + (".experts.gate_up_proj" if role == "expert_up"
                                           else ".experts.down_proj")
        elif (one := _PER_EXPERT.match(module)) is not None:
            (role, part), expert = _PROJ[one["proj"]], int(one["expert"])
            if expert >= c.num_experts:
                raise LoraBaseMismatchError(
                    f"adapter tensor {name!r} changes expert {expert}; the model's layers "
                    f"have {c.num_experts} experts (another base model?)")
        else:
            role, part = _SHARED[module]
            expert = None
        if role not in self.shapes:
            raise LoraTargetError(f"adapter tensor {name!r} targets {module!r}, which this "
                                  f"model does not have (no shared expert)")
        count, width_in, width_out = self.shapes[role]
        first, end = _parts(role, width_out)[part]
        num = count if stacked is not None else 1
        r = a.shape[0] // num
        if a.shape[0] % num or a.shape[1] != width_in or b.shape != (end - first, a.shape[0]):
            raise LoraShapeError(
                f"layer {layer} {module}: lora_A {a.shape} and lora_B {b.shape} do not fit "
                f"[{num} x r, {width_in}] and [{end - first}, {num} x r]")
        max_rank = self.max_rank * (2 if part == "all" and role.endswith("_up") else 1)
        if r > max_rank:
            raise LoraRankError(f"adapter rank {r} (layer {layer} {module}) is above "
                                f"--max_lora_rank {self.max_rank}"
                                f"{' (x 2 for gate_up_proj)' if max_rank > self.max_rank else ''}")
        scale = scale_of(r, path)
        a = a.astype(np.float32)
        b = b.astype(np.float32)
        if stacked is not None:  # expert e: A rows e r .. (e + 1) r; B columns j E + e
            a_all, b_all = a.reshape(num, r, width_in), b.reshape(-1, r, num).transpose(2, 0, 1)
        else:  # one expert's (or a single module's) pair, zeros for the other experts
            a_all = np.zeros([count, r, width_in], np.float32)
            b_all = np.zeros([count, end - first, r], np.float32)
            a_all[expert or 0], b_all[expert or 0] = a, b
        self._pieces.setdefault((layer, role), []).append(
            (part, module, expert, a_all, b_all, scale, first, end))

    def _stacked_role(self, name: str, a: np.ndarray, b: np.ndarray) -> str:
        """gate_up ([D] -> [2F]) or down ([F] -> [D]), told apart by the factors' shapes."""
        for role in EXPERT_ROLES:
            count, width_in, width_out = self.shapes[role]
            if a.shape[1] == width_in and b.shape[0] == width_out:
                return role
        raise LoraShapeError(
            f"adapter tensor {name!r}: stacked experts' lora_A {a.shape} / lora_B {b.shape} "
            f"fit neither gate_up_proj ([E r, {self.shapes['expert_up'][1]}] / "
            f"[{self.shapes['expert_up'][2]}, E r]) nor down_proj ([E r, "
            f"{self.shapes['expert_down'][1]}] / [{self.shapes['expert_down'][2]}, E r])")

    def layers(self, num_layers: int) -> list[dict]:
        """Per layer, MoE role -> (A, B) as the module docstring lays them out.

        Raises:
            LoraShapeError: one module given twice (an expert as a stacked parameter and
                on its own).
            LoraRankError: a role's fused rank over its slot's (moe_role_ranks).
        """
        ranks = moe_role_ranks(self.config, self.max_rank)
        layers: list[dict] = [{} for _ in range(num_layers)]
        for (layer, role), pieces in sorted(self._pieces.items()):
            count, width_in, width_out = self.shapes[role]
            seen: dict[tuple[str, int], str] = {}  # (part, expert) -> the module changing it
            for part, module, expert, *_ in pieces:
                covered = ("gate", "up") if part == "all" and role.endswith("_up") else (part,)
                for key in ((p, e) for p in covered
                            for e in (range(count) if expert is None else (expert,))):
                    if key in seen:
                        raise LoraShapeError(f"layer {layer}: {module} changes what "
                                             f"{seen[key]} changes")
                    seen[key] = module
            # per expert, modules of one part that differ only in expert share rank columns
            groups: dict[tuple[str, int], list] = {}
            for piece in pieces:
                groups.setdefault((piece[0], piece[3].shape[1]), []).append(piece)
            big_a, big_b = [], []
            for group in groups.values():
                a_sum = sum(p[3] for p in group)                          # [E, r, in]
                b_cols = np.zeros([count, width_out, a_sum.shape[1]], np.float32)
                for _, _, _, _, b_all, scale, first, end in group:
                    b_cols[:, first:end] += b_all * scale
                big_a.append(a_sum.transpose(0, 2, 1))                   # [E, in, r]
                big_b.append(b_cols.transpose(0, 2, 1))                  # [E, r, out]
            a, b = np.concatenate(big_a, 2), np.concatenate(big_b, 1)
            if a.shape[2] > ranks[role]:
                raise LoraRankError(f"layer {layer} {role}: its modules' ranks add to "
                                    f"{a.shape[2]}, above the slot's {ranks[role]} "
                                    f"(2 x --max_lora_rank for gate and up)")
            layers[layer][role] = (a, b) if role in EXPERT_ROLES else (a[0], b[0])
        return layers
