"""LoRA adapters in PEFT's layout, read into the step's per-layer low-rank factors (no TF).

A PEFT adapter directory holds `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
...) and `adapter_model.safetensors`, whose tensors are named after the torch modules of the
base model, e.g.

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   [out, r]
    base_model.model.transformer.h.3.attn.c_attn.lora_A.weight       (GPT-2)

A module's output gains `scale * x @ A.T @ B.T`, scale = alpha / r (alpha / sqrt(r) with
rslora). Our blocks fuse q/k/v into one `qkv` matrix and gate/up into one `up` matrix, so
the modules of one fused matrix become one factor pair per role: A [in, sum of ranks] (the
modules' A side by side) and B [sum of ranks, out] (block-diagonal, each module's B.T in its
own output columns, the scale folded in). Every check runs here, before anything reaches a
slot: a refused adapter raises a LoraAdapterError subclass (HTTP 400) naming what is wrong.
llama.cpp's GGUF LoRA files are read into the same names first (lora_gguf.py); what a
mixture of experts serves is lora_moe.py's.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tokenserve.config import TransformerConfig
from tokenserve.engine.lora_errors import (LoraAdapterError, LoraBaseMismatchError,  # noqa: F401
                                           LoraNameError, LoraNotFoundError, LoraRankError,
                                           LoraShapeError, LoraTargetError)
from tokenserve.engine.lora_gguf import is_gguf_adapter, read_gguf_adapter
from tokenserve.engine.lora_moe import EXPERT_ROLES, MoeFactors, is_moe_module

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

ROLES = ("qkv", "out", "up", "down")
"""The fused matrices of a block that adapters change, in the step's order."""

# torch module path inside a block -> (role, which part of the role's output)
LLAMA_MODULES = {"self_attn.q_proj": ("qkv", "q"), "self_attn.k_proj": ("qkv", "k"),
                  "self_attn.v_proj": ("qkv", "v"), "self_attn.o_proj": ("out", "all"),
                  "mlp.gate_proj": ("up", "gate"), "mlp.up_proj": ("up", "up"),
                  "mlp.down_proj": ("down", "all")}
PHI3_MODULES = {"self_attn.qkv_proj": ("qkv", "all"), "self_attn.o_proj": ("out", "all"),
                "mlp.gate_up_proj": ("up", "all"), "mlp.down_proj": ("down", "all")}
LLAMA_FAMILY_MODULES = {**LLAMA_MODULES, **PHI3_MODULES}
"""What an adapter of a Llama-family model may target: Llama's modules, and Phi-3's fused
qkv_proj and gate_up_proj (A [r, hidden], B [q + 2 kv or 2 f, r]: the whole of our fused
matrix, in its order q, k, v and gate, up). Where the base's config records its architecture,
only its own kind loads (`check_architecture`); an older export's takes either."""
FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)
"""The architectures whose checkpoints fuse q/k/v into qkv_proj and gate/up into gate_up_proj
(and have no q_proj ... up_proj modules for an adapter to target)."""
_SAME_LAYOUT = {"Mistral": "Llama"}  # one module tree: a GGUF Mistral imports as Llama
GPT2_MODULES = {"attn.c_attn": ("qkv", "all"), "attn.c_proj": ("out", "all"),
                 "mlp.c_fc": ("up", "all"), "mlp.c_proj": ("down", "all")}
_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<stem>transformer\.h|model\.layers|h)\."
                   r"(?P<layer>\d+)\.(?P<module>[\w.]+)\.lora_(?P<side>[AB])(?:\.\w+)?\.weight$")


_load_ids = itertools.count(1)


@dataclass(frozen=True)
class LoraRequest:
    """An adapter as a request names it: its name, its directory, and the load that
    registered it (a name loaded again from another path is another adapter)."""

    name: str
    path: str
    load_id: int

    @classmethod
    def new(cls, name: str, path: str | Path) -> "LoraRequest":
        return cls(name, str(path), next(_load_ids))

    @property
    def cache_key(self) -> str:
        return f"lora:{self.name}#{self.load_id}"


@dataclass(frozen=True)
class LoraWeights:
    """An adapter as the step takes it.

    layers: per layer, role -> (A float32 [in, R], B float32 [R, out]), the scale folded
    into B; a role the adapter leaves alone is absent.
    """

    rank: int
    """The largest module rank."""
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]] = field(repr=False)

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for a, b in layer.values())


