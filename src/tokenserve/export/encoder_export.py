"""Writes an encoder as a versioned SavedModel that stock TF Serving loads:
BASE_PATH/<version>/{saved_model.pb, variables, assets/{encoder_config.json, tokenizer.json}}.

Signatures (every tensor [B, T] int32, right-padded; TF Serving's Predict takes them by name):
  embed (and serving_default) of an embedding model:
      input_ids, attention_mask -> embeddings [B, D] (pooled, normalized if configured)
  score (and serving_default) of a cross-encoder:
      input_ids, attention_mask, token_type_ids -> logits [B, num_labels], scores [B] (0..1)
Text goes in through the tokenizer in assets/ (stock TF Serving has no tokenizer ops), or
through tokenserve's /v1/embeddings and /v1/rerank, which tokenize and batch.
"""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf

from tokenserve.encoder_config import ENCODER_CONFIG_FILE, EncoderConfig, EncoderTask
from tokenserve.export.exporter import TOKENIZER_FILE, staged_version
from tokenserve.model.encoder import BertEncoder, relevance_scores
from tokenserve.model.encoder_tokenizer import EncoderTokenizer

_IDS = tf.TensorSpec([None, None], tf.int32, name="input_ids")
_MASK = tf.TensorSpec([None, None], tf.int32, name="attention_mask")
_TYPES = tf.TensorSpec([None, None], tf.int32, name="token_type_ids")


class EncoderModule(tf.Module):
    """The exported object: the encoder's variables and its one signature function."""

    def __init__(self, encoder: BertEncoder):
        super().__init__(name="encoder_module")
        self.encoder = encoder
        # only the task's function: saving traces every function the module holds
        if encoder.config.task is EncoderTask.SCORE:
            self.score = tf.function(self._score, input_signature=[_IDS, _MASK, _TYPES])
        else:
            self.embed = tf.function(self._embed, input_signature=[_IDS, _MASK])

    def _embed(self, input_ids, attention_mask):
        return {"embeddings": self.encoder.embed(input_ids, attention_mask)}

    def _score(self, input_ids, attention_mask, token_type_ids):
        logits = self.encoder.classify(input_ids, attention_mask, token_type_ids)
        return {"logits": logits, "scores": relevance_scores(logits)}

    def signatures(self) -> dict:
        if self.encoder.config.task is EncoderTask.SCORE:
            function = self.score.get_concrete_function()
            return {"score": function, "serving_default": function}
        function = self.embed.get_concrete_function()
        return {"embed": function, "serving_default": function}


def export_encoder(encoder: BertEncoder, tokenizer: EncoderTokenizer, config: EncoderConfig,
                   base_path: str | Path, version: int | None = None) -> Path:
    """Exports `encoder` as BASE_PATH/<version>/ (appearing atomically); returns that dir."""
    with staged_version(base_path, version) as (staging, final):
        module = EncoderModule(encoder)
        tf.saved_model.save(module, str(staging), signatures=module.signatures())
        assets = staging / "assets"
        assets.mkdir(exist_ok=True)
        tokenizer.save(assets / TOKENIZER_FILE)
        (assets / ENCODER_CONFIG_FILE).write_text(config.to_json() + "\n")
    return final


def read_encoder_config(version_dir: str | Path) -> EncoderConfig:
    return EncoderConfig.from_json((Path(version_dir) / "assets" / ENCODER_CONFIG_FILE)
                                   .read_text())
