"""Importing Hugging Face GPT-2 and Llama checkpoints matches `transformers` exactly."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from support.transformers_parity import assert_logits_match
from tokenserve.errors import ModelLoadError
from tokenserve.export.exporter import export_model
from tokenserve.model.hf import UnsupportedArchitectureError, load_hf
from tokenserve.sampling import SamplingParams
from tokenserve.tools.generate import ExportedModel

if os.environ.get("CI"):
    # In CI these are installed (the test extra): a missing one is a broken setup, and
    # skipping would pass the run without ever checking the import against transformers.
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

SAMPLE = "def f(x):\n\treturn x  # ünïcödé ✓ 日本語 🐍\n\n    spaces   and\ttabs\r\n"


def save_checkpoint(directory, hf_model, tokenizer, dtype=None, max_shard_size="5GB"):
    if dtype is not None:
        hf_model = hf_model.to(dtype)
    hf_model.save_pretrained(directory, safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save(directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
         "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))


def gpt2(tokenizer):
    config = transformers.GPT2Config(vocab_size=400, n_positions=128, n_embd=64, n_layer=2,
                                     n_head=4, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


# Llama 3.1's RoPE scaling with a 16-token "original" context, so that at these prompts' few
# dozen positions the scaled pairs turn visibly slower than plain RoPE's (head_dim 16, theta
# 5000: pair 0's wavelength, 2 pi, lies between the bounds 4 and 16 and is blended; the seven
# longer ones are slowed 8x)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def llama(tokenizer, tie=False, rope_scaling=None):
    config = transformers.LlamaConfig(
        vocab_size=400, max_position_embeddings=128, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        tie_word_embeddings=tie, rope_theta=5000.0, rms_norm_eps=1e-6, bos_token_id=1,
        eos_token_id=2, rope_scaling=rope_scaling)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises norms to 1; perturb them so a missed norm shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def qwen2(tokenizer):
    config = transformers.Qwen2Config(
        vocab_size=400, max_position_embeddings=128, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # zero-initialised biases would hide a dropped q/k/v bias
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.fixture(scope="module",
                params=["gpt2", "llama-gqa-untied", "llama-tied-bf16", "qwen2-biases",
                        "llama3-rope-scaling"])
def imported(request, tokenizer, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt2":
        hf_model = gpt2(tokenizer)
        save_checkpoint(directory, hf_model, tokenizer)
    elif request.param == "llama-gqa-untied":
        hf_model = llama(tokenizer)
        save_checkpoint(directory, hf_model, tokenizer, max_shard_size="60KB")
        assert (directory / "model.safetensors.index.json").exists()  # sharded
    elif request.param == "qwen2-biases":
        hf_model = qwen2(tokenizer)
        save_checkpoint(directory, hf_model, tokenizer)
    elif request.param == "llama3-rope-scaling":
        hf_model = llama(tokenizer, rope_scaling=LLAMA3_ROPE)
        save_checkpoint(directory, hf_model, tokenizer)
    else:
        hf_model = llama(tokenizer, tie=True)
        save_checkpoint(directory, hf_model, tokenizer, dtype=torch.bfloat16)
        hf_model = transformers.LlamaForCausalLM.from_pretrained(directory).float().eval()
    return hf_model, directory, load_hf(directory)


PROMPTS = [[5, 17, 33, 90, 140, 7, 8, 9, 250, 3], [12, 44, 1, 77], [300, 301, 302, 303, 304, 8]]


def test_logits_match_transformers_on_ragged_batch(imported):
    hf_model, _, (model, _, _) = imported
    assert_logits_match(hf_model, model, PROMPTS)


@pytest.mark.slow_cases(imported=["gpt2", "llama-gqa-untied", "llama-tied-bf16",
                                   "qwen2-biases"])
def test_greedy_32_tokens_match_transformers_generate(imported, tmp_path):
    hf_model, _, (model, tokenizer, config) = imported
    prompt = PROMPTS[0]
    with torch.no_grad():
        hf_out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                   eos_token_id=None, pad_token_id=0, min_new_tokens=32)
    expected = hf_out[0, len(prompt):].tolist()
    path = export_model(model, tokenizer, config, tmp_path)
    generate = tf.saved_model.load(str(path)).signatures["generate"]
    out = generate(input_ids=tf.constant([prompt], tf.int32), max_new_tokens=tf.constant(32),
                   temperature=tf.constant(0.0), top_k=tf.constant(0), top_p=tf.constant(1.0),
                   seed=tf.constant(0))
    got = out["output_ids"].numpy()[0].tolist()
    # generate stops at eos; transformers was told not to, so compare up to it
    n = int(out["num_generated"].numpy()[0])
    assert got[:n] == expected[:n] and (n == 32 or got[n - 1] == config.eos_token_id)
    streamed = list(ExportedModel(path).stream(prompt, SamplingParams(max_tokens=32,
                                                                      ignore_eos=True)))
    assert streamed == expected
    predicted = tf.saved_model.load(str(path)).signatures["serving_default"](
        input_ids=tf.constant([prompt], tf.int32))["predicted_id"].numpy()
    assert predicted.tolist() == expected[:1]


def test_tokenizer_matches_transformers(imported):
    _, directory, (_, tokenizer, config) = imported
    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory /
                                                                           "tokenizer.json"))
    ids = tokenizer.encode(SAMPLE)
    assert ids == hf_tokenizer.encode(SAMPLE, add_special_tokens=False)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids) == SAMPLE
    assert config.chat_template.startswith("{% for m in messages %}")


def test_llama3_rope_scaling_is_what_the_import_matches(tokenizer):
    # the same weights under plain RoPE give other logits (by 50 times the 1e-4 the import is
    # held to), so the match above is the scaling's
    scaled = llama(tokenizer, rope_scaling=LLAMA3_ROPE)
    plain = llama(tokenizer)
    plain.load_state_dict(scaled.state_dict())
    with torch.no_grad():
        a = scaled(torch.tensor([PROMPTS[0]])).logits.numpy()
        b = plain(torch.tensor([PROMPTS[0]])).logits.numpy()
    assert np.abs(a - b).max() > 5e-3
    # and the divisors are transformers' own: its llama3 inverse frequencies, ours divided
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tokenserve.model.hf import architecture_config

    config = architecture_config({**scaled.config.to_dict(),
                                  "architectures": ["LlamaForCausalLM"]})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](scaled.config)
    default = 1.0 / 5000.0 ** (np.arange(0, 16, 2) / 16)
    np.testing.assert_allclose(default / np.array(config.rope_freq_factors),
                               inv_freq.numpy(), rtol=1e-6)
    assert 1.0 < config.rope_freq_factors[0] < 8.0  # the blended pair
    assert config.rope_freq_factors[1:] == (8.0,) * 7
    # Llama 3.2 1B's own settings (head_dim 64, theta 500,000): pairs kept, blended and slowed
    real = transformers.LlamaConfig(
        hidden_size=2048, num_attention_heads=32, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    factors = np.array(architecture_config(
        {**real.to_dict(), "architectures": ["LlamaForCausalLM"]}).rope_freq_factors)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](real)
    default = 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(default / factors, inv_freq.numpy(), rtol=1e-6)
    assert (factors == 1).sum() > 0 and (factors == 32).sum() > 0
    assert ((factors > 1) & (factors < 32)).sum() > 0


def test_other_rope_scaling_is_refused(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=400, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=96, rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    from tokenserve.errors import ConfigError
    from tokenserve.model.hf import architecture_config

    with pytest.raises(ConfigError, match="rope scaling 'dynamic' is not supported; "
                                          "supported: default, linear, llama3, yarn"):
        architecture_config({**config.to_dict(), "architectures": ["LlamaForCausalLM"]})


def test_errors_name_the_tensor_and_shapes(tokenizer, tmp_path):
    from safetensors.torch import load_file, save_file

    save_checkpoint(tmp_path, llama(tokenizer), tokenizer)
    weights = tmp_path / "model.safetensors"
    original = load_file(str(weights))

    def rewrite(tensors):
        save_file(tensors, str(weights), metadata={"format": "pt"})

    broken = dict(original)
    del broken["model.layers.1.mlp.down_proj.weight"]
    rewrite(broken)
    with pytest.raises(ModelLoadError, match="missing tensor model.layers.1.mlp.down_proj.weight"):
        load_hf(tmp_path)
    rewrite(dict(original, **{"model.layers.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor model.layers.0.extra.weight "
                                             r"with shape \(3,\)"):
        load_hf(tmp_path)
    rewrite(dict(original, **{"model.norm.weight": torch.zeros(65)}))
    with pytest.raises(ModelLoadError, match=r"model.norm.weight \(65,\).*expected \(64,\)"):
        load_hf(tmp_path)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    with pytest.raises(UnsupportedArchitectureError,
                       match="'MambaForCausalLM' is not supported; supported: GPT2LMHeadModel"):
        load_hf(tmp_path)


def test_cli_imports_a_checkpoint(tokenizer, tmp_path):
    import os
    import subprocess
    import sys

    save_checkpoint(tmp_path / "hf", gpt2(tokenizer), tokenizer)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-m", "tokenserve", "export", "--from-hf",
                             str(tmp_path / "hf"), "--output", str(tmp_path / "out")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "exported hf (transformer" in result.stdout
    assert (tmp_path / "out" / "1" / "saved_model.pb").exists()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"architectures": ["T5Model"]}')
    result = subprocess.run([sys.executable, "-m", "tokenserve", "export", "--from-hf",
                             str(tmp_path / "bad"), "--output", str(tmp_path / "out")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "'T5Model' is not supported" in result.stderr


def test_bfloat16_compute_stays_close_to_float32(tokenizer, tmp_path):
    save_checkpoint(tmp_path / "hf", llama(tokenizer), tokenizer)
    model32, tokenizer32, config32 = load_hf(tmp_path / "hf")
    model16, _, config16 = load_hf(tmp_path / "hf", compute_dtype="bfloat16")
    assert model16.weights[0].dtype == "bfloat16"
    ids = np.array([PROMPTS[0]], np.int32)
    full32, full16 = model32(ids).numpy(), model16(ids).numpy()
    assert full16.dtype == np.float32
    assert np.abs(full16 - full32).max() < 0.05 * np.abs(full32).max()
    path = export_model(model16, tokenizer32, config16, tmp_path / "out")
    signatures = tf.saved_model.load(str(path)).signatures
    state = signatures["init_state"](batch_size=tf.constant(1), max_len=tf.constant(32))["state"]
    assert state.dtype == tf.bfloat16
    out = signatures["generate"](input_ids=tf.constant(ids), max_new_tokens=tf.constant(8),
                                 temperature=tf.constant(0.0), top_k=tf.constant(0),
                                 top_p=tf.constant(1.0), seed=tf.constant(0))
    assert out["output_ids"].shape == (1, 8)


@pytest.mark.slow_cases(imported=["gpt2", "llama-gqa-untied", "qwen2-biases",
                                   "llama3-rope-scaling"])
def test_imported_export_runs_with_plain_tensorflow(imported, tmp_path):
    import os
    import subprocess
    import sys

    _, _, (model, tokenizer, config) = imported
    path = export_model(model, tokenizer, config, tmp_path)
    script = f"""
import json, sys
import tensorflow as tf
s = tf.saved_model.load({str(path)!r}).signatures
ids = tf.constant([{PROMPTS[0]}], tf.int32)
out = s["generate"](input_ids=ids, max_new_tokens=tf.constant(8), temperature=tf.constant(0.0),
                    top_k=tf.constant(0), top_p=tf.constant(1.0), seed=tf.constant(0))
nxt = s["serving_default"](input_ids=ids)["predicted_id"]
assert not any(name.startswith("tokenserve") for name in sys.modules)
print(json.dumps([out["output_ids"].numpy()[0].tolist(), nxt.numpy().tolist()]))
"""
    env = dict(os.environ, PYTHONPATH="", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, cwd="/", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    generated, predicted = json.loads(result.stdout.strip().splitlines()[-1])
    expected = int(np.argmax(model(np.array([PROMPTS[0]], np.int32)).numpy()[0, -1]))
    assert predicted == [expected] and generated[0] == expected
