"""Speculative decoding with n-gram drafts: exactly the tokens of plain decoding, in fewer
steps (tiny real models, the TensorFlow runner)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from support.engines import PROMPTS, engine_config
from support.tiny_models import reference_greedy, tiny
from tokenserve.engine.async_engine import AsyncEngine
from tokenserve.engine.config import EngineConfig
from tokenserve.engine.llm import LLM
from tokenserve.engine.ngram import NgramDrafter
from tokenserve.engine.sampler.draw import SequenceSampler
from tokenserve.engine.sampler.verify import verify_draft
from tokenserve.errors import ConfigError
from tokenserve.sampling import SamplingParams

DRAFTS = 3


# -- the drafter ------------------------------------------------------------------------------
def test_a_draft_is_what_followed_the_tails_first_occurrence():
    assert NgramDrafter(3, 1, 2).propose([5, 6, 7, 8, 5, 6]) == [7, 8, 5]
    # the longest tail found wins: (9, 1) was followed by 3, the single 1 by 2
    assert NgramDrafter(3, 1, 2).propose([1, 2, 9, 1, 3, 9, 1]) == [3, 9, 1]
    assert NgramDrafter(3, 1, 1).propose([1, 2, 9, 1, 3, 9, 1]) == [2, 9, 1]
    # the tail's own occurrence never matches itself
    assert NgramDrafter(3).propose([1, 2, 3]) == []
    assert NgramDrafter(3).propose([4]) == []
    # a loop of one token drafts as many as asked, up to the limit given
    assert NgramDrafter(4).propose([7] * 8) == [7, 7, 7, 7]
    assert NgramDrafter(4).propose([7] * 8, limit=2) == [7, 7]
    assert NgramDrafter(4).propose([7] * 8, limit=0) == []
    with pytest.raises(ValueError):
        NgramDrafter(0)
    with pytest.raises(ValueError):
        NgramDrafter(2, min_n=3, max_n=2)


def test_the_draft_length_follows_what_the_model_keeps():
    drafter = NgramDrafter(5)
    tokens = [7] * 12
    assert len(drafter.propose(tokens)) == 5
    drafter.observe(5, 2)
    assert len(drafter.propose(tokens)) == 4
    for _ in range(6):
        drafter.observe(4, 0)
    assert len(drafter.propose(tokens)) == 1  # never below one
    drafter.observe(1, 1)
    assert len(drafter.propose(tokens)) == 3
    drafter.observe(3, 3)
    drafter.observe(5, 5)
    assert len(drafter.propose(tokens)) == 5  # never above num_tokens
    drafter.observe(0, 0)  # nothing proposed: nothing learned
    assert len(drafter.propose(tokens)) == 5


def test_a_drafter_kept_up_to_date_proposes_what_a_fresh_one_does():
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(0, 6, 300)]  # a small alphabet: many repeats
    kept = NgramDrafter(4, 1, 3)
    for end in range(1, len(tokens) + 1):
        grown = tokens[:end]
        assert kept.propose(grown) == NgramDrafter(4, 1, 3).propose(list(grown))


def test_speculative_settings_are_checked():
    for bad in (dict(num_speculative_tokens=-1), dict(speculative_max_seqs=0),
                dict(speculative_ngram_min=0), dict(speculative_ngram_min=3,
                                                    speculative_ngram_max=2)):
        with pytest.raises(ConfigError):
            EngineConfig(**bad)
    config = EngineConfig(max_num_seqs=2, num_speculative_tokens=4, speculative_max_seqs=4,
                          speculative_max_step_tokens=16)
    assert config.max_logit_rows == 2 * 5  # a drafting step's rows: its tokens, not its seqs
    assert config.replace(speculative_max_step_tokens=8).max_logit_rows == 8
    with pytest.raises(ConfigError):
        EngineConfig(speculative_max_step_tokens=0)
    assert EngineConfig(max_num_seqs=8).max_logit_rows == 8


# -- checking a draft of a sampled sequence -----------------------------------------------------
LOGITS = np.array([2.0, 1.6, 1.5, 0.9, 0.4, 0.2, -0.3, -0.8, -1.0, -1.6, -2.5, -3.0])
PROMPT_IDS = [1, 4]


def target_distribution(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                        repetition_penalty=1.0) -> np.ndarray:
    """What sampling draws from, written out plainly for LOGITS (a tiny vocabulary)."""
    scores = LOGITS.copy()
    seen = np.isin(np.arange(scores.size), PROMPT_IDS)
    scores[seen] = np.where(scores[seen] > 0, scores[seen] / repetition_penalty,
                            scores[seen] * repetition_penalty)
    probs = np.exp(scores / temperature)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(probs.size, bool)
    if top_k:
        keep[order[:top_k]] = True
    else:
        keep[:] = True
    kept = probs * keep
    kept /= kept.sum()
    before = np.cumsum(kept[order]) - kept[order]  # mass of the more likely tokens
    keep[order[before >= top_p]] = False
    keep &= probs >= min_p * probs.max()
    kept = probs * keep
    return kept / kept.sum()


@pytest.mark.parametrize("knobs", [dict(), dict(temperature=0.6, top_k=5),
                                   dict(temperature=1.4, top_p=0.8), dict(min_p=0.3),
                                   dict(repetition_penalty=1.8)])
@pytest.mark.parametrize("draft", [0, 3, 10])
def test_a_checked_draft_leaves_the_sampling_distribution_as_it_was(knobs, draft):
    """Keeping a draft with probability p(draft) and otherwise drawing from the rest gives
    every token exactly its probability: likely, unlikely and cut-off drafts alike."""
    knobs = dict(knobs)  # (pytest shares the parameter's dict between the drafts' cases)
    want = target_distribution(**knobs)
    params = SamplingParams(temperature=knobs.pop("temperature", 1.0), seed=0, **knobs)
    sampler = SequenceSampler(params, 0, LOGITS.size, PROMPT_IDS)
    draws = 20000
    got = np.bincount([verify_draft(sampler, LOGITS, draft) for _ in range(draws)],
                      minlength=LOGITS.size) / draws
    if want[draft] == 0:
        assert got[draft] == 0  # outside top-k / top-p / min-p: never kept
    # 20,000 draws: each frequency within ~4 standard deviations, the total off by < 3 %
    assert np.all(np.abs(got - want) <= 4 * np.sqrt(want * (1 - want) / draws) + 1e-3), (got, want)
    assert 0.5 * np.abs(got - want).sum() < 0.03
    # sample() draws from the same distribution (the reference is right)
    plain = np.bincount([sampler.sample(LOGITS) for _ in range(draws)],
                        minlength=LOGITS.size) / draws
    assert 0.5 * np.abs(plain - want).sum() < 0.03


def test_a_greedy_check_is_the_models_choice_penalties_included():
    sampler = SequenceSampler(SamplingParams(repetition_penalty=2.0), 0, LOGITS.size, [0])
    # token 0's logit halves to 1.0 once it was seen: token 1 (1.6) is the choice
    assert verify_draft(sampler, LOGITS, 0) == 1 and verify_draft(sampler, LOGITS, 1) == 1


# -- the engine -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(exported):
    """(in-memory model, plain LLM, drafting LLM) on the same export."""
    model, _, version_dir = exported
    plain = LLM(version_dir, engine_config())
    drafting = LLM(version_dir, engine_config(num_speculative_tokens=DRAFTS,
                                              speculative_max_seqs=8,
                                              speculative_max_step_tokens=64))
    return model, plain, drafting


def drafts_checked(llm: LLM) -> tuple[int, int]:
    return llm.engine.num_draft_tokens, llm.engine.num_accepted_tokens


def test_drafted_greedy_output_equals_full_forward_passes_in_fewer_steps(pair):
    model, _, llm = pair
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    if not llm.engine.runner.is_transformer:  # an LSTM's state cannot be written ahead
        assert not llm.engine.speculative
        return
    steps, checked = llm.engine.num_steps, drafts_checked(llm)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        ids = llm.tokenizer.encode(prompt)
        assert out.outputs[0].token_ids == reference_greedy(model, ids, 24, eos=-1)
    drafted, accepted = (a - b for a, b in zip(drafts_checked(llm), checked))
    # random tiny models repeat themselves: drafts are made, some kept, some refused
    assert drafted > accepted > 0
    assert llm.engine.num_steps - steps < len(PROMPTS) * 24


def test_one_drafting_sequence_alone_matches_plain_decoding_token_for_token(pair):
    _, plain, llm = pair
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2)
    for prompt in PROMPTS[:3]:
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids and got.text == want.text
        assert [lp.token_id for lp in got.logprobs] == got.token_ids
        np.testing.assert_allclose([lp.logprob for lp in got.logprobs],
                                   [lp.logprob for lp in want.logprobs], atol=1e-4)
        assert [t for t, _ in got.logprobs[-1].top] == [t for t, _ in want.logprobs[-1].top]


def test_limits_and_stops_land_mid_draft_exactly_as_without_drafts(pair):
    """max_tokens and stop strings can fall inside a step's accepted drafts: the output ends
    where plain decoding ends it."""
    _, plain, llm = pair
    prompt = PROMPTS[2]
    full = plain.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    stops = {full.text[i:i + 3] for i in range(4, len(full.text) - 3, 5)
             if full.text[i:i + 3].strip()}
    cases = [SamplingParams(max_tokens=n, ignore_eos=True) for n in range(1, 9)]
    cases += [SamplingParams(max_tokens=30, ignore_eos=True, stop=[s]) for s in sorted(stops)]
    cases.append(SamplingParams(max_tokens=30, ignore_eos=True,
                                stop_token_ids=[full.token_ids[len(full.token_ids) // 2]]))
    for params in cases:
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason), params


def test_a_mixed_batch_keeps_every_request_exact(pair):
    """Greedy requests draft, sampled and n > 1 ones run beside them: a fixed seed still
    gives its tokens, and the greedy ones equal plain decoding."""
    _, plain, llm = pair
    requests = [SamplingParams(max_tokens=20, ignore_eos=True),
                SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=5),
                SamplingParams(max_tokens=16, ignore_eos=True, n=2),
                SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.3)]
    prompts = PROMPTS[:len(requests)]
    for order in (requests, requests[::-1]):
        wants = [plain.generate([p], params, use_tqdm=False)[0]  # each alone, no drafts
                 for p, params in zip(prompts, order)]
        for got, want in zip(llm.generate(prompts, order, use_tqdm=False), wants):
            assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]


def test_penalized_greedy_requests_draft_and_keep_their_tokens(pair):
    """Penalties change the model's choice token by token: drafts are checked one row at a
    time after the tokens kept before them, so the output is plain decoding's."""
    _, plain, llm = pair
    if not llm.engine.speculative:
        pytest.skip("the LSTM does not draft")
    # mild: strong ones keep a tiny random model off every token it has seen, and then no
    # tail recurs to draft from
    params = SamplingParams(max_tokens=32, ignore_eos=True, repetition_penalty=1.05,
                            frequency_penalty=0.05)
    before = drafts_checked(llm)
    for prompt in PROMPTS[:3]:
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids and got.text == want.text
    assert drafts_checked(llm)[0] > before[0]


