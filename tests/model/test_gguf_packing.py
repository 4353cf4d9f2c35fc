"""An engine over a GGUF import repacks its Q4_0, Q4_1 and Q5_0 projections into 8-row tiles
at load (model/gguf_packing.py): in place, the same bytes' worth; the engine's cached decode
still equals full forward passes of the model and the dequantized import's greedy choices;
the export on disk keeps the file's rows; TOKENSERVE_GGUF_REPACK=off keeps them in memory
too; and a repacked model refuses to be exported."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from support.gguf_files import write_tiny_gguf
from support.greedy_checks import assert_greedy_up_to_near_ties
from support.tiny_models import greedy_by_full_forward
from tokenserve.errors import FailedPreconditionError
from tokenserve.kernels import gguf_matmul as gm
from tokenserve.kernels.gguf_packed import unpack_rows
from tokenserve.model.gguf_packing import REPACK_ENV, packed_layers

gguf = pytest.importorskip("gguf")

PROMPTS = ["def add(a, b):", "import os", "class Point:\n    def"]


def load(path, keep_blocks=True):
    from tokenserve.model.gguf import load_gguf

    return load_gguf(path, keep_blocks=keep_blocks)


def engine(model, tokenizer, config):
    from tokenserve.engine.llm import LLM

    return LLM.from_model(model, tokenizer, config, max_num_seqs=4, max_num_batched_tokens=16,
                          block_size=4, kv_cache_dtype="float32")


def blocks_by_layer(model) -> dict[str, list[np.ndarray]]:
    return {f"block_{i}/{name}": [v.numpy() for v in layer.kernel_blocks]
            for i, block in enumerate(model.blocks)
            for name, layer in (("qkv", block.attn.qkv), ("out", block.attn.out),
                                ("up", block.mlp.up), ("down", block.mlp.down))}


@pytest.fixture(scope="module")
def compiled():
    if not gm.reads_packed_faster():
        pytest.skip(f"the GGUF op has no SIMD kernels here: {gm.kernel_status()}")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0"])
def test_engine_repacks_in_place_and_decodes_as_the_model(compiled, qtype, tokenizer, tmp_path,
                                                          caplog):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer, qtype,
                           types={"token_embd.weight": "Q8_0"})
    model, tok, config = load(path)
    before = blocks_by_layer(model)
    with caplog.at_level(logging.INFO, logger="tokenserve.model.gguf_packing"):
        llm = engine(model, tok, config)
    assert "repacked into 8-row tiles" in caplog.text
    packed = f"{qtype.lower()}x8"
    for block in model.blocks:
        for layer in (block.attn.qkv, block.attn.out, block.mlp.up, block.mlp.down):
            assert layer.block_types == [packed]
    after = blocks_by_layer(model)
    for name, parts in before.items():  # the file's rows, moved into tiles in place
        for old, new in zip(parts, after[name]):
            assert new.shape == old.shape and not np.array_equal(new, old)
            np.testing.assert_array_equal(unpack_rows(new, packed).numpy(), old)
    assert model.token_embedding_blocks.numpy().shape[0] == config.model.vocab_size

    from tokenserve.sampling import SamplingParams

    reference = load(path, keep_blocks=False)[0]
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True),
                           use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        ids, tokens = llm.tokenizer.encode(prompt), out.outputs[0].token_ids
        assert tokens == greedy_by_full_forward(model, ids, 10)  # the model reads its tiles
        assert_greedy_up_to_near_ties(reference, ids, tokens, 0.03)


def test_repacking_can_be_turned_off(compiled, tokenizer, tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer, "Q4_1")
    model, tok, config = load(path)
    before = blocks_by_layer(model)
    monkeypatch.setenv(REPACK_ENV, "off")
    engine(model, tok, config)
    assert packed_layers(model) == []
    for name, parts in blocks_by_layer(model).items():
        for old, new in zip(before[name], parts):
            np.testing.assert_array_equal(new, old)


def test_the_export_keeps_the_files_rows_and_a_repacked_model_is_not_exported(
        compiled, tokenizer, tmp_path):
    import tensorflow as tf

    from tokenserve.engine.llm import LLM
    from tokenserve.export.exporter import export_model

    path = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer, "Q4_0")
    model, tok, config = load(path)
    version_dir = export_model(model, tok, config, tmp_path / "m")
    llm = LLM(version_dir, max_num_seqs=2, block_size=4)
    assert len(packed_layers(llm.engine.runner.model)) == 2 * 4
    checkpoint = tf.train.load_checkpoint(str(version_dir / "variables" / "variables"))
    stored = [checkpoint.get_tensor(name) for name, dtype
              in checkpoint.get_variable_to_dtype_map().items() if dtype == tf.uint8]
    file = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    down = file["blk.1.ffn_down.weight"]
    assert any(value.shape == down.shape and np.array_equal(value, down) for value in stored)
    with pytest.raises(FailedPreconditionError, match="repacked in memory"):
        export_model(llm.engine.runner.model, tok, config, tmp_path / "again")
