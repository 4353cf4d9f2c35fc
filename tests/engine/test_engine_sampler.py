"""The server's sampler (engine/sampler/), directly: min-p, the three penalties, and top-p's
candidate path (the nucleus found among the 256 likeliest tokens without a full sort) against
the full sort, and whole-distribution sampling against the full sort."""

from __future__ import annotations

import numpy as np
import pytest

from tokenserve.engine.sampler.draw import SequenceSampler, sample_batch, token_logprob
from tokenserve.engine.sampler.verify import verify_draft
from tokenserve.engine.sampler.walk import CANDIDATES, descending, pick_past_head, pick_whole
from tokenserve.sampling import SamplingParams

VOCAB = 1000


def sampler(prompt_ids=(), **params) -> SequenceSampler:
    return SequenceSampler(SamplingParams(**params), 0, VOCAB, list(prompt_ids))


def draws(params: dict, logits: np.ndarray, n: int = 400) -> set[int]:
    """Tokens drawn by n samplers with seeds 0..n-1."""
    return {sampler(seed=seed, **params).sample(logits) for seed in range(n)}


def test_min_p_keeps_exactly_the_tokens_within_its_ratio_of_the_best():
    logits = np.full(VOCAB, -30.0)
    logits[:4] = np.log([0.4, 0.3, 0.2, 0.02])  # ratios to the best: 1, .75, .5, .05
    assert draws({"temperature": 1.0, "min_p": 0.45}, logits) == {0, 1, 2}
    assert draws({"temperature": 1.0, "min_p": 0.6}, logits) == {0, 1}
    assert draws({"temperature": 1.0, "min_p": 0.01}, logits) >= {0, 1, 2, 3}


def test_presence_and_frequency_penalties_subtract_per_generated_token():
    logits = np.zeros(VOCAB)
    logits[:3] = [5.0, 4.75, 4.5]  # binary fractions: exact sums
    presence = sampler(presence_penalty=0.5)   # temperature 0: argmax after penalties
    assert presence.sample(logits) == 0
    presence.observe(0)
    assert presence.sample(logits) == 1        # 5.0 - 0.5 < 4.75
    presence.observe(0)
    assert presence.sample(logits) == 1        # presence counts once: still 4.5
    frequency = sampler(frequency_penalty=0.5)
    frequency.observe(0)
    assert frequency.sample(logits) == 1       # 4.5 < 4.75
    frequency.observe(1)
    assert frequency.sample(logits) == 0       # 4.5, 4.25, 4.5: the lower id wins a tie
    frequency.observe(0)
    assert frequency.sample(logits) == 2       # 5.0 - 2 * 0.5 = 4.0 < 4.5


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = np.full(VOCAB, -10.0)
    logits[:4] = [3.0, 2.0, -1.0, -1.5]
    # token 0 is in the prompt: 3.0 / 2 = 1.5 < 2.0, so token 1 wins
    assert sampler(prompt_ids=[0], repetition_penalty=2.0).sample(logits) == 1
    # a generated token is penalized too, and unseen tokens are not
    penalized = sampler(repetition_penalty=2.0)
    assert penalized.sample(logits) == 0
    penalized.observe(0)
    assert penalized.sample(logits) == 1
    # negative logits get more negative: -1.0 * 3 = -3.0 < -1.5
    negative = np.full(VOCAB, -10.0)
    negative[2:4] = [-1.0, -1.5]
    assert sampler(prompt_ids=[2], repetition_penalty=3.0).sample(negative) == 3
    assert sampler(prompt_ids=[2], repetition_penalty=1.0 + 1e-9).sample(negative) == 2


@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.95])
def test_top_p_candidate_path_equals_the_full_sort(top_p):
    rng = np.random.default_rng(7)
    for trial in range(20):
        # float32, as the sampler's softmax gives them
        probs = rng.dirichlet(np.full(VOCAB, 0.05 if trial % 2 else 0.5)).astype(np.float32)
        fast = sampler(temperature=1.0, top_p=top_p)._sorted_nucleus(probs)
        order = np.lexsort((np.arange(VOCAB), -probs))  # the full sort, ties by lower id
        mass_before = np.cumsum(probs[order]) - probs[order]
        expected = order[mass_before < top_p]
        np.testing.assert_array_equal(fast, expected)


