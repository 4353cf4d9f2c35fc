"""Export round trip: the SavedModel generates what the in-memory model generates."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tokenserve.export.exporter import export_model
from tokenserve.export.module import GenerationModule
from tokenserve.lifecycle.warmup_replay import read_warmup
from tokenserve.sampling import SamplingParams
from tokenserve.tools.generate import ExportedModel
from support.tiny_models import tiny

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
SIGNATURES = ["serving_default", "generate", "init_state", "prefill", "decode"]


def greedy_reference(model, prompt, steps, eos):
    """The research-script loop: full forward pass each step, no cache."""
    ids, out = list(prompt), []
    for _ in range(steps):
        token = int(np.argmax(model(np.array([ids], np.int32)).numpy()[0, -1]))
        out.append(token)
        ids.append(token)
        if token == eos:
            break
    return out


def call_generate(signature, ids, max_new, temperature=0.0, top_k=0, top_p=1.0, seed=0):
    result = signature(input_ids=tf.constant(ids, tf.int32),
                       max_new_tokens=tf.constant(max_new), temperature=tf.constant(temperature),
                       top_k=tf.constant(top_k), top_p=tf.constant(top_p), seed=tf.constant(seed))
    return result["output_ids"].numpy(), result["num_generated"].numpy()


@pytest.mark.slow_cases(exported=["tiny-lstm"])
def test_greedy_64_steps_match_in_memory_model(exported):
    model, config, path = exported
    expected = greedy_reference(model, PROMPT, 64, config.eos_token_id)
    assert len(expected) == 64, "pick a prompt that does not hit eos for this seed"
    generate = tf.saved_model.load(str(path)).signatures["generate"]
    output, num = call_generate(generate, [PROMPT], 64)
    assert num.tolist() == [64]
    assert output[0].tolist() == expected
    streamed = list(ExportedModel(path).stream(PROMPT, SamplingParams(max_tokens=64)))
    assert streamed == expected


def test_batched_generate_with_ragged_prompts_matches_single_rows(exported):
    _, config, path = exported
    generate = tf.saved_model.load(str(path)).signatures["generate"]
    short = PROMPT[:3]
    batch = [PROMPT, short + [config.pad_token_id] * (len(PROMPT) - 3)]
    output, _ = call_generate(generate, batch, 20)
    assert output[0].tolist() == call_generate(generate, [PROMPT], 20)[0][0].tolist()
    assert output[1].tolist() == call_generate(generate, [short], 20)[0][0].tolist()


def test_serving_default_predicts_the_greedy_next_token(exported):
    model, config, path = exported
    predict = tf.saved_model.load(str(path)).signatures["serving_default"]
    got = predict(input_ids=tf.constant([PROMPT], tf.int32))["predicted_id"].numpy()
    assert got.dtype == np.int32 and got.shape == (1,)
    assert got[0] == greedy_reference(model, PROMPT, 1, config.eos_token_id)[0]


def test_sampling_is_reproducible_from_seed(exported):
    _, _, path = exported
    generate = tf.saved_model.load(str(path)).signatures["generate"]
    first = call_generate(generate, [PROMPT], 24, temperature=1.0, top_k=50, top_p=0.95, seed=7)
    again = call_generate(generate, [PROMPT], 24, temperature=1.0, top_k=50, top_p=0.95, seed=7)
    other = call_generate(generate, [PROMPT], 24, temperature=1.0, top_k=50, top_p=0.95, seed=8)
    assert first[0].tolist() == again[0].tolist()
    assert first[0].tolist() != other[0].tolist()
    top1 = call_generate(generate, [PROMPT], 24, temperature=1.0, top_k=1, seed=3)
    assert top1[0].tolist() == call_generate(generate, [PROMPT], 24)[0].tolist()


def test_loads_and_runs_with_plain_tensorflow(exported):
    _, _, path = exported
    script = f"""
import json, sys
import tensorflow as tf
m = tf.saved_model.load({str(path)!r})
out = m.signatures["generate"](input_ids=tf.constant([{PROMPT}], tf.int32),
    max_new_tokens=tf.constant(16), temperature=tf.constant(0.0), top_k=tf.constant(0),
    top_p=tf.constant(1.0), seed=tf.constant(0))
