"""Cached decoding must equal one full forward pass, for every family."""

import numpy as np
import pytest

from support.tiny_models import tiny

FAMILIES = ["tiny-gpt2", "tiny-llama", "tiny-lstm"]


@pytest.mark.parametrize("name", FAMILIES)
def test_token_by_token_cached_loop_equals_full_forward(name, tokenizer):
    model, _ = tiny(name, tokenizer)
    ids = np.random.default_rng(0).integers(3, 400, size=(2, 24)).astype(np.int32)
    full = model(ids).numpy()  # [B, T, V]
    state = model.init_state(2, 32)
    for t in range(ids.shape[1]):
        logits, state = model.step(ids[:, t:t + 1], state, np.full([2], t, np.int32))
        np.testing.assert_allclose(logits.numpy(), full[:, t], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_padded_chunked_prefill_then_decode_equals_full_forward(name, tokenizer):
    """Rows of different lengths share one padded chunk, then decode at their own positions."""
    model, _ = tiny(name, tokenizer)
    rng = np.random.default_rng(1)
    lengths = [9, 4]
    rows = [rng.integers(3, 400, size=n + 6).astype(np.int32) for n in lengths]
    chunk = np.zeros([2, 12], np.int32)  # right-padded with pad id 0
    for i, n in enumerate(lengths):
        chunk[i, :n] = rows[i][:n]
    state = model.init_state(2, 32)
    logits, state = model.step(chunk, state, np.zeros(2, np.int32), np.array(lengths, np.int32))
    for i, n in enumerate(lengths):
        expected = model(rows[i][None, :n]).numpy()[0, -1]
        np.testing.assert_allclose(logits.numpy()[i], expected, atol=1e-4, rtol=0)
    for t in range(6):
        tokens = np.array([[rows[i][n + t]] for i, n in enumerate(lengths)], np.int32)
        positions = np.array([n + t for n in lengths], np.int32)
        logits, state = model.step(tokens, state, positions)
        for i, n in enumerate(lengths):
            expected = model(rows[i][None, :n + t + 1]).numpy()[0, -1]
            np.testing.assert_allclose(logits.numpy()[i], expected, atol=1e-4, rtol=0)


def test_gqa_really_shares_kv_heads(tokenizer):
    model, config = tiny("tiny-llama", tokenizer)
    assert config.model.num_kv_heads < config.model.num_heads
    assert model.state_shape(1, 8)[4] == config.model.num_kv_heads


def test_gpt2_and_llama_configs_differ_where_they_should(tokenizer):
    gpt2, _ = tiny("tiny-gpt2", tokenizer)
    llama, _ = tiny("tiny-llama", tokenizer)
    gpt2_names = {w.path.split("/", 1)[1] for w in gpt2.weights}
    llama_names = {w.path.split("/", 1)[1] for w in llama.weights}
    assert "position_embedding" in gpt2_names and "position_embedding" not in llama_names
    assert "head/kernel" in llama_names and "head/kernel" not in gpt2_names  # untied vs tied
    assert any(n.endswith("attn_norm/bias") for n in gpt2_names)  # LayerNorm has a bias
    assert not any(n.endswith("attn_norm/bias") for n in llama_names)  # RMSNorm has none
