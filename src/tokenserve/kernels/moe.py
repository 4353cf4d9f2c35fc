"""A mixture of experts as one op a layer: the router and the routed MLPs, grouped by expert.

    y, counts = moe_layer(x, router, ups, downs, k=2, normalize=True, residual=x)
    # ids, gates = top_k(softmax(x @ router), k), gates renormalised where `normalize`
    # y = residual + sum_j gates[:, j] * swiglu(x @ ups[e][:, :F], x @ ups[e][:, F:]) @ downs[e]
    #     with e = ids[:, j], for float32 x [M, D]; counts [E]: rows per expert

    y = moe_experts(x, expert_ids, gates, ups, downs, residual=x)   # the router's choice given
    y, counts = moe_gguf_layer(x, router, [((gate_type, gate_blocks), (up_type, up_blocks),
                                            (down_type, down_blocks)), ...], k=2, ...)

Each expert with rows runs once on its rows (the dense op's kernels); an expert without rows
is never read, so a step reads the active experts' bytes (moe_grouped.h; moe_layer.cc adds
the router, moe_experts.cc takes its choice as inputs; moe_gguf_layer.cc is moe_layer for
experts kept in a GGUF file's blocks, through the block op's kernels). The stock-TF path is
`tokenserve.model.moe.moe_mlp`, which the engine takes where these return None (the op not
compiled, or forced off with TOKENSERVE_MOE_KERNEL=fallback or TOKENSERVE_KERNELS=fallback),
and which SavedModels export.

`python -m tokenserve.kernels.moe` builds the op and prints kernel_status().
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tokenserve.kernels import build as kbuild

LIBRARY = kbuild.LIBRARIES["moe"]


def moe_experts(x, expert_ids, gates, ups: list, downs: list, residual=None,
                isa: str = "auto", with_counts: bool = False):
    """residual + sum_j gates[:, j] * expert_{expert_ids[:, j]}(x) as one op, or None where
    the op is unavailable (the caller takes the stock-TF path then). with_counts: (y, the
    rows each expert ran on, int32 [len(ups)]), the counts from the op's own grouping.

    x: float32 [M, D]; expert_ids: int32 [M, k] in [0, len(ups)); gates: float32 [M, k];
    ups: [D, 2F] per expert (gate half, then up half), downs: [F, D] per expert, all
    float32 or all bfloat16; residual: float32 [M, D] or None. isa: "auto" or "scalar" (the
    op's portable path; tests)."""
    op = LIBRARY.module()
    if op is None:
        return None
    empty = tf.zeros([0, 0], tf.float32)
    y, counts = op.tokenserve_moe_experts(x, expert_ids, gates,
                                          empty if residual is None else residual, list(ups),
                                          list(downs), isa=isa)
    return (y, counts) if with_counts else y


def moe_layer(x, router, ups: list, downs: list, k: int, normalize: bool, residual=None,
              shared_gate=None, isa: str = "auto"):
    """(residual + the mixture of experts of x, the rows each routed expert ran on: int32
    [E]) as one op, or None where the op is unavailable (the caller takes the stock-TF path
    then).

    x: float32 [M, D]; router: [D, E]; ups: [D, 2F] per expert (gate half, then up half),
    downs: [F, D] per expert, all float32 or all bfloat16, the E routed experts then, with
    shared_gate [D, 1] (router's dtype), the shared expert, which every row runs scaled by
    sigmoid(x @ shared_gate). k, normalize: the router's top-k and whether the chosen
    probabilities are renormalised to sum to 1 (ties go to the lower expert index, as in
    tf.math.top_k). residual: float32 [M, D] or None. isa: "auto" or "scalar" (tests)."""
    op = LIBRARY.module()
    if op is None:
        return None
    return op.tokenserve_moe_layer(x, *_router_inputs(router, residual, shared_gate),
                                   list(ups), list(downs), k=k, normalize=normalize, isa=isa)


def _router_inputs(router, residual, shared_gate) -> tuple:
    """(router, residual, shared_gate) as both layer ops take them: a missing residual or
    shared gate is an empty [0, 0] tensor (float32, and the router's dtype)."""
    router = tf.convert_to_tensor(router)
    return (router,
            tf.zeros([0, 0], tf.float32) if residual is None else residual,
            tf.zeros([0, 0], router.dtype) if shared_gate is None else shared_gate)


def moe_gguf_layer(x, router, experts: list, k: int, normalize: bool, residual=None,
                   shared_gate=None, isa: str = "auto"):
    """moe_layer for experts kept as GGUF blocks (moe_gguf_layer.cc): (y, counts int32 [E]),
    or None where the op is unavailable.

    experts: per expert, ((gate type, gate blocks), (up type, up blocks), (down type, down
    blocks)): uint8 [F, D / values * block bytes] for gate and up, [D, F / values * block
    bytes] for down, types "q4_0", "q4_1", "q8_0", "q4_k", "q5_k" or "q6_k"; the E routed
    experts, then the shared one where shared_gate is given. The rest as moe_layer."""
    op = LIBRARY.module()
    if op is None:
        return None
    (gate_types, gates), (up_types, ups), (down_types, downs) = (
        zip(*[expert[role] for expert in experts]) for role in range(3))
    return op.tokenserve_moe_gguf_layer(
        x, *_router_inputs(router, residual, shared_gate), list(gates), list(ups), list(downs),
        gate_types=list(gate_types), up_types=list(up_types), down_types=list(down_types), k=k,
        normalize=normalize, isa=isa)


def is_compiled() -> bool:
    """True when the compiled op is loaded and not forced off."""
    return LIBRARY.is_compiled()


def kernel_status() -> str:
    """One line: which path the experts take here, and why (builds the op if needed)."""
    return LIBRARY.status()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(kernel_status())