def test_top_p_candidate_path_is_taken_and_the_fallback_when_the_head_is_short():
    peaked = np.full(VOCAB, 1e-6, np.float32)
    peaked[:10] = 0.1
    peaked /= peaked.sum()
    flat = np.full(VOCAB, 1.0 / VOCAB, np.float32)  # the 256 likeliest hold only 25.6% of the mass
    for probs in (peaked, flat):
        nucleus = sampler(temperature=1.0, top_p=0.9)._sorted_nucleus(probs)
        mass = probs[nucleus].sum()
        assert mass >= 0.9 - 1e-9 and mass - probs[nucleus[-1]] < 0.9
    assert len(sampler(temperature=1.0, top_p=0.9)._sorted_nucleus(flat)) > CANDIDATES


def test_top_p_draws_only_from_the_nucleus():
    logits = np.full(VOCAB, -30.0)
    logits[:3] = np.log([0.5, 0.3, 0.2])
    assert draws({"temperature": 1.0, "top_p": 0.7}, logits) == {0, 1}


def test_greedy_rows_and_sampled_rows_share_one_batch():
    logits = np.zeros((2, VOCAB), np.float32)
    logits[0, 17] = 5.0
    logits[1, :2] = [1.0, 1.0]
    seeded = [sampler(), sampler(temperature=1.0, seed=3)]
    again = [sampler(), sampler(temperature=1.0, seed=3)]
    first, second = sample_batch(logits, seeded)[0], sample_batch(logits, again)[0]
    assert first[0] == 17 and first == second  # a seed reproduces its draw


def test_a_large_batch_draws_each_row_as_it_would_alone():
    """From 8 sampled rows the draws split over two threads (sample_batch); every row still
    draws from its own stream, so each token is the one that row draws in a batch of one,
    over several tokens, with greedy, plain, top-p, top-k and penalized rows mixed."""
    kinds = [dict(), dict(temperature=1.0), dict(temperature=0.7, top_p=0.9),
             dict(temperature=1.2, top_k=40), dict(temperature=1.0, presence_penalty=0.5)]
    params = [dict(kinds[i % len(kinds)], seed=i) for i in range(20)]
    logits = np.random.default_rng(5).standard_normal((len(params), VOCAB)).astype(np.float32)
    batch = [sampler(**p) for p in params]
    alone = [sampler(**p) for p in params]
    for _ in range(4):
        tokens, _ = sample_batch(logits, batch)
        assert tokens == [sample_batch(logits[i:i + 1], [s])[0][0] for i, s in enumerate(alone)]
        for s, t in zip(batch + alone, tokens + tokens):
            s.observe(t)
        logits = np.roll(logits, 1, axis=1)


def full_sort_pick(probs: np.ndarray, uniform: float) -> int:
    """The reference: walk the whole distribution most likely first (ties: lower id first)."""
    order = np.lexsort((np.arange(probs.size), -probs))
    cumulative = np.cumsum(probs[order], dtype=np.float64)
    target = uniform * float(probs.sum(dtype=np.float64))
    return int(order[min(int(np.searchsorted(cumulative, target, side="right")),
                         probs.size - 1)])


@pytest.mark.parametrize("shape", ["peaked", "flat", "ties"])
def test_whole_distribution_sampling_sorts_only_the_head_and_picks_as_a_full_sort(shape):
    rng = np.random.default_rng(5)
    size = 4 * CANDIDATES
    if shape == "peaked":    # the draw nearly always lands among the likeliest tokens
        probs = np.exp(rng.normal(0, 4, size))
    elif shape == "flat":    # it often lands past them: the full-sort fallback
        probs = rng.uniform(0.9, 1.0, size)
    else:                    # many equal values, some across the head's boundary
        probs = rng.integers(1, 6, size).astype(np.float64)
    probs = (probs / probs.sum()).astype(np.float32)
    for uniform in np.concatenate([rng.random(300), [0.0, 1 - 1e-12]]):
        assert pick_whole(probs, float(uniform)) == full_sort_pick(
            probs, float(uniform))


def test_descending_orders_as_lexsort_by_probability_then_id():
    rng = np.random.default_rng(11)
    probs = rng.dirichlet(np.full(5000, 0.1)).astype(np.float32)
    probs[rng.integers(0, 5000, 300)] = 0.0                 # exp underflow: exact zeros
    probs[rng.integers(0, 5000, 300)] = probs[17]           # ties across the vocabulary
    probs[-1] = np.float32(np.inf)                          # the extreme key
    np.testing.assert_array_equal(descending(probs), np.lexsort((np.arange(5000), -probs)))
    ids = np.sort(rng.choice(5000, 700, replace=False))     # a subset, ordered by its own ids
    np.testing.assert_array_equal(descending(probs[ids], ids),
                                  ids[np.lexsort((ids, -probs[ids]))])
    with pytest.raises(TypeError):
        descending(probs.astype(np.float64))


