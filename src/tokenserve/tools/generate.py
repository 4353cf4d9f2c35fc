"""Generation through an export's own signatures, one sequence at a time, outside the engine.

`ExportedModel` runs a SavedModel's `init_state`/`prefill`/`decode` signatures (what `tokenserve
generate` runs, and what stock TensorFlow can run); `edge.runner.LiteRTModel` does the same
for a .tflite export. Both pick tokens with the engine's sampler (`token_stream.sample_tokens`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import tensorflow as tf
from tokenizers import Tokenizer as HFTokenizer

from tokenserve.config import GenerationConfig
from tokenserve.errors import ModelLoadError, PromptTooLongError
from tokenserve.export.exporter import GENERATION_CONFIG_FILE, TOKENIZER_FILE
from tokenserve.export.module import buckets
from tokenserve.export.restore import resolve_version_dir
from tokenserve.model.tokenizer import Tokenizer
from tokenserve.sampling import SamplingParams
from tokenserve.tools.token_stream import sample_tokens


def _bucket(size: int, limit: int) -> int:
    return next(b for b in buckets(limit) if b >= size)


class ExportedModel:
    """An exported tokenserve SavedModel, ready to generate.

    Example:
        >>> model = ExportedModel("models/builtin")          # base path or version dir
        >>> ids = model.tokenizer.encode("def read_config(path):")
        >>> text = model.tokenizer.decode(model.stream(ids, SamplingParams(max_tokens=32)))
    """

    def __init__(self, path: str | Path):
        self.path = resolve_version_dir(path)
        assets = self.path / "assets"
        try:
            self.config = GenerationConfig.from_dict(
                json.loads((assets / GENERATION_CONFIG_FILE).read_text()))
            self.tokenizer = Tokenizer(
                HFTokenizer.from_file(str(assets / TOKENIZER_FILE)),
                bos_token_id=self.config.bos_token_id, eos_token_id=self.config.eos_token_id,
                pad_token_id=self.config.pad_token_id, add_bos=self.config.add_bos_token)
            self.saved_model = tf.saved_model.load(str(self.path))
            self.signatures = self.saved_model.signatures
            for name in ("init_state", "prefill", "decode", "generate", "serving_default"):
                if name not in self.signatures:
                    raise ModelLoadError(f"{self.path} has no {name!r} signature")
        except ModelLoadError:
            raise
        except Exception as error:  # corrupt protobuf, missing files, bad JSON ...
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise ModelLoadError(f"cannot load model from {self.path}: "
                                 f"{type(error).__name__}: {first_line}") from error

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if num_prompt_tokens + max_tokens > self.max_seq_len:
            raise PromptTooLongError(
                f"prompt of {num_prompt_tokens} tokens plus max_tokens {max_tokens} exceeds "
                f"the model's context length of {self.max_seq_len} tokens")

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        """Yields generated token ids one at a time (prefill once, then decode per token)."""
        if not prompt_ids:
            prompt_ids = [self.config.bos_token_id]
        length = len(prompt_ids)
        self.check_fits(length, params.max_tokens)
        cache_len = _bucket(length + params.max_tokens, self.max_seq_len)
        padded = np.full([1, min(_bucket(length, self.max_seq_len), cache_len)],
                         self.config.pad_token_id, np.int32)
        padded[0, :length] = prompt_ids
        state = self.signatures["init_state"](batch_size=tf.constant(1),
                                              max_len=tf.constant(cache_len))["state"]
        out = self.signatures["prefill"](token_ids=tf.constant(padded),
                                         positions=tf.zeros([1], tf.int32),
                                         num_tokens=tf.constant([length], tf.int32), state=state)

        def decode(token: int, position: int) -> np.ndarray:
            nonlocal out
            out = self.signatures["decode"](token_ids=tf.constant([[token]], tf.int32),
                                            positions=tf.constant([position], tf.int32),
                                            state=out["state"])
            return out["logits"].numpy()[0]

        yield from sample_tokens(out["logits"].numpy()[0], decode, params, prompt_ids,
                                 self.config.model.vocab_size, self.config.eos_token_id)
