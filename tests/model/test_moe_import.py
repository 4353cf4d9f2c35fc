"""Mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) from Hugging Face
directories and GGUF files match `transformers`: logits by full forward pass and by the cached
step, and greedy tokens over 64 steps through the engine, including checkpoints where one
expert gets every row and several get none, and Qwen-MoE checkpoints with dense layers among
the MoE ones. Bad files are refused by name."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from support.engines import engine_config
from support.moe_checkpoints import PROMPTS, engine_greedy, hf_model, save_hf, write_gguf
from support.tiny_models import greedy_by_full_forward
from support.transformers_parity import assert_logits_match
from tokenserve.engine.llm import LLM
from tokenserve.errors import ModelLoadError
from tokenserve.export.exporter import export_model
from tokenserve.model.gguf import load_gguf
from tokenserve.model.hf import load_hf
from tokenserve.sampling import SamplingParams

if os.environ.get("CI"):
    import torch
else:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
pytest.importorskip("gguf")

# (family, file format, skewed routing, hf_model's options)
CASES = {"mixtral-hf": ("mixtral", "hf", False, {}), "qwen2moe-hf": ("qwen2moe", "hf", False, {}),
         "mixtral-gguf-skewed": ("mixtral", "gguf", True, {}),
         "qwen2moe-normed-gguf": ("qwen2moe-normed", "gguf", False, {}),
         "qwen2moe-hf-skewed": ("qwen2moe", "hf", True, {}),
         "qwen3moe-gguf-skewed": ("qwen3moe", "gguf", True, {}),
         "qwen3moe-hf": ("qwen3moe", "hf", False, {}),
         # top-4 of 16, not renormalised; QK-norm over the whole q and k projections
         "olmoe-hf": ("olmoe", "hf", False, dict(num_experts=16, top_k=4)),
         "olmoe-gguf-skewed": ("olmoe", "gguf", True, dict(num_experts=16, top_k=4)),
         # dense layers among the MoE ones: layer 0 by mlp_only_layers, by decoder_sparse_step
         "qwen3moe-dense-layer-hf": ("qwen3moe", "hf", False, dict(mlp_only_layers=[0])),
         "qwen2moe-sparse-step-gguf": ("qwen2moe", "gguf", False, dict(decoder_sparse_step=2))}
DEFAULT_GREEDY = ("mixtral-gguf-skewed", "qwen2moe-sparse-step-gguf")  # the rest: -m slow
SLOW_LOGITS = ("qwen3moe-hf",)  # a default run checks Qwen3-MoE's logits from the GGUF case
# seed 0's Qwen3-MoE has its top two logits 1e-4 apart at one greedy step (2e-5 with a dense
# layer 0); seeds 3 and 1 keep them 1.5e-3 apart over the 64 steps of every prompt
SEEDS = {"qwen3moe-hf": 3, "qwen3moe-dense-layer-hf": 1}


_LOADED: dict = {}


def load_case(name: str, tokenizer, tmp_path_factory):
    """(name, transformers model, what tokenserve imported), once per module."""
    if name not in _LOADED:
        family, kind, skewed, options = CASES[name]
        reference = hf_model(family, skewed=skewed, seed=SEEDS.get(name, 0), **options)
        directory = tmp_path_factory.mktemp(name)
        if kind == "hf":
            loaded = load_hf(save_hf(directory, reference, tokenizer))
        else:
            loaded = load_gguf(write_gguf(directory / "tiny.gguf", reference, tokenizer))
        _LOADED[name] = name, reference, loaded
    return _LOADED[name]


@pytest.fixture(params=[
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_LOGITS else name
    for name in CASES])
def case(request, tokenizer, tmp_path_factory):
    return load_case(request.param, tokenizer, tmp_path_factory)


def test_logits_match_transformers_by_full_forward_and_cached_step(case):
    name, reference, (model, _, config) = case
    options = CASES[name][3]
    assert config.model.num_experts == options.get("num_experts", 8)
    assert config.model.num_experts_per_token == options.get("top_k", 2)
    dense = {"mlp_only_layers", "decoder_sparse_step"} & set(options)
    assert config.model.dense_layers == ((0,) if dense else ())
    assert_logits_match(reference, model, PROMPTS)


@pytest.mark.parametrize("name", [
    name if name in DEFAULT_GREEDY else pytest.param(name, marks=pytest.mark.slow)
    for name in CASES])
def test_greedy_64_tokens_match_transformers_through_the_engine(name, tokenizer,
                                                                tmp_path_factory):
    _, reference, (model, tokenizer, config) = load_case(name, tokenizer, tmp_path_factory)
    with torch.no_grad():
        expected = [reference.generate(torch.tensor([p]), max_new_tokens=64, min_new_tokens=64,
                                       do_sample=False, eos_token_id=None,
                                       pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    got, runner = engine_greedy(model, tokenizer, config, PROMPTS, 64)
    assert got == expected
    load = runner.expert_load()  # [layers, experts]: rows routed to each
    num_rows = sum(len(p) for p in PROMPTS) + len(PROMPTS) * 63
    c = config.model
    routed = [i for i in range(c.num_layers) if c.layer_has_experts(i)]
    assert load.shape == (2, c.num_experts)
    assert (load.sum(axis=1) == [c.num_experts_per_token * num_rows if i in routed else 0
                                 for i in range(c.num_layers)]).all()
    if name.endswith("skewed"):  # one expert took every row, those from 4 up none
        assert (load[:, 2] == num_rows).all() and (load[:, 4:] == 0).all()


@pytest.mark.slow
def test_greedy_by_full_forward_and_through_an_export_match_transformers(tokenizer, tmp_path):
    reference = hf_model("qwen2moe")
    model, hf_tokenizer, config = load_hf(save_hf(tmp_path / "hf", reference, tokenizer))
    prompt = PROMPTS[1]
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=64,
                                      min_new_tokens=64, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy_by_full_forward(model, prompt, 64) == expected
    llm = LLM(export_model(model, hf_tokenizer, config, tmp_path / "export", jit_compile=False),
              engine_config())
    out = llm.generate([prompt], SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected


def test_a_missing_expert_or_a_mismatched_expert_count_is_refused_by_name(tokenizer,
                                                                         tmp_path):
    reference = hf_model("mixtral")
    directory = save_hf(tmp_path / "hf", reference, tokenizer)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensor model\.layers\.1\.block_sparse_moe"
                                             r"\.experts\.5\.w3\.weight"):
        load_hf(directory)
    fewer = save_hf(tmp_path / "fewer", hf_model("mixtral", num_experts=4), tokenizer)
    config = (fewer / "config.json").read_text().replace('"num_local_experts": 4',
                                                         '"num_local_experts": 8')
    (fewer / "config.json").write_text(config)
    with pytest.raises(ModelLoadError, match=r"layer 0 has 4 experts .* says 8"):
        load_hf(fewer)

    qwen = hf_model("qwen2moe")
    with pytest.raises(ModelLoadError, match=r"missing tensor blk\.1\.ffn_up_exps\.weight"):
        load_gguf(write_gguf(tmp_path / "missing.gguf", qwen, tokenizer,
                             drop=["blk.1.ffn_up_exps.weight"]))
    with pytest.raises(ModelLoadError, match=r"missing tensor blk\.0\.ffn_gate_inp_shexp"):
        load_gguf(write_gguf(tmp_path / "no-shared-gate.gguf", qwen, tokenizer,
                             drop=["blk.0.ffn_gate_inp_shexp.weight"]))
    short = np.zeros([7, 64, 32], np.float32)  # 7 experts' down matrices, the file says 8
    with pytest.raises(ModelLoadError,
                       match=r"blk\.0\.ffn_down_exps\.weight holds 7 experts but "
                             r"qwen2moe\.expert_count is 8"):
        load_gguf(write_gguf(tmp_path / "short.gguf", qwen, tokenizer,
                             extra=[("blk.0.ffn_down_exps.weight", short)]))


def test_qwen3_moe_without_qk_norm_or_with_a_shared_expert_is_refused(tokenizer, tmp_path):
    reference = hf_model("qwen3moe")
    with pytest.raises(ModelLoadError, match=r"missing tensor blk\.0\.attn_q_norm\.weight"):
        load_gguf(write_gguf(tmp_path / "no-qk-norm.gguf", reference, tokenizer,
                             drop=[f"blk.{i}.attn_{x}_norm.weight" for i in (0, 1)
                                   for x in "qk"]))
    shared = np.zeros([32, 64], np.float32)
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.ffn_up_shexp\.weight, a shared"):
        load_gguf(write_gguf(tmp_path / "shared.gguf", reference, tokenizer,
                             extra=[("blk.0.ffn_up_shexp.weight", shared)]))


def test_olmoe_refusals_and_dense_layers_name_what_they_refuse(tokenizer, tmp_path):
    from tokenserve.config import TransformerConfig
    from tokenserve.errors import ConfigError

    olmoe = hf_model("olmoe")
    directory = save_hf(tmp_path / "olmoe", olmoe, tokenizer)
    config = (directory / "config.json").read_text()
    assert '"clip_qkv": null' in config
    (directory / "config.json").write_text(config.replace('"clip_qkv": null', '"clip_qkv": 8.0'))
    with pytest.raises(ConfigError, match=r"OLMoE clip_qkv 8\.0 is not supported"):
        load_hf(directory)
    with pytest.raises(ModelLoadError, match=r"missing tensor blk\.1\.attn_k_norm\.weight"):
        load_gguf(write_gguf(tmp_path / "no-k-norm.gguf", olmoe, tokenizer,
                             drop=["blk.1.attn_k_norm.weight"]))
    # a dense layer's MLP missing from a GGUF file whose layer 0 has no router
    qwen = hf_model("qwen2moe", decoder_sparse_step=2)
    with pytest.raises(ModelLoadError, match=r"missing tensor blk\.0\.ffn_down\.weight"):
        load_gguf(write_gguf(tmp_path / "no-dense-down.gguf", qwen, tokenizer,
                             drop=["blk.0.ffn_down.weight"]))
    qwen3 = save_hf(tmp_path / "qwen3", hf_model("qwen3moe"), tokenizer)
    text = (qwen3 / "config.json").read_text()
    assert '"decoder_sparse_step": 1' in text
    (qwen3 / "config.json").write_text(text.replace('"decoder_sparse_step": 1',
                                                    '"decoder_sparse_step": 0'))
    with pytest.raises(ConfigError, match=r"Qwen3-MoE decoder_sparse_step 0 is not positive"):
        load_hf(qwen3)
    # the dense layers travel through an export's JSON config
    _, _, generation = load_hf(save_hf(tmp_path / "dense", hf_model(
        "qwen3moe", decoder_sparse_step=2, mlp_only_layers=[1]), tokenizer))
    assert generation.model.dense_layers == (0, 1)
    assert TransformerConfig(**json.loads(json.dumps(
        dataclasses.asdict(generation.model)))) == generation.model
    with pytest.raises(ConfigError, match=r"dense_layers must be layer indices below 2"):
        dataclasses.replace(generation.model, dense_layers=(2,))