assert not any(name.startswith("tokenserve") for name in sys.modules), "imported tokenserve"
print(json.dumps(out["output_ids"].numpy().tolist()))
"""
    env = dict(os.environ, PYTHONPATH="", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, cwd="/", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    generate = tf.saved_model.load(str(path)).signatures["generate"]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == \
        call_generate(generate, [PROMPT], 16)[0].tolist()


def test_runs_in_a_tf1_session_as_tf_serving_loads_it(exported):
    """TF Serving's SavedModelBundle restores variables through the MetaGraph's saver into a
    Session and runs signatures by tensor name; every variable the graph reads must be one
    that restore wrote (Keras 3 objects once saved a second, unread copy of each)."""
    model, _, path = exported
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as session:
        meta = tf.compat.v1.saved_model.loader.load(session, ["serve"], str(path))
        signature = meta.signature_def["serving_default"]
        predicted = session.run(signature.outputs["predicted_id"].name,
                                {signature.inputs["input_ids"].name: [PROMPT]})
    expected = int(np.argmax(model(np.asarray([PROMPT], np.int32)).numpy()[0, -1]))
    assert predicted.tolist() == [expected]


def test_saved_model_cli_lists_every_signature(exported):
    _, _, path = exported
    cli = Path(sys.executable).parent / "saved_model_cli"
    result = subprocess.run([str(cli), "show", "--dir", str(path), "--all"], capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert result.returncode == 0, result.stderr[-2000:]
    for name in SIGNATURES:
        assert f"signature_def['{name}']" in result.stdout
    assert "inputs['input_ids'] tensor_info:\n        dtype: DT_INT32\n        shape: (-1, -1)" \
        in result.stdout
    assert "outputs['predicted_id'] tensor_info:\n        dtype: DT_INT32\n        shape: (-1)" \
        in result.stdout


def test_wrong_dtype_shape_and_length_fail_clearly(exported):
    _, config, path = exported
    signatures = tf.saved_model.load(str(path)).signatures
    predict = signatures["serving_default"]
    with pytest.raises((TypeError, ValueError, tf.errors.InvalidArgumentError), match="int32"):
        predict(input_ids=tf.constant([[1.5, 2.5]], tf.float32))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"input_ids \[3\] is not compatible with expected shape \[\?,\?\]"):
        predict(input_ids=tf.constant([1, 2, 3], tf.int32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="token_ids .* not compatible"):
        signatures["decode"](token_ids=tf.constant([[1, 2]], tf.int32),
                             positions=tf.constant([0], tf.int32),
                             state=signatures["init_state"](batch_size=tf.constant(1),
                                                            max_len=tf.constant(16))["state"])
    state = signatures["init_state"](batch_size=tf.constant(1), max_len=tf.constant(16))["state"]
    # two scalars must not make the server allocate without bound (a 400, not an OOM)
    with pytest.raises(tf.errors.InvalidArgumentError, match="would be over 1073741824 bytes"):
        signatures["init_state"](batch_size=tf.constant(2**31 - 1), max_len=tf.constant(16))
    if config.model.family == "transformer":
        with pytest.raises(tf.errors.InvalidArgumentError, match="exceed the length of the state"):
            signatures["decode"](token_ids=tf.constant([[1]], tf.int32),
                                 positions=tf.constant([16], tf.int32), state=state)
    too_long = tf.ones([1, config.max_seq_len + 1], tf.int32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="context length"):
        predict(input_ids=too_long)
    with pytest.raises(tf.errors.InvalidArgumentError, match="context length"):
        call_generate(signatures["generate"], [PROMPT], config.max_seq_len)
    # near 2**31 the prompt plus max_new_tokens wrapped around in int32 and passed the check
    with pytest.raises(tf.errors.InvalidArgumentError, match="context length"):
        call_generate(signatures["generate"], [PROMPT], 2**31 - 1)
    # ids outside the vocabulary: the XLA step's gather would clamp them and answer anyway
    vocab = config.model.vocab_size
    for bad_id in (-1, vocab):
        with pytest.raises(tf.errors.InvalidArgumentError, match="outside the vocabulary"):
            predict(input_ids=tf.constant([[5, bad_id]], tf.int32))
        with pytest.raises(tf.errors.InvalidArgumentError, match="outside the vocabulary"):
            call_generate(signatures["generate"], [[5, bad_id]], 2)
        with pytest.raises(tf.errors.InvalidArgumentError, match="outside the vocabulary"):
            signatures["decode"](token_ids=tf.constant([[bad_id]], tf.int32),
                                 positions=tf.constant([0], tf.int32), state=state)
    for name in ("temperature", "top_p"):
        with pytest.raises(tf.errors.InvalidArgumentError, match=f"{name} must be a finite"):
            call_generate(signatures["generate"], [PROMPT], 2, **{name: float("nan")})


@pytest.mark.slow_cases(exported=["tiny-gpt2"])
def test_assets_and_versions(exported, tokenizer, tmp_path):
    model, config, path = exported
    assets = path / "assets"
    generation = json.loads((assets / "generation_config.json").read_text())
    assert generation["family"] == config.model.family
    assert generation["eos_token_id"] == tokenizer.eos_token_id
    assert generation["max_seq_len"] == config.max_seq_len
    assert generation["model"]["vocab_size"] == config.model.vocab_size
    assert "chat_template" in generation
    assert (assets / "tokenizer.json").exists()
    assert [export_model(model, tokenizer, config, tmp_path, jit_compile=False).name
            for _ in range(2)] == ["1", "2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]  # no staging left behind


def test_warmup_file_holds_prediction_logs_that_replay(exported):
    """Written by export.warmup_records, found and read by the lifecycle's replay."""
    from tokenserve.export import warmup_records
    from tokenserve.lifecycle.warmup_replay import MAX_WARMUP_RECORDS, warmup_file

    _, config, path = exported
    assert warmup_file(path) == path / "assets.extra" / warmup_records.WARMUP_FILE
    assert warmup_records.MAX_WARMUP_RECORDS == MAX_WARMUP_RECORDS
    records = read_warmup(warmup_file(path))
    assert 1 <= len(records) <= MAX_WARMUP_RECORDS
    signatures = tf.saved_model.load(str(path)).signatures
    for record in records:
        request = record.predict_log.request
        assert request.model_spec.name == config.name
        inputs = {k: tf.make_ndarray(v) for k, v in request.inputs.items()}
        outputs = signatures[request.model_spec.signature_name](**inputs)
        assert outputs
    assert {r.predict_log.request.model_spec.signature_name for r in records} == \
        {"serving_default", "generate"}


