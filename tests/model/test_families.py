"""Qwen3, Mistral, Gemma 2 and 3 and Phi-3 match `transformers`: each family's tiny random
model, imported from its safetensors (--from-hf) and from a GGUF file written as llama.cpp
writes it (--from-gguf), gives transformers' logits (full forward pass and cached step) and
its greedy tokens, with prompts longer than the sliding windows so the windows matter."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import numpy as np
import pytest

from support.gguf_from_hf import bpe_vocab, write_gguf_from_hf
from support.tiny_models import greedy_by_full_forward
from support.transformers_parity import assert_logits_match
from tokenserve.errors import ConfigError, ModelLoadError
from tokenserve.model.gguf import load_gguf
from tokenserve.model.hf import architecture_config, load_hf

if os.environ.get("CI"):
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")

BASE = dict(vocab_size=400, max_position_embeddings=128, hidden_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1)
WINDOW = 5  # far below the prompts' lengths: a layer that ignored its window would differ

CASES = {
    # head_dim 32 beside hidden 64 / 4 heads: Qwen3's head width is its own
    "qwen3": ("Qwen3", dict(head_dim=32, tie_word_embeddings=False)),
    # YaRN with a 16-position "original" context, so its blend shows at these positions
    "qwen3-yarn": ("Qwen3", dict(head_dim=16, tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
        "original_max_position_embeddings": 16})),
    "mistral": ("Mistral", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    # local layers at RoPE base 100, the global one at 10000; a query scale of its own
    "gemma3": ("Gemma3Text", dict(
        head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "gemma2": ("Gemma2", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "phi3": ("Phi3", dict(sliding_window=None, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
}
PROMPTS = [list(range(5, 29)), [12, 44, 1, 77], [300, 301, 302, 303, 304, 8, 9, 10, 11]]
# LongRoPE with a 16-position original context: PROMPTS[2] (9) turns by the short factors,
# PROMPTS[0] (24) by the long ones, far apart so that the wrong table would show
LONGROPE = {"phi3-longrope": ("Phi3", dict(
    original_max_position_embeddings=16, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [1.0 + 2.0 * i for i in range(8)]}))}


def hf_model(case: str):
    """The case's transformers model, seeded, with norms perturbed so a missed one shows."""
    prefix, options = {**CASES, **LONGROPE}[case]
    config = getattr(transformers, f"{prefix}Config")(**{**BASE, **options})
    arch = "Gemma3ForCausalLM" if prefix == "Gemma3Text" else f"{prefix}ForCausalLM"
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def save_hf(directory, model, tokenizer):
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save(directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}))
    return directory


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# every family from safetensors; from GGUF by default only Gemma 3 (Gemma's norms, its
# per-layer window flags) and Mistral (llama.cpp's Q/K permutation), the rest under -m slow
FAST_GGUF = ("gemma3", "mistral")


@pytest.fixture(scope="module", params=[
    pytest.param((case, source), id=f"{case}-{source}",
                 marks=[pytest.mark.slow] if source == "gguf" and case not in FAST_GGUF else [])
    for case in CASES for source in ("hf", "gguf")])
def imported(request, tokenizer, tmp_path_factory):
    case, source = request.param
    reference = hf_model(case)
    directory = tmp_path_factory.mktemp(f"{case}-{source}")
    if source == "hf":
        loaded = load_hf(save_hf(directory, reference, tokenizer))
    else:
        path = write_gguf_from_hf(directory / "tiny.gguf", reference, bpe_vocab(tokenizer))
        loaded = load_gguf(path)
    return case, reference, loaded


def test_logits_match_transformers_full_forward_and_cached_step(imported):
    _, reference, (model, _, _) = imported
    # the cached step in two chunks, split inside the longer prompts
    assert_logits_match(reference, model, PROMPTS, split=7)


def test_greedy_tokens_match_transformers(imported):
    _, reference, (model, _, _) = imported
    prompt = PROMPTS[0]
    assert greedy_by_full_forward(model, prompt, 12) == hf_greedy(reference, prompt, 12)


@pytest.mark.slow
def test_64_greedy_tokens_match_transformers(imported):
    _, reference, (model, _, _) = imported
    prompt = PROMPTS[0]
    assert greedy_by_full_forward(model, prompt, 64) == hf_greedy(reference, prompt, 64)


