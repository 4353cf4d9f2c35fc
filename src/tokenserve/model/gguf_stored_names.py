"""Which GGUF tensors each of our variables takes in an import that keeps blocks as stored
(gguf_stored.py), for every dense architecture the importer reads: llama (and Mistral),
qwen2, gpt2, and the families of model/families/ (qwen3, gemma2, gemma3, phi3).

Only the projections (and the token embedding, and an untied head) are blocks; the extra
tensors of the newer families are small float vectors (QK-norm scales, Gemma's post-norms),
F32 in the files llama.cpp writes. llama.cpp stores Gemma's norms as 1 + w, which is what
our Gemma norms hold, so every norm is taken as the file stores it.
"""

from __future__ import annotations

from tokenserve.config import TransformerConfig

# architectures whose q, k, v (and gate, up) rows are one GGUF tensor each
_FUSED = ("gpt2", "phi3")


def layer_sources(architecture: str, config: TransformerConfig) -> dict[str, list[str]]:
    """Our layer ("block_3/qkv", "token_embedding", "head") -> its GGUF tensors, in row order
    (q, k, v rows; gate rows, then up rows)."""
    fused = architecture in _FUSED
    roles = {"qkv": ["attn_qkv"] if fused else ["attn_q", "attn_k", "attn_v"],
             "out": ["attn_output"],
             "up": ["ffn_up"] if fused else ["ffn_gate", "ffn_up"],  # Phi-3: gate+up rows
             "down": ["ffn_down"]}
    sources = {"token_embedding": ["token_embd.weight"]}
    if not config.tie_embeddings:
        sources["head"] = ["output.weight"]
    for i in range(config.num_layers):
        for role, names in roles.items():
            if role in ("up", "down") and config.layer_has_experts(i):
                continue  # a mixture of experts' MLP: model/gguf_moe_stored.py
            sources[f"block_{i}/{role}"] = [f"blk.{i}.{name}.weight" for name in names]
    return sources


def float_sources(architecture: str, config: TransformerConfig
                  ) -> dict[str, tuple[list[str], str]]:
    """Our float variable (its path below the model) -> (its GGUF tensors, how they combine:
    "keep" one, "cat" several along the rows, "positions" the first max_seq_len rows)."""
    fused = architecture in _FUSED
    sources = {"final_norm/scale": (["output_norm.weight"], "keep"),
               "final_norm/bias": (["output_norm.bias"], "keep"),
               "position_embedding": (["position_embd.weight"], "positions")}
    for i in range(config.num_layers):
        p, b = f"block_{i}/", f"blk.{i}."
        qkv = [b + "attn_qkv.bias"] if fused else [b + f"attn_{x}.bias" for x in "qkv"]
        up = [b + "ffn_up.bias"] if fused else [b + "ffn_gate.bias", b + "ffn_up.bias"]
        sources.update({
            p + "attn_norm/scale": ([b + "attn_norm.weight"], "keep"),
            p + "attn_norm/bias": ([b + "attn_norm.bias"], "keep"),
            p + "mlp_norm/scale": ([b + "ffn_norm.weight"], "keep"),
            p + "mlp_norm/bias": ([b + "ffn_norm.bias"], "keep"),
            p + "qkv/bias": (qkv, "cat"), p + "out/bias": ([b + "attn_output.bias"], "keep"),
            p + "up/bias": (up, "cat"), p + "down/bias": ([b + "ffn_down.bias"], "keep"),
            # QK-norm (Qwen3, Gemma 3), [head_dim] each
            p + "q_norm/scale": ([b + "attn_q_norm.weight"], "keep"),
            p + "k_norm/scale": ([b + "attn_k_norm.weight"], "keep"),
            # Gemma's norms of each branch's output, before the residual add
            p + "post_attn_norm/scale": ([b + "post_attention_norm.weight"], "keep"),
            p + "post_mlp_norm/scale": ([b + "post_ffw_norm.weight"], "keep")})
    return sources