@pytest.mark.parametrize("name", ["tiny-llama", pytest.param("tiny-lstm", marks=pytest.mark.slow)])
def test_repeated_calls_do_not_retrace(name, tokenizer):
    model, config = tiny(name, tokenizer)
    module = GenerationModule(model, config, jit_compile=True)
    for length, batch in [(3, 1), (9, 2), (17, 1)]:
        ids = tf.fill([batch, length], 5)
        module.serving_default(ids)
        module.generate(ids, tf.constant(4), tf.constant(0.0), tf.constant(0), tf.constant(1.0),
                        tf.constant(length))
        state = module.init_state(tf.constant(batch), tf.constant(32))["state"]
        out = module.prefill(ids, tf.zeros([batch], tf.int32), tf.fill([batch], length), state)
        for position in (length, length + 1):
            out = module.decode(tf.fill([batch, 1], 6), tf.fill([batch], position), out["state"])
    for function in (module.serving_default, module.generate, module.init_state, module.prefill,
                     module.decode, module._step, *module._loops):
        assert function.experimental_get_tracing_count() <= 1
    assert module.generate.experimental_get_tracing_count() == 1
    assert module.decode.experimental_get_tracing_count() == 1


def test_decode_at_a_new_position_does_not_recompile(exported, tmp_path):
    """XLA writes one program per compilation to its persistent cache; count them."""
    _, _, path = exported
    script = f"""
import tensorflow as tf
s = tf.saved_model.load({str(path)!r}).signatures
state = s["init_state"](batch_size=tf.constant(1), max_len=tf.constant(32))["state"]
out = s["prefill"](token_ids=tf.constant([[5, 6, 7, 0]]), positions=tf.constant([0]),
                   num_tokens=tf.constant([3]), state=state)
for position in (3, 4, 5, 6):
    out = s["decode"](token_ids=tf.constant([[8]]), positions=tf.constant([position]),
                      state=out["state"])
"""
    cache = tmp_path / "xla"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               TF_XLA_FLAGS=f"--tf_xla_persistent_cache_directory={cache}")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(list(cache.iterdir())) == 2  # one prefill program, one decode program


def test_restored_weights_equal_the_exported_model_and_bad_files_fail_clearly(tiny_gpt2_dir,
                                                                              tmp_path):
    """load_language_model reads every weight back bit for bit (one RestoreV2 op); a
    truncated variables file or a config whose shapes disagree is a ModelLoadError, never a
    raw TensorFlow error."""
    import shutil

    from tokenserve.errors import ModelLoadError
    from tokenserve.export.restore import load_language_model

    model, _, _, _ = load_language_model(tiny_gpt2_dir, precision="float32")
    reader = tf.train.load_checkpoint(str(Path(tiny_gpt2_dir) / "variables" / "variables"))
    restored = {w.path: w.numpy() for w in model.weights}
    # the export's own copy of a weight, found by value: every restored weight matches one
    stored = [reader.get_tensor(key) for key in reader.get_variable_to_shape_map()
              if key != "_CHECKPOINTABLE_OBJECT_GRAPH"]
    for path, value in restored.items():
        assert any(s.shape == value.shape and np.array_equal(s, value) for s in stored), path

    broken = tmp_path / "broken"
    shutil.copytree(tiny_gpt2_dir, broken)
    data = next((broken / "variables").glob("variables.data-*"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="cannot read weights"):
        load_language_model(broken, precision="float32")

    wider = tmp_path / "wider"
    shutil.copytree(tiny_gpt2_dir, wider)
    config_file = wider / "assets" / "generation_config.json"
    config = json.loads(config_file.read_text())
    config["model"]["hidden_size"] *= 2
    config_file.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="has shape"):
        load_language_model(wider, precision="float32")
