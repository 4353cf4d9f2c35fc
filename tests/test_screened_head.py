"""The LM head's float16 screen: its error bounds hold, and it picks the float32 argmax
(engine/screened_head.py); in the engine, greedy steps take it and give the tokens of the
float32 head, and no step with a sampled, penalized, logprobs or structured row does."""

from __future__ import annotations

import numpy as np
import pytest

from test_engine import PROMPTS, engine_config
from tokenserve.engine.llm import LLM
from tokenserve.sampling import SamplingParams

tf = pytest.importorskip("tensorflow")

from tokenserve.engine.screened_head import ScreenedHead  # noqa: E402


def _weights(vocab=3000, width=96, seed=0):
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((vocab, width)).astype(np.float32) * 0.05
    weights[7] = weights[3]  # an exact tie: both are candidates, the lower id wins
    weights[11] *= 40.0      # a row far larger than the rest: its own scale
    return weights


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_the_bounds_hold_and_the_argmax_is_the_float32_one(layout):
    weights = _weights()
    rng = np.random.default_rng(1)
    bias = np.linspace(-0.5, 0.5, len(weights)).astype(np.float32) if layout == "kn" else 0.0
    head = ScreenedHead(tf.constant(weights if layout == "nk" else weights.T), layout,
                        None if layout == "nk" else tf.constant(bias))
    x = rng.standard_normal((6, weights.shape[1])).astype(np.float32)
    x[1] *= 50.0            # large activations
    x[2, 5] = 300.0         # one outlier: its block's quantization step is coarse
    x[3] = weights[3] * 30  # the tied pair is the argmax
    x[4] = 0.0              # nothing at all
    exact = x.astype(np.float64) @ weights.T.astype(np.float64) + bias
    approx, bound = (t.numpy() for t in head.bounds(tf.constant(x)))
    assert np.all(np.abs(approx - exact) <= bound)
    logits = head(tf.constant(x)).numpy()
    assert list(logits.argmax(-1)) == list((x @ weights.T + bias).argmax(-1))
    if layout == "nk":
        assert logits[3].argmax() == 3  # the tie, as np.argmax breaks it
    # every entry the screen could not rule out holds its float32 logit
    floor = (approx - bound).max(-1, keepdims=True)
    candidates = approx + bound >= floor
    # x = 0: every logit ties without a bias; with one, only the bias decides
    assert candidates[4].all() if layout == "nk" else candidates[4].sum() == 1
    assert candidates[[0, 1, 2, 3, 5]].mean() < 0.05  # elsewhere a screen, not the vocabulary
    np.testing.assert_allclose(logits[candidates], exact[candidates], rtol=1e-5, atol=1e-5)


def test_the_bound_is_tight_where_x_follows_a_rows_rounding():
    """x along row i's own float16 rounding makes that row's error r_i ||x||, the largest
    Cauchy-Schwarz allows: the bound must still cover it (it fails with r_i halved)."""
    weights = _weights(vocab=64, width=64, seed=2)
    head = ScreenedHead(tf.constant(weights), "nk")
    residual = weights.astype(np.float64) - weights.astype(np.float16).astype(np.float64)
    x = (residual[5] / np.abs(residual[5]).max()).astype(np.float32)
    exact = weights.astype(np.float64) @ x.astype(np.float64)
    approx, bound = (t.numpy()[0] for t in head.bounds(tf.constant(x[None])))
    error = abs(approx[5] - exact[5])
    assert error <= bound[5]
    assert error > 0.5 * bound[5]  # the residual term dominates here, at its limit


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


def test_a_head_with_a_bias_keeps_it():
    weights = _weights(vocab=500, width=64)
    bias = np.linspace(-3, 3, 500).astype(np.float32)
    head = ScreenedHead(tf.constant(weights.T), "kn", tf.constant(bias))
    x = np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32)
    want = x @ weights.T + bias
    got = head(tf.constant(x)).numpy()
    assert list(got.argmax(-1)) == list(want.argmax(-1))
    np.testing.assert_allclose(got.max(-1), want.max(-1), rtol=1e-6)


# -- in the engine --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def screened_and_plain(exported):
    model, _, version_dir = exported
    if type(model).__name__ != "TransformerLM":
        pytest.skip("the LSTM's step has no separate LM head")
    return (LLM(version_dir, engine_config(max_screened_head_rows=8)),
            LLM(version_dir, engine_config(max_screened_head_rows=0)))


def test_greedy_steps_take_the_screen_and_keep_their_tokens(screened_and_plain):
    screened, plain = screened_and_plain
    runner = screened.engine.runner
    assert runner.step.screened_head is not None and plain.engine.runner.step.screened_head is None
    # the float16 copy is reported beside the weights
    vocab, width = runner.vocab_size, runner.config.model.hidden_size
    assert runner.memory_bytes()["head_screen"] == vocab * width * 2 + vocab * 4
    assert "head_screen" not in plain.engine.runner.memory_bytes()
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    before = runner.num_screened_steps
    got = screened.generate(PROMPTS, params, use_tqdm=False)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert runner.num_screened_steps > before


def test_a_step_with_a_row_that_needs_its_distribution_reads_the_float32_head(
        screened_and_plain):
    """Mixed batches: greedy rows beside a logprobs, a penalized, a sampled (seeded) and a
    structured one. Those steps must not screen: their logprobs and tokens are exactly
    the unscreened engine's."""
    screened, plain = screened_and_plain
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    others = [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=5)]
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


def test_only_plain_greedy_requests_need_only_the_argmax():
    from tokenserve.sampling import GuideKind, StructuredOutput

    assert SamplingParams().needs_only_argmax
    assert SamplingParams(stop=("x",), stop_token_ids=(3,), ignore_eos=True).needs_only_argmax
    for needs_more in (dict(temperature=0.5), dict(logprobs=0), dict(repetition_penalty=1.1),
                       dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
                       dict(structured=StructuredOutput(GuideKind.CHOICE, ("a", "b")))):
        assert not SamplingParams(**needs_more).needs_only_argmax, needs_more


def test_the_warmup_traces_every_head_a_request_can_need(exported):
    """The warmup's requests are greedy: the heads sampled rows need are traced too, so a
    first sampled request pays no trace (the step graphs' part: test_engine.py)."""
    import asyncio

    from tokenserve.engine.async_engine import AsyncEngine

    model, _, version_dir = exported
    if type(model).__name__ != "TransformerLM":
        pytest.skip("the LSTM's step has no separate LM head")
    engine = AsyncEngine.from_model_dir(version_dir, engine_config(max_screened_head_rows=8))
    try:
        step = engine.engine.runner.step
        traced = set(step._heads)
        assert "screened" in traced and len(traced) >= 2, traced

        async def requests():
            for params in (SamplingParams(max_tokens=3, temperature=0.7, seed=1),
                           SamplingParams(max_tokens=3, logprobs=1),
                           SamplingParams(max_tokens=3)):
                async for _ in engine.generate([5, 6, 7], params, f"r{params.temperature}"
                                               f"{params.logprobs}"):
                    pass

        asyncio.run(requests())
        assert set(step._heads) == traced
    finally:
        engine.shutdown()
