"""TransformerConfig from a GGUF file's metadata, for the families of this package, with
llama.cpp's conventions where the file is silent: Gemma 3's local layers turn RoPE at base
10000 and run five to one global layer, Gemma 2's alternate from a local layer 0, and the
query scale is `attention.scale`, else 1 / sqrt(head_dim) but for the 27B models (1 /
sqrt(hidden / heads))."""

from __future__ import annotations

import math

from tokenserve.config import TransformerConfig
from typing import TYPE_CHECKING

from tokenserve.errors import ConfigError, ModelLoadError, UnsupportedGGUFError
from tokenserve.model.families.hf_configs import clamp_windows
from tokenserve.model.families.rope_scaling import gguf_longrope, gguf_rope

if TYPE_CHECKING:  # the reader imports none of the importers' modules; this one neither
    from tokenserve.model.gguf_file import GGUFFile

GGUF_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                      "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
"""The GGUF architectures read here, and the Hugging Face layout their tensors map onto."""

_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp's set_swa_pattern
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # where llama.cpp scales by hidden / heads


def _windows(file: GGUFFile, arch: str, num_layers: int) -> list[int]:
    window = int(file.get("attention.sliding_window") or 0)
    pattern = file.get("attention.sliding_window_pattern") or _SWA_PATTERN.get(arch, 1)
    if isinstance(pattern, list):  # one flag per layer: windowed or not
        if len(pattern) != num_layers:
            raise ModelLoadError(f"{file.path.name}: {arch}.attention.sliding_window_pattern "
                                 f"has {len(pattern)} flags for {num_layers} layers")
        return [window if local else 0 for local in pattern]
    pattern = int(pattern)
    # llama.cpp: layer i is local when i % pattern < pattern - 1 (pattern 1: every layer)
    return [window if pattern == 1 or i % pattern < pattern - 1 else 0
            for i in range(num_layers)]


def gguf_config(file: GGUFFile, context: int | None = None) -> TransformerConfig:
    """Our TransformerConfig for a file of one of GGUF_ARCHITECTURES (or a `llama` file
    with a sliding window: Mistral). context: cap the context length below the file's."""
    arch = file.architecture
    hidden = int(file.require("embedding_length"))
    heads = int(file.require("attention.head_count"))
    kv_heads = file.get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise UnsupportedGGUFError(f"per-layer KV head counts {kv_heads} are not supported")
        kv_heads = kv_heads[0]
    head_dim = int(file.get("attention.key_length") or hidden // heads)
    if int(file.get("attention.value_length") or head_dim) != head_dim:
        raise UnsupportedGGUFError(f"{arch}.attention.value_length differs from key_length")
    max_seq_len = int(file.require("context_length"))
    if context is not None:
        if context < 1:
            raise ConfigError(f"context must be positive, got {context}")
        max_seq_len = min(max_seq_len, context)
    num_layers = int(file.require("block_count"))
    rotary_dim = int(file.get("rope.dimension_count") or head_dim)
    theta, factors, attention_factor = gguf_rope(
        file, float(file.get("rope.freq_base", 10000.0)), rotary_dim)
    long_factors, original = (), 0
    longrope = gguf_longrope(file, rotary_dim)
    if longrope is not None:  # Phi-3's two tables, as the Hugging Face import reads them
        factors, long_factors, original, attention_factor = longrope
    embedding = file.tensors.get("token_embd.weight")
    if embedding is None:
        raise ModelLoadError(f"{file.path.name} has no tensor token_embd.weight")
    gemma = arch in ("gemma2", "gemma3")
    scale = float(file.get("attention.scale") or 0.0)
    if not scale and gemma and num_layers == _GEMMA_27B_LAYERS[arch]:
        scale = 1.0 / math.sqrt(hidden / heads)
    return TransformerConfig(
        vocab_size=int(embedding.shape[-1]), max_seq_len=max_seq_len, hidden_size=hidden,
        num_layers=num_layers, num_heads=heads, num_kv_heads=int(kv_heads),
        intermediate_size=int(file.require("feed_forward_length")), head_dim=head_dim,
        norm="rmsnorm", norm_eps=float(file.get("attention.layer_norm_rms_epsilon", 1e-6)),
        position="rope", rope_theta=theta, rope_freq_factors=factors,
        rope_attention_factor=attention_factor, rope_long_freq_factors=long_factors,
        rope_original_context=original, rotary_dim=rotary_dim,
        local_rope_theta=float(file.get("rope.freq_base_swa", 10000.0))
        if arch == "gemma3" else 0.0,
        mlp="geglu" if gemma else "swiglu", tie_embeddings="output.weight" not in file.tensors,
        qkv_bias="blk.0.attn_q.bias" in file.tensors,
        out_bias="blk.0.attn_output.bias" in file.tensors, mlp_bias=False,
        qk_norm="blk.0.attn_q_norm.weight" in file.tensors,
        sliding_windows=clamp_windows(_windows(file, arch, num_layers), max_seq_len),
        attn_scale=scale, attn_softcap=float(file.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(file.get("final_logit_softcapping") or 0.0),
        embedding_multiplier=math.sqrt(hidden) if gemma else 1.0, post_norms=gemma)
