"""LoRA adapters written as GGUF files the way llama.cpp's convert_lora_to_gguf.py writes
them, from PEFT-named factors. No tests here."""

from __future__ import annotations

from pathlib import Path

import numpy as np

GGUF_TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
"""A Llama-family PEFT module -> its GGUF tensor's name in a block."""


def write_gguf_lora(path, tensors: dict, heads: int, kv_heads: int, alpha: float = 8.0,
                    arch: str = "llama", kind: str = "F32", extra: dict | None = None,
                    general_type: str = "adapter") -> Path:
    """PEFT-named factors as blk.N.<tensor>.weight.lora_a [r, in] and .lora_b [out, r], Q/K's
    lora_b rows permuted for a `llama` file as convert_hf_to_gguf permutes the weights', in
    `kind` (F32 or F16; Q8_0 takes no rank-4 row); `extra`: more (GGUF name -> array)
    tensors."""
    import gguf

    from support.gguf_from_hf import permute_qk

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(general_type)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    out = {}
    for name, value in tensors.items():
        layer, module = name.split(".layers.")[1].split(".", 1)
        module, side = module.rsplit(".lora_", 1)
        if side.startswith("B") and arch == "llama" and module in ("self_attn.q_proj",
                                                                   "self_attn.k_proj"):
            value = permute_qk(value, heads if "q_proj" in module else kv_heads)
        out[f"blk.{layer}.{GGUF_TENSORS[module]}.weight.lora_{side[0].lower()}"] = value
    for name, value in {**out, **(extra or {})}.items():
        writer.add_tensor(name, value.astype(np.float16) if kind == "F16" else value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def peft_dir_to_gguf(directory: Path, path, heads: int, kv_heads: int, arch: str = "llama"
                     ) -> Path:
    """A PEFT adapter directory (adapter_config.json's lora_alpha) as a GGUF LoRA file of
    GGUF architecture `arch`."""
    import json

    from safetensors.numpy import load_file

    options = json.loads((directory / "adapter_config.json").read_text())
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    return write_gguf_lora(path, tensors, heads, kv_heads, alpha=float(options["lora_alpha"]),
                           arch=arch)
