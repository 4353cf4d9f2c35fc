"""`tokenserve serve`'s LoRA flags, vLLM's names: --lora_modules, --max_loras, --max_lora_rank
(and --no_lora_experts)."""

from __future__ import annotations

import argparse
import json

from tokenserve.engine.config import EngineConfig
from tokenserve.errors import ConfigError

DEFAULT_MAX_LORAS = 4
"""Slots when --lora_modules names adapters and --max_loras is not given."""


def add_lora_flags(p) -> None:
    engine = EngineConfig()
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--lora_modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="serve these PEFT adapters (adapter_config.json + "
                        "adapter_model.safetensors), or llama.cpp's GGUF LoRA files "
                        "(PATH ending in .gguf), on the base model, each as the model "
                        "id NAME; also '{\"name\": ..., \"path\": ...}' as vLLM takes them")
    g.add_argument("--max_loras", type=int, default=None,
                   help=f"adapters resident at once (more wait on disk, LRU); default "
                        f"{DEFAULT_MAX_LORAS} with --lora_modules, else {engine.max_loras} "
                        f"(no adapters, and /v1/load_lora_adapter refuses)")
    g.add_argument("--max_lora_rank", type=int, default=engine.max_lora_rank,
                   help="largest adapter rank served")
    g.add_argument("--no_lora_experts", action="store_true",
                   help="on a mixture of experts, serve adapters of the attention only: no "
                        "slot room for the experts', shared expert's and router's factors "
                        "(the load log says what that room costs)")


def parse_lora_modules(entries: list[str]) -> dict[str, str]:
    """name -> path of `--lora_modules` entries (NAME=PATH or vLLM's JSON form)."""
    modules: dict[str, str] = {}
    for entry in entries:
        if entry.lstrip().startswith("{"):
            try:
                found = json.loads(entry)
                name, path = found["name"], found["path"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"--lora_modules entry {entry!r} is not "
                                  f"{{\"name\": ..., \"path\": ...}}") from None
        else:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora_modules entry {entry!r} is not NAME=PATH")
        if name in modules:
            raise ConfigError(f"--lora_modules names adapter {name!r} twice")
        modules[name] = path
    return modules


def lora_engine_options(args: argparse.Namespace) -> dict:
    """EngineConfig fields the LoRA flags set."""
    max_loras = args.max_loras
    if max_loras is None:
        max_loras = DEFAULT_MAX_LORAS if args.lora_modules else 0
    return {"max_loras": max_loras, "max_lora_rank": args.max_lora_rank,
            "lora_experts": not args.no_lora_experts}
