"""Tiny llama-architecture GGUF files written in a test, with a chosen type per tensor, for the
tests of imports that keep the file's blocks as stored."""

from __future__ import annotations

import numpy as np

from support.gguf_from_hf import bpe_vocab


def tiny_tensors(n_vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
                 tie: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights of a llama model under their GGUF names ([out, in] rows)."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def normal(*shape):  # a few large weights, as trained ones have
        w = rng.normal(0, 0.08, shape).astype(np.float32)
        w[rng.random(shape) < 0.01] *= 6
        return w

    norm = lambda: (1 + rng.normal(0, 0.1, hidden)).astype(np.float32)  # noqa: E731
    tensors = {"token_embd.weight": normal(n_vocab, hidden), "output_norm.weight": norm()}
    if not tie:
        tensors["output.weight"] = normal(n_vocab, hidden)
    for i in range(layers):
        b = f"blk.{i}."
        tensors.update({
            b + "attn_norm.weight": norm(), b + "attn_q.weight": normal(heads * head_dim, hidden),
            b + "attn_k.weight": normal(kv_heads * head_dim, hidden),
            b + "attn_v.weight": normal(kv_heads * head_dim, hidden),
            b + "attn_output.weight": normal(hidden, heads * head_dim),
            b + "ffn_norm.weight": norm(), b + "ffn_gate.weight": normal(inter, hidden),
            b + "ffn_up.weight": normal(inter, hidden),
            b + "ffn_down.weight": normal(hidden, inter)})
    return tensors


# K-quants: (bytes a super-block, where its fp16 scales sit, their value); gguf.quants cannot
# quantize to them, so their tensors are random super-blocks with scales of trained weights' size
K_QUANTS = {"Q4_K": (144, [0, 2], 5e-4), "Q5_K": (176, [0, 2], 3e-4), "Q6_K": (210, [208], 1e-4)}


def kquant_blocks(rows: int, cols: int, kind: str, rng) -> np.ndarray:
    """uint8 [rows, cols / 256 * bytes]: random super-blocks of `kind` ("Q4_K", ...)."""
    size, offsets, scale = K_QUANTS[kind]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for offset in offsets:
        blocks[..., offset:offset + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(path, tokenizer, qtype: str = "Q4_0", types: dict | None = None,
                    tie: bool = True, hidden: int = 64, inter: int = 96, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, ctx: int = 128, seed: int = 0,
                    raw: dict | None = None):
    """A tiny llama GGUF: 2-D tensors in `qtype` unless `types` names another for a tensor
    ({"blk.0.attn_v.weight": "Q8_0", "token_embd.weight": "F16"}); 1-D tensors F32. raw:
    {name: (uint8 blocks, type name)} written as given (any bytes). K-quant tensors (hidden
    and inter multiples of 256) are random super-blocks (kquant_blocks)."""
    import gguf

    tokens, token_types, merges = bpe_vocab(tokenizer)
    tensors = tiny_tensors(len(tokens), hidden, inter, layers, heads, kv_heads, tie, seed)
    rng = np.random.default_rng(seed + 1)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(ctx)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    for name, value in tensors.items():
        if raw and name in raw:
            blocks, kind = raw[name]
            writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
            continue
        kind = (types or {}).get(name, qtype)
        if value.ndim == 1 or kind == "F32":
            writer.add_tensor(name, value)
        elif kind == "F16":
            writer.add_tensor(name, value.astype(np.float16))
        elif kind in K_QUANTS:
            writer.add_tensor(name, kquant_blocks(*value.shape, kind, rng),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            q = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(value, q), raw_dtype=q)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
