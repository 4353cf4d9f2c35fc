"""Where each family's tensors go: Hugging Face names -> our variables (hf_tensor_names, in
the (sources, combine) form hf.assign_weights takes), and GGUF names -> Hugging Face names
(gguf_layer_names, gguf_tensor_value) for model/gguf.py, which maps a file onto the
Hugging Face layout first.
"""

from __future__ import annotations

import numpy as np

from tokenserve.config import TransformerConfig
from tokenserve.model.families.hf_configs import HF_ARCHITECTURES


def _transpose(w: np.ndarray) -> np.ndarray:
    return w.T  # torch Linear weights are [out, in]; ours are [in, out]


def _fuse(*ws: np.ndarray) -> np.ndarray:
    return np.concatenate([w.T for w in ws], axis=1)  # q/k/v or gate/up fused along out


def _keep(w: np.ndarray) -> np.ndarray:
    return w


def _gemma_norm(w: np.ndarray) -> np.ndarray:
    # Gemma's RMSNorm multiplies by (1 + w), in float32 like ours: stored as 1 + w here
    return (np.float32(1.0) + w.astype(np.float32)).astype(np.float32)


def hf_tensor_names(config: TransformerConfig, arch: str) -> dict:
    """our weight name -> (hf tensor names, how to combine them), for HF_ARCHITECTURES."""
    family = HF_ARCHITECTURES[arch]
    gemma = family in ("gemma2", "gemma3")
    norm = _gemma_norm if gemma else _keep
    names = {"token_embedding": (["model.embed_tokens.weight"], _keep),
             "final_norm/scale": (["model.norm.weight"], norm)}
    if not config.tie_embeddings:
        names["head/kernel"] = (["lm_head.weight"], _transpose)
    for i in range(config.num_layers):
        p, h = f"block_{i}/", f"model.layers.{i}."
        attn = [h + f"self_attn.{x}_proj" for x in "qkv"]
        names[p + "attn_norm/scale"] = ([h + "input_layernorm.weight"], norm)
        names[p + "out/kernel"] = ([h + "self_attn.o_proj.weight"], _transpose)
        names[p + "down/kernel"] = ([h + "mlp.down_proj.weight"], _transpose)
        if family == "phi3":
            names[p + "qkv/kernel"] = ([h + "self_attn.qkv_proj.weight"], _transpose)
            names[p + "up/kernel"] = ([h + "mlp.gate_up_proj.weight"], _transpose)
        else:
            names[p + "qkv/kernel"] = ([a + ".weight" for a in attn], _fuse)
            names[p + "up/kernel"] = ([h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"],
                                      _fuse)
        if gemma:  # post_attention_layernorm is the attention output's norm here
            names[p + "post_attn_norm/scale"] = ([h + "post_attention_layernorm.weight"], norm)
            names[p + "mlp_norm/scale"] = ([h + "pre_feedforward_layernorm.weight"], norm)
            names[p + "post_mlp_norm/scale"] = ([h + "post_feedforward_layernorm.weight"], norm)
        else:
            names[p + "mlp_norm/scale"] = ([h + "post_attention_layernorm.weight"], norm)
        if config.qk_norm:
            names[p + "q_norm/scale"] = ([h + "self_attn.q_norm.weight"], norm)
            names[p + "k_norm/scale"] = ([h + "self_attn.k_norm.weight"], norm)
        if config.qkv_bias:
            names[p + "qkv/bias"] = ([a + ".bias" for a in attn],
                                     lambda *bs: np.concatenate(bs))
        if config.out_bias:
            names[p + "out/bias"] = ([h + "self_attn.o_proj.bias"], _keep)
        if config.mlp_bias:
            names[p + "up/bias"] = ([h + "mlp.gate_proj.bias", h + "mlp.up_proj.bias"],
                                    lambda *bs: np.concatenate(bs))
            names[p + "down/bias"] = ([h + "mlp.down_proj.bias"], _keep)
    return names


_LLAMA_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm"}
_GEMMA_LAYER = {**_LLAMA_LAYER, "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_PHI3_LAYER = {**_LLAMA_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


def gguf_layer_names(arch: str) -> dict[str, str]:
    """A GGUF architecture's per-layer tensor names (blk.N.<key>) -> Hugging Face's."""
    return {"gemma2": _GEMMA_LAYER, "gemma3": _GEMMA_LAYER, "phi3": _PHI3_LAYER}.get(
        arch, _LLAMA_LAYER)


def gguf_tensor_value(arch: str, name: str, value: np.ndarray) -> np.ndarray:
    """A GGUF tensor in the Hugging Face checkpoint's form: llama.cpp stores Gemma's norms
    as 1 + w already, which hf_tensor_names adds again."""
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        return value - np.float32(1.0)
    return value