def test_config_reads_every_family_field(imported):
    case, reference, (_, _, generation) = imported
    config = generation.model
    assert config.architecture == type(reference).__name__  # from config.json or the GGUF's
    if case.startswith("qwen3"):
        assert config.qk_norm and not config.qkv_bias and not config.sliding_windows
    if case == "qwen3-yarn":
        assert config.rope_attention_factor == pytest.approx(0.1 * np.log(8.0) + 1)
        assert config.rope_freq_factors[0] == 1.0 and config.rope_freq_factors[-1] == 8.0
    if case == "mistral":
        assert config.sliding_windows == (WINDOW,) * 3
    if case == "gemma3":
        assert config.sliding_windows == (WINDOW, 0, WINDOW)
        assert (config.rope_theta, config.local_rope_theta) == (10000.0, 100.0)
        assert config.qk_norm and config.post_norms and config.mlp == "geglu"
        assert config.embedding_multiplier == pytest.approx(8.0) and config.tie_embeddings
    if case == "gemma2":
        assert (config.attn_softcap, config.final_softcap) == (5.0, 3.0)
        assert config.sliding_windows == (WINDOW, 0, WINDOW)
    if case == "phi3":
        assert config.rotary_dim == 8 and config.head_dim == 16


@pytest.mark.parametrize("case", ["gemma3", pytest.param("mistral", marks=pytest.mark.slow),
                                  pytest.param("gemma2", marks=pytest.mark.slow)])
def test_engine_greedy_equals_transformers_past_the_window(case, tokenizer, tmp_path):
    """The engine's paged step (the windowed row tables of the fused op; Gemma 2's
    soft-capped scores in it) gives transformers' greedy tokens for prompts and generations
    far past the window."""
    from support.engines import engine_config
    from tokenserve.engine.llm import LLM
    from tokenserve.export.exporter import export_model
    from tokenserve.sampling import SamplingParams

    reference = hf_model(case)
    model, tok, generation = load_hf(save_hf(tmp_path / "hf", reference, tokenizer))
    llm = LLM(export_model(model, tok, generation, tmp_path / "export", jit_compile=False),
              engine_config())
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True),
                           use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == hf_greedy(reference, prompt, 24)


def test_longrope_matches_transformers_under_and_over_the_original_context(tokenizer,
                                                                          tmp_path):
    """Phi-3's LongRoPE: logits within 1e-4 of transformers for a prompt under the original
    context (short factors) and one over it (long factors); the engine's greedy tokens are
    those of transformers' model called step by step on its cache, also for a prompt that
    decodes past the original context: both switch to the long factors there and keep the
    keys cached before with the short ones. (transformers' Phi-3 `generate` goes further and
    drops its cache once at that point, recomputing every key with the long factors; vLLM,
    as this engine, does not.)"""
    from support.engines import engine_config
    from tokenserve.engine.llm import LLM
    from tokenserve.export.exporter import export_model
    from tokenserve.sampling import SamplingParams

    reference = hf_model("phi3-longrope")
    model, tok, generation = load_hf(save_hf(tmp_path / "hf", reference, tokenizer))
    config = generation.model
    assert config.rope_original_context == 16 and len(config.rope_long_freq_factors) == 8
    # max_position_embeddings 128 over 16: factor 8
    assert config.rope_attention_factor == pytest.approx(
        np.sqrt(1 + np.log(8.0) / np.log(16.0)))
    for prompt in (PROMPTS[2], PROMPTS[0]):
        with torch.no_grad():
            want = reference(torch.tensor([prompt])).logits.numpy()[0]
        got = model(np.array([prompt], np.int32)).numpy()[0]
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    llm = LLM(export_model(model, tok, generation, tmp_path / "export", jit_compile=False),
              engine_config())
    for prompt, num_tokens in ((PROMPTS[2], 16), (PROMPTS[0], 8)):  # one prefill chunk each
        output = llm.generate([prompt], SamplingParams(max_tokens=num_tokens, ignore_eos=True),
                              use_tqdm=False)[0]
        assert output.outputs[0].token_ids == hf_cached_greedy(reference, prompt, num_tokens)


def test_longrope_from_gguf_reads_what_the_hf_import_does(tokenizer, tmp_path):
    """A Phi-3 LongRoPE GGUF (the two tables as tensors, the original context and attention
    factor as metadata, as convert_hf_to_gguf writes them) fills the config fields the Hugging
    Face import fills, and gives transformers' logits under and over the original context
    and its greedy tokens. A file with one table, or a table of the wrong width, is refused
    by the table's name."""
    from tokenserve.errors import UnsupportedGGUFError

    reference = hf_model("phi3-longrope")
    vocab = bpe_vocab(tokenizer)
    model, _, generation = load_gguf(write_gguf_from_hf(tmp_path / "longrope.gguf",
                                                        reference, vocab))
    from_hf = architecture_config({**reference.config.to_dict(),
                                   "architectures": ["Phi3ForCausalLM"]})
    for field in ("rope_theta", "rope_freq_factors", "rope_long_freq_factors",
                  "rope_original_context", "rope_attention_factor", "rotary_dim"):
        assert getattr(generation.model, field) == pytest.approx(getattr(from_hf, field)), field
    for prompt in (PROMPTS[2], PROMPTS[0]):  # short tables, long ones
        with torch.no_grad():
            want = reference(torch.tensor([prompt])).logits.numpy()[0]
        np.testing.assert_allclose(model(np.array([prompt], np.int32)).numpy()[0], want,
                                   atol=1e-4, rtol=0)
    assert greedy_by_full_forward(model, PROMPTS[0], 12) == hf_greedy(reference, PROMPTS[0], 12)
    with pytest.raises(UnsupportedGGUFError, match=r"needs rope_factors_short\.weight"):
        load_gguf(write_gguf_from_hf(tmp_path / "one.gguf", reference, vocab,
                                     drop=["rope_factors_short.weight"]))
    with pytest.raises(UnsupportedGGUFError, match=r"rope_factors_long\.weight has 5 entries"):
        load_gguf(write_gguf_from_hf(tmp_path / "narrow.gguf", reference, vocab, replace=[
            ("rope_factors_long.weight", np.ones(5, np.float32))]))


