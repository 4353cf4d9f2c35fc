"""LoRA adapters as GGUF files (llama.cpp's convert_lora_to_gguf.py output), read into the
PEFT names and layout lora_adapter.py checks, so one adapter loads the same from either
form (no TF: the `gguf` package reads the file).

Such a file says `general.type = "adapter"`, `adapter.type = "lora"` and, in
`adapter.lora.alpha`, PEFT's lora_alpha (0: a scale of 1, as llama.cpp applies it). Its
tensors are named after the base model's GGUF tensors, each module a pair

    blk.3.attn_q.weight.lora_a   [r, in]     (NumPy order; GGUF lists the shape reversed)
    blk.3.attn_q.weight.lora_b   [out, r]

in F32, F16, BF16 or Q8_0. For `llama` files (Llama, Mistral, Mixtral) the conversion
permuted lora_b's rows of attn_q and attn_k as it permutes the base's Q/K rows for
llama.cpp's rotary kernel; they are put back in Hugging Face order here, as the model
importer does for the weights. Layer norms, embeddings and experts are refused by name.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from tokenserve.config import TransformerConfig
from tokenserve.engine.lora_errors import (LoraBaseMismatchError, LoraNotFoundError,
                                           LoraTargetError)

MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
           "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
           "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
"""A GGUF tensor of a block -> the PEFT module it is (Llama-family layout)."""
PHI3_MODULES = {**MODULES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
ARCHITECTURES = {"llama": ("Llama", "Mistral", "Mixtral"), "qwen2": ("Qwen2",),
                 "qwen3": ("Qwen3",), "gemma2": ("Gemma2",),
                 "gemma3": ("Gemma3", "Gemma3Text", "Gemma3ForConditionalGeneration"),
                 "phi3": ("Phi3",), "qwen2moe": ("Qwen2Moe",), "qwen3moe": ("Qwen3Moe",),
                 "olmoe": ("Olmoe",)}
"""The GGUF architectures whose LoRA files load, and the Hugging Face architectures (their
class names' model part) of the base models each fits."""
_EXPERTS = re.compile(r"ffn_(?:gate|up|down)_(?:exps|shexp)|ffn_gate_inp(?:_shexp)?")
_NAME = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<tensor>\w+)\.weight\.lora_(?P<side>[ab])$")


def is_gguf_adapter(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its suffix) rather than a PEFT directory."""
    return Path(path).suffix.lower() == ".gguf"


def read_gguf_adapter(path: str | Path, config: TransformerConfig
                      ) -> tuple[dict, dict[str, np.ndarray]]:
    """(adapter_config.json's options, PEFT-named float32 tensors) of a GGUF LoRA file.

    Raises:
        LoraNotFoundError: no such file, or not a readable GGUF LoRA adapter file.
        LoraTargetError: a tensor of a module tokenserve does not adapt.
        LoraBaseMismatchError: an adapter of another architecture than the base's.
    """
    import gguf

    path = Path(path)
    if not path.is_file():
        raise LoraNotFoundError(f"GGUF LoRA file {str(path)!r} does not exist")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as error:  # noqa: BLE001  the reader's errors have no common type
        raise LoraNotFoundError(f"{path} is not a readable GGUF file: {error}") from None
    meta = {key: _value(field) for key, field in reader.fields.items()}
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise LoraNotFoundError(
            f"{path.name} is not a GGUF LoRA adapter (general.type "
            f"{meta.get('general.type')!r}, adapter.type {meta.get('adapter.type')!r}; "
            f"llama.cpp's convert_lora_to_gguf.py writes 'adapter' and 'lora')")
    arch = str(meta.get("general.architecture"))
    _check_architecture(path.name, arch, config)
    modules = PHI3_MODULES if arch == "phi3" else MODULES
    alpha = float(meta.get("adapter.lora.alpha") or 0.0)
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, int] = {}
    for tensor in reader.tensors:
        match = _NAME.match(tensor.name)
        if match is None or match["tensor"] not in modules:
            raise LoraTargetError(_refusal(tensor.name, match, modules))
        value = _float32(tensor)
        layer, module = int(match["layer"]), modules[match["tensor"]]
        if match["side"] == "b" and arch == "llama" and match["tensor"] in ("attn_q", "attn_k"):
            heads = config.num_heads if match["tensor"] == "attn_q" else config.num_kv_heads
            value = _unpermute_rows(value, heads)
        full = f"model.layers.{layer}.{module}"
        tensors[f"base_model.model.{full}.lora_{match['side'].upper()}.weight"] = value
        if match["side"] == "a":
            ranks[full] = value.shape[0]
    # PEFT's scale is alpha / r; llama.cpp's the same, or 1 where alpha is 0
    options = {"peft_type": "LORA", "lora_alpha": alpha} if alpha else {
        "peft_type": "LORA", "alpha_pattern": {full: r for full, r in ranks.items()}}
    return options, tensors


def _value(field):
    try:
        return field.contents()
    except Exception:  # noqa: BLE001  a value we cannot decode is one we do not read
        return None


def _check_architecture(file: str, arch: str, config: TransformerConfig) -> None:
    if arch not in ARCHITECTURES:
        raise LoraTargetError(f"{file} is a LoRA adapter of GGUF architecture {arch!r}; "
                              f"tokenserve reads those of {', '.join(ARCHITECTURES)}")
    if config.mlp == "gelu":
        raise LoraBaseMismatchError(f"{file} is an adapter of a {arch} model; this model is "
                                    f"GPT-2")
    stem = re.sub(r"(ForCausalLM|LMHeadModel|Model)$", "", config.architecture or "")
    if stem and stem not in ARCHITECTURES[arch]:
        raise LoraBaseMismatchError(f"{file} is an adapter of a GGUF {arch} model; this "
                                    f"model is a {config.architecture}")


def _refusal(name: str, match, modules: dict) -> str:
    targets = ", ".join(sorted(modules))
    if match is None:
        return (f"GGUF adapter tensor {name!r} is not a LoRA factor of a block's linear "
                f"layer (blk.N.<tensor>.weight.lora_a / .lora_b; targets: {targets})")
    if _EXPERTS.fullmatch(match["tensor"]):
        return (f"GGUF adapter tensor {name!r} targets {match['tensor']!r}, part of a mixture "
                f"of experts: GGUF LoRA files of experts, shared experts and routers are not "
                f"read (the PEFT adapter they were converted from is served)")
    return (f"GGUF adapter tensor {name!r} targets {match['tensor']!r}, which tokenserve does "
            f"not adapt (targets: {targets})")


def _float32(tensor) -> np.ndarray:
    """A tensor as float32 in NumPy order ([r, in] or [out, r])."""
    import gguf

    try:
        value = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise LoraTargetError(f"GGUF adapter tensor {tensor.name!r} has type "
                              f"{tensor.tensor_type.name}, which tokenserve does not read "
                              f"(F32, F16, BF16, Q8_0 do)") from None
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the innermost first
    return np.asarray(value, np.float32).reshape(shape)


def _unpermute_rows(b: np.ndarray, heads: int) -> np.ndarray:
    """Undoes convert_hf_to_gguf's permute of Q/K rows on lora_b [out, r]: each head's rows
    back from (pairs, 2) to (2, pairs) order."""
    rows = b.shape[0]
    if rows % (2 * heads):
        return b  # a shape the checks refuse by the module's width
    return b.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(b.shape)