@pytest.mark.parametrize("params", [dict(min_p=0.2), dict(min_p=0.02, top_p=0.5),
                                    dict(top_p=0.95), dict(top_p=0.3)])
def test_the_nucleus_is_a_prefix_of_the_full_sort_with_both_cuts(params):
    """min-p then top-p on the fully sorted distribution: what the sampler finds sorting
    only what min-p keeps, or only the likeliest tokens."""
    rng = np.random.default_rng(3)
    for trial in range(10):
        probs = rng.dirichlet(np.full(VOCAB, 0.05 if trial % 2 else 1.0)).astype(np.float32)
        probs[rng.integers(0, VOCAB, 50)] = probs[int(np.argmax(probs))] / 3  # ties
        probs /= probs.sum(dtype=np.float64)
        order = np.lexsort((np.arange(VOCAB), -probs))
        kept = probs[order] >= params.get("min_p", 0.0) * probs.max()
        if "top_p" in params:
            mass_before = np.cumsum(probs[order], dtype=np.float64) - probs[order]
            kept &= mass_before < params["top_p"]
        fast = sampler(temperature=1.0, **params)._sorted_nucleus(probs)
        np.testing.assert_array_equal(fast, order[kept])


def test_token_logprob_matches_a_float64_log_softmax_and_orders_ties_by_id():
    rng = np.random.default_rng(2)
    logits = rng.normal(0.0, 3.0, VOCAB).astype(np.float32)
    logits[[40, 7, 900]] = logits.max() + 1.0              # a three-way tie for the best
    reference = logits.astype(np.float64) - logits.max()
    reference -= np.log(np.exp(reference).sum())
    got = token_logprob(logits, 123, 5)
    assert got.token_id == 123
    assert got.logprob == pytest.approx(reference[123], abs=1e-6)
    assert [t for t, _ in got.top] == list(np.argsort(-reference, kind="stable")[:5])
    assert [t for t, _ in got.top][:3] == [7, 40, 900]
    np.testing.assert_allclose([v for _, v in got.top], reference[[t for t, _ in got.top]],
                               rtol=0, atol=1e-6)
    assert token_logprob(logits, 7, 0).top == ()
    assert len(token_logprob(logits[:3], 0, 5).top) == 3   # no more alternatives than words


def test_a_draw_past_the_head_sorts_one_bucket_and_picks_as_a_full_sort():
    """A flat distribution's draws land past the likeliest 256 tokens; there the sampler sorts
    only the bucket of values the draw lands in (walk.pick_past_head), and declines
    (None: the full sort decides) only where a draw lies on a token's border."""
    rng = np.random.default_rng(8)
    probs = np.exp(rng.normal(0.0, 1.0, 50_000)).astype(np.float32)
    probs[rng.integers(0, probs.size, 2000)] = probs[5]   # ties inside one bucket
    probs[rng.integers(0, probs.size, 500)] = 0.0        # and tokens that cannot be drawn
    probs /= probs.sum(dtype=np.float64)
    kth = np.partition(probs, probs.size - CANDIDATES)[probs.size - CANDIDATES]
    order = np.lexsort((np.arange(probs.size), -probs))
    cumulative = np.cumsum(probs[order], dtype=np.float64)
    head_mass = float(cumulative[np.count_nonzero(probs >= kth) - 1])
    total = float(probs.sum(dtype=np.float64))
    taken = 0
    for uniform in rng.uniform(head_mass / total, 1.0, 300):
        landed = pick_past_head(probs, kth, head_mass, float(uniform) * total, total)
        taken += landed is not None
        if landed is not None:
            token, before, through = landed
            assert token == full_sort_pick(probs, float(uniform))
            position = int(np.flatnonzero(order == token)[0])  # its running sums, near enough
            assert before == pytest.approx(cumulative[position - 1], abs=1e-11)
            assert through == pytest.approx(cumulative[position], abs=1e-11)
    assert taken == 300
    # a draw exactly on a border: declined, and the whole walk still picks the full sort's
    for k in rng.integers(np.count_nonzero(probs >= kth), probs.size - 600, 20):
        target = float(cumulative[k])
        assert pick_past_head(probs, kth, head_mass, target, total) is None
        uniform = target / total
        assert pick_whole(probs, uniform) == full_sort_pick(probs, uniform)


