"""The built-in and packaged models, exported once into the user cache.

`tokenserve serve`, `generate` and `eval` serve these by name; the first run exports them
(seconds for the built-in model, about 2 minutes for SmolLM2), later runs find the export.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from tokenserve.export.exporter import export_model, version_dirs
from tokenserve.model.checkpoint import (BUILTIN_DIR, BUILTIN_NAMES, DEFAULT_SOURCE,
                                         PACKAGED_GGUF, load_source, packaged_gguf)
from tokenserve.user_cache import cache_dir


def builtin_export(source: str = DEFAULT_SOURCE) -> Path:
    """The built-in model exported once into the user cache; returns its base path.

    Keyed by a hash of the shipped weights, so new weights get a fresh export.
    """
    family = BUILTIN_NAMES[source]
    digest = hashlib.sha256((BUILTIN_DIR / f"{family}.safetensors").read_bytes()).hexdigest()
    base = cache_dir(f"builtin-{family}-{digest[:12]}")
    if not version_dirs(base):
        print(f"exporting the built-in {family} model to {base} (first run only)",
              file=sys.stderr)
        model, tokenizer, config = load_source(source)
        export_model(model, tokenizer, config, base)
    return base


def packaged_export(source: str) -> Path:
    """A PACKAGED_GGUF model exported once into the user cache; returns its base path.

    Keyed by the file's size and modification time, so a new package gets a fresh export.
    """
    path = packaged_gguf(source)
    stat = path.stat()
    key = hashlib.sha256(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}:"
                         f"{PACKAGED_GGUF[source][2]}".encode()).hexdigest()
    base = cache_dir(f"{source}-{key[:12]}")
    if not version_dirs(base):
        print(f"importing {path.name} and exporting it to {base} (first run only)",
              file=sys.stderr)
        model, tokenizer, config = load_source(source)
        export_model(model, tokenizer, config, base, model_name=source)
    return base
