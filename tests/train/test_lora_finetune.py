"""LoRA fine-tuning writes a PEFT adapter that peft and tokenserve both load, with the same
logits as the model that was trained."""

from __future__ import annotations

import numpy as np
import pytest

from support.lora_models import lora_checkpoint
from tokenserve.engine.lora_adapter import LoraRequest
from tokenserve.sampling import SamplingParams

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

PROMPT = [5, 17, 33, 90, 140, 7, 8, 9]


# the trainer's XLA step compiles for each: about 40 s a family on a 2-core VM
@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "gemma3", "qwen3moe"])
def test_a_trained_adapter_round_trips_through_peft_and_the_engine(family, tokenizer, tmp_path):
    import transformers

    from tokenserve.engine.config import EngineConfig
    from tokenserve.engine.core import LLMEngine
    from tokenserve.engine.runner import ModelRunner
    from tokenserve.model.hf import load_hf
    from tokenserve.train.finetune import finetune
    from tokenserve.train.lora import LoraModel, LoraTrainer
    from tokenserve.train.trainer import holdout_windows, perplexity

    made = _checkpoint(family, tokenizer, tmp_path)
    model, hf_tokenizer, config = load_hf(made.directory)
    lora = LoraModel(model, rank=4, seed=1)
    stream = np.random.default_rng(0).integers(3, 60, 4000).astype(np.int32)  # a small
    holdout = stream[-400:]                                                   # vocabulary
    windows = holdout_windows(holdout, 32, 4)
    before = perplexity(lora, windows)
    np.testing.assert_allclose(before, perplexity(model, windows), rtol=1e-5)  # B starts at 0
    finetune(lora, stream[:-400], holdout, 4, tmp_path / "work", learning_rate=1e-2,
             batch_size=2, seq_len=32, trainer_class=LoraTrainer)
    assert perplexity(lora, windows) < before
    adapter = lora.save_adapter(tmp_path / "adapter")

    base = transformers.AutoModelForCausalLM.from_pretrained(made.directory).eval()
    reference = peft.PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits.numpy()
    np.testing.assert_allclose(lora(np.asarray([PROMPT], np.int32)).numpy(), expected,
                               atol=1e-4, rtol=0)

    engine_config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                                 precision="float32", max_loras=1, max_lora_rank=4)
    engine = LLMEngine(ModelRunner(model, config, engine_config), hf_tokenizer, engine_config)
    request = engine.make_request(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True),
                                  lora=LoraRequest.new("trained", adapter))
    engine.add_request(request)
    while engine.has_work:
        engine.step()
    with torch.no_grad():
        greedy = reference.generate(torch.tensor([PROMPT]), max_new_tokens=6, min_new_tokens=6,
                                    do_sample=False)[0, len(PROMPT):].tolist()
    assert request.seqs[0].output_ids == greedy


@pytest.mark.parametrize("family", ["phi3", "gpt2"])
def test_the_written_adapter_names_the_familys_own_modules(family, tokenizer, tmp_path):
    """`tokenserve finetune`'s adapter (here untrained, B random) carries the module names of
    the model's own checkpoint (Phi-3's fused qkv_proj and gate_up_proj, GPT-2's c_attn ...),
    so peft loads it onto the transformers model with the logits of the model it was written
    from, and tokenserve loads it back."""
    from safetensors.numpy import load_file

    from tokenserve.engine.lora_adapter import load_adapter
    from tokenserve.model.hf import load_hf
    from tokenserve.train.lora import LoraModel

    made = lora_checkpoint(family, tokenizer, tmp_path, num_adapters=0)
    model, _, config = load_hf(made.directory)
    lora = LoraModel(model, rank=4, seed=1)
    rng = np.random.default_rng(2)
    for _, b in lora.factors.values():
        b.assign(rng.normal(0, 0.2, b.shape).astype(np.float32))
    adapter = lora.save_adapter(tmp_path / "adapter")
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    written = {name.split(".")[-3] for name in tensors}  # ...qkv_proj.lora_A.weight
    assert written == ({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} if family == "phi3"
                       else {"c_attn", "c_proj", "c_fc"})
    _check_peft_logits(made, adapter, lora, model)
    assert load_adapter(adapter, config.model, max_rank=4).rank == 4