def test_top_k_keeps_exactly_k_tokens_and_the_lower_ids_of_a_tie():
    logits = np.full(VOCAB, -5.0, np.float32)
    logits[[900, 3, 450, 7, 600]] = 2.0           # five tied for the best
    logits[[11, 12]] = 3.0
    # k = 4: the two best and the two lowest ids of the tie
    assert draws({"temperature": 1.0, "top_k": 4}, logits) == {11, 12, 3, 7}
    assert draws({"temperature": 1.0, "top_k": 2}, logits) == {11, 12}
    candidates, probs = sampler(temperature=1.0, top_k=6).softmax(logits.copy())
    assert list(candidates) == [3, 7, 11, 12, 450, 600] and probs.size == 6


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9),
                                    dict(temperature=1.0, top_k=5),
                                    dict(temperature=1.0, min_p=0.1)])
def test_non_finite_logits_still_draw_a_defined_token(params):
    """NaN is never drawn, +inf tokens take all the mass, and a row with nothing finite
    draws any token: no exception, which would fail every sequence in the step."""
    nan_one = np.zeros(VOCAB, np.float32)
    nan_one[[3, 500]] = np.nan
    assert not draws(params, nan_one, n=100) & {3, 500}
    infinite = np.zeros(VOCAB, np.float32)
    infinite[[7, 70]] = np.inf
    infinite[9] = np.nan
    assert draws(params, infinite, n=100) == {7, 70}
    nothing = np.full(VOCAB, np.nan, np.float32)
    nothing[:10] = -np.inf
    picked = draws(params, nothing, n=50)
    assert picked and all(0 <= t < VOCAB for t in picked)


@pytest.mark.parametrize("params", [dict(), dict(temperature=1.0), dict(temperature=0.7, top_p=0.9),
                                    dict(temperature=0.0, repetition_penalty=1.2)])
def test_a_row_with_nan_or_plus_inf_is_reported_and_minus_inf_is_not(params):
    """sample_batch says which rows held a NaN or +inf (greedy rows, sampled rows and a
    penalized greedy row, each found its own way); -inf, a masked token, is not reported."""
    rows = np.zeros((5, VOCAB), np.float32)
    rows[0, 3] = np.nan
    rows[1, 7] = np.inf
    rows[2, [1, 2]] = -np.inf
    rows[3, 4], rows[3, 9] = np.inf, np.nan
    rows[4, 5] = 2.0  # healthy, with a clear best
    samplers = [sampler(**params) for _ in range(5)]
    tokens, broken = sample_batch(rows, samplers)
    assert broken == [True, True, False, True, False]
    assert tokens[0] != 3 and tokens[1] == 7 and tokens[3] == 4  # never a NaN; +inf first
    assert tokens[4] == 5 or params.get("temperature", 0.0) > 0
    _, after = sample_batch(rows[4:], samplers[:1])  # the sampler that saw the NaN: per draw
    assert after == [False]


@pytest.mark.parametrize("params", [dict(), dict(temperature=0.0, repetition_penalty=1.2),
                                    dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)])
def test_checking_a_draft_against_nan_logits_follows_the_draws_rule(params):
    """verify_draft() (speculative decoding) takes no NaN either, neither as the draft nor as its
    own pick, and says it saw one; a healthy row after it is not reported."""
    nan_row = np.zeros(VOCAB, np.float32)
    nan_row[3] = np.nan
    nan_row[8] = 1.0
    one = sampler(**params)
    for _ in range(20):
        assert verify_draft(one, nan_row, draft=3) != 3 and one.saw_nonfinite
    if params.get("temperature", 0.0) == 0.0:
        assert verify_draft(one, nan_row, draft=3) == 8
    healthy = np.zeros(VOCAB, np.float32)
    healthy[8] = 5.0
    verify_draft(one, healthy, draft=8)
    assert not one.saw_nonfinite


def nucleus_pick(probs: np.ndarray, top_p: float, uniform: float) -> int:
    """The reference: sort everything, cut at top_p, walk the nucleus to uniform x its mass."""
    order = np.lexsort((np.arange(probs.size), -probs))
    mass_before = np.cumsum(probs[order], dtype=np.float64) - probs[order]
    nucleus = order[mass_before < top_p]
    cumulative = np.cumsum(probs[nucleus], dtype=np.float64)
    pick = int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"))
    return int(nucleus[min(pick, nucleus.size - 1)])