def role_columns(config: TransformerConfig) -> dict[str, dict[str, tuple[int, int]]]:
    """role -> part -> (first, end) output columns of our fused matrix."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    f, d = config.intermediate_size, config.hidden_size
    up = 2 * f if config.mlp in ("swiglu", "geglu") else f  # gate and up side by side
    return {"qkv": {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv),
                    "all": (0, q + 2 * kv)},
            "out": {"all": (0, d)}, "up": {"gate": (0, f), "up": (f, 2 * f), "all": (0, up)},
            "down": {"all": (0, d)}}


def role_ranks(config: TransformerConfig, max_rank: int) -> dict[str, int]:
    """role -> its rank in the slot table: `max_rank` per PEFT module of the model's family
    that shares the role (Llama: q/k/v, gate/up; GPT-2's fused c_attn and c_fc: one), so a
    GPT-2 step multiplies no columns that no adapter can fill. A mixture of experts without
    a dense layer has no up or down matrix an adapter may change (lora_moe.py): rank 0, so
    a slot holds no zeros for them (for Qwen3-30B-A3B, 113 of a rank-16 slot's 198 MB)."""
    if config.mlp == "gelu":
        return {role: max_rank for role in ROLES}
    # Llama's separate q/k/v and gate/up (Phi-3's fused qkv_proj and gate_up_proj take one
    # module's rank of them)
    split = {"qkv": 3, "out": 1, "up": 2, "down": 1}
    if all(config.layer_has_experts(i) for i in range(config.num_layers)):
        split.update(up=0, down=0)
    return {role: max_rank * split[role] for role in ROLES}


def role_shapes(config: TransformerConfig) -> dict[str, tuple[int, int]]:
    """role -> (in, out) widths of our fused matrices."""
    columns = role_columns(config)
    ins = {"qkv": config.hidden_size, "out": config.num_heads * config.head_dim,
           "up": config.hidden_size, "down": config.intermediate_size}
    return {role: (ins[role], columns[role]["all"][1]) for role in ROLES}


def read_adapter_config(path: Path) -> dict:
    """adapter_config.json of the adapter directory `path`, with the two files checked."""
    if not path.is_dir():
        raise LoraNotFoundError(f"LoRA adapter directory {str(path)!r} does not exist")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise LoraNotFoundError(f"LoRA adapter {str(path)!r} has no {name}")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as error:
        raise LoraNotFoundError(f"{path / CONFIG_FILE} is not readable JSON: {error}") from None
    if not isinstance(config, dict):
        raise LoraNotFoundError(f"{path / CONFIG_FILE} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoraTargetError(f"adapter type {kind!r} is not LoRA")
    refused = [(key, config[key]) for key in ("use_dora", "modules_to_save", "layer_replication")
               if config.get(key)]
    if config.get("bias", "none") != "none":
        refused.append(("bias", config["bias"]))
    if refused:
        raise LoraTargetError(f"adapter option {refused[0][0]}={refused[0][1]!r} is not "
                              f"supported (plain LoRA on the linear layers only)")
    return config


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError, ValueError) as error:
        raise LoraNotFoundError(f"{path / WEIGHTS_FILE} is not a readable safetensors "
                                f"file: {error}") from None


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: a key matching the module's path's end wins."""
    for key, value in (patterns or {}).items():
        if module == key or module.endswith("." + key) or re.fullmatch(key, module):
            return value
    return default


def family_modules(config: TransformerConfig) -> dict[str, tuple[str, str]]:
    """The modules (torch path inside a block -> (role, part)) that the model's own checkpoint
    has, as PEFT names them: GPT-2's, Phi-3's fused ones, else Llama's."""
    if config.mlp == "gelu":
        return GPT2_MODULES
    return PHI3_MODULES if config.architecture in FUSED_ARCHITECTURES else LLAMA_MODULES


def _stem(architecture: str) -> str:
    """A transformers class name's model part ("Phi3ForCausalLM", "Phi3Model" -> "Phi3"),
    with the architectures of one module tree as one."""
    stem = re.sub(r"(ForCausalLM|LMHeadModel|Model)$", "", architecture)
    return _SAME_LAYOUT.get(stem, stem)


def check_architecture(options: dict, modules: set[str], config: TransformerConfig) -> None:
    """Refuses an adapter that plainly belongs to another architecture than the base's (where
    the base records one): modules only the other kind of checkpoint has (Phi-3's fused
    qkv_proj / gate_up_proj against Llama's separate ones), or the model class PEFT recorded
    when it saved the adapter (`auto_mapping.base_model_class`, present when no task type was
    set). `base_model_name_or_path` is a path or hub id, not an architecture: not read.

    Raises:
        LoraBaseMismatchError: the adapter is another architecture's.
    """
    if not config.architecture:  # an export from before it was recorded, or built here
        return
    fused = {m for m in modules if m in ("self_attn.qkv_proj", "mlp.gate_up_proj")}
    split = {m for m in modules  # o_proj and down_proj: both kinds have them
             if LLAMA_MODULES.get(m, ("", "all"))[1] != "all"}
    base_fused = config.architecture in FUSED_ARCHITECTURES
    if config.mlp != "gelu" and ((fused and not base_fused) or (split and base_fused)):
        found = sorted(split if base_fused else fused)[0]
        raise LoraBaseMismatchError(
            f"adapter targets {found!r}, a module {config.architecture} does not have (an "
            f"adapter for another architecture?)")
    mapping = options.get("auto_mapping")
    declared = mapping.get("base_model_class") if isinstance(mapping, dict) else None
    if isinstance(declared, str) and declared and _stem(declared) != _stem(config.architecture):
        raise LoraBaseMismatchError(
            f"adapter was made for a {declared} (its adapter_config.json's auto_mapping); "
            f"this model is a {config.architecture}")


def load_adapter(path: str | Path, config: TransformerConfig, max_rank: int,
                 experts: bool = True) -> LoraWeights:
    """Reads and checks a PEFT LoRA adapter against the base model `config`; `experts`:
    whether a mixture of experts' experts, shared expert and router may be adapted.

    Raises:
        LoraNotFoundError: a missing directory or file, or one that does not parse.
        LoraRankError: a module rank above `max_rank`.
        LoraTargetError: a module tokenserve does not adapt, or the model lacks.
        LoraShapeError: a factor that does not fit its module.
        LoraBaseMismatchError: another family or architecture, hidden size or layer count.
    """
    path = Path(path)
    if is_gguf_adapter(path):  # llama.cpp's form of the same factors
        options, tensors = read_gguf_adapter(path, config)
    else:
        options = read_adapter_config(path)
        tensors = _read_tensors(path)
    columns = role_columns(config)
    shapes = role_shapes(config)
    factors: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    moe_pairs: dict[tuple[int, str], dict[str, tuple[str, np.ndarray]]] = {}
    for name, value in tensors.items():
        match = _NAME.match(name)
        if match is None:
            raise LoraTargetError(f"adapter tensor {name!r} is not a LoRA factor of a "
                                  f"transformer block's linear layer")
        gpt2 = match["stem"] != "model.layers"
        modules = GPT2_MODULES if gpt2 else LLAMA_FAMILY_MODULES
        layer = int(match["layer"])
        if config.num_experts and is_moe_module(match["module"]):
            if layer >= config.num_layers:
                raise LoraBaseMismatchError(f"adapter changes layer {layer}; the model has "
                                            f"{config.num_layers} layers (another base model?)")
            if not experts:
                raise LoraTargetError(f"adapter tensor {name!r} targets {match['module']!r}, "
                                      f"part of a mixture of experts, and this server holds "
                                      f"no slots for them (--no_lora_experts)")
            moe_pairs.setdefault((layer, match["module"]), {})[match["side"]] = (name, value)
            continue
        if (config.num_experts and modules.get(match["module"], ("",))[0] in ("up", "down")
                and config.layer_has_experts(layer)):
            raise LoraTargetError(f"adapter tensor {name!r} targets {match['module']!r}, but "
                                  f"layer {layer}'s MLP is a mixture of experts without that "
                                  f"module (an adapter for a dense model?)")
        if match["module"] not in modules:
            raise LoraTargetError(f"adapter tensor {name!r} targets {match['module']!r}, "
                                  f"which tokenserve does not adapt (targets: "
                                  f"{', '.join(sorted(modules))})")
        if gpt2 != (config.mlp == "gelu"):
            raise LoraBaseMismatchError(
                f"adapter tensor {name!r} is for a {'GPT-2' if gpt2 else 'Llama-family'} "
                f"model; this model is {'GPT-2' if config.mlp == 'gelu' else 'Llama-family'}")
        if layer >= config.num_layers:
            raise LoraBaseMismatchError(f"adapter changes layer {layer}; the model has "
                                        f"{config.num_layers} layers (another base model?)")
        if value.ndim != 2:
            raise LoraShapeError(f"adapter tensor {name!r} has shape {value.shape}, not 2-D")
        factors.setdefault((layer, match["module"]), {})[match["side"]] = value
    if not factors and not moe_pairs:
        raise LoraTargetError(f"{path if is_gguf_adapter(path) else path / WEIGHTS_FILE} "
                              f"holds no LoRA factors")
    check_architecture(options, {module for _, module in factors}, config)

    layers: list[dict] = [{} for _ in range(config.num_layers)]
    parts: dict[tuple[int, str], list] = {}
    rank = 0
    for (layer, module), pair in sorted(factors.items()):
        if set(pair) != {"A", "B"}:
            raise LoraShapeError(f"layer {layer} {module} has lora_{next(iter(pair))} but "
                                 f"not its other factor")
        a, b = pair["A"], pair["B"]                                        # [r, in], [out, r]
        role, part = (GPT2_MODULES if config.mlp == "gelu" else LLAMA_FAMILY_MODULES)[module]
        first, end = columns[role][part]
        width_in = shapes[role][0]
        r = a.shape[0]
        if r > max_rank:
            raise LoraRankError(f"adapter rank {r} (layer {layer} {module}) is above "
                                f"--max_lora_rank {max_rank}")
        # the hidden size is the input of qkv and up, the output of out and down
        hidden = a.shape[1] if role in ("qkv", "up") else b.shape[0]
        if hidden != config.hidden_size:
            raise LoraBaseMismatchError(
                f"adapter's hidden size is {hidden} (layer {layer} {module}); the "
                f"model's is {config.hidden_size} (another base model?)")
        if a.shape[1] != width_in or b.shape != (end - first, r):
            raise LoraShapeError(
                f"layer {layer} {module}: lora_A {a.shape} and lora_B {b.shape} do not fit "
                f"[{r}, {width_in}] and [{end - first}, {r}]")
        scale = _scale(options, f"model.layers.{layer}.{module}", r)
        parts.setdefault((layer, role), []).append(
            (first, end, a.astype(np.float32), b.astype(np.float32), scale))
        rank = max(rank, r)
    for (layer, role), pieces in parts.items():
        layers[layer][role] = fuse_role(pieces, shapes[role][1])
    if moe_pairs:  # the experts', shared expert's and router's roles (lora_moe.py)
        moe = MoeFactors(config, max_rank)
        rank = max(rank, moe.add_pairs(moe_pairs, lambda r, path: _scale(options, path, r)))
        for layer, roles in zip(layers, moe.layers(config.num_layers)):
            layer.update(roles)
    return LoraWeights(rank, layers)


def _scale(options: dict, path: str, r: int) -> float:
    """A module's scale: alpha (PEFT's alpha_pattern's where a key matches `path`, the
    module's path from model.layers) over r, or over sqrt(r) with rslora."""
    alpha = float(_pattern_value(options.get("alpha_pattern"), path,
                                 options.get("lora_alpha", r)))
    return alpha / (math.sqrt(r) if options.get("use_rslora") else r)


def fuse_role(pieces: list, width_out: int, xp=np) -> tuple:
    """One fused matrix's factor pair (A [in, R], B [R, out], R the modules' ranks summed)
    from its modules' PEFT factors: pieces of (first, end, A [r, in], B [end - first, r],
    scale), each module's output columns first:end of the matrix. A holds the modules' A.T
    side by side; B each module's B.T * scale in its own columns, zeros elsewhere.

    xp: numpy (loading an adapter), or tensorflow.experimental.numpy, whose ops carry
    gradients to the factors (the LoRA trainer builds the same pair from its variables)."""
    big_a = xp.concatenate([xp.transpose(a) for _, _, a, _, _ in pieces], axis=1)
    big_b = xp.concatenate([xp.pad(xp.transpose(b) * scale, [[0, 0], [first, width_out - end]],
                                   "constant")
                            for first, end, _, b, scale in pieces], axis=0)
    return big_a, big_b


ROLE_LAYERS = {"qkv": ("attn", "qkv"), "out": ("attn", "out"), "up": ("mlp", "up"),
               "down": ("mlp", "down")}
"""Each role's Dense layer in one of the model's blocks (block.attn.qkv, ...)."""


def block_factors(blocks, layers: list[dict]) -> dict:
    """model.layers.lora_factors' table from per-layer role -> (A [in, R], B [R, out])
    (LoraWeights.layers' layout): id of each role's Dense layer in `blocks` -> its pair."""
    factors = {}
    for block, layer in zip(blocks, layers):
        for role, pair in layer.items():
            if role in ROLE_LAYERS:
                owner, name = ROLE_LAYERS[role]
                factors[id(getattr(getattr(block, owner), name))] = pair
            elif role in EXPERT_ROLES:  # model/moe.py's MoE: experts [(up, down)]
                a, b = pair
                for e, dense in enumerate(block.mlp.experts):
                    factors[id(dense[role == "expert_down"])] = (a[e], b[e])
            else:  # router, shared_up / shared_down / shared_gate (MoE.shared's order)
                shared = ("shared_up", "shared_down", "shared_gate")
                owner = (block.mlp.router if role == "router"
                         else block.mlp.shared[shared.index(role)])
                factors[id(owner)] = pair
    return factors


def merged_kernels(weights: LoraWeights) -> list[dict[str, np.ndarray]]:
    """Per layer, role -> the delta A @ B [in, out] to add to our fused kernel (merging an
    adapter into the weights: the parity tests' reference and the benchmark's ceiling)."""
    return [{role: a @ b for role, (a, b) in layer.items()} for layer in weights.layers]