def test_sampled_requests_draft_unless_seeded(pair):
    """A seeded sampled request keeps its tokens whatever runs beside it, so it never drafts
    (whether a step drafts depends on the batch); an unseeded one drafts."""
    _, plain, llm = pair
    if not llm.engine.speculative:
        pytest.skip("the LSTM does not draft")
    seeded = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=11)
    before = drafts_checked(llm)
    got = llm.generate(PROMPTS[:2], seeded, use_tqdm=False)
    assert drafts_checked(llm) == before
    want = plain.generate(PROMPTS[:2], seeded, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # unseeded and sampled, but with top_k=1: a random tiny model's distribution is nearly
    # flat over its 512 words, so at any real temperature whether a drawn token recurs (and
    # a draft is made) is chance; one word kept makes the draws, and so the drafts, certain
    unseeded = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.3, top_k=1,
                              logprobs=1)
    outputs = llm.generate(PROMPTS[:3], unseeded, use_tqdm=False)
    assert drafts_checked(llm)[0] > before[0]
    greedy = plain.generate(PROMPTS[:3], SamplingParams(max_tokens=24, ignore_eos=True),
                            use_tqdm=False)
    for out, want in zip(outputs, greedy):
        completion = out.outputs[0]
        assert completion.token_ids == want.outputs[0].token_ids
        assert [lp.token_id for lp in completion.logprobs] == completion.token_ids


