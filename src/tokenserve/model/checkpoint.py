"""Model sources: what `tokenserve export SOURCE` and `generate` can start from.

A checkpoint is what `tokenserve train` writes: `<name>.json` (a generation
config), `<name>.safetensors` beside it and `tokenizer.json` in the same folder.
The built-in models are such checkpoints, shipped inside the package.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

from tokenserve.cache import cache_dir
from tokenserve.config import PRESETS, GenerationConfig, preset
from tokenserve.errors import ModelNotFoundError, UnknownPresetError

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "builtin"
BUILTIN_NAMES = {"builtin": "transformer", "builtin-transformer": "transformer",
                 "builtin-lstm": "lstm"}
DEFAULT_SOURCE = "builtin"


def load_checkpoint(config_path: str | Path):
    """(model, tokenizer, generation config) from a checkpoint's `<name>.json`."""
    from tokenserve.model import build_model
    from tokenserve.model.tokenizer import Tokenizer
    from tokenserve.model.weights import load_weights

    config_path = Path(config_path)
    weights = config_path.with_suffix(".safetensors")
    tokenizer_path = config_path.parent / "tokenizer.json"
    for needed in (config_path, weights, tokenizer_path):
        if not needed.exists():
            raise ModelNotFoundError(f"checkpoint file {needed} does not exist")
    config = GenerationConfig.from_dict(json.loads(config_path.read_text()))
    model = build_model(config.model)
    load_weights(model, weights)
    return model, Tokenizer.load(tokenizer_path), config


def load_source(source: str | None, seed: int = 0):
    """Resolves SOURCE: a built-in name, a preset (random weights) or a checkpoint json."""
    source = source or DEFAULT_SOURCE
    if source in BUILTIN_NAMES:
        return load_checkpoint(BUILTIN_DIR / f"{BUILTIN_NAMES[source]}.json")
    if source in PRESETS:
        return _random_preset(source, seed)
    path = Path(source)
    if path.is_dir():
        candidates = sorted(p for p in path.glob("*.json") if p.name != "tokenizer.json"
                            and p.with_suffix(".safetensors").exists())
        if candidates:
            return load_checkpoint(candidates[0])
        raise ModelNotFoundError(f"{path} holds no <name>.json with <name>.safetensors")
    if path.suffix == ".json" and path.exists():
        return load_checkpoint(path)
    if path.exists() or "/" in source or source.endswith(".json"):
        raise ModelNotFoundError(f"model source {source} does not exist or is not a checkpoint")
    raise UnknownPresetError(
        f"unknown model source {source!r}; use a checkpoint path, "
        f"{', '.join(sorted(BUILTIN_NAMES))} or a preset ({', '.join(sorted(PRESETS))})")


def _random_preset(name: str, seed: int):
    """A preset architecture with random weights and the built-in tokenizer (for benchmarks)."""
    from tokenserve.model import build_model
    from tokenserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(BUILTIN_DIR / "tokenizer.json")
    architecture = preset(name)
    if architecture.vocab_size < tokenizer.vocab_size:
        architecture = dataclasses.replace(architecture, vocab_size=tokenizer.vocab_size)
    config = GenerationConfig(model=architecture, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, name=name)
    return build_model(architecture, seed=seed), tokenizer, config


def builtin_export(source: str = DEFAULT_SOURCE) -> Path:
    """The built-in model exported once into the user cache; returns its base path.

    Keyed by a hash of the shipped weights, so new weights get a fresh export.
    """
    from tokenserve.export.exporter import export_model, version_dirs

    family = BUILTIN_NAMES[source]
    digest = hashlib.sha256((BUILTIN_DIR / f"{family}.safetensors").read_bytes()).hexdigest()
    base = cache_dir(f"builtin-{family}-{digest[:12]}")
    if not version_dirs(base):
        print(f"exporting the built-in {family} model to {base} (first run only)",
              file=sys.stderr)
        model, tokenizer, config = load_source(source)
        export_model(model, tokenizer, config, base)
    return base
