"""Tiny random mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) built with
`transformers`, saved as Hugging Face directories or written as GGUF files the way llama.cpp's
convert_hf_to_gguf lays them out (Q/K rows permuted for `llama`, experts stacked per role).
No tests here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from support.gguf_from_hf import add_bpe_tokenizer, bpe_vocab, permute_qk, write_tensors

VOCAB = 400
PROMPTS = [[5, 17, 33, 90, 140, 7, 8, 9, 250, 3], [12, 44, 1, 77], [300, 301, 302, 303, 304, 8]]


def hf_model(family: str, skewed: bool = False, num_experts: int = 8, seed: int = 0,
             top_k: int = 2, **options):
    """A random eval-mode Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE (2 layers, hidden 64, top_k
    of num_experts; Qwen3-MoE's heads 24 wide, not hidden / heads, and its top-k
    renormalised; OLMoE's not). options: more config fields (mlp_only_layers, ...).

    Norms and biases are perturbed so a dropped one shows. skewed: every row of every layer
    routes to expert 2 first and never to experts 4 and up: the embedding's first column is
    a large constant, which the router rows of those experts weigh heavily (+ for expert 2,
    - for 4 and up), so one expert gets every row and several get none."""
    import torch
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=top_k, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **options)
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
    elif family == "olmoe":
        config = transformers.OlmoeConfig(intermediate_size=32, num_experts=num_experts,
                                          rope_theta=5000.0, **common)
        model = transformers.OlmoeForCausalLM(config)
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
                if hasattr(moe, "gate") and hasattr(moe.gate, "weight"):  # not a dense layer
                    moe.gate.weight[2, 0] = 3.0
                    moe.gate.weight[4:, 0] = -3.0
    return model


def save_hf(directory: Path, model, tokenizer) -> Path:
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save(directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}))
    return directory


ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe"}


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names (float32), experts stacked per role; a
    dense layer's MLP as ffn_gate/ffn_up/ffn_down."""
    c = model.config
    arch = ARCH[c.model_type]
    mixtral = arch == "llama"
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
            q, k = permute_qk(q, c.num_attention_heads), permute_qk(k, c.num_key_value_heads)
        out.update({b + "attn_norm.weight": sd[h + "input_layernorm.weight"],
                    b + "attn_q.weight": q, b + "attn_k.weight": k,
                    b + "attn_v.weight": sd[h + "self_attn.v_proj.weight"],
                    b + "attn_output.weight": sd[h + "self_attn.o_proj.weight"],
                    b + "ffn_norm.weight": sd[h + "post_attention_layernorm.weight"]})
        if arch in ("qwen3moe", "olmoe"):  # QK-norm, no biases
            out[b + "attn_q_norm.weight"] = sd[h + "self_attn.q_norm.weight"]
            out[b + "attn_k_norm.weight"] = sd[h + "self_attn.k_norm.weight"]
        elif arch == "qwen2moe":
            for x in "qkv":
                out[b + f"attn_{x}.bias"] = sd[h + f"self_attn.{x}_proj.bias"]
        if h + "mlp.gate_proj.weight" in sd:  # a dense layer of a Qwen-MoE
            for role in ("gate", "up", "down"):
                out[b + f"ffn_{role}.weight"] = sd[f"{h}mlp.{role}_proj.weight"]
            continue
        moe = h + ("block_sparse_moe." if mixtral else "mlp.")
        names = ({"gate": "w1", "up": "w3", "down": "w2"} if mixtral
                 else {r: f"{r}_proj" for r in ("gate", "up", "down")})
        out[b + "ffn_gate_inp.weight"] = sd[moe + "gate.weight"]
        for role, hf in names.items():
            out[b + f"ffn_{role}_exps.weight"] = np.stack(
                [sd[f"{moe}experts.{e}.{hf}.weight"] for e in range(_num_experts(c))])
        if arch == "qwen2moe":
            out[b + "ffn_gate_inp_shexp.weight"] = sd[moe + "shared_expert_gate.weight"][0]
            for role in ("gate", "up", "down"):
                out[b + f"ffn_{role}_shexp.weight"] = sd[f"{moe}shared_expert.{role}_proj.weight"]
    return out


def _num_experts(config) -> int:
    return getattr(config, "num_local_experts", None) or config.num_experts


def write_gguf(path: Path, model, tokenizer, drop=(), extra=(), qtype: str | None = None,
               types: dict | None = None) -> Path:
    """The model as a GGUF file (float32 tensors, or with `qtype` its 2-D and stacked
    expert tensors in that type but where `types` names another: gguf_files.add_tensors);
    `drop` names tensors left out, `extra` (name, array) pairs replace or add tensors."""
    import gguf

    from support.gguf_files import add_tensors

    c = model.config
    arch = ARCH[c.model_type]
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
    if arch == "qwen3moe":  # as convert_hf_to_gguf writes Qwen3-MoE: no expert_weights_norm
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_expert_count(_num_experts(c))
    writer.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
        writer.add_expert_weights_norm(bool(c.norm_topk_prob))
    add_bpe_tokenizer(writer, bpe_vocab(tokenizer),
                      pre="llama-bpe" if arch in ("llama", "olmoe") else "qwen2")
    if qtype is None:
        return write_tensors(writer, tensors, path)
    add_tensors(writer, tensors, qtype, types)
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