def test_cached_blocks_written_while_drafting_hold_the_right_keys(pair):
    """Drafts that were refused left rows in the cache past the sequence's end; a next turn
    that reuses the first turn's blocks (prefix caching) must see only accepted tokens."""
    _, plain, llm = pair
    if not llm.engine.runner.is_transformer:
        pytest.skip("the LSTM has no blocks to share")
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    first_ids = llm.tokenizer.encode(PROMPTS[3])
    first = llm.generate([first_ids], params, use_tqdm=False)[0].outputs[0].token_ids
    turn = first_ids + first + llm.tokenizer.encode("x")
    hits = llm.engine.prefix_cache_stats().num_hit_tokens
    got = llm.generate([turn], params, use_tqdm=False)[0]
    assert llm.engine.prefix_cache_stats().num_hit_tokens - hits >= 16  # blocks were reused
    # the plain engine never held those blocks: it computes the whole turn itself
    assert got.outputs[0].token_ids == plain.generate([turn], params,
                                                      use_tqdm=False)[0].outputs[0].token_ids


def test_a_tight_cache_preempts_and_recomputes_drafting_sequences_exactly(exported):
    model, _, version_dir = exported
    llm = LLM(version_dir, engine_config(max_cache_tokens=96, num_speculative_tokens=DRAFTS,
                                         speculative_max_seqs=8,
                                         speculative_max_step_tokens=64))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == reference_greedy(
            model, llm.tokenizer.encode(prompt), 20, eos=-1)
    if llm.engine.runner.is_transformer:
        assert llm.engine.scheduler.num_preemptions > 0


