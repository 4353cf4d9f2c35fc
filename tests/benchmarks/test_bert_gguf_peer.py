"""The llama.cpp peer of the embeddings benchmark runs the model tokenserve serves:
benchmarks/peers/bert_gguf.py writes the packaged all-MiniLM-L6-v2 as llama.cpp's "bert",
and reading the file back gives the same weights, the metadata llama.cpp's BERT graph needs,
and a vocabulary that llama.cpp's WordPiece lookup (each word with a leading U+2581, its
continuations without) turns into the token ids the model's own tokenizer makes."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from support.paths import REPO_ROOT

CONVERTER = REPO_ROOT / "benchmarks" / "peers" / "bert_gguf.py"


def _converter():
    spec = importlib.util.spec_from_file_location("bert_gguf", CONVERTER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wordpiece(tokens: list[str], words: list[str]) -> list[int]:
    """llama.cpp's WPM lookup, greedy longest match, on already split lowercase words."""
    index = {token: i for i, token in enumerate(tokens)}
    ids = []
    for word in words:
        text, start = "\u2581" + word, 0
        while start < len(text):
            end = len(text)
            while end > start and text[start:end] not in index:
                end -= 1
            assert end > start, f"no piece for {text[start:]!r}"
            ids.append(index[text[start:end]])
            start = end
    return ids


def test_minilm_gguf_holds_the_served_weights_and_tokenizer(tmp_path):
    gguf = pytest.importorskip("gguf")
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    from tokenserve.model.encoder_packages import packaged_encoder_dir

    folder = packaged_encoder_dir("minilm")
    assert _converter().main(["--output-dir", str(tmp_path), "--types", "f32"]) == 0
    reader = gguf.GGUFReader(tmp_path / "minilm-f32.gguf")

    def field(name):
        return reader.fields[name].contents()

    assert field("general.architecture") == "bert"
    assert field("bert.pooling_type") == gguf.PoolingType.MEAN
    assert field("bert.attention.causal") is False
    assert field("tokenizer.ggml.model") == "bert"
    assert field("tokenizer.ggml.bos_token_id") == 101  # [CLS]
    assert field("tokenizer.ggml.seperator_token_id") == 102  # [SEP] (gguf's spelling)

    config = json.loads((folder / "config.json").read_text())
    tensors = {t.name: t for t in reader.tensors}
    # three tables and their LayerNorm, 8 weights and 8 biases a block; no pooler head
    assert len(tensors) == 5 + 16 * config["num_hidden_layers"]
    weights = load_file(str(folder / "model.safetensors"))
    for ours, theirs in (("embeddings.word_embeddings.weight", "token_embd.weight"),
                         ("encoder.layer.5.attention.self.key.weight", "blk.5.attn_k.weight"),
                         ("encoder.layer.0.output.dense.weight", "blk.0.ffn_down.weight")):
        np.testing.assert_array_equal(
            np.asarray(tensors[theirs].data).reshape(weights[ours].shape), weights[ours])

    tokens = field("tokenizer.ggml.tokens")
    text = "Servers answer unbelievably many requests, batching embeddings."
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    expected = tokenizer.encode(text)
    words = ["servers", "answer", "unbelievably", "many", "requests", ",", "batching",
             "embeddings", "."]
    assert [101, *_wordpiece(tokens, words), 102] == expected.ids
