"""LoRA adapters on mixture-of-experts models: adapters of the attention projections, the
experts, the shared expert and the router give, row by row in mixed batches, what
transformers + peft give; bad expert factors are refused by name."""

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

    made = moe_lora_checkpoint(request.param, tokenizer, tmp_path_factory.mktemp(request.param),
                               num_adapters=3)
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


def test_adapters_of_experts_match_peft_in_one_batch(checkpoint):
    """The base, an adapter of the attention, one of the attention, the stacked experts,
    the shared expert (Qwen2-MoE) and the router, and one of the router and shared expert
    only (the routed experts keep their op), as peft writes them: each row's tokens and
    logits are transformers + peft's, in one batch, and each row's tokens its own alone."""
    made, loaded = checkpoint
    engine = make_engine(loaded)
    # every layer's MLP a mixture of experts: no slot room for dense MLP factors
    assert engine.runner.step.lora_table.ranks == {"qkv": 24, "out": 8, "up": 0, "down": 0}
    experts = engine.loras.check(made.adapters[1][0]).layers[0]
    expected_roles = {"qkv", "router", "expert_up", "expert_down"} | (
        {"shared_up", "shared_down", "shared_gate"} if made.family == "qwen2moe" else set())
    assert set(experts) == expected_roles
    assert np.abs(experts["expert_up"][1]).max() > 0.01  # peft's random B: deltas that show
    around = engine.loras.check(made.adapters[2][0]).layers[0]
    assert set(around) == {"qkv", "router"} | (
        {"shared_up", "shared_down", "shared_gate"} if made.family == "qwen2moe" else set())
    loras = check_batch_matches_references(engine, made, reference_greedy)
    jobs = [(PROMPTS[0], None), (PROMPTS[1], loras[1]), (PROMPTS[2], loras[2]),
            (PROMPTS[0], loras[2]), (PROMPTS[1], loras[3])]
    assert run(engine, jobs) == [run(engine, [job])[0] for job in jobs]
    # echo + logprobs' full pass, with the expert adapter
    path, reference = made.adapters[1]
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPTS[1]])).logits[0].numpy()
    got = engine.runner.prompt_logits(PROMPTS[1], engine.loras.weights_of(loras[2]).layers)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def _write(directory, tensors: dict, config: dict | None = None):
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(
        config or {"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def _pair(module: str, a_shape, b_shape, layer: int = 1) -> dict:
    name = f"base_model.model.model.layers.{layer}.{module}.lora_"
    return {name + "A.weight": np.ones(a_shape, np.float32),
            name + "B.weight": np.ones(b_shape, np.float32)}


def test_per_expert_modules_load_as_the_stacked_experts(checkpoint, tmp_path):
    """transformers 4's per-expert gate_proj / up_proj / down_proj (Mixtral's w1 / w3 / w2)
    give expert e its own factors, beside zeros for the experts they leave alone."""
    _, (_, _, config) = checkpoint
    c = config.model
    d, f = c.hidden_size, c.expert_intermediate_size
    tensors = {**_pair("mlp.experts.3.gate_proj", [2, d], [f, 2]),
               **_pair("block_sparse_moe.experts.3.w3", [2, d], [f, 2]),
               **_pair("mlp.experts.5.down_proj", [2, f], [d, 2])}
    weights = load_adapter(_write(tmp_path / "per-expert", tensors), c, max_rank=8)
    a, b = weights.layers[1]["expert_up"]                   # [E, D, 4], [E, 4, 2F]
    assert a.shape == (c.num_experts, d, 4) and b.shape == (c.num_experts, 4, 2 * f)
    # expert 3's gate and up each gain (x @ A.T) @ B.T x alpha 4 / r 2: ones [D, 2] @ 2 x ones
    np.testing.assert_array_equal(a[3] @ b[3], np.full([d, 2 * f], 4.0))
    assert not (a[0] @ b[0]).any()
    down_a, down_b = weights.layers[1]["expert_down"]
    np.testing.assert_array_equal(down_a[5] @ down_b[5], np.full([f, d], 4.0))
    assert not (down_a[3] @ down_b[3]).any()


def test_a_transformers_4_expert_adapter_matches_peft(checkpoint, tmp_path):
    """Per-expert factors as peft wrote them on transformers 4 (Mixtral's
    block_sparse_moe.experts.E.w1 / w3 / w2, the router block_sparse_moe.gate), which peft
    0.21 folds into transformers 5's stacked experts when it loads them: the engine's
    tokens and logits are peft's. (peft 0.21 leaves Qwen-MoE's such files unapplied, so
    Mixtral is the family with a reference.)"""
    import peft
    import transformers

    made, loaded = checkpoint
    if made.family != "mixtral":
        pytest.skip("peft applies transformers 4's per-expert files to Mixtral only")
    c = loaded[2].model
    d, f = c.hidden_size, c.expert_intermediate_size
    rng = np.random.default_rng(5)
    tensors = {}
    for layer in range(c.num_layers):
        modules = {"block_sparse_moe.gate": (d, c.num_experts)}
        for e in range(c.num_experts):
            modules.update({f"block_sparse_moe.experts.{e}.w1": (d, f),
                            f"block_sparse_moe.experts.{e}.w3": (d, f),
                            f"block_sparse_moe.experts.{e}.w2": (f, d)})
        for module, (width_in, width_out) in modules.items():
            name = f"base_model.model.model.layers.{layer}.{module}.lora_"
            tensors[name + "A.weight"] = rng.normal(0, 0.3, [2, width_in]).astype(np.float32)
            tensors[name + "B.weight"] = rng.normal(0, 0.3, [width_out, 2]).astype(np.float32)
    path = _write(tmp_path / "v4", tensors, {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 2, "lora_alpha": 4,
        "target_modules": ["w1", "w2", "w3", "gate"]})
    base = transformers.AutoModelForCausalLM.from_pretrained(made.directory).eval()
    reference = peft.PeftModel.from_pretrained(base, path).eval()
    engine = make_engine(loaded)
    lora = LoraRequest.new("v4", path)
    assert run(engine, [(PROMPTS[0], lora), (PROMPTS[0], None)]) == [
        reference_greedy(reference, PROMPTS[0], MAX_TOKENS),
        reference_greedy(made.hf_model, PROMPTS[0], MAX_TOKENS)]
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPTS[1]])).logits[0].numpy()
    got = engine.runner.prompt_logits(PROMPTS[1], engine.loras.weights_of(lora).layers)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["rank", "gate-up-rank", "expert-shape", "stacked-shape",
                                  "expert-index", "dense-module", "twice"])
