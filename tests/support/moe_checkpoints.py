"""Tiny random mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE) built with `transformers`,
saved as Hugging Face directories or written as GGUF files the way llama.cpp's
convert_hf_to_gguf lays them out (Q/K rows permuted for `llama`, experts stacked per role).
No tests here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VOCAB = 400
PROMPTS = [[5, 17, 33, 90, 140, 7, 8, 9, 250, 3], [12, 44, 1, 77], [300, 301, 302, 303, 304, 8]]


def hf_model(family: str, skewed: bool = False, num_experts: int = 8, seed: int = 0):
    """A random eval-mode Mixtral, Qwen2-MoE or Qwen3-MoE (2 layers, hidden 64, top-2 of
    num_experts; Qwen3-MoE's heads 24 wide, not hidden / heads, and its top-2 renormalised).

    Norms and biases are perturbed so a dropped one shows. skewed: every row of every layer
    routes to expert 2 first and never to experts 4 and up: the embedding's first column is
    a large constant, which the router rows of those experts weigh heavily (+ for expert 2,
    - for 4 and up), so one expert gets every row and several get none."""
    import torch
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=48, num_local_experts=num_experts,
                                            rope_theta=5000.0, **common)
        model = transformers.MixtralForCausalLM(config)
    elif family == "qwen3moe":
        config = transformers.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, num_experts=num_experts,
            head_dim=24, norm_topk_prob=True, rope_theta=5000.0, **common)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=num_experts, norm_topk_prob=family == "qwen2moe-normed", **common)
        model = transformers.Qwen2MoeForCausalLM(config)
    model = model.eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
            else:  # std 0.1, not 0.02: no near-tie of the top two logits in 64 greedy steps
                param.mul_(5.0)
        if skewed:
            model.model.embed_tokens.weight[:, 0] = 4.0
            for layer in model.model.layers:
                moe = getattr(layer, "block_sparse_moe", None) or layer.mlp
                moe.gate.weight[2, 0] = 3.0
                moe.gate.weight[4:, 0] = -3.0
    return model


def save_hf(directory: Path, model, tokenizer) -> Path:
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save(directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}))
    return directory


def _bpe_vocab(tokenizer):
    """(tokens, token types, merges) of our byte-level BPE tokenizer, as a GGUF stores them."""
    state = json.loads(tokenizer.hf.to_str())
    vocab = state["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in state["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    return tokens, [3 if t in special else 1 for t in tokens], merges


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's Q/K row permutation for llama's rotary kernel."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names (float32), experts stacked per role."""
    c = model.config
    mixtral, qwen3 = c.model_type == "mixtral", c.model_type == "qwen3_moe"
    import tempfile

    from safetensors.numpy import load_file

    with tempfile.TemporaryDirectory() as directory:  # the checkpoint's own names and layout
        model.save_pretrained(directory, safe_serialization=True)
        sd = load_file(Path(directory) / "model.safetensors")
    out = {"token_embd.weight": sd["model.embed_tokens.weight"],
           "output_norm.weight": sd["model.norm.weight"], "output.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        h, b = f"model.layers.{i}.", f"blk.{i}."
        q, k = sd[h + "self_attn.q_proj.weight"], sd[h + "self_attn.k_proj.weight"]
        if mixtral:
            q, k = _permute(q, c.num_attention_heads), _permute(k, c.num_key_value_heads)
        out.update({b + "attn_norm.weight": sd[h + "input_layernorm.weight"],
                    b + "attn_q.weight": q, b + "attn_k.weight": k,
                    b + "attn_v.weight": sd[h + "self_attn.v_proj.weight"],
                    b + "attn_output.weight": sd[h + "self_attn.o_proj.weight"],
                    b + "ffn_norm.weight": sd[h + "post_attention_layernorm.weight"]})
        if qwen3:  # QK-norm, no biases
            out[b + "attn_q_norm.weight"] = sd[h + "self_attn.q_norm.weight"]
            out[b + "attn_k_norm.weight"] = sd[h + "self_attn.k_norm.weight"]
        elif not mixtral:
            for x in "qkv":
                out[b + f"attn_{x}.bias"] = sd[h + f"self_attn.{x}_proj.bias"]
        moe = h + ("block_sparse_moe." if mixtral else "mlp.")
        names = ({"gate": "w1", "up": "w3", "down": "w2"} if mixtral
                 else {r: f"{r}_proj" for r in ("gate", "up", "down")})
        out[b + "ffn_gate_inp.weight"] = sd[moe + "gate.weight"]
        num_experts = c.num_local_experts if mixtral else c.num_experts
        for role, hf in names.items():
            out[b + f"ffn_{role}_exps.weight"] = np.stack(
                [sd[f"{moe}experts.{e}.{hf}.weight"] for e in range(num_experts)])
        if not (mixtral or qwen3):
            out[b + "ffn_gate_inp_shexp.weight"] = sd[moe + "shared_expert_gate.weight"][0]
            for role in ("gate", "up", "down"):
                out[b + f"ffn_{role}_shexp.weight"] = sd[f"{moe}shared_expert.{role}_proj.weight"]
    return out


def write_gguf(path: Path, model, tokenizer, drop=(), extra=()) -> Path:
    """The model as a GGUF file (float32 tensors); `drop` names tensors left out, `extra`
    (name, array) pairs replace or add tensors."""
    import gguf

    c = model.config
    mixtral, qwen3 = c.model_type == "mixtral", c.model_type == "qwen3_moe"
    arch = "llama" if mixtral else "qwen3moe" if qwen3 else "qwen2moe"
    tensors = gguf_tensors(model)
    for name in drop:
        del tensors[name]
    tensors.update(dict(extra))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-moe")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    if qwen3:  # as convert_hf_to_gguf writes Qwen3-MoE: no expert_weights_norm (always on)
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_expert_count(c.num_local_experts if mixtral else c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    if not (mixtral or qwen3):
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
        writer.add_expert_weights_norm(bool(c.norm_topk_prob))
    tokens, types, merges = _bpe_vocab(tokenizer)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe" if mixtral else "qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def moe_engine(model, tokenizer, config, **options):
    """An LLMEngine on an in-memory model (no export: a MoE export traces every expert into
    each signature, tens of seconds); `options` override support.engines.engine_config's."""
    from support.engines import engine_config
    from tokenserve.engine.core import LLMEngine
    from tokenserve.engine.runner import ModelRunner

    knobs = engine_config(**options)
    return LLMEngine(ModelRunner(model, config, knobs), tokenizer, knobs)


def greedy(engine, prompts, max_tokens: int) -> list[list[int]]:
    """Greedy token ids per prompt, the prompts run together on `engine`."""
    from tokenserve.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    first = engine.num_steps
    requests = [engine.make_request(list(p), params, f"moe-{first}-{i}")
                for i, p in enumerate(prompts)]
    for request in requests:
        engine.add_request(request)
    while engine.has_work:
        engine.step()
    return [r.seqs[0].output_ids for r in requests]


def engine_greedy(model, tokenizer, config, prompts, max_tokens: int, **options):
    """(greedy token ids per prompt, the runner) from a fresh moe_engine."""
    engine = moe_engine(model, tokenizer, config, **options)
    return greedy(engine, prompts, max_tokens), engine.runner
