"""The llama.cpp peer of the headline benchmark runs the model tokenserve serves:
benchmarks/peers/gpt2_gguf.py writes an export's weights and tokenizer as GGUF, and reading
the file back (with tokenserve's GGUF importer, itself checked against transformers in
test_gguf.py) gives the same logits, exactly in f32 and closely in q8_0, and the same
token ids."""

from __future__ import annotations

import importlib.util

import numpy as np

from support.paths import REPO_ROOT
from support.tiny_models import TINY_TEXT

CONVERTER = REPO_ROOT / "benchmarks" / "peers" / "gpt2_gguf.py"


def _converter():
    spec = importlib.util.spec_from_file_location("gpt2_gguf", CONVERTER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gguf_files_hold_the_served_weights_and_tokenizer(tiny_gpt2_dir, tmp_path):
    from tokenserve.export.restore import load_language_model
    from tokenserve.model.gguf import load_gguf, read_gguf

    assert _converter().main([str(tiny_gpt2_dir), "--output-dir", str(tmp_path)]) == 0
    model, tokenizer, _, _ = load_language_model(tiny_gpt2_dir, precision="float32")
    f32, f32_tokenizer, _ = load_gguf(tmp_path / "gpt2-f32.gguf")
    q8, _, _ = load_gguf(tmp_path / "gpt2-q8_0.gguf")

    ids = tokenizer.encode(TINY_TEXT[3])
    assert f32_tokenizer.encode(TINY_TEXT[3]) == ids
    batch = np.asarray([ids], np.int32)
    served = model(batch).numpy()
    np.testing.assert_array_equal(f32(batch).numpy(), served)
    quantized = q8(batch).numpy()
    assert np.abs(quantized - served).max() < 0.05 * np.abs(served).max()
    assert (quantized.argmax(-1) == served.argmax(-1)).mean() >= 0.8

    file = read_gguf(tmp_path / "gpt2-q8_0.gguf")
    vocab = model.config.vocab_size
    assert file.metadata["general.architecture"] == "gpt2"
    # end of text is a padding token the tokenizer never makes: the benchmark ignores EOS
    assert file.metadata["tokenizer.ggml.eos_token_id"] == vocab - 1 > tokenizer.vocab_size
