"""Reading PEFT adapters: peft's own files load, and every kind of bad adapter is refused
with its own error type (HTTP 400) naming what is wrong."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from support.lora_models import lora_checkpoint
from tokenserve.engine.lora_adapter import (LoraBaseMismatchError, LoraNotFoundError,
                                            LoraRankError, LoraShapeError, LoraTargetError,
                                            load_adapter, merged_kernels)

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def made(tokenizer, tmp_path_factory):
    from tokenserve.model.hf import architecture_config

    root = tmp_path_factory.mktemp("adapters")
    found = {}
    for family in ("gpt2", "llama", "phi3"):
        checkpoint = lora_checkpoint(family, tokenizer, root, num_adapters=1)
        found[family] = (checkpoint, architecture_config(checkpoint.hf_model.config.to_dict()))
    return found


def rewrite(source, target, change):
    from safetensors.numpy import load_file, save_file

    target.mkdir()
    (target / "adapter_config.json").write_text((source / "adapter_config.json").read_text())
    tensors = change(load_file(str(source / "adapter_model.safetensors")))
    save_file(tensors, str(target / "adapter_model.safetensors"))
    return target


@pytest.mark.parametrize("family", ["gpt2", "llama", "phi3"])
def test_peft_adapters_load_as_the_merged_delta(made, family):
    """Our per-role factors' product is peft's merged delta, in our fused layout."""
    import torch

    checkpoint, config = made[family]
    path, peft_model = checkpoint.adapters[0]
    weights = load_adapter(path, config, max_rank=4)
    assert weights.rank == 4 and len(weights.layers) == config.num_layers
    merged = merged_kernels(weights)
    base = checkpoint.hf_model.state_dict()  # the weights the adapter was made on
    with torch.no_grad():
        merged_model = copy.deepcopy(peft_model).merge_and_unload()
        delta = {k: v - base[k] for k, v in merged_model.state_dict().items() if k in base}
    if family == "gpt2":  # Conv1D weights are [in, out], as ours
        want = delta["transformer.h.1.attn.c_attn.weight"].numpy()
    elif family == "phi3":  # one fused qkv_proj [q + 2 kv, in], and gate_up_proj likewise
        want = delta["model.layers.1.self_attn.qkv_proj.weight"].numpy().T
        np.testing.assert_allclose(
            merged[1]["up"], delta["model.layers.1.mlp.gate_up_proj.weight"].numpy().T,
            atol=1e-6)
    else:  # torch Linear is [out, in]; q, k, v side by side along out
        want = np.concatenate([delta[f"model.layers.1.self_attn.{m}_proj.weight"].numpy().T
                               for m in "qkv"], axis=1)
    np.testing.assert_allclose(merged[1]["qkv"], want, atol=1e-6)


def test_each_bad_adapter_has_its_own_error(made, tmp_path):
    checkpoint, config = made["llama"]
    good = checkpoint.adapters[0][0]
    with pytest.raises(LoraNotFoundError, match="does not exist"):
        load_adapter(tmp_path / "nowhere", config, 8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraNotFoundError, match="adapter_config.json"):
        load_adapter(tmp_path / "empty", config, 8)
    with pytest.raises(LoraRankError, match="max_lora_rank 2"):
        load_adapter(good, config, 2)
    target = rewrite(good, tmp_path / "target", lambda t: {
        k.replace("self_attn.o_proj", "self_attn.dense"): v for k, v in t.items()})
    with pytest.raises(LoraTargetError, match="self_attn.dense"):
        load_adapter(target, config, 8)
    shape = rewrite(good, tmp_path / "shape", lambda t: {
        k: (v[:-1] if "k_proj.lora_B" in k else v) for k, v in t.items()})
    with pytest.raises(LoraShapeError, match="k_proj"):
        load_adapter(shape, config, 8)
    with pytest.raises(LoraBaseMismatchError, match="layers"):
        load_adapter(good, dataclasses.replace(config, num_layers=1), 8)
    with pytest.raises(LoraBaseMismatchError, match="hidden size"):
        load_adapter(good, dataclasses.replace(config, hidden_size=128, head_dim=32), 8)
    with pytest.raises(LoraBaseMismatchError, match="GPT-2"):
        load_adapter(made["gpt2"][0].adapters[0][0], config, 8)


def _with_options(source, target, **options):
    """A copy of the adapter at `source` with adapter_config.json's `options` changed."""
    import json
    import shutil

    shutil.copytree(source, target)
    config = json.loads((target / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**config, **options}))
    return target


def test_an_adapter_for_another_architecture_is_refused(made, tmp_path):
    """The base records its architecture; Phi-3's fused modules do not load onto a Llama (nor
    Llama's onto a Phi-3) even where every shape fits, nor an adapter whose saved model class
    is another architecture's; a base without a recorded architecture takes either."""
    llama, llama_config = made["llama"][0], made["llama"][1]
    phi3, phi3_config = made["phi3"][0], made["phi3"][1]
    assert (llama_config.architecture, phi3_config.architecture) == (
        "LlamaForCausalLM", "Phi3ForCausalLM")
    with pytest.raises(LoraBaseMismatchError, match="gate_up_proj.*LlamaForCausalLM"):
        load_adapter(phi3.adapters[0][0], llama_config, 8)
    with pytest.raises(LoraBaseMismatchError, match="Phi3ForCausalLM does not have"):
        load_adapter(llama.adapters[0][0], phi3_config, 8)
    unknown = dataclasses.replace(llama_config, architecture="")  # an older export
    assert load_adapter(phi3.adapters[0][0], unknown, 8).rank == 4
    qwen = _with_options(llama.adapters[0][0], tmp_path / "qwen", auto_mapping={
        "base_model_class": "Qwen2ForCausalLM", "parent_library": "transformers"})
    with pytest.raises(LoraBaseMismatchError, match="Qwen2ForCausalLM"):
        load_adapter(qwen, llama_config, 8)
    # Mistral's module tree is Llama's (a GGUF Mistral imports as one); a hub id says nothing
    mistral = _with_options(llama.adapters[0][0], tmp_path / "mistral", auto_mapping={
        "base_model_class": "MistralForCausalLM"}, base_model_name_or_path="microsoft/phi-2")
    assert load_adapter(mistral, llama_config, 8).rank == 4
