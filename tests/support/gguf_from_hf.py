"""A tiny Hugging Face model written as llama.cpp's convert_hf_to_gguf would write it, for
the families' import tests: the GGUF and the safetensors import are both held to the one
`transformers` model.

llama.cpp's conventions kept here: `llama` files (Mistral) store Q and K rows permuted for
its rotary kernel; Gemma files store every norm as 1 + w; Phi-3's fused qkv and gate_up keep
their names' roles (attn_qkv, ffn_up), and its LongRoPE tables are tensors
(rope_factors_short/long).
"""

from __future__ import annotations

import json
import math

import numpy as np

GGUF_ARCH = {"Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "llama",
             "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
             "Phi3ForCausalLM": "phi3"}
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
GEMMA_LAYER = {**LAYER, "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


def bpe_vocab(tokenizer):
    """(tokens, token types, merges) of our byte-level BPE tokenizer, as a GGUF stores them."""
    state = json.loads(tokenizer.hf.to_str())
    vocab = state["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in state["added_tokens"] if t["special"]}
    types = [3 if t in special else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    return tokens, types, merges


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute of Q/K rows."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_tensors(hf_model, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors under their GGUF names and in llama.cpp's layout."""
    config = hf_model.config
    gemma = arch in ("gemma2", "gemma3")
    layer_names = GEMMA_LAYER if gemma else LAYER
    tensors = {}
    for name, param in hf_model.state_dict().items():
        value = param.detach().float().numpy()
        if name == "lm_head.weight":
            if config.tie_word_embeddings:
                continue
            out = "output.weight"
        elif name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            role, kind = rest.rsplit(".", 1)
            out = f"blk.{layer}.{layer_names[role]}.{kind}"
            if arch == "llama" and role == "self_attn.q_proj":
                value = permute_qk(value, config.num_attention_heads)
            elif arch == "llama" and role == "self_attn.k_proj":
                value = permute_qk(value, config.num_key_value_heads)
        if gemma and out.endswith("norm.weight"):
            value = value + np.float32(1.0)
        tensors[out] = value.astype(np.float32)
    return tensors


def write_gguf_from_hf(path, hf_model, vocab, extra_metadata=(), drop=(), replace=()):
    """`hf_model` as a GGUF file at `path` (float32 tensors), with the tokenizer `vocab`
    (bpe_vocab's). drop: GGUF tensor names to leave out; replace: (name, value) pairs."""
    import gguf

    config = hf_model.config
    arch = GGUF_ARCH[type(hf_model).__name__]
    tensors = gguf_tensors(hf_model, arch)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = dict(getattr(config, "rope_parameters", None) or {})
    local_rope = rope.get("sliding_attention")
    rope = rope.get("full_attention", rope)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
        types = getattr(config, "layer_types", None)
        if arch == "gemma3" and types:  # llama.cpp's default there is 5 local to 1 global
            writer.add_array(f"{arch}.attention.sliding_window_pattern",
                             [t == "sliding_attention" for t in types])
    if local_rope is not None:  # llama.cpp's default there is 10000
        writer.add_float32(f"{arch}.rope.freq_base_swa", float(local_rope["rope_theta"]))
    scalar = getattr(config, "query_pre_attn_scalar", None)
    if scalar and scalar != head_dim:  # llama.cpp's attention.scale
        writer.add_float32(f"{arch}.attention.scale", float(scalar) ** -0.5)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if rope.get("rope_type") == "longrope":  # convert_hf_to_gguf's Phi3MiniModel
        original = config.original_max_position_embeddings
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        tensors["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    add_bpe_tokenizer(writer, vocab)
    for key, (value, kind) in dict(extra_metadata).items():
        writer.add_key_value(key, value, kind)
    for name in drop:
        del tensors[name]
    tensors.update(dict(replace))
    return write_tensors(writer, tensors, path)


def add_bpe_tokenizer(writer, vocab, pre: str = "llama-bpe", model: str = "gpt2") -> None:
    """bpe_vocab's (tokens, types, merges) as a GGUF's BPE tokenizer (tokenizer.ggml.model
    `model`: llama.cpp's "gpt2"), with the test tokenizer's special ids (bos 1, eos 2, pad 0)."""
    tokens, types, merges = vocab
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)


def write_tensors(writer, tensors: dict, path):
    """Adds `tensors` (name -> array) after the metadata, writes the file, returns `path`."""
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
