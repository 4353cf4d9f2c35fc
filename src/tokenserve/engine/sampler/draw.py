"""Per-sequence sampling in NumPy: penalties, temperature, top-k, top-p, min-p, logprobs.

Each sequence owns its random stream (seeded from the request's seed and its index) and
draws from it a fixed amount per sampled token, so a seeded request gives the same tokens
whatever else shares its batch. Greedy rows are decided together in one argmax.

Two ways to draw:
- **Plain temperature sampling** (no top-k, top-p or min-p cut; what OpenAI's API does with
  a request that names only a temperature)
  draws one exponential number E_i per vocabulary entry and takes the argmax of
  logits_i + T * -log(E_i): -log(E) is Gumbel noise, and the argmax of logits / T plus
  independent Gumbel noise is a draw from softmax(logits / T) (the Gumbel-max trick). Being
  an argmax, it lets the engine screen the LM head for sampled rows as for greedy ones
  (engine/screened_head.py): the step adds the noise and returns logits + noise, exact
  wherever that argmax could be. The noise for a token is drawn once (`noise`), whichever
  head the step ran, so the token is the same either way (up to float32 rounding where two
  sums tie within it: the screen recomputes its candidates in another order than the head).
- **With a cut**, one uniform number per token, walked down the distribution most likely
  first (inverse transform sampling), only as far as the draw needs.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tokenserve.engine.outputs import TokenLogprob
from tokenserve.host.cpu_quota import usable_cpus
from tokenserve.sampling import SamplingParams

_CANDIDATES = 256  # the likeliest tokens a walk sorts first; past them, buckets (or a full sort)
# Sampled rows in one batch from which their draws are split over two threads. A draw is
# numpy that releases the GIL (the exponential fill, the ufuncs, argmax), 0.27 ms over
# GPT-2's 50,257 entries; 32 sampled rows took 8.7 ms a step on one thread and 4.7 on two,
# a tenth of a 32-sequence float32 step on two cores, between steps when TF's threads wait.
_SPLIT_ROWS = 8
_SPARSE_WORDS = 8  # masks with at most this many non-zero words (256 tokens) go token by token
_ID_BITS = np.uint64(32)


@functools.lru_cache(maxsize=8)
def _all_ids(size: int) -> np.ndarray:
    """0 .. size - 1, read-only and made once per vocabulary size (a fresh arange of 50k ids
    cost 0.13 ms per sampled token, more than its softmax)."""
    ids = np.arange(size)
    ids.setflags(write=False)
    return ids


_scratch = threading.local()


def _buffer(name: str, size: int, dtype) -> np.ndarray:
    """A vocabulary-sized temporary this thread keeps between tokens. Fresh 200-400 kB
    arrays are mapped from the OS and faulted in on every call (glibc gives blocks of that
    size back when they are freed): the bucket walk took 0.48 ms with fresh arrays and 0.16
    with its memory kept. Per thread, as engines in one process sample on their own
    threads."""
    buffer = getattr(_scratch, name, None)
    if buffer is None or buffer.size < size or buffer.dtype != dtype:
        buffer = np.empty(size, dtype)
        setattr(_scratch, name, buffer)
    return buffer[:size]


_BUCKET_SHIFT = 19  # float32 bits >> 19: exponent and 4 mantissa bits
_WALK_MARGIN = 1e-9  # of the total mass: how near a bucket's sums may put a draw to a border


def _pick_past_head(probs: np.ndarray, kth, head_mass: float, target: float, total: float
                    ) -> tuple[int, float, float] | None:
    """The token a walk most likely first lands on at `target` past the head (every token of
    at least `kth`, holding `head_mass`), in linear time: the other tokens' mass per bucket
    of values (a float32's bits >> 19: each bucket 2^(1/16) wide, and higher buckets hold
    only higher values), summed from the top bucket down, and only the bucket the draw lands
    in sorted. Flat distributions (a random model's) land here on nearly every token, where
    sorting the whole vocabulary took 0.6 ms of a 0.9 ms sampled token.

    Summed by bucket, the masses before a token are not the full sort's running sum bit for
    bit; they differ by at most about (tokens x 1e-16) of the total, 5e-12 over 50k tokens.
    So where the draw is within _WALK_MARGIN of the total from either border of the token it
    lands on, this returns None and the caller walks the full sort: the pick is always the
    full sort's. total: the sum of `probs`. Returns (token, the running sum before it, the
    running sum through it)."""
    rest = np.less(probs, kth, out=_buffer("rest", probs.size, np.bool_))
    # intp keys and float64 weights: bincount takes them as they are (it converted uint32
    # keys 5x slower than it counts)
    keys = np.right_shift(probs.view(np.int32), _BUCKET_SHIFT,
                          out=_buffer("keys", probs.size, np.intp))
    weights = np.multiply(probs, rest, out=_buffer("weights", probs.size, np.float64))
    masses = np.bincount(keys, weights=weights)
    reached = head_mass + np.cumsum(masses[::-1])  # after each bucket, the highest first
    j = int(np.searchsorted(reached, target, side="right"))
    if j == reached.size:
        return None
    start = head_mass if j == 0 else float(reached[j - 1])
    members = np.flatnonzero(rest & (keys == masses.size - 1 - j))
    order = descending(probs[members], members)
    borders = np.cumsum(np.concatenate(([start], probs[order])), dtype=np.float64)
    i = int(np.searchsorted(borders, target, side="right"))  # token i - 1 spans the draw
    margin = _WALK_MARGIN * total
    if not 0 < i < borders.size or min(target - borders[i - 1], borders[i] - target) < margin:
        return None
    return int(order[i - 1]), float(borders[i - 1]), float(borders[i])


def _make_finite(scores: np.ndarray) -> None:
    """Replaces a row's non-finite scores, in place, with what they mean for a draw: a NaN is
    never drawn, the +inf tokens share all the mass equally, and a row with no finite score
    and no +inf one (all NaN or -inf) draws every token equally. A model that makes them is
    broken, but this row's draw stays defined, where the softmax would sum to NaN and the
    walk fail the whole step (every sequence in the batch)."""
    positive = np.isposinf(scores)
    if positive.any():
        scores[:] = np.where(positive, np.float32(0), np.float32(-np.inf))
        return
    scores[np.isnan(scores)] = -np.inf
    if scores.max() == -np.inf:
        scores[:] = 0


def descending(probs: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
    """`ids` (default: every position of `probs`) most likely first, ties lower id first:
    the order of np.lexsort((ids, -probs)), from one sort of 64-bit keys instead.

    probs: float32, none negative (a non-negative float32's bits order as its value does),
    one per id. Each key is the probability's bits inverted above the id, so NumPy's
    vectorized integer sort does it: 0.6 ms over a 50,257-word vocabulary, against 3.7 ms
    for lexsort (a 2-core Zen 5 EPYC). The sampler sorts whole distributions this way where
    it still must: a top-p nucleus that the likeliest 256 tokens do not hold, and the draws
    _pick_past_head declines."""
    if probs.dtype != np.float32:
        raise TypeError(f"descending() orders float32 probabilities, got {probs.dtype}")
    ids = _all_ids(probs.size) if ids is None else ids
    keys = np.uint64(0xFFFFFFFF) - probs.view(np.uint32).astype(np.uint64)
    keys <<= _ID_BITS
    keys |= ids.astype(np.uint64)
    keys.sort()
    keys &= np.uint64(0xFFFFFFFF)
    return keys.astype(np.intp)


class SequenceSampler:
    """Sampling state of one sequence: its random stream and its token counts."""

    def __init__(self, params: SamplingParams, index: int, vocab_size: int,
                 prompt_ids: list[int], guide=None):
        self.params = params
        self.guide = guide
        """The sequence's structured-output constraint (engine.guided.Guide), or None."""
        self.rng = np.random.default_rng(None if params.seed is None else params.seed + index)
        self.vocab_size = vocab_size
        self._noise = None          # the next token's noise once drawn (noise()), else None
        self._noise_buffer = None   # its memory, kept between tokens (see _buffer)
        self._noise_in_logits = False  # a step added that noise to the logits it returned
        self.counts = None
        self.saw_nonfinite = False
        """Whether the logits of the last sample() held a NaN or +inf (a broken model)."""
        if params.needs_penalties:
            self.counts = np.zeros(vocab_size, np.int32)   # generated-token counts
            self.seen = np.zeros(vocab_size, bool)          # in the prompt or generated
            self.seen[np.asarray(prompt_ids, np.int64)] = True

    @property
    def is_greedy(self) -> bool:
        return self.params.temperature == 0.0 and self.counts is None

    def noise(self) -> np.ndarray:
        """The next token's noise: float32 [vocab], T * -log(E) with E ~ Exp(1) per entry
        (numpy's ziggurat, 0.2 ms over 50k entries), drawn once per token from this
        sequence's stream and kept until sample() takes it."""
        if self._noise is None:
            if self._noise_buffer is None:
                self._noise_buffer = np.empty(self.vocab_size, np.float32)
            noise = self.rng.standard_exponential(out=self._noise_buffer, dtype=np.float32)
            # E = 0 would be infinite noise; float32's smallest positive value gives 103.3
            np.maximum(noise, np.float32(np.finfo(np.float32).smallest_subnormal), out=noise)
            np.log(noise, out=noise)
            noise *= np.float32(-self.params.temperature)
            self._noise = noise
        return self._noise

    def noise_for_step(self) -> np.ndarray:
        """noise(), handed to a step that adds it to the logits it returns for this
        sequence: the next sample() takes those logits as they are. The runner calls this
        only for a row the engine samples from after the step (ScheduledSeq.samples)."""
        noise = self.noise()
        self._noise_in_logits = True
        return noise

    def observe(self, token_id: int) -> None:
        if self.counts is not None:
            self.counts[token_id] += 1
            self.seen[token_id] = True
        if self.guide is not None:
            self.guide.consume(token_id)

    @property
    def is_guide_done(self) -> bool:
        """The constraint is complete: the sequence must end here."""
        return self.guide is not None and self.guide.is_done

    def sample(self, logits: np.ndarray) -> int:
        """logits: float [vocab] -> the chosen token id."""
        p = self.params
        if p.samples_by_noise:
            return self._noisy_argmax(logits)
        scores = self._scores(logits)
        if p.temperature == 0.0:
            return self._greedy(scores)
        candidates, probs = self._softmax(scores)
        if p.top_p >= 1.0 and p.min_p == 0.0:
            return int(candidates[self._pick_whole(probs, self.rng.random())])
        uniform = self.rng.random()
        if p.min_p == 0.0:
            picked = self._pick_in_nucleus(probs, uniform)
            if picked is not None:
                return int(candidates[picked])
        candidates, probs = self._nucleus(candidates, probs)
        cumulative = np.cumsum(probs, dtype=np.float64)
        pick = int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"))
        return int(candidates[min(pick, len(candidates) - 1)])

    def verify(self, logits: np.ndarray, draft: int) -> int:
        """The token this sequence takes where `draft` was proposed (speculative decoding):
        greedy, the model's own choice (the draft is kept when they agree); sampled, the
        draft with probability p(draft) under this sequence's distribution (temperature,
        top-k, top-p, min-p and penalties applied), else a token drawn from that distribution
        without the draft, renormalized. A draft proposed with certainty (an n-gram lookup)
        is the speculative-sampling rule's simplest case: the token follows exactly the
        distribution sample() draws from, though from other random draws."""
        p = self.params
        scores = self._scores(logits)
        if p.temperature == 0.0:
            return self._greedy(scores)
        candidates, probs = self._softmax(scores)
        if p.top_p < 1.0 or p.min_p > 0.0:
            candidates, probs = self._nucleus(candidates, probs)
        at = np.flatnonzero(candidates == draft)
        if at.size and self.rng.random() < probs[at[0]] / probs.sum(dtype=np.float64):
            return int(draft)
        probs[at] = 0.0  # (probs is this call's own array)
        if not probs.any():  # p(draft) was 1 within rounding: nothing else to draw
            return int(draft)
        return int(candidates[self._pick_whole(probs, self.rng.random())])

    def _noisy_argmax(self, logits: np.ndarray) -> int:
        """The argmax of the (penalized) logits plus this token's noise: a draw from their
        softmax at this temperature. Where a step added the noise already
        (noise_for_step), `logits` are that sum.

        Non-finite logits follow _make_finite's rules, as the softmax's draw: +inf tokens
        share the mass equally (the argmax of the noise among them), a NaN is never drawn,
        and a row with nothing finite draws every token equally. From a step's sum the
        logits are taken back as sum - noise: a NaN or an infinity stays one, and the
        entries that could win are exact (the screen recomputes them)."""
        noise = self.noise()
        if self._noise_in_logits:
            perturbed = np.asarray(logits, np.float32)
            scores = None
        else:
            scores = self._scores(logits)
            perturbed = np.add(scores, noise, out=_buffer("perturbed", noise.size, np.float32))
        self._noise, self._noise_in_logits = None, False
        token = int(np.argmax(perturbed))  # a NaN, or else a +inf, if there is any
        best = perturbed[token]
        self.saw_nonfinite = is_nonfinite(best)
        if np.isfinite(best):
            return token
        if scores is None:
            scores = np.subtract(perturbed, noise, dtype=np.float32)
        _make_finite(scores)
        return int(np.argmax(scores + noise))

    def _greedy(self, scores: np.ndarray) -> int:
        token = int(np.argmax(scores))  # a NaN, or else a +inf, if there is any
        self.saw_nonfinite = is_nonfinite(scores[token])
        return _finite_argmax(scores) if self.saw_nonfinite else token

    def _scores(self, logits: np.ndarray) -> np.ndarray:
        """float32 scores (a copy) with this sequence's penalties applied."""
        scores = np.array(logits, np.float32)
        return self._penalize(scores) if self.counts is not None else scores

    def _softmax(self, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(candidate ids, their probabilities) after temperature and top-k, computed in
        place in `scores`. float32 throughout (relative error ~1e-7, far below what a draw
        can tell apart; sums and cumulative sums are float64): over a 49,152-word vocabulary
        the float64 version cost 1.2 ms a sampled token, mostly float64 exponentials and
        fresh 400 kB arrays (each one new pages from the OS)."""
        p = self.params
        top = scores.max()  # NaN if there is any, else +inf if there is any
        self.saw_nonfinite = is_nonfinite(top)
        if not np.isfinite(top):
            _make_finite(scores)
        scores /= np.float32(p.temperature)
        if p.top_k > 0 and p.top_k < scores.size:
            # the k highest, in id order; of tokens tied with the k-th, the lower ids (a
            # partition and two scans: half of argpartition's time over 50k words)
            kth = np.partition(scores, scores.size - p.top_k)[scores.size - p.top_k]
            above = np.flatnonzero(scores > kth)
            tied = np.flatnonzero(scores == kth)[:p.top_k - above.size]
            candidates = np.union1d(above, tied)
            scores = scores[candidates]
        else:
            candidates = _all_ids(scores.size)
        scores -= scores.max()
        probs = np.exp(scores, out=scores)
        probs *= np.float32(1.0 / probs.sum(dtype=np.float64))
        return candidates, probs

    def _nucleus(self, candidates: np.ndarray, probs: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
        """The top-p nucleus with the min-p cut, most likely first (ties: lower id first);
        probs stay as given (not renormalized)."""
        order = self._sorted_nucleus(probs)
        return candidates[order], probs[order]

    @staticmethod
    def _pick_whole(probs: np.ndarray, uniform: float) -> int:
        """Index of the token the draw `uniform` lands on when the whole distribution is
        walked most likely first (ties: lower id first), as with a full sort; only the most
        likely tokens are sorted, and past them only the bucket the draw lands in
        (_pick_past_head). A full sort of a 50k-word vocabulary was ~5 ms per sampled token,
        the default OpenAI sampling path."""
        total = float(probs.sum(dtype=np.float64))
        return SequenceSampler._walk(probs, uniform * total, total)[0]

    @staticmethod
    def _head(probs: np.ndarray) -> tuple | None:
        """(the 256th highest probability, the tokens of at least it most likely first, their
        running sums), or None for a vocabulary of at most 256 tokens."""
        if probs.size <= _CANDIDATES:
            return None
        kth = np.partition(probs, probs.size - _CANDIDATES)[probs.size - _CANDIDATES]
        head = np.flatnonzero(probs >= kth)  # every token tied with the last one too
        order = descending(probs[head], head)
        return kth, order, np.cumsum(probs[order], dtype=np.float64)

    @staticmethod
    def _walk(probs: np.ndarray, target: float, total: float, head: tuple | None = None
              ) -> tuple[int, float, float]:
        """(index of the first token, most likely first, whose running sum of `probs` passes
        `target`, the running sum before it, the running sum through it); past the last
        token, the last token. The sums are the full sort's, except from _pick_past_head,
        whose sums are within 5e-12 of the total and whose target is 1e-9 from any border.
        total: the sum of `probs`; head: _head(probs), where the caller has it already."""
        head = SequenceSampler._head(probs) if head is None else head
        if head is not None:
            kth, order, cumulative = head
            if target < cumulative[-1]:
                i = int(np.searchsorted(cumulative, target, side="right"))
                return (int(order[i]), float(cumulative[i - 1]) if i else 0.0,
                        float(cumulative[i]))
            landed = _pick_past_head(probs, kth, float(cumulative[-1]), target, total)
            if landed is not None:
                return landed
        order = descending(probs)
        cumulative = np.cumsum(probs[order], dtype=np.float64)
        i = min(int(np.searchsorted(cumulative, target, side="right")), probs.size - 1)
        return int(order[i]), float(cumulative[i - 1]) if i else 0.0, float(cumulative[i])

    def _pick_in_nucleus(self, probs: np.ndarray, uniform: float) -> int | None:
        """Index of the token top-p sampling (no min-p) draws with `uniform`, without sorting
        the nucleus: two walks (_walk). The nucleus ends at the token whose running sum first
        reaches top_p, so its mass is that running sum, and the draw is a walk to `uniform`
        times that mass, which stays inside the nucleus. A flat distribution's nucleus is
        most of the vocabulary, and sorting it was most of a 1.1-1.4 ms token.

        The full sort's own cut compares (running sum - probability) with top_p, which can
        differ from the sum before the token in its last bit, and a bucket's sums are within
        5e-12 of the total: so where top_p or the draw lies within _WALK_MARGIN of the total
        from a border, this returns None and the caller sorts the nucleus."""
        total = float(probs.sum(dtype=np.float64))
        margin = _WALK_MARGIN * total
        head = self._head(probs)
        _, start, end = self._walk(probs, self.params.top_p, total, head)
        if min(self.params.top_p - start, end - self.params.top_p) < margin:
            return None
        target = uniform * end
        token, start, end = self._walk(probs, target, total, head)
        if min(target - start, end - target) < margin:
            return None
        return token

    def _sorted_nucleus(self, probs: np.ndarray) -> np.ndarray:
        """Positions in `probs` of the top-p nucleus with the min-p cut, most likely first
        (ties: lower id first). Each cut keeps a prefix of the whole distribution in that
        order, so only what min-p keeps is sorted, or only the likeliest 256 tokens where
        they hold top_p: the whole vocabulary only when neither narrows it."""
        top_p, min_p = self.params.top_p, self.params.min_p
        if min_p > 0.0:
            kept = np.flatnonzero(probs >= min_p * probs.max())
            return self._cut(descending(probs[kept], kept), probs)
        head = self._head(probs) if top_p < 1.0 else None
        # every token past the head has at least the head's mass before it
        if head is not None and head[2][-1] >= top_p:
            return self._cut(head[1], probs)
        return self._cut(descending(probs), probs)

    def _cut(self, order: np.ndarray, probs: np.ndarray) -> np.ndarray:
        """The tokens of `order` (most likely first) whose mass before them is under top_p."""
        if self.params.top_p >= 1.0:
            return order
        kept = probs[order]
        mass_before = np.cumsum(kept, dtype=np.float64) - kept
        return order[mass_before < self.params.top_p]

    def _penalize(self, scores: np.ndarray) -> np.ndarray:
        p = self.params
        if p.repetition_penalty != 1.0:
            hit = self.seen
            scores[hit] = np.where(scores[hit] > 0, scores[hit] / p.repetition_penalty,
                                   scores[hit] * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            # only the generated tokens: no vocabulary-sized temporaries
            hit = np.flatnonzero(self.counts)
            scores[hit] -= p.presence_penalty + p.frequency_penalty * self.counts[hit]
        return scores


def is_nonfinite(score) -> bool:
    """A NaN or +inf logit: what no working model makes (-inf is a masked token)."""
    return bool(np.isnan(score) or score == np.inf)


def _finite_argmax(scores: np.ndarray) -> int:
    """A greedy pick by the rules of a draw (_make_finite): never a NaN, the first +inf if
    there is one, and token 0 where nothing is finite."""
    scores = np.array(scores, np.float32)
    _make_finite(scores)
    return int(np.argmax(scores))


def greedy_batch(logits: np.ndarray) -> tuple[list[int], list[bool]]:
    """logits: float32 [S, vocab] -> each row's greedy token in one argmax, and per row
    whether it held a NaN or +inf (argmax picks one where a row has it; such rows then take
    _finite_argmax's token)."""
    best = np.argmax(logits, axis=-1)
    chosen = logits[np.arange(len(best)), best]
    bad = (np.isnan(chosen) | (chosen == np.inf)).tolist()
    tokens = [_finite_argmax(row) if is_bad else token
              for row, token, is_bad in zip(logits, best.tolist(), bad)]
    return tokens, bad


def sample_batch(logits: np.ndarray, samplers: list[SequenceSampler]
                 ) -> tuple[list[int], list[bool]]:
    """logits: float32 [S, vocab] -> one token id per row (greedy rows in one argmax), and
    per row whether its logits held a NaN or +inf. Found from what the draw computes anyway:
    argmax picks a NaN, or else a +inf, where a row has one, and the sampler checks the max
    it takes for the softmax; a pass over the whole batch would cost more than the draw."""
    tokens, broken = [0] * len(samplers), [False] * len(samplers)
    greedy = [i for i, s in enumerate(samplers) if s.is_greedy]
    if greedy:  # all rows greedy: no row gather (a copy of the whole batch)
        best, bad = greedy_batch(logits if len(greedy) == len(samplers) else logits[greedy])
        for i, token, is_bad in zip(greedy, best, bad):
            tokens[i], broken[i] = token, is_bad
    sampled = [i for i, s in enumerate(samplers) if not s.is_greedy]

    def draw(rows: list[int]) -> None:  # each row its own sampler: no state is shared
        for i in rows:
            tokens[i] = samplers[i].sample(logits[i])
            broken[i] = samplers[i].saw_nonfinite

    if len(sampled) >= _SPLIT_ROWS and _helper() is not None:
        half = _helper().submit(draw, sampled[::2])
        draw(sampled[1::2])
        half.result()
    else:
        draw(sampled)
    return tokens, broken


_HELPER: list[ThreadPoolExecutor | None] = []
_HELPER_LOCK = threading.Lock()


def _helper() -> ThreadPoolExecutor | None:
    """One thread that takes half of a large batch's draws (sample_batch); None where this
    process may run on one core only. Shared by the process's engines: a draw never waits
    on anything, so an engine's half waits at most for another's."""
    if not _HELPER:
        with _HELPER_LOCK:
            if not _HELPER:
                _HELPER.append(ThreadPoolExecutor(1, thread_name_prefix="tokenserve-sample")
                               if usable_cpus() > 1 else None)
    return _HELPER[0]


def apply_token_masks(logits: np.ndarray, rows: list[int], masks: np.ndarray) -> None:
    """Sets every token a row's mask does not allow to -inf, in place.

    Args:
        logits: float [S, vocab].
        rows: the rows of `logits` the masks are for.
        masks: int32 [len(rows), ceil(vocab / 32)]; bit t of a row (little-endian) allows
            token t.
    """
    words = masks.view(np.uint32)
    sparse = np.count_nonzero(words, axis=1) <= _SPARSE_WORDS
    if sparse.any():  # a forced token, a digit, a key: set the few allowed ones, not the vocab
        rows_sparse, words_sparse = np.asarray(rows)[sparse], words[sparse]
        mask_rows, word_ids = np.nonzero(words_sparse)
        bits = np.unpackbits(words_sparse[mask_rows, word_ids].view(np.uint8).reshape(-1, 4),
                             axis=1, bitorder="little")  # uint8 [set words, 32]
        set_words, bit_ids = np.nonzero(bits)
        token_rows = rows_sparse[mask_rows[set_words]]
        token_ids = word_ids[set_words] * 32 + bit_ids
        kept = logits[token_rows, token_ids]
        logits[rows_sparse] = -np.inf
        logits[token_rows, token_ids] = kept
    for row, mask in zip(np.asarray(rows)[~sparse], masks[~sparse]):
        allowed = np.unpackbits(mask.view(np.uint8), count=logits.shape[1], bitorder="little")
        np.copyto(logits[row], -np.inf, where=allowed == 0)


def token_logprob(logits: np.ndarray, token_id: int, num_top: int) -> TokenLogprob:
    """The model's (unprocessed) log-probability of `token_id`, with `num_top` alternatives.

    Exponentials in float32, their sum in float64 (as the sampler's softmax): over 50,257
    words the float64 version cost 0.48 ms a token, 0.83 with five alternatives."""
    best = np.float32(logits.max())
    shifted = np.subtract(logits, best, dtype=np.float32)
    log_total = float(np.log(np.exp(shifted, out=shifted).sum(dtype=np.float64)))

    def logprob(token: int) -> float:
        return (float(logits[token]) - float(best)) - log_total

    top: tuple = ()
    if num_top > 0:
        num_top = min(num_top, logits.size)
        kth = np.partition(logits, logits.size - num_top)[logits.size - num_top]
        head = np.flatnonzero(logits >= kth)  # every token tied with the last one too
        head = head[np.lexsort((head, -logits[head]))][:num_top]
        top = tuple((int(t), logprob(int(t))) for t in head)
    return TokenLogprob(int(token_id), logprob(int(token_id)), top)
