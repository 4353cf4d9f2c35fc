"""EncoderRunner: an encoder export's signature function, run on padded NumPy batches. The
only TensorFlow under the encoder batcher (engine/encoder_batcher.py), as runner.py is the
only TensorFlow under the generation engine.

Each batch is padded to a (rows, length) bucket (encoder_shapes.py) and runs an XLA program
compiled for that shape: XLA fuses the many small ops of a BERT block, 1.6-2.5x the plain
graph's sentences/s at 8 or 32 rows on a busy 2-core AVX2 VM (MiniLM, 16 and 32 tokens). A few shapes
are compiled at warm-up; others on first use."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import tensorflow as tf

from tokenserve.encoder_config import EncoderConfig, EncoderTask
from tokenserve.engine.encoder_shapes import (MIN_LENGTH_BUCKET, length_bucket, row_bucket,
                                              row_buckets)
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

    def __init__(self, function, config: EncoderConfig, max_rows: int = 32,
                 jit_compile: bool = True):
        self.config, self.max_rows = config, max_rows
        self.weights_bytes = 0
        self.restored, self.jit_compile = function, jit_compile
        self.programs: dict[tuple[int, int], tf.types.experimental.ConcreteFunction] = {}
        """(rows, length) -> its program, traced once (a concrete function per shape: a
        shape is never traced again, and TensorFlow does not warn about retracing, which here
        is the design)."""

    @classmethod
    def from_model_dir(cls, path: str | Path, max_rows: int = 32
                       ) -> tuple["EncoderRunner", EncoderTokenizer]:
        """The runner and tokenizer of a version dir (or a base path's newest version), for
        batches of up to `max_rows` inputs."""
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
        runner = cls(function, config, max_rows)
        runner.loaded = loaded  # keeps the variables the function reads alive
        # the checkpoint's size: the restored object lists no variables of its own
        runner.weights_bytes = sum(p.stat().st_size for p in (path / "variables").iterdir())
        return runner, EncoderTokenizer.load(path / "assets" / TOKENIZER_FILE)

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray,
            token_type_ids: np.ndarray) -> np.ndarray:
        """[B, T] int32 arrays -> float32 embeddings [B, D] (embed) or scores [B] (score)."""
        num_rows, length = input_ids.shape
        pad = ((0, row_bucket(num_rows, self.max_rows) - num_rows),
               (0, length_bucket(length, self.config.max_seq_len) - length))
        # padded rows have an all-zero mask: their (discarded) outputs stay finite
        ids = np.pad(input_ids, pad, constant_values=self.config.pad_token_id)
        mask, types = np.pad(attention_mask, pad), np.pad(token_type_ids, pad)
        program = self._program(ids.shape)
        if self.config.task is EncoderTask.SCORE:
            return program(ids, mask, types)["scores"].numpy()[:num_rows]
        return program(ids, mask)["embeddings"].numpy()[:num_rows]

    def _program(self, shape: tuple[int, int]):
        """The concrete program of one padded shape, traced (and compiled) once."""
        program = self.programs.get(shape)
        if program is None:
            restored = self.restored
            spec = tf.TensorSpec(shape, tf.int32)
            specs = [spec] * (3 if self.config.task is EncoderTask.SCORE else 2)
            # wrapped: tf.function of a restored function alone returns it, without XLA
            program = tf.function(lambda *inputs: restored(*inputs),
                                  jit_compile=self.jit_compile).get_concrete_function(*specs)
            self.programs[shape] = program
        return program

    def warm_up(self) -> float:
        """Compiles the programs one-sentence traffic meets (lengths 16, 24 and 32, every row
        bucket); returns the seconds it took. Longer inputs' shapes compile on first use
        (1-4 s each for MiniLM on a busy 2-core VM)."""
        started = time.perf_counter()
        for length in (MIN_LENGTH_BUCKET, 24, 32):
            if length > self.config.max_seq_len:
                break
            for num_rows in row_buckets(self.max_rows):
                ids = np.full((num_rows, length), self.config.pad_token_id, np.int32)
                self.run(ids, np.ones_like(ids), np.zeros_like(ids))
        return time.perf_counter() - started

    def memory_bytes(self) -> dict[str, int]:
        return {"weights": self.weights_bytes}
