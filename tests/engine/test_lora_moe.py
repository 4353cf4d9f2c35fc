"""LoRA adapters on mixture-of-experts models: adapters of the attention projections give, row
by row in mixed batches, what transformers + peft give; adapters of the experts, the shared
expert or the router are refused by name (never served without their expert deltas)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from support.lora_engines import (MAX_TOKENS, PROMPTS, check_batch_matches_references,
                                  make_engine, run)
from support.lora_models import moe_lora_checkpoint
from tokenserve.engine.lora_adapter import LoraRequest, LoraTargetError, load_adapter

torch = pytest.importorskip("torch")
pytest.importorskip("peft")


# Qwen2-MoE (a shared expert, q/k/v biases) by default; Mixtral, Qwen3-MoE (QK-norm, a head
# width of its own) and OLMoE with -m slow
@pytest.fixture(scope="module", params=[
    "qwen2moe", *(pytest.param(f, marks=pytest.mark.slow) for f in
                  ("mixtral", "qwen3moe", "olmoe"))])
def checkpoint(request, tokenizer, tmp_path_factory):
    from tokenserve.model.hf import load_hf

    made = moe_lora_checkpoint(request.param, tokenizer, tmp_path_factory.mktemp(request.param))
    return made, load_hf(made.directory)


def reference_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' (+ peft's) greedy tokens by full forward passes: its cached generate
    picked another token than its own full pass where OLMoE's top two logits lie 0.15 apart
    (seed 0, prompt 2, step 3)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            tokens.append(int(hf_model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def test_attention_adapters_on_experts_match_peft_in_one_batch(checkpoint):
    made, loaded = checkpoint
    engine = make_engine(loaded)
    # every layer's MLP a mixture of experts: no slot room for MLP factors
    assert engine.runner.step.lora_table.ranks == {"qkv": 24, "out": 8, "up": 0, "down": 0}
    loras = check_batch_matches_references(engine, made, reference_greedy)
    # echo + logprobs' full pass, with the adapter
    path, reference = made.adapters[0]
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPTS[1]])).logits[0].numpy()
    got = engine.runner.prompt_logits(PROMPTS[1], engine.loras.weights_of(loras[1]).layers)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def _write(directory, tensors: dict, config: dict | None = None):
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(
        config or {"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


@pytest.mark.parametrize("module", [
    "mlp.experts.3.gate_proj", "mlp.experts.0.down_proj", "block_sparse_moe.experts.1.w1",
    "mlp.experts", "mlp.experts.base_layer", "mlp.shared_expert.up_proj", "mlp.gate",
    "mlp.shared_expert_gate", "mlp.gate_proj"])
def test_expert_targets_are_refused_by_name(checkpoint, tmp_path, module):
    """transformers 4's per-expert modules (Qwen-MoE's, Mixtral's w1/w2/w3), transformers 5's
    stacked experts as peft wraps them, the shared expert, the router; and a dense model's
    MLP module, which a layer of experts does not have."""
    made, (_, _, config) = checkpoint
    model = config.model
    a = np.ones([2, model.hidden_size], np.float32)
    b = np.ones([model.intermediate_size, 2], np.float32)
    name = f"base_model.model.model.layers.1.{module}.lora_"
    path = _write(tmp_path / "bad", {name + "A.weight": a, name + "B.weight": b})
    with pytest.raises(LoraTargetError, match=module.replace(".", r"\.")):
        load_adapter(path, model, max_rank=8)


def test_a_peft_adapter_of_the_experts_is_refused(checkpoint, tmp_path):
    """As peft writes one here (transformers 5: the experts one stacked parameter; Qwen2-MoE's
    shared expert its own modules)."""
    import peft
    import transformers

    made, (_, _, config) = checkpoint
    base = transformers.AutoModelForCausalLM.from_pretrained(made.directory)
    targets = ["gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"]
    present = [t for t in targets if any(n.endswith("." + t) or n.endswith(".experts")
                                         for n, _ in base.named_modules())]
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=present, init_lora_weights=False))
    model.save_pretrained(tmp_path)
    with pytest.raises(LoraTargetError, match="mixture of experts"):
        load_adapter(tmp_path, config.model, max_rank=8)


@pytest.mark.slow  # two more engines
@pytest.mark.parametrize("path", ["stock-tf-grouping", "graph"])
def test_the_other_moe_paths_give_the_same_tokens(checkpoint, monkeypatch, path):
    """Experts by model/moe.py's stock-TF grouping after the fused dense ops, and the whole
    step as TF ops (no compiled op): the adapters' rows still get peft's tokens."""
    from tokenserve.kernels import moe as kmoe
    from tokenserve.kernels.build import KERNELS_ENV

    made, loaded = checkpoint
    monkeypatch.setenv(kmoe.LIBRARY.mode_env if path == "stock-tf-grouping" else KERNELS_ENV,
                       "fallback")
    engine = make_engine(loaded)
    # (OLMoE's QK-norm over the whole projection takes graph steps on every path)
    fused = path != "graph" and made.family != "olmoe"
    assert engine.runner.step.fused_every_step == fused
    loras = [None, LoraRequest.new("a0", made.adapters[0][0])]
    jobs = [(PROMPTS[0], lora) for lora in loras] + [(PROMPTS[1], loras[1])]
    references = [made.hf_model, made.adapters[0][1], made.adapters[0][1]]
    assert run(engine, jobs) == [reference_greedy(model, prompt, MAX_TOKENS)
                                 for model, (prompt, _) in zip(references, jobs)]


@pytest.mark.slow
def test_the_mlp_of_a_dense_layer_among_experts_takes_an_adapter(tokenizer, tmp_path):
    """Qwen3-MoE with layer 0 dense (mlp_only_layers): an adapter of q_proj everywhere and of
    layer 0's gate/up/down_proj gives the tokens of transformers' model with the adapter
    merged into its weights (peft 0.21 on transformers 5 wraps the experts of layer 1 for
    these targets, not layer 0's MLP: the factors are written here); the same modules on
    layer 1, a layer of experts, are refused."""
    import transformers

    from support.moe_checkpoints import hf_model, save_hf
    from tokenserve.model.hf import load_hf

    directory = save_hf(tmp_path / "base", hf_model("qwen3moe", seed=1, mlp_only_layers=[0]),
                        tokenizer)
    loaded = load_hf(directory)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    rng = np.random.default_rng(3)
    modules = {f"{i}.self_attn.q_proj": (64, 96) for i in range(2)}  # 4 heads of 24
    modules.update({"0.mlp.gate_proj": (64, 96), "0.mlp.up_proj": (64, 96),
                    "0.mlp.down_proj": (96, 64)})
    tensors = {}
    with torch.no_grad():
        for module, (width_in, width_out) in modules.items():
            a = rng.normal(0, 0.3, [4, width_in]).astype(np.float32)
            b = rng.normal(0, 0.3, [width_out, 4]).astype(np.float32)
            name = f"base_model.model.model.layers.{module}.lora_"
            tensors.update({name + "A.weight": a, name + "B.weight": b})
            weight = reference.get_submodule(f"model.layers.{module}").weight
            weight += torch.from_numpy(2.0 * b @ a)  # alpha 8 / r 4
    path = _write(tmp_path / "dense", tensors, {"peft_type": "LORA", "r": 4, "lora_alpha": 8})
    engine = make_engine(loaded)
    lora = LoraRequest.new("dense", path)
    assert set(engine.loras.weights_of(lora).layers[0]) == {"qkv", "up", "down"}
    assert run(engine, [(PROMPTS[0], lora), (PROMPTS[0], None)]) == [
        reference_greedy(reference, PROMPTS[0], MAX_TOKENS),
        reference_greedy(transformers.AutoModelForCausalLM.from_pretrained(directory).eval(),
                         PROMPTS[0], MAX_TOKENS)]
    moe_mlp = {f"base_model.model.model.layers.1.mlp.{name}.lora_{side}.weight": value
               for name in ("gate_proj", "up_proj") for side, value in
               (("A", np.ones([2, 64], np.float32)), ("B", np.ones([96, 2], np.float32)))}
    with pytest.raises(LoraTargetError, match=r"layer 1's MLP is a mixture of experts"):
        load_adapter(_write(tmp_path / "moe-mlp", moe_mlp), loaded[2].model, max_rank=8)