def hf_cached_greedy(model, prompt, n):
    """Greedy tokens of transformers' model called token by token on its own cache (no
    generate(): Phi-3's recomputes the cache where LongRoPE switches tables)."""
    cache = transformers.DynamicCache(config=model.config)
    ids, tokens = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            start = len(prompt) + len(tokens) - ids.shape[1]
            logits = model(ids, past_key_values=cache, use_cache=True,
                           position_ids=torch.arange(start, start + ids.shape[1])[None]).logits
            tokens.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens


def test_a_missing_or_misshapen_family_tensor_is_named(tokenizer, tmp_path):
    reference = hf_model("gemma3")
    vocab = bpe_vocab(tokenizer)
    path = write_gguf_from_hf(tmp_path / "missing.gguf", reference, vocab,
                              drop=["blk.2.post_ffw_norm.weight"])
    with pytest.raises(ModelLoadError, match=r"missing tensor blk\.2\.post_ffw_norm\.weight"):
        load_gguf(path)
    path = write_gguf_from_hf(tmp_path / "shape.gguf", reference, vocab,
                              replace=[("blk.1.attn_k_norm.weight", np.ones(8, np.float32))])
    with pytest.raises(ModelLoadError, match=r"blk\.1\.attn_k_norm\.weight \(8,\) does not "
                                             r"fit block_1/k_norm/scale"):
        load_gguf(path)
    from safetensors.torch import load_file, save_file

    directory = save_hf(tmp_path / "hf", hf_model("qwen3"), tokenizer)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError,
                       match=r"missing tensor model\.layers\.1\.self_attn\.q_norm\.weight"):
        load_hf(directory)


def test_a_window_not_shorter_than_the_context_is_clamped_and_logged(caplog):
    config = transformers.MistralConfig(**{**BASE, "sliding_window": 4096})
    with caplog.at_level(logging.INFO, logger="tokenserve.model"):
        ours = architecture_config({**config.to_dict(),
                                    "architectures": ["MistralForCausalLM"]})
    assert ours.sliding_windows == ()
    assert "sliding window 4096 is not shorter than the context (128 positions)" in caplog.text


def test_unimplemented_settings_are_refused_by_name():
    phi3 = transformers.Phi3Config(**BASE).to_dict()
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ConfigError, match="rope scaling 'dynamic' is not supported; "
                                          "supported: default, linear, llama3, yarn"):
        architecture_config({**phi3, "rope_parameters": dynamic,
                             "architectures": ["Phi3ForCausalLM"]})
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 7}
    with pytest.raises(ConfigError, match="longrope long_factor has 7 entries; the rotated "
                                          "width 16 turns 8 pairs"):
        architecture_config({**phi3, "rope_parameters": longrope,
                             "architectures": ["Phi3ForCausalLM"]})
    gemma = transformers.Gemma2Config(**BASE).to_dict()
    with pytest.raises(ConfigError, match="activation 'relu' is not supported"):
        architecture_config({**gemma, "hidden_activation": "relu",
                             "architectures": ["Gemma2ForCausalLM"]})


def test_config_round_trips_through_json():
    from tokenserve.config import model_config_from_dict

    config = architecture_config({**transformers.Gemma3TextConfig(
        **{**BASE, "sliding_window": WINDOW}).to_dict(), "architectures": ["Gemma3ForCausalLM"]})
    again = model_config_from_dict(json.loads(json.dumps(dataclasses.asdict(config))))
    assert again == config and again.sliding_windows == config.sliding_windows
    assert again.architecture == "Gemma3ForCausalLM"
    older = {k: v for k, v in dataclasses.asdict(config).items() if k != "architecture"}
    assert model_config_from_dict(older).architecture == ""  # an export from before it