def test_bad_expert_factors_are_refused(checkpoint, tmp_path, case):
    """A rank over --max_lora_rank, an expert factor of the wrong width, stacked factors
    that fit neither expert matrix, an expert the model lacks, a dense model's MLP module on
    a layer of experts, one expert given twice: refused by name, nothing loaded."""
    from tokenserve.engine.lora_adapter import (LoraBaseMismatchError, LoraRankError,
                                                LoraShapeError)

    _, (_, _, config) = checkpoint
    c = config.model
    d, f, e = c.hidden_size, c.expert_intermediate_size, c.num_experts
    tensors, error, match = {
        "rank": (_pair("mlp.experts", [e * 9, f], [d, e * 9]), LoraRankError,
                 r"rank 9 .*above --max_lora_rank 8"),
        # gate_up_proj: up to twice the rank (peft's own for gate_proj + up_proj targets)
        "gate-up-rank": (_pair("mlp.experts.base_layer", [e * 17, d], [2 * f, e * 17]),
                         LoraRankError, r"rank 17 .*above --max_lora_rank 8 \(x 2 for gate_up"),
        "expert-shape": (_pair("mlp.experts.0.down_proj", [2, f + 1], [d, 2]), LoraShapeError,
                         r"experts\.0\.down_proj: lora_A \(2, %d\)" % (f + 1)),
        "stacked-shape": (_pair("mlp.experts", [e * 2, d], [d + 3, e * 2]), LoraShapeError,
                          r"fit neither gate_up_proj"),
        "expert-index": (_pair(f"mlp.experts.{e}.up_proj", [2, d], [f, 2]),
                         LoraBaseMismatchError, rf"expert {e}; the model's layers have {e}"),
        "dense-module": (_pair("mlp.gate_proj", [2, d], [c.intermediate_size, 2]),
                         LoraTargetError, r"layer 1's MLP is a mixture of experts"),
        "twice": ({**_pair("mlp.experts.base_layer", [e * 2, d], [2 * f, e * 2]),
                   **_pair("mlp.experts.2.gate_proj", [2, d], [f, 2])}, LoraShapeError,
                  r"changes what"),
    }[case]
    with pytest.raises(error, match=match):
        load_adapter(_write(tmp_path / case, tensors), c, max_rank=8)


def test_no_lora_experts_leaves_the_experts_out_of_the_slots(checkpoint):
    """--no_lora_experts: the slot table holds no MoE factors, an adapter with them is
    refused, and the attention's adapter still loads."""
    import argparse

    from tokenserve.cli.lora_flags import add_lora_flags, lora_engine_options

    made, loaded = checkpoint
    parser = argparse.ArgumentParser()
    add_lora_flags(parser)
    options = lora_engine_options(parser.parse_args(["--max_loras", "2", "--no_lora_experts"]))
    assert options["lora_experts"] is False
    engine = make_engine(loaded, **options)
    assert engine.runner.step.lora_table.moe is None
    with pytest.raises(LoraTargetError, match="--no_lora_experts"):
        engine.loras.check(made.adapters[1][0])
    assert engine.loras.check(made.adapters[0][0]).layers[0]
    assert lora_engine_options(parser.parse_args([]))["lora_experts"] is True


@pytest.mark.slow  # a warm-up's traces
def test_warm_up_traces_the_steps_of_expert_adapters(checkpoint):
    """The warm-up runs a zero adapter flagged as having expert factors, so the first user
    request on such an adapter meets traced steps: serving it then traces nothing new."""
    from tokenserve.engine.warmup import warm_up

    made, loaded = checkpoint
    engine = make_engine(loaded)
    warm_up(engine)
    steps = engine.runner.step._steps
    warmed = set(steps)
    assert {"experts", "moe-around"} <= {key[-1] for key in warmed}
    run(engine, [(PROMPTS[0], LoraRequest.new(f"a{i}", made.adapters[i][0])) for i in (1, 2)])
    assert set(steps) == warmed


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
