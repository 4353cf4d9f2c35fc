"""Tiny GGUF files of the newer families (qwen3, Mistral, gemma2, gemma3, phi3) with quantized
projections, written in a test the way llama.cpp lays them out: random weights (no
transformers), each family's own tensors (QK-norm, Gemma's post-norms stored as 1 + w,
Phi-3's fused attn_qkv and gate+up ffn_up, Mistral's permuted Q/K rows under `llama`) and
metadata (windows, soft caps, partial rotary)."""

from __future__ import annotations

import numpy as np

from support.gguf_files import add_tensors, add_vocab
from support.gguf_from_hf import bpe_vocab, permute_qk

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 64, 96, 3, 4, 2
WINDOW = 5  # far below the test prompts' lengths, so the windows matter

FAMILIES = {
    # GGUF architecture, head_dim, QK-norm, post-norms, extra metadata
    "qwen3": ("qwen3", 32, True, False, {}),
    "mistral": ("llama", 16, False, False, {"attention.sliding_window": WINDOW}),
    "gemma2": ("gemma2", 16, False, True, {"attention.sliding_window": WINDOW,
                                          "attn_logit_softcapping": 5.0,
                                          "final_logit_softcapping": 3.0}),
    "gemma3": ("gemma3", 32, True, True, {"attention.sliding_window": WINDOW,
                                         "attention.sliding_window_pattern": 2}),
    "phi3": ("phi3", 16, False, False, {"rope.dimension_count": 8}),  # a partial rotary
}


def family_tensors(family: str, n_vocab: int, tie: bool, seed: int = 0
                   ) -> dict[str, np.ndarray]:
    """Random float32 weights of a tiny `family` model under their GGUF names ([out, in])."""
    arch, head_dim, qk_norm, post_norms, _ = FAMILIES[family]
    rng = np.random.default_rng(seed)

    def normal(*shape):  # a few large weights, as trained ones have
        w = rng.normal(0, 0.08, shape).astype(np.float32)
        w[rng.random(shape) < 0.01] *= 6
        return w

    def norm(width=HIDDEN):  # scales near 1 (Gemma's files store 1 + w: the same here)
        return (1 + rng.normal(0, 0.1, width)).astype(np.float32)

    tensors = {"token_embd.weight": normal(n_vocab, HIDDEN), "output_norm.weight": norm()}
    if not tie:
        tensors["output.weight"] = normal(n_vocab, HIDDEN)
    q_rows, kv_rows = HEADS * head_dim, KV_HEADS * head_dim
    for i in range(LAYERS):
        b = f"blk.{i}."
        q, k, v = normal(q_rows, HIDDEN), normal(kv_rows, HIDDEN), normal(kv_rows, HIDDEN)
        if arch == "llama":  # convert_hf_to_gguf permutes Mistral's Q/K rows for its rotary
            q, k = permute_qk(q, HEADS), permute_qk(k, KV_HEADS)
        if family == "phi3":
            tensors.update({b + "attn_qkv.weight": np.concatenate([q, k, v]),
                            b + "ffn_up.weight": normal(2 * INTER, HIDDEN)})  # gate, up rows
        else:
            tensors.update({b + "attn_q.weight": q, b + "attn_k.weight": k,
                            b + "attn_v.weight": v, b + "ffn_gate.weight": normal(INTER, HIDDEN),
                            b + "ffn_up.weight": normal(INTER, HIDDEN)})
        tensors.update({b + "attn_norm.weight": norm(), b + "ffn_norm.weight": norm(),
                        b + "attn_output.weight": normal(HIDDEN, q_rows),
                        b + "ffn_down.weight": normal(HIDDEN, INTER)})
        if qk_norm:
            tensors.update({b + "attn_q_norm.weight": norm(head_dim),
                            b + "attn_k_norm.weight": norm(head_dim)})
        if post_norms:
            tensors.update({b + "post_attention_norm.weight": norm(),
                            b + "post_ffw_norm.weight": norm()})
    return tensors


def write_family_gguf(path, tokenizer, family: str, qtype: str = "Q4_0",
                      types: dict | None = None, tie: bool = True, ctx: int = 128,
                      seed: int = 0):
    """A tiny `family` GGUF (FAMILIES): 2-D tensors in `qtype` unless `types` names another
    for a tensor, 1-D tensors F32."""
    import gguf

    arch, head_dim, _, _, extra = FAMILIES[family]
    tensors = family_tensors(family, len(bpe_vocab(tokenizer)[0]), tie, seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{family}")
    writer.add_context_length(ctx)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    extra = {"rope.dimension_count": head_dim, **extra}
    for key, value in extra.items():
        if isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    add_vocab(writer, tokenizer)
    add_tensors(writer, tensors, qtype, types, rng=np.random.default_rng(seed + 1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
