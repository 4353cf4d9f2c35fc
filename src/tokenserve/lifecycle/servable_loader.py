"""Picks the servable class for a version directory (SavedModel Session or TFLite) and builds it."""

from __future__ import annotations

from pathlib import Path

from tokenserve.errors import ModelLoadError
from tokenserve.lifecycle.model_config import ModelSpecConfig
from tokenserve.lifecycle.repository import SAVED_MODEL_FILES, TFLITE_FILE


def load_servable(spec: ModelSpecConfig, version_dir: Path, prefer_tflite: bool = False,
                  tags: tuple[str, ...] = ("serve",), session_options=None,
                  lazy_session: bool = False):
    """A SavedModelServable (a TF1 Session over the MetaGraph tagged `tags`, with the
    thread pools of `session_options`, a lifecycle.session_bundle.SessionOptions), or a
    TFLiteServable when the platform is `tflite` or --prefer_tflite_model is set and the
    directory holds model.tflite. `lazy_session`: the Session (a copy of the weights) is
    built on the first run instead (LazySavedModelServable)."""
    has_tflite = (version_dir / TFLITE_FILE).exists()
    if has_tflite and (prefer_tflite or spec.platform == "tflite"):
        from tokenserve.lifecycle.tflite import TFLiteServable
        return TFLiteServable(version_dir)
    if spec.platform == "tflite":
        raise ModelLoadError(f"{version_dir} holds no {TFLITE_FILE}")
    if not any((version_dir / name).exists() for name in SAVED_MODEL_FILES):
        failure = ModelLoadError(f"Could not find SavedModel .pb or .pbtxt at supplied export "
                                 f"directory path: {version_dir}")
        failure.error_code = "NOT_FOUND"
        raise failure
    from tokenserve.lifecycle.savedmodel import LazySavedModelServable, SavedModelServable
    from tokenserve.lifecycle.session_bundle import SessionOptions
    servable_class = LazySavedModelServable if lazy_session else SavedModelServable
    return servable_class(version_dir, tags, session_options or SessionOptions())