def test_drafts_stop_at_the_step_token_cap(exported):
    _, _, version_dir = exported
    llm = LLM(version_dir, engine_config(num_speculative_tokens=4, speculative_max_seqs=8,
                                         speculative_max_step_tokens=5))
    if not llm.engine.speculative:
        pytest.skip("the LSTM does not draft")
    steps = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append([(s.num_new_tokens, len(s.draft_ids)) for s in out.scheduled])
        return out
    llm.engine.scheduler.schedule = recording
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    drafting = [step for step in steps if any(d for _, d in step)]
    assert drafting  # two sequences, room for three drafts between them
    for step in drafting:
        assert sum(n for n, _ in step) <= 5


def test_no_drafts_above_speculative_max_seqs(exported):
    _, _, version_dir = exported
    llm = LLM(version_dir, engine_config(num_speculative_tokens=DRAFTS, speculative_max_seqs=2))
    llm.generate(PROMPTS[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert drafts_checked(llm) == (0, 0)  # four ran together throughout


def test_streamed_deltas_of_several_tokens_add_up_to_the_output(exported, pair):
    _, plain, _ = pair
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    want = plain.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
    engine = AsyncEngine.from_model_dir(exported[2], engine_config(num_speculative_tokens=DRAFTS))

    async def stream():
        return [out async for out in engine.generate(plain.tokenizer.encode(PROMPTS[1]),
                                                     params)]

    try:
        deltas = asyncio.run(stream())
    finally:
        engine.shutdown()
    tokens = [t for d in deltas for c in d.outputs for t in c.token_ids]
    assert tokens == want.token_ids
    assert "".join(c.text for d in deltas for c in d.outputs) == want.text
    assert deltas[-1].finished and deltas[-1].num_generated_tokens == 32
    if engine.engine.runner.is_transformer:
        assert len(deltas) < 32  # some steps gave several tokens


@pytest.mark.slow  # an int8 export and two engines; the float drafting tests cover acceptance
def test_int8_weights_draft_too_and_say_what_it_costs(tokenizer, tmp_path, caplog):
    """int8 steps check drafts through the int8 op (every step runs the fused ops): the same
    tokens as plain decoding of that export, and a warning about the cost."""
    import dataclasses
    import logging

    from tokenserve.export.exporter import export_model
    from tokenserve.model.quantize import quantize_model

    model, config = tiny("tiny-gpt2", tokenizer)
    int8 = quantize_model(model)
    version_dir = export_model(int8, tokenizer, dataclasses.replace(config, model=int8.config),
                               tmp_path / "int8")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = LLM(version_dir, engine_config()).generate(PROMPTS, params, use_tqdm=False)
    with caplog.at_level(logging.WARNING, logger="tokenserve.engine.spec_decode"):
        llm = LLM(version_dir, engine_config(num_speculative_tokens=DRAFTS,
                                             speculative_max_seqs=8))
    assert any("int8" in r.getMessage() for r in caplog.records)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.num_accepted_tokens > 0
