"""The built-in and packaged models, exported once into the user cache.

`tokenserve serve`, `generate` and `eval` serve these by name; the first run exports them
(seconds for the built-in model, about 2 minutes for SmolLM2), later runs find the export.

A server asks for the export in a child process (`in_child=True`): building, tracing and
saving a model leaves hundreds of MB in the exporting process's heap (the built-in model's
first `serve` held 827 MB after a burst against 540 MB on later starts), which a long-lived
server should not carry. One-shot commands (`generate`, `eval`) export in process.
"""

from __future__ import annotations

import fcntl
import hashlib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tokenserve.export.exporter import export_model, version_dirs
from tokenserve.host.user_cache import cache_dir
from tokenserve.model.checkpoint import (BUILTIN_DIR, BUILTIN_NAMES, DEFAULT_SOURCE,
                                         PACKAGED_GGUF, load_source, packaged_gguf)


_GRAPH_SOURCES = ("export", "model")
"""The packages whose code decides what an export's graph computes."""


def exporter_fingerprint(package_dir: Path = Path(__file__).resolve().parent.parent) -> str:
    """A hash of the code that writes an export's graph (every .py under `_GRAPH_SOURCES` but
    this file, which only says where exports go), part of each cache key: after an upgrade
    that changes the graph (a new check in a signature, a fixed op), the next run exports
    afresh instead of serving the old graph."""
    digest = hashlib.sha256()
    for package in _GRAPH_SOURCES:
        for path in sorted((package_dir / package).rglob("*.py")):
            relative = path.relative_to(package_dir).as_posix()
            if relative == "export/cached_exports.py":
                continue
            digest.update(relative.encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _export_in_child(kind: str, source: str) -> None:
    """Runs this module's main() for (kind, source) in a child process; raises RuntimeError
    when it fails (its own error went to stderr)."""
    done = subprocess.run([sys.executable, "-m", __name__, kind, source])
    if done.returncode != 0:
        raise RuntimeError(f"exporting the {source} model failed "
                           f"(exit status {done.returncode}; its error is above)")


def _export_once(base: Path, export: Callable[[], None]) -> None:
    """Runs `export` (which writes a version under `base`) unless a version is there. An
    exclusive lock beside `base` makes processes that start at once on a cold cache (test
    workers, replicas of the local cluster) export once: the others wait, then find it."""
    if version_dirs(base):
        return
    base.parent.mkdir(parents=True, exist_ok=True)
    with open(base.parent / f".{base.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not version_dirs(base):
            export()


def builtin_export(source: str = DEFAULT_SOURCE, in_child: bool = False) -> Path:
    """The built-in model exported once into the user cache; returns its base path.

    Keyed by a hash of the shipped weights and the exporter's code, so new weights or a
    changed graph get a fresh export. With `in_child`, a missing export is made by a child
    process.
    """
    family = BUILTIN_NAMES[source]
    weights = (BUILTIN_DIR / f"{family}.safetensors").read_bytes()
    digest = hashlib.sha256(weights + exporter_fingerprint().encode()).hexdigest()
    base = cache_dir(f"builtin-{family}-{digest[:12]}")
    if not version_dirs(base) and in_child:
        _export_in_child("builtin", source)

    def export() -> None:
        print(f"exporting the built-in {family} model to {base} (once for these weights "
              f"and this exporter)",
              file=sys.stderr)
        model, tokenizer, config = load_source(source)
        export_model(model, tokenizer, config, base)

    _export_once(base, export)
    return base


def packaged_export(source: str, in_child: bool = False) -> Path:
    """A PACKAGED_GGUF model exported once into the user cache; returns its base path.

    Keyed by the file's size and modification time and the exporter's code, so a new
    package or a changed graph gets a fresh export. With `in_child`, a missing export is made
    by a child process.
    """
    path = packaged_gguf(source)
    stat = path.stat()
    key = hashlib.sha256(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}:"
                         f"{PACKAGED_GGUF[source][2]}:{exporter_fingerprint()}".encode()
                         ).hexdigest()
    base = cache_dir(f"{source}-{key[:12]}")
    if not version_dirs(base) and in_child:
        _export_in_child("packaged", source)

    def export() -> None:
        print(f"importing {path.name} and exporting it to {base} (once for these weights "
              f"and this exporter)",
              file=sys.stderr)
        # the file's quantized blocks as stored, as `tokenserve export --from-gguf` keeps them
        model, tokenizer, config = load_source(source, keep_blocks=True)
        export_model(model, tokenizer, config, base, model_name=source)

    _export_once(base, export)
    return base


def packaged_encoder_export(source: str, in_child: bool = False) -> Path:
    """A PACKAGED_ENCODERS model (e.g. minilm) exported once into the user cache; returns its
    base path. Keyed as packaged_export is: the zip's size and modification time, the
    exporter's code."""
    from tokenserve.model.encoder_packages import packaged_encoder_zip

    archive = packaged_encoder_zip(source)
    stat = archive.stat()
    key = hashlib.sha256(f"{archive.name}:{stat.st_size}:{stat.st_mtime_ns}:"
                         f"{exporter_fingerprint()}".encode()).hexdigest()
    base = cache_dir(f"{source}-{key[:12]}")
    if not version_dirs(base) and in_child:
        _export_in_child("encoder", source)

    def export() -> None:
        from tokenserve.export.encoder_export import export_encoder
        from tokenserve.model.encoder_hf import load_hf_encoder
        from tokenserve.model.encoder_packages import packaged_encoder_dir

        print(f"importing {source} from {archive.name} and exporting it to {base} (once for "
              f"this package and this exporter)", file=sys.stderr)
        encoder, tokenizer, config = load_hf_encoder(packaged_encoder_dir(source), name=source)
        export_encoder(encoder, tokenizer, config, base)

    _export_once(base, export)
    return base


_EXPORTS = {"builtin": builtin_export, "packaged": packaged_export,
            "encoder": packaged_encoder_export}


def main(argv: list[str] | None = None) -> int:
    """`python -m tokenserve.export.cached_exports builtin|packaged|encoder SOURCE`: makes the
    export if it is missing (the child process of `in_child=True`)."""
    kind, source = argv if argv is not None else sys.argv[1:]
    _EXPORTS[kind](source)
    return 0


if __name__ == "__main__":
    sys.exit(main())
