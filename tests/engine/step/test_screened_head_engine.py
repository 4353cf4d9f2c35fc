"""The LM head's screen in the engine (engine/step/head.py): greedy and plainly sampled
steps take it and give the tokens of the float32 head, no step with a top-p, penalized,
logprobs or structured row does, and the warmup traces every head a request can need."""

from __future__ import annotations

import numpy as np
import pytest

from support.engines import PROMPTS, engine_config
from tokenserve.engine.llm import LLM
from tokenserve.sampling import SamplingParams

pytest.importorskip("tensorflow")


def test_the_screen_is_refused_where_its_op_is_not_built(exported, monkeypatch):
    """Its fallback writes a float32 copy of the float16 head every step: slower than the
    head it stands in for, so no screen then (and the same tokens, through the plain head)."""
    model, _, version_dir = exported
    if type(model).__name__ != "TransformerLM":
        pytest.skip("the LSTM's step has no separate LM head")
    monkeypatch.setenv("TOKENSERVE_HALF_KERNEL", "fallback")
    llm = LLM(version_dir, engine_config(max_screened_head_rows=8))
    assert llm.engine.runner.step.screened_head is None
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert llm.engine.runner.num_screened_steps == 0


@pytest.fixture(scope="module")
def screened_and_plain(exported):
    model, _, version_dir = exported
    if type(model).__name__ != "TransformerLM":
        pytest.skip("the LSTM's step has no separate LM head")
    return (LLM(version_dir, engine_config(max_screened_head_rows=8)),
            LLM(version_dir, engine_config(max_screened_head_rows=0)))


@pytest.fixture(scope="module")
def float16_screened(exported, screened_and_plain):
    return LLM(exported[2], engine_config(max_screened_head_rows=8, head_screen="float16"))


@pytest.mark.parametrize("dtype", ["int8", "float16"])
def test_greedy_steps_take_the_screen_and_keep_their_tokens(screened_and_plain, dtype,
                                                            request):
    screened, plain = screened_and_plain
    if dtype == "float16":
        screened = request.getfixturevalue("float16_screened")
    runner = screened.engine.runner
    assert runner.step.screened_head is not None and plain.engine.runner.step.screened_head is None
    assert runner.step.screened_head.dtype == dtype  # int8 is the default
    # the copy is reported beside the weights
    vocab, width = runner.vocab_size, runner.config.model.hidden_size
    want_bytes = (vocab * width + vocab * 8 if dtype == "int8"
                  else vocab * width * 2 + vocab * 4)
    assert runner.memory_bytes()["head_screen"] == want_bytes
    assert "head_screen" not in plain.engine.runner.memory_bytes()
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    before = runner.num_screened_steps
    got = screened.generate(PROMPTS, params, use_tqdm=False)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert runner.num_screened_steps > before


def test_a_step_with_a_row_that_needs_its_distribution_reads_the_float32_head(
        screened_and_plain):
    """Mixed batches: greedy rows beside a logprobs, a penalized and a top-p sampled
    (seeded) one. Those steps must not screen: their logprobs and tokens are exactly the
    unscreened engine's."""
    screened, plain = screened_and_plain
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    others = [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9,
                             seed=5)]
    for other in others:
        params = [greedy, other, greedy]
        runner = screened.engine.runner
        before = runner.num_screened_steps
        got = screened.generate(PROMPTS[:3], params, use_tqdm=False)
        # every step had all three rows (same max_tokens, prompts prefilled together)
        assert runner.num_screened_steps == before
        want = plain.generate(PROMPTS[:3], params, use_tqdm=False)
        for g, w in zip(got, want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            if g.outputs[0].logprobs is None:
                continue
            # the same up to float rounding (the two engines' caches hold other prefixes,
            # so their prefills differ in order); a screened head's logsumexp would be off
            # by the int8 error, orders of magnitude more
            for lp, want_lp in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert [t for t, _ in lp.top] == [t for t, _ in want_lp.top]
                np.testing.assert_allclose([lp.logprob] + [v for _, v in lp.top],
                                           [want_lp.logprob] + [v for _, v in want_lp.top],
                                           rtol=0, atol=1e-6)


def test_plainly_sampled_steps_take_the_screen_and_keep_their_tokens(screened_and_plain):
    """Seeded requests with plain temperature sampling (OpenAI's default request), beside
    a greedy one and two completions of one prompt: their steps screen the head, with each
    sampled row's noise, and every token is the unscreened engine's."""
    screened, plain = screened_and_plain
    params = [SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.8, seed=5),
              SamplingParams(max_tokens=14, ignore_eos=True),
              SamplingParams(max_tokens=14, ignore_eos=True, temperature=1.3, seed=9, n=2)]
    runner = screened.engine.runner
    before = runner.num_sampled_screened_steps
    got = screened.generate(PROMPTS[:3], params, use_tqdm=False)
    assert runner.num_sampled_screened_steps >= before + 13
    want = plain.generate(PROMPTS[:3], params, use_tqdm=False)
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
    assert got[2].outputs[0].token_ids != got[2].outputs[1].token_ids  # two streams
    # and alone: a seeded request's tokens do not depend on what shares its steps
    alone = screened.generate(PROMPTS[:1], params[:1], use_tqdm=False)
    assert alone[0].outputs[0].token_ids == got[0].outputs[0].token_ids


def test_only_plain_greedy_requests_need_only_the_argmax():
    from tokenserve.sampling import GuideKind, StructuredOutput

    assert SamplingParams().needs_only_argmax
    assert SamplingParams(stop=("x",), stop_token_ids=(3,), ignore_eos=True).needs_only_argmax
    for needs_more in (dict(temperature=0.5), dict(logprobs=0), dict(repetition_penalty=1.1),
                       dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
                       dict(structured=StructuredOutput(GuideKind.CHOICE, ("a", "b")))):
        assert not SamplingParams(**needs_more).needs_only_argmax, needs_more


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_warmup_traces_every_head_a_request_can_need(exported, precision):
    """The warmup's requests are greedy: the heads sampled rows need are traced too, so a
    first sampled request pays no trace (the step graphs' part: test_engine.py). A
    bfloat16 model's graph steps have their own head, in bfloat16: traced too."""
    import asyncio

    from tokenserve.engine.async_engine import AsyncEngine

    model, _, version_dir = exported
    if type(model).__name__ != "TransformerLM":
        pytest.skip("the LSTM's step has no separate LM head")
    engine = AsyncEngine.from_model_dir(version_dir, engine_config(
        max_screened_head_rows=8, precision=precision))
    try:
        step = engine.engine.runner.step
        traced = set(step._heads)
        assert {"screened", "screened-noisy"} <= traced and len(traced) >= 3, traced
        if precision == "bfloat16" and not step.fused_every_step:
            assert traced == {"screened", "screened-noisy", "fused", "xla"}

        async def requests():
            for i, params in enumerate((
                    SamplingParams(max_tokens=3, temperature=0.7, seed=1),
                    SamplingParams(max_tokens=3, temperature=0.7, top_k=4),
                    SamplingParams(max_tokens=3, logprobs=1),
                    SamplingParams(max_tokens=3))):
                async for _ in engine.generate([5, 6, 7], params, f"r{i}"):
                    pass

        asyncio.run(requests())
        assert set(step._heads) == traced
    finally:
        engine.shutdown()
