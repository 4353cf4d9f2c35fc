"""Writes a versioned SavedModel: BASE_PATH/<next version>/{saved_model.pb, variables,
assets, assets.extra}, the layout TF Serving polls for."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

import tensorflow as tf

from tokenserve.config import GenerationConfig
from tokenserve.export.module import GenerationModule, buckets
from tokenserve.export.warmup_records import warmup_records, write_warmup
from tokenserve.errors import FailedPreconditionError
from tokenserve.model.base import DecoderLM
from tokenserve.model.gguf_packing import packed_layers
from tokenserve.model.layers import portable_graphs
from tokenserve.model.tokenizer import Tokenizer

GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"


def version_dirs(base_path: Path) -> list[int]:
    """Numeric version directories under base_path, ascending."""
    if not base_path.is_dir():
        return []
    return sorted(int(p.name) for p in base_path.iterdir() if p.is_dir() and p.name.isdigit())


def next_version(base_path: Path) -> int:
    versions = version_dirs(base_path)
    return versions[-1] + 1 if versions else 1


@contextlib.contextmanager
def staged_version(base_path: str | Path, version: int | None = None):
    """Yields (staging dir, version dir) for a new version under `base_path` (default: the
    next number). Write the version into the staging dir (not created yet); when the block
    ends without an error it is renamed into place, so the version directory appears
    atomically and a server polling `base_path` never loads a half-written one."""
    base_path = Path(base_path)
    base_path.mkdir(parents=True, exist_ok=True)
    version = version or next_version(base_path)
    final = base_path / str(version)
    if final.exists():
        raise FileExistsError(f"version {version} already exists in {base_path}")
    staging = base_path / f".tmp-{version}-{int(time.time() * 1000)}"
    try:
        yield staging, final
        staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def export_model(model: DecoderLM, tokenizer: Tokenizer, config: GenerationConfig,
                 base_path: str | Path, jit_compile: bool = True, version: int | None = None,
                 model_name: str | None = None) -> Path:
    """Exports `model` as BASE_PATH/<version>/ and returns that directory.

    The version directory appears atomically (written under a hidden name, then
    renamed), so a server polling BASE_PATH never loads a half-written version.
    """
    if packed := packed_layers(model):
        raise FailedPreconditionError(
            f"{len(packed)} GGUF layers of this model ({packed[0]}, ...) were repacked in "
            f"memory for an engine's decode kernel; export the model before serving it, or "
            f"load it again")
    with staged_version(base_path, version) as (staging, final):
        with portable_graphs():  # loads in stock TensorFlow and TF Serving
            module = GenerationModule(model, config, jit_compile=jit_compile)
            tf.saved_model.save(module, str(staging), signatures=module.signatures())
        assets = staging / "assets"
        assets.mkdir(exist_ok=True)
        tokenizer.save(assets / TOKENIZER_FILE)
        exported = dict(config.to_dict(), jit_compile=jit_compile,
                        cache_buckets=module.cache_buckets)
        (assets / GENERATION_CONFIG_FILE).write_text(json.dumps(exported, indent=2) + "\n")
        sample_ids = tokenizer.encode("def main():\n    return 0\n") or [config.bos_token_id]
        prompt_buckets = [b for b in buckets(config.max_seq_len) if b <= 64]
        write_warmup(staging, warmup_records(model_name or config.name, sample_ids,
                                             prompt_buckets, config.pad_token_id))
    return final
