"""Importing BERT encoders matches sentence-transformers' encode (every pooling, with and
without Normalize) and transformers' cross-encoder logits; exports serve the same numbers
through their signatures; bad folders are refused by name."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from support.tiny_encoders import MAX_SEQ_LEN, write_cross_encoder, write_embedder
from tokenserve.encoder_config import Pooling
from tokenserve.errors import ModelLoadError
from tokenserve.model.encoder_hf import load_hf_encoder
from tokenserve.model.hf import UnsupportedArchitectureError

if os.environ.get("CI"):  # installed by the test extra: a missing one is a broken setup
    import sentence_transformers
    import torch
else:
    torch = pytest.importorskip("torch")
    sentence_transformers = pytest.importorskip("sentence_transformers")

TEXTS = ["def add(a, b): return a + b", "", "ünïcödé 日本語 ✓", "x",
         "for item in items: print(item) " * 20]  # the last is cut at MAX_SEQ_LEN


def padded(encoded: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EncodedInputs -> [B, T] ids, mask and types, right-padded with 0."""
    longest = max(len(e.token_ids) for e in encoded)
    ids, mask, types = (np.zeros((len(encoded), longest), np.int32) for _ in range(3))
    for row, e in enumerate(encoded):
        ids[row, :len(e.token_ids)], mask[row, :len(e.token_ids)] = e.token_ids, 1
        types[row, :len(e.type_ids)] = e.type_ids
    return ids, mask, types


def our_embeddings(folder) -> np.ndarray:
    encoder, tokenizer, config = load_hf_encoder(folder)
    ids, mask, _ = padded([tokenizer.encode(t, config.max_seq_len) for t in TEXTS])
    return encoder.embed(ids, mask).numpy()


@pytest.mark.parametrize("pooling, normalize", [("mean", True), ("cls", False), ("max", True),
                                                ("last", False)])
def test_embeddings_match_sentence_transformers(tmp_path, pooling, normalize):
    folder = write_embedder(tmp_path / "st", pooling, normalize)
    reference = sentence_transformers.SentenceTransformer(str(folder), device="cpu").encode(
        TEXTS, convert_to_numpy=True)
    ours = our_embeddings(folder)
    np.testing.assert_allclose(ours, reference, atol=2e-5)
    norms = np.linalg.norm(ours, axis=-1)
    assert np.allclose(norms, 1.0, atol=1e-5) == normalize


def test_the_long_text_is_cut_at_max_seq_length(tmp_path):
    _, tokenizer, config = load_hf_encoder(write_embedder(tmp_path / "st"))
    assert config.max_seq_len == MAX_SEQ_LEN and config.pooling is Pooling.MEAN
    assert len(tokenizer.encode(TEXTS[-1]).token_ids) > MAX_SEQ_LEN
    cut = tokenizer.encode(TEXTS[-1], MAX_SEQ_LEN).token_ids
    whole = tokenizer.encode(TEXTS[-1]).token_ids
    assert len(cut) == MAX_SEQ_LEN and cut[-1] == whole[-1] and cut[:-1] == whole[:-2][:47]


@pytest.mark.parametrize("num_labels", [1, 3])
def test_cross_encoder_logits_match_transformers(tmp_path, num_labels):
    import transformers

    folder = write_cross_encoder(tmp_path / "ce", num_labels)
    encoder, tokenizer, config = load_hf_encoder(folder)
    assert config.num_labels == num_labels
    pairs = [("what is x", "def add(a, b): return a + b"), ("", "ünïcödé 日本語"),
             ("a much longer query about items " * 3, "x")]
    ids, mask, types = padded([tokenizer.encode_pair(q, d) for q, d in pairs])
    assert types.max() == 1  # the documents' tokens are type 1
    ours = encoder.classify(ids, mask, types).numpy()
    hf = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        reference = hf(input_ids=torch.tensor(ids, dtype=torch.long),
                       attention_mask=torch.tensor(mask, dtype=torch.long),
                       token_type_ids=torch.tensor(types, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, reference, atol=1e-4)


def test_exported_signatures_equal_the_model(tmp_path):
    import tensorflow as tf

    from tokenserve.export.encoder_export import export_encoder

    embedder = load_hf_encoder(write_embedder(tmp_path / "st"))
    scorer = load_hf_encoder(write_cross_encoder(tmp_path / "ce"))
    for (encoder, tokenizer, config), signature in ((embedder, "embed"), (scorer, "score")):
        path = export_encoder(encoder, tokenizer, config, tmp_path / signature)
        loaded = tf.saved_model.load(str(path))
        assert set(loaded.signatures) == {signature, "serving_default"}
        ids, mask, types = padded([tokenizer.encode_pair("q", t) for t in TEXTS[:3]])
        if signature == "embed":
            got = loaded.signatures["embed"](input_ids=ids, attention_mask=mask)["embeddings"]
            np.testing.assert_allclose(got.numpy(), encoder.embed(ids, mask).numpy(), atol=1e-6)
        else:
            got = loaded.signatures["score"](input_ids=ids, attention_mask=mask,
                                             token_type_ids=types)
            logits = encoder.classify(ids, mask, types).numpy()
            np.testing.assert_allclose(got["logits"].numpy(), logits, atol=1e-6)
            np.testing.assert_allclose(got["scores"].numpy(), 1 / (1 + np.exp(-logits[:, 0])),
                                       atol=1e-6)


def test_unsupported_modules_and_missing_tensors_are_named(tmp_path):
    folder = write_embedder(tmp_path / "st")
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps(
        modules + [{"idx": 3, "name": "3", "path": "3_Dense",
                    "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(UnsupportedArchitectureError, match="Dense"):
        load_hf_encoder(folder)
    (folder / "modules.json").write_text(json.dumps(modules))
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    pooling["pooling_mode_cls_token"] = True  # two modes at once: concatenated, not ours
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(UnsupportedArchitectureError, match="pooling"):
        load_hf_encoder(folder)

    from safetensors.numpy import load_file, save_file

    cross = write_cross_encoder(tmp_path / "ce")
    tensors = load_file(cross / "model.safetensors")
    del tensors["classifier.weight"]
    save_file(tensors, cross / "model.safetensors")
    with pytest.raises(ModelLoadError, match="classifier.weight"):
        load_hf_encoder(cross)