@pytest.mark.parametrize("shape", ["flat", "peaked", "ties"])
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99])
def test_top_p_walks_twice_and_picks_as_sorting_the_nucleus(shape, top_p):
    """Top-p without min-p finds the nucleus's end and the draw by two walks (no sort of the
    nucleus), and declines only on a border: the pick is the full sort's, always."""
    rng = np.random.default_rng(12)
    if shape == "flat":
        probs = np.exp(rng.normal(0.0, 1.0, 20_000))
    elif shape == "peaked":
        probs = np.exp(rng.normal(0.0, 4.0, 20_000))
    else:
        probs = rng.integers(1, 6, 20_000).astype(np.float64)
    probs = (probs / probs.sum()).astype(np.float32)
    walker = sampler(temperature=1.0, top_p=top_p)
    declined = 0
    for uniform in rng.random(200):
        picked = walker._pick_in_nucleus(probs, float(uniform))
        declined += picked is None
        if picked is not None:
            assert picked == nucleus_pick(probs, top_p, float(uniform))
    assert declined <= 2
    # and through sample(): the same tokens as the reference, seed by seed
    logits = np.log(probs)
    for seed in range(20):
        drawn = sampler(temperature=1.0, top_p=top_p, seed=seed).sample(logits)
        uniform = np.random.default_rng(seed).random()
        _, redone = sampler(temperature=1.0, top_p=top_p).softmax(logits.copy())
        assert drawn == nucleus_pick(redone, top_p, uniform)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_plain_sampling_draws_from_the_softmax(temperature):
    """Plain temperature sampling is the argmax of logits plus T x Gumbel noise: over 20,000
    draws of one seeded sequence, each token's frequency is its softmax probability within
    4.5 standard deviations (the seed fixes the draws, so this cannot flake)."""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -np.inf, 3.0], np.float32)
    one = SequenceSampler(SamplingParams(temperature=temperature, seed=11), 0, logits.size, [])
    assert one.params.samples_by_noise
    n = 20_000
    counts = np.bincount([one.sample(logits) for _ in range(n)], minlength=logits.size)
    want = np.exp((logits - logits.max()) / temperature)
    want /= want.sum()
    sigma = np.sqrt(n * want * (1 - want))
    assert counts[5] == 0  # -inf: never
    assert np.all(np.abs(counts - n * want) <= 4.5 * sigma + 1e-9), (counts, n * want)


def test_only_plain_temperature_sampling_draws_by_noise():
    assert SamplingParams(temperature=0.7).samples_by_noise
    assert SamplingParams(temperature=0.7, repetition_penalty=1.2).samples_by_noise
    for cut in (dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1), dict(temperature=0.0)):
        assert not SamplingParams(**{"temperature": 0.7, **cut}).samples_by_noise, cut
    assert SamplingParams(temperature=0.7).needs_only_noisy_argmax
    assert SamplingParams().needs_only_noisy_argmax  # greedy: no noise
    for needs_more in (dict(logprobs=0), dict(presence_penalty=0.5), dict(top_p=0.9)):
        assert not SamplingParams(temperature=0.7, **needs_more).needs_only_noisy_argmax


def test_noise_a_step_added_gives_the_token_the_logits_give():
    """The engine's screened head returns logits + the row's noise, exact only where the
    argmax could be (engine/step/head.py): a sampler that handed its noise to the step
    picks the token that a sampler with the same seed picks from the plain logits, however
    low the entries that cannot win are. And the draws go on in step: 300 tokens."""
    rng = np.random.default_rng(4)
    plain, screened = (sampler(temperature=0.9, seed=21) for _ in range(2))
    for step in range(300):
        logits = rng.normal(0.0, 2.0, VOCAB).astype(np.float32)
        logits[rng.integers(0, VOCAB, 20)] = -np.inf  # masked tokens
        noise = screened.noise_for_step()
        returned = logits + noise
        best = returned.max()
        losers = returned < best - 1.0  # entries a screen rules out keep any lower value
        returned[losers] -= rng.uniform(0.0, 1.0, int(losers.sum())).astype(np.float32)
        assert screened.sample(returned) == plain.sample(logits), step
    infinite = np.zeros(VOCAB, np.float32)
    infinite[[7, 70]] = np.inf
    infinite[9] = np.nan
    picked = set()
    for _ in range(100):
        token = screened.sample(infinite + screened.noise_for_step())
        assert screened.saw_nonfinite
        picked.add(token)
    assert picked == {7, 70}  # the +inf tokens share the draws, a NaN is never one