def _check_peft_logits(made, adapter, lora, model):
    """peft's logits for the written adapter on the transformers model of the same checkpoint
    are the LoRA model's (within 1e-4), and the adapter moves them off the base's."""
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(made.directory).eval()
    reference = peft.PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits.numpy()
    got = lora(np.asarray([PROMPT], np.int32)).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    assert not np.allclose(got, model(np.asarray([PROMPT], np.int32)).numpy(), atol=1e-3)


def _checkpoint(family, tokenizer, root):
    from support.lora_models import moe_lora_checkpoint

    if family == "qwen3moe":
        return moe_lora_checkpoint(family, tokenizer, root, num_adapters=0)
    return lora_checkpoint(family, tokenizer, root, num_adapters=0)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "qwen3moe"])
def test_families_the_trainer_does_not_recompute_train_through_the_models_own_forward(
        family, tokenizer, tmp_path):
    """LoRA trains through the model's own forward (QK-norm, post-norms, GeGLU, windows,
    experts): gradients reach every factor through a traced step, a few steps lower the
    loss, and the adapter gives peft's logits and loads in tokenserve (a mixture of experts'
    on its attention projections)."""
    import tensorflow as tf

    from tokenserve.engine.lora_adapter import load_adapter
    from tokenserve.model.hf import load_hf
    from tokenserve.train.lora import LoraModel

    made = _checkpoint(family, tokenizer, tmp_path)
    model, _, config = load_hf(made.directory)
    lora = LoraModel(model, rank=4, seed=1)
    batch = np.random.default_rng(0).integers(3, 60, [2, 17]).astype(np.int32)
    variables = lora.trainable_variables

    @tf.function  # the trainer's step is traced: the factors must reach the trace
    def gradients():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=batch[:, 1:], logits=lora(batch[:, :-1])))
        return loss, tape.gradient(loss, variables)

    losses = []
    for _ in range(4):
        loss, grads = gradients()
        losses.append(float(loss))
        assert all(g is not None for g in grads)
        for variable, grad in zip(variables, grads):
            variable.assign_sub(0.5 * grad)
    assert losses[-1] < losses[0]
    assert all(np.abs(b.numpy()).max() > 0 for _, b in lora.factors.values())  # all trained
    adapter = lora.save_adapter(tmp_path / "adapter")

    _check_peft_logits(made, adapter, lora, model)
    served = load_adapter(adapter, config.model, max_rank=4)
    assert sorted(served.layers[0]) == (["out", "qkv"] if family == "qwen3moe"
                                        else ["down", "out", "qkv", "up"])


def test_a_mixture_of_experts_trains_its_attention_projections_only(tokenizer, tmp_path):
    from tokenserve.engine.lora_adapter import LoraTargetError
    from tokenserve.model.hf import load_hf
    from tokenserve.train.lora import LoraModel

    model, _, _ = load_hf(_checkpoint("qwen3moe", tokenizer, tmp_path).directory)
    assert LoraModel(model, rank=2).targets == ["k_proj", "o_proj", "q_proj", "v_proj"]
    with pytest.raises(LoraTargetError, match="'gate_proj'.*attention projections only"):
        LoraModel(model, rank=2, targets=["q_proj", "gate_proj"])


@pytest.mark.slow  # the trainer's XLA step compiles
def test_tokenserve_finetune_on_a_hugging_face_checkpoint_dir(tokenizer, tmp_path, capsys):
    """`tokenserve finetune DIR` takes a Hugging Face checkpoint directory (here Qwen3's,
    with QK-norm) and writes an adapter that tokenserve loads."""
    from support.tiny_models import TINY_TEXT
    from tokenserve.cli.main import main
    from tokenserve.engine.lora_adapter import load_adapter
    from tokenserve.model.hf import load_hf

    made = lora_checkpoint("qwen3", tokenizer, tmp_path, num_adapters=0)
    data = tmp_path / "code.py"
    data.write_text("\n".join(TINY_TEXT) * 4)
    out = tmp_path / "adapter"
    assert main(["finetune", str(made.directory), "--data", str(data), "--lora_rank", "2",
                 "--steps", "6", "--seq_len", "32", "--learning_rate", "1e-2",
                 "--target_modules", "q_proj", "v_proj", "--output", str(out)]) == 0
    before, after = capsys.readouterr().out.split("held-out perplexity ")[1].split(" (")[0] \
        .split(" -> ")
    assert float(after) < float(before)
    served = load_adapter(out, load_hf(made.directory)[2].model, max_rank=2)
    assert sorted(served.layers[0]) == ["qkv"]
