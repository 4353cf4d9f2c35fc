"""EncoderRunner: an encoder export's signature function, run on padded NumPy batches. The
only TensorFlow under the encoder batcher (engine/encoder_batcher.py), as runner.py is the
only TensorFlow under the generation engine."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import tensorflow as tf

from tokenserve.encoder_config import EncoderConfig, EncoderTask
from tokenserve.errors import ModelNotFoundError
from tokenserve.export.encoder_export import read_encoder_config
from tokenserve.export.exporter import TOKENIZER_FILE, version_dirs
from tokenserve.model.encoder_tokenizer import EncoderTokenizer


class EncoderRunner:
    """Runs one encoder version: `run(ids, mask, types)` -> embeddings [B, D] or scores [B].

    Example:
        >>> runner, tokenizer = EncoderRunner.from_model_dir("models/minilm/1")
        >>> runner.run(ids, mask, np.zeros_like(ids))   # ids, mask: [B, T] int32
    """

    def __init__(self, function, config: EncoderConfig):
        self.function = function
        self.config = config
        self.weights_bytes = 0

    @classmethod
    def from_model_dir(cls, path: str | Path) -> tuple["EncoderRunner", EncoderTokenizer]:
        """The runner and tokenizer of a version dir (or a base path's newest version)."""
        path = Path(path)
        versions = version_dirs(path)
        if versions and not (path / "saved_model.pb").exists():
            path = path / str(versions[-1])
        if not (path / "saved_model.pb").exists():
            raise ModelNotFoundError(f"{path} holds no SavedModel")
        config = read_encoder_config(path)
        loaded = tf.saved_model.load(str(path))
        # the restored tf.function, not the signature: no dict of named outputs to unpack
        function = loaded.score if config.task is EncoderTask.SCORE else loaded.embed
        runner = cls(function, config)
        runner.loaded = loaded  # keeps the variables the function reads alive
        # the checkpoint's size: the restored object lists no variables of its own
        runner.weights_bytes = sum(p.stat().st_size for p in (path / "variables").iterdir())
        return runner, EncoderTokenizer.load(path / "assets" / TOKENIZER_FILE)

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray,
            token_type_ids: np.ndarray) -> np.ndarray:
        """[B, T] int32 arrays -> float32 embeddings [B, D] (embed) or scores [B] (score)."""
        if self.config.task is EncoderTask.SCORE:
            return self.function(input_ids, attention_mask, token_type_ids)["scores"].numpy()
        return self.function(input_ids, attention_mask)["embeddings"].numpy()

    def warm_up(self) -> float:
        """Runs one small batch (the first call builds the function's kernels); seconds."""
        started = time.perf_counter()
        ids = np.full((2, 4), self.config.pad_token_id, np.int32)
        self.run(ids, np.ones_like(ids), np.zeros_like(ids))
        return time.perf_counter() - started

    def memory_bytes(self) -> dict[str, int]:
        return {"weights": self.weights_bytes}
