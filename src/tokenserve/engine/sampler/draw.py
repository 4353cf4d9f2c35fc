"""Per-sequence draws in NumPy: temperature, top-k, top-p, min-p, greedy rows in batches,
and logprobs.

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
  (engine/step/head.py): the step adds the noise and returns logits + noise, exact
  wherever that argmax could be. The noise for a token is drawn once (`noise`), whichever
  head the step ran, so the token is the same either way (up to float32 rounding where two
  sums tie within it: the screen recomputes its candidates in another order than the head).
- **With a cut**, one uniform number per token, walked down the distribution most likely
  first (inverse transform sampling, walk.py), only as far as the draw needs.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tokenserve.engine.outputs import TokenLogprob
from tokenserve.engine.sampler.masks import Penalties, finite_argmax, is_nonfinite, make_finite
from tokenserve.engine.sampler.walk import (WALK_MARGIN, all_ids, buffer, descending, head,
                                            pick_whole, walk)
from tokenserve.host.cpu_quota import usable_cpus
from tokenserve.sampling import SamplingParams

# Sampled rows in one batch from which their draws are split over two threads. A draw is
# numpy that releases the GIL (the exponential fill, the ufuncs, argmax), 0.27 ms over
# GPT-2's 50,257 entries; 32 sampled rows took 8.7 ms a step on one thread and 4.7 on two,
# a tenth of a 32-sequence float32 step on two cores, between steps when TF's threads wait.
_SPLIT_ROWS = 8


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
        self._noise_buffer = None   # its memory, kept between tokens (see walk.buffer)
        self._noise_in_logits = False  # a step added that noise to the logits it returned
        self.penalties = (Penalties(params, vocab_size, prompt_ids) if params.needs_penalties
                          else None)
        self.saw_nonfinite = False
        """Whether the logits of the last sample() held a NaN or +inf (a broken model)."""

    @property
    def is_greedy(self) -> bool:
        return self.params.temperature == 0.0 and self.penalties is None

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
        if self.penalties is not None:
            self.penalties.observe(token_id)
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
        scores = self.scores(logits)
        if p.temperature == 0.0:
            return self.greedy(scores)
        candidates, probs = self.softmax(scores)
        if p.top_p >= 1.0 and p.min_p == 0.0:
            return int(candidates[pick_whole(probs, self.rng.random())])
        uniform = self.rng.random()
        if p.min_p == 0.0:
            picked = self._pick_in_nucleus(probs, uniform)
            if picked is not None:
                return int(candidates[picked])
        candidates, probs = self.nucleus(candidates, probs)
        cumulative = np.cumsum(probs, dtype=np.float64)
        pick = int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"))
        return int(candidates[min(pick, len(candidates) - 1)])

    def _noisy_argmax(self, logits: np.ndarray) -> int:
        """The argmax of the (penalized) logits plus this token's noise: a draw from their
        softmax at this temperature. Where a step added the noise already
        (noise_for_step), `logits` are that sum.

        Non-finite logits follow make_finite's rules, as the softmax's draw: +inf tokens
        share the mass equally (the argmax of the noise among them), a NaN is never drawn,
        and a row with nothing finite draws every token equally. From a step's sum the
        logits are taken back as sum - noise: a NaN or an infinity stays one, and the
        entries that could win are exact (the screen recomputes them)."""
        noise = self.noise()
        if self._noise_in_logits:
            perturbed = np.asarray(logits, np.float32)
            scores = None
        else:
            scores = self.scores(logits)
            perturbed = np.add(scores, noise, out=buffer("perturbed", noise.size, np.float32))
        self._noise, self._noise_in_logits = None, False
        token = int(np.argmax(perturbed))  # a NaN, or else a +inf, if there is any
        best = perturbed[token]
        self.saw_nonfinite = is_nonfinite(best)
        if np.isfinite(best):
            return token
        if scores is None:
            scores = np.subtract(perturbed, noise, dtype=np.float32)
        make_finite(scores)
        return int(np.argmax(scores + noise))

    def greedy(self, scores: np.ndarray) -> int:
        """The argmax of `scores` (a NaN or +inf by make_finite's rules), noting in
        saw_nonfinite whether there was one."""
        token = int(np.argmax(scores))  # a NaN, or else a +inf, if there is any
        self.saw_nonfinite = is_nonfinite(scores[token])
        return finite_argmax(scores) if self.saw_nonfinite else token

    def scores(self, logits: np.ndarray) -> np.ndarray:
        """float32 scores (a copy) with this sequence's penalties applied."""
        scores = np.array(logits, np.float32)
        return self.penalties.apply(scores) if self.penalties is not None else scores

    def softmax(self, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(candidate ids, their probabilities) after temperature and top-k, computed in
        place in `scores`. float32 throughout (relative error ~1e-7, far below what a draw
        can tell apart; sums and cumulative sums are float64): over a 49,152-word vocabulary
        the float64 version cost 1.2 ms a sampled token, mostly float64 exponentials and
        fresh 400 kB arrays (each one new pages from the OS)."""
        p = self.params
        top = scores.max()  # NaN if there is any, else +inf if there is any
        self.saw_nonfinite = is_nonfinite(top)
        if not np.isfinite(top):
            make_finite(scores)
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
            candidates = all_ids(scores.size)
        scores -= scores.max()
        probs = np.exp(scores, out=scores)
        probs *= np.float32(1.0 / probs.sum(dtype=np.float64))
        return candidates, probs

    def nucleus(self, candidates: np.ndarray, probs: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
        """The top-p nucleus with the min-p cut, most likely first (ties: lower id first);
        probs stay as given (not renormalized)."""
        order = self._sorted_nucleus(probs)
        return candidates[order], probs[order]

    def _pick_in_nucleus(self, probs: np.ndarray, uniform: float) -> int | None:
        """Index of the token top-p sampling (no min-p) draws with `uniform`, without sorting
        the nucleus: two walks (walk.walk). The nucleus ends at the token whose running sum
        first reaches top_p, so its mass is that running sum, and the draw is a walk to
        `uniform` times that mass, which stays inside the nucleus. A flat distribution's
        nucleus is most of the vocabulary, and sorting it was most of a 1.1-1.4 ms token.

        The full sort's own cut compares (running sum - probability) with top_p, which can
        differ from the sum before the token in its last bit, and a bucket's sums are within
        5e-12 of the total: so where top_p or the draw lies within WALK_MARGIN of the total
        from a border, this returns None and the caller sorts the nucleus."""
        total = float(probs.sum(dtype=np.float64))
        margin = WALK_MARGIN * total
        first = head(probs)
        _, start, end = walk(probs, self.params.top_p, total, first)
        if min(self.params.top_p - start, end - self.params.top_p) < margin:
            return None
        target = uniform * end
        token, start, end = walk(probs, target, total, first)
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
        first = head(probs) if top_p < 1.0 else None
        # every token past the head has at least the head's mass before it
        if first is not None and first[2][-1] >= top_p:
            return self._cut(first[1], probs)
        return self._cut(descending(probs), probs)

    def _cut(self, order: np.ndarray, probs: np.ndarray) -> np.ndarray:
        """The tokens of `order` (most likely first) whose mass before them is under top_p."""
        if self.params.top_p >= 1.0:
            return order
        kept = probs[order]
        mass_before = np.cumsum(kept, dtype=np.float64) - kept
        return order[mass_before < self.params.top_p]


def greedy_batch(logits: np.ndarray) -> tuple[list[int], list[bool]]:
    """logits: float32 [S, vocab] -> each row's greedy token in one argmax, and per row
    whether it held a NaN or +inf (argmax picks one where a row has it; such rows then take
    finite_argmax's token)."""
    best = np.argmax(logits, axis=-1)
    chosen = logits[np.arange(len(best)), best]
    bad = (np.isnan(chosen) | (chosen == np.inf)).tolist()
    tokens = [finite_argmax(row) if is_bad else token
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
        best_ids = np.flatnonzero(logits >= kth)  # every token tied with the last one too
        best_ids = best_ids[np.lexsort((best_ids, -logits[best_ids]))][:num_top]
        top = tuple((int(t), logprob(int(t))) for t in best_ids)
    return TokenLogprob(int(token_id), logprob(int(token_id)), top)
