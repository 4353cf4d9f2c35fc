"""A step's scheduled tokens packed into the transformer step's index arrays, and the
bucket sizes steps are padded to (plain Python and NumPy: no TensorFlow).

Packed order: decode tokens group by group, then prefill tokens, then padding up to the
step's bucket size (the runner pads: only XLA's programs and TF Serving's batch sizes need
it). Decode rows group by context length (`split_by_context`), so a short context is not
padded to a long one; prefill chunks are laid out [Sp, Tp] for the graph path's masked
attention, with `unpack` taking them back to the packed order.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

from tokenserve.engine.config import EngineConfig


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def token_buckets():
    """1, 2, 4, ... 64, then steps of 64: padding stays under 2x for small steps and under
    64 tokens for large ones, with a few dozen shapes in all."""
    size = 1
    while size < 64:
        yield size
        size *= 2
    while True:
        yield size
        size += 64


def token_buckets_upto(limit: int) -> list[int]:
    return [b for b in itertools.takewhile(lambda b: b <= limit, token_buckets())]


def bucket_size(num_tokens: int, batch_sizes, only_decode: bool, xla: bool) -> int:
    """How many tokens (or head rows) a step computes for `num_tokens` real ones.

    TF Serving's allowed_batch_sizes (`batch_sizes`) pad decode batches; XLA compiles one
    program per shape, so a step through XLA is padded to a few bucket sizes."""
    if only_decode and batch_sizes:
        return next((s for s in batch_sizes if s >= num_tokens), num_tokens)
    if xla:
        return next(b for b in token_buckets() if b >= num_tokens)
    return num_tokens


def xla_shapes(max_tokens: int, max_logit_rows: int, max_fused_tokens: int,
               fused_head: bool) -> list[tuple[int, int]]:
    """The (tokens, LM-head rows) shapes of the XLA programs steps of up to `max_tokens`
    can run: every token bucket above `max_fused_tokens` (the fused dense ops take the
    smaller steps), and the head's bucket of rows for each number of sequences (up to
    `max_logit_rows`) such a step can have; rows 0 (no head program) with `fused_head`."""
    max_rows = bucket_size(max_logit_rows, (), only_decode=False, xla=True)
    sizes = []
    for size in token_buckets():
        if size > max_fused_tokens:
            sizes.append(size)
        if size >= max_tokens:
            break
    if not sizes:
        return []
    if fused_head:
        return [(size, 0) for size in sizes]
    shapes = [(size, min(size, max_rows)) for size in sizes]
    heads = {rows for _, rows in shapes}
    # the other head sizes ride along with the smallest token bucket's (compiled first)
    shapes += [(sizes[0], rows) for rows in token_buckets_upto(max_rows) if rows not in heads]
    return shapes


def split_by_context(decode: list, max_groups: int, group_cost: int,
                     pad: int = EngineConfig.context_pad) -> list[list]:
    """Splits decode rows into at most `max_groups` groups of similar context length.

    Each group is padded to its longest context, so one group would pad every sequence to the
    longest in the batch (prompts of 16..512 tokens read about 2x the rows they need). The
    split minimizes the rows read plus `group_cost` rows per group (each group adds a gather
    and two matmuls per layer), by dynamic programming over the sorted, padded lengths."""
    if len(decode) < 2 or max_groups < 2:
        return [decode]
    ordered = sorted(decode, key=lambda g: len(g[1]))
    lengths = [round_up(len(g[1]), pad) for g in ordered]
    # a group only ever ends where the padded length changes
    ends = [i + 1 for i in range(len(lengths))
            if i + 1 == len(lengths) or lengths[i + 1] != lengths[i]]
    # cost[e], cuts[e]: the cheapest split of the first ends[e] rows found so far
    cost = [end * lengths[end - 1] + group_cost for end in ends]
    cuts = [[end] for end in ends]
    for _ in range(1, max_groups):
        new_cost, new_cuts = list(cost), list(cuts)
        for e, end in enumerate(ends):
            for p in range(e):
                candidate = cost[p] + (end - ends[p]) * lengths[end - 1] + group_cost
                if candidate < new_cost[e]:
                    new_cost[e], new_cuts[e] = candidate, cuts[p] + [end]
        cost, cuts = new_cost, new_cuts
    bounds = [0] + cuts[-1]
    return [ordered[start:end] for start, end in zip(bounds, bounds[1:])]


class PackedTokens(NamedTuple):
    """A step's scheduled tokens in packed order, before the bucket padding.

    token_ids, positions, write_rows: [N] each (write_rows: each token's cache row).
    decode_groups: per group, (context rows [Sg, Lg] (padding: row 0), query positions [Sg]).
    prefill: () without prefill tokens, else (index [Sp, Tp] into the packed prefill tokens
        (padding: Np), context rows [Sp, Lp], positions [Sp, Tp] (padding: -1), unpack [Np]
        into the flattened [Sp * Tp]).
    last_tokens: [sum of num_logits] the packed index of each logits row, in scheduled order.
    token_seqs: [N] the index into `scheduled` of each packed token's sequence.
    """
    token_ids: list[int]
    positions: list[int]
    write_rows: list[int]
    decode_groups: list[tuple[np.ndarray, np.ndarray]]
    prefill: tuple
    last_tokens: np.ndarray
    token_seqs: list[int] = []


def pack_tokens(scheduled: list, block_size: int, max_groups: int, group_cost: int,
                context_pad: int) -> PackedTokens:
    """Packs a SchedulerOutput's `scheduled` sequences (ScheduledSeq) for the transformer
    step: decode rows (one new token) split into at most `max_groups` groups by context
    length, padded to multiples of `context_pad` rows."""
    offsets = np.arange(block_size)
    decode, prefill = [], []  # (scheduled index, context rows, start position, count)
    # the copies taken when the step was scheduled, never the live sequences: an abort
    # may free their blocks while this runs (ScheduledSeq)
    for index, item in enumerate(scheduled):
        start, count = item.start, item.num_new_tokens
        rows = (np.asarray(item.block_ids)[:, None] * block_size + offsets).ravel()
        (decode if count == 1 else prefill).append((index, rows[:start + count], start, count))
    groups = split_by_context(decode, max_groups, group_cost, context_pad) if decode else []

    token_ids, positions, write_rows, token_seqs = [], [], [], []
    # logits rows, in scheduled order: each sequence's last token, or all of them where
    # it checks drafts
    num_logits = [item.num_logits for item in scheduled]
    first_row = np.cumsum([0] + num_logits[:-1])
    last = np.zeros([sum(num_logits)], np.int32)
    for item in [g for group in groups for g in group] + prefill:
        index, rows, start, count = item
        token_ids.extend(scheduled[index].token_ids)
        token_seqs.extend([index] * count)
        positions.extend(range(start, start + count))
        write_rows.extend(rows[start:start + count])
        wanted = num_logits[index]
        last[first_row[index]:first_row[index] + wanted] = np.arange(
            len(token_ids) - wanted, len(token_ids))

    def context(group):
        length = round_up(max((len(g[1]) for g in group), default=1), context_pad)
        rows = np.zeros([len(group), length], np.int32)
        for i, (_, ctx, _, _) in enumerate(group):
            rows[i, :len(ctx)] = ctx
        return rows

    decode_groups = [(context(g), np.asarray([s for _, _, s, _ in g], np.int32))
                     for g in groups]
    prefill_inputs = ()
    if prefill:
        chunk = max(g[3] for g in prefill)
        num_prefill = sum(g[3] for g in prefill)
        index = np.full([len(prefill), chunk], num_prefill, np.int32)
        pos = np.full([len(prefill), chunk], -1, np.int32)
        unpack, first = [], 0
        for i, (_, _, start, count) in enumerate(prefill):
            index[i, :count] = np.arange(first, first + count)
            pos[i, :count] = np.arange(start, start + count)
            unpack.extend(range(i * chunk, i * chunk + count))
            first += count
        prefill_inputs = (index, context(prefill), pos, np.asarray(unpack, np.int32))
    return PackedTokens(token_ids, positions, write_rows, decode_groups, prefill_inputs, last,
                        token_seqs)
