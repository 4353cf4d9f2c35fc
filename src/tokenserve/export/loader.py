"""Loads an exported model and streams tokens through its prefill/decode signatures."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import tensorflow as tf
from tokenizers import Tokenizer as HFTokenizer

from tokenserve.config import GenerationConfig
from tokenserve.errors import ModelLoadError, ModelNotFoundError, PromptTooLongError
from tokenserve.export.exporter import GENERATION_CONFIG_FILE, TOKENIZER_FILE, version_dirs
from tokenserve.export.module import buckets
from tokenserve.model.tokenizer import Tokenizer
from tokenserve.sampling import Sampler, SamplingParams

log = logging.getLogger(__name__)


def resolve_version_dir(path: str | Path) -> Path:
    """A version directory, or the newest version under a base path."""
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"model directory {path} does not exist")
    if (path / "saved_model.pb").exists():
        return path
    versions = version_dirs(path)
    if not versions:
        raise ModelNotFoundError(f"{path} holds no saved_model.pb and no numbered version "
                                 f"directories")
    return path / str(versions[-1])


def _bucket(size: int, limit: int) -> int:
    return next(b for b in buckets(limit) if b >= size)


class ExportedModel:
    """An exported tokenserve SavedModel, ready to generate."""

    def __init__(self, path: str | Path):
        self.path = resolve_version_dir(path)
        assets = self.path / "assets"
        try:
            self.config = GenerationConfig.from_dict(
                json.loads((assets / GENERATION_CONFIG_FILE).read_text()))
            self.tokenizer = Tokenizer(
                HFTokenizer.from_file(str(assets / TOKENIZER_FILE)),
                bos_token_id=self.config.bos_token_id, eos_token_id=self.config.eos_token_id,
                pad_token_id=self.config.pad_token_id)
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
        sampler = Sampler(params)
        for step in range(params.max_tokens):
            token = sampler(out["logits"].numpy()[0])
            yield token
            if token == self.config.eos_token_id and not params.ignore_eos:
                return
            if step + 1 == params.max_tokens:
                return
            out = self.signatures["decode"](token_ids=tf.constant([[token]], tf.int32),
                                            positions=tf.constant([length + step], tf.int32),
                                            state=out["state"])


def load_language_model(version_dir: str | Path, precision: str = "auto"):
    """(model, tokenizer, generation config, version dir) of an exported tokenserve model,
    its weights restored into a fresh Keras model computing in `precision` (auto: as
    `choose_precision` decides for this CPU and the export's weight format). The engine and
    `tokenserve eval` both load through here, so eval measures what the engine serves."""
    from tokenserve.engine.runner import choose_precision
    from tokenserve.model import build_model

    version_dir = resolve_version_dir(version_dir)
    assets = version_dir / "assets"
    try:
        config = GenerationConfig.from_dict(
            json.loads((assets / GENERATION_CONFIG_FILE).read_text()))
        hf = HFTokenizer.from_file(str(assets / TOKENIZER_FILE))
    except Exception as error:
        raise ModelLoadError(f"{version_dir} is not a tokenserve language model "
                             f"(no readable assets/{GENERATION_CONFIG_FILE}): {error}"
                             ) from error
    tokenizer = Tokenizer(hf, bos_token_id=config.bos_token_id,
                          eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    weight_format = getattr(config.model, "weight_format", "float")
    dtype, why = choose_precision(precision, weight_format)
    log.info("%s: computing in %s (precision=%s: %s)", version_dir, dtype, precision, why)
    model = build_model(config.model, dtype=dtype)
    restore_weights(model, version_dir)
    return model, tokenizer, config, version_dir


def restore_weights(model, version_dir: str | Path) -> None:
    """Copies an exported SavedModel's weights into a freshly built Keras `model`.

    The SavedModel's object graph records each variable's Keras path as its `full_name`
    ("transformer/block_0/attn/qkv/kernel"), so weights match by name, whatever the
    dtype the new model computes in (values are cast to each variable's dtype).
    """
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    prefix = str(Path(version_dir) / "variables" / "variables")
    try:
        reader = tf.train.load_checkpoint(prefix)
        graph = trackable_object_graph_pb2.TrackableObjectGraph()
        graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    except Exception as error:
        raise ModelLoadError(f"cannot read weights of {version_dir}: {error}") from error
    keys = {attribute.full_name: attribute.checkpoint_key
            for node in graph.nodes for attribute in node.attributes}
    missing = [w.path for w in model.weights if w.path not in keys]
    if missing:
        raise ModelLoadError(f"{version_dir} lacks weights {missing[:3]} "
                             f"({len(missing)} missing); was it exported by tokenserve?")
    for weight in model.weights:
        value = reader.get_tensor(keys[weight.path])
        if tuple(value.shape) != tuple(weight.shape):
            raise ModelLoadError(f"weight {weight.path} has shape {value.shape} in "
                                 f"{version_dir}, the config expects {tuple(weight.shape)}")
        weight.assign(tf.cast(value, weight.dtype))
