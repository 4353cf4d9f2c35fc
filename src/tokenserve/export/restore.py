"""Reads a tokenserve export back: its version directory, and its weights into a fresh Keras
model (`load_language_model`, how the engine's runner and `tokenserve eval` load a model).

Generating through the export's own signatures is `tokenserve.tools.generate.ExportedModel`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import tensorflow as tf
from tokenizers import Tokenizer as HFTokenizer

from tokenserve.config import GenerationConfig
from tokenserve.errors import ModelLoadError, ModelNotFoundError
from tokenserve.export.exporter import GENERATION_CONFIG_FILE, TOKENIZER_FILE, version_dirs
from tokenserve.model.tokenizer import Tokenizer

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


def load_language_model(version_dir: str | Path, precision: str = "auto"):
    """(model, tokenizer, generation config, version dir) of an exported tokenserve model,
    its weights restored into a fresh Keras model computing in `precision` (auto: as
    `choose_precision` decides for this CPU and the export's weight format). The engine and
    `tokenserve eval` both load through here, so eval measures what the engine serves."""
    from tokenserve.model.precision import choose_precision
    from tokenserve.model import build_model
    from tokenserve.model.layers import restoring_weights

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
                          eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
                          add_bos=config.add_bos_token)
    weight_format = getattr(config.model, "weight_format", "float")
    dtype, why = choose_precision(precision, weight_format)
    log.info("%s: computing in %s (precision=%s: %s)", version_dir, dtype, precision, why)
    with restoring_weights():  # every weight is overwritten below (or the load fails)
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
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    for weight in model.weights:
        shape = tuple(shapes[keys[weight.path]])
        if shape != tuple(weight.shape):
            raise ModelLoadError(f"weight {weight.path} has shape {shape} in "
                                 f"{version_dir}, the config expects {tuple(weight.shape)}")
    # One RestoreV2 op reads every tensor into TF's own buffers, which the assignments take:
    # reading each through the reader's numpy copy, then converting that to a tensor, took
    # 1.1 s of GPT-2-small's load on a 2-core VM (0.5 s this way).
    names = [keys[weight.path] for weight in model.weights]
    try:
        values = tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=names,
                                      shape_and_slices=[""] * len(names),
                                      dtypes=[dtypes[name] for name in names])
    except tf.errors.OpError as error:  # a truncated or corrupt variables file
        raise ModelLoadError(f"cannot read weights of {version_dir}: {error.message}") from error
    for weight, value in zip(model.weights, values):
        weight.assign(value if value.dtype == weight.dtype else tf.cast(value, weight.dtype))
