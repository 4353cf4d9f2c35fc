"""A mixture of experts' routed MLPs as one op, grouped by expert (moe_experts.cc).

    y = moe_experts(x, expert_ids, gates, ups, downs, residual=x)
    # y = residual + sum_j gates[:, j] * swiglu(x @ ups[e][:, :F], x @ ups[e][:, F:]) @ downs[e]
    #     with e = expert_ids[:, j], for float32 x [M, D], expert_ids and gates [M, k]

Each expert with rows runs once on its rows (the dense op's kernels); an expert without rows
is never read, so a step reads the active experts' bytes. The stock-TF path is
`tokenserve.model.moe.grouped_experts`, which the engine takes where this returns None (the
op not compiled, or forced off with TOKENSERVE_MOE_KERNEL=fallback or
TOKENSERVE_KERNELS=fallback), and which SavedModels export.

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


def is_compiled() -> bool:
    """True when the compiled op is loaded and not forced off."""
    return LIBRARY.is_compiled()


def kernel_status() -> str:
    """One line: which path the experts take here, and why (builds the op if needed)."""
    return LIBRARY.status()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(kernel_status())
