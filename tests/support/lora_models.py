"""Tiny Hugging Face checkpoints (GPT-2, Llama, Qwen2, Qwen3, Gemma 3, Mistral, Gemma 2,
Phi-3) with LoRA adapters written by `peft`, the references the LoRA tests hold tokenserve
to. No tests here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FAMILIES = ("gpt2", "llama", "qwen2", "qwen3", "gemma3", "mistral", "gemma2", "phi3")

TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"],
           "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"],
           "qwen2": ["q_proj", "v_proj", "down_proj"],
           "qwen3": ["q_proj", "k_proj", "o_proj", "up_proj"],
           "gemma3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                      "down_proj"],
           "mistral": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"],
           "gemma2": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
           "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
"""Every module tokenserve adapts (GPT-2, Llama, Gemma 3, Mistral, Phi-3's fused qkv_proj
and gate_up_proj), and partial sets (Qwen2; Qwen3: q and k feed its QK-norm; Gemma 2: gate
without up)."""


@dataclass
class LoraCheckpoint:
    """A tiny checkpoint, its transformers model and adapters (directory, peft model)."""

    family: str
    directory: Path
    hf_model: object
    adapters: list[tuple[Path, object]]


def _hf_config(family: str):
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=400, n_positions=128, n_embd=64, n_layer=2,
                                       n_head=4, bos_token_id=1, eos_token_id=2)
    if family == "gemma3":  # QK-norm, post-norms, GeGLU; a local and a global layer
        return transformers.Gemma3TextConfig(
            vocab_size=400, max_position_embeddings=128, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
            sliding_window=4, query_pre_attn_scalar=16, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, layer_types=["sliding_attention", "full_attention"])
    if family == "gemma2":  # post-norms, GeGLU, both softcaps; a local and a global layer
        return transformers.Gemma2Config(
            vocab_size=400, max_position_embeddings=128, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
            sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "mistral":  # every layer windowed
        return transformers.MistralConfig(
            vocab_size=400, max_position_embeddings=128, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
            sliding_window=4, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if family == "phi3":  # fused qkv_proj and gate_up_proj; a partial rotary
        return transformers.Phi3Config(
            vocab_size=400, max_position_embeddings=128, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
            sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            # logits less flat than at the default 0.02, where two tokens came within 0.004
            # and transformers' own cached and full passes chose differently
            initializer_range=0.1, pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": 0.5})
    if family == "qwen3":  # QK-norm, a head width of its own
        return transformers.Qwen3Config(
            vocab_size=400, max_position_embeddings=128, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    kind = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    return kind(vocab_size=400, max_position_embeddings=128, hidden_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, tie_word_embeddings=False, bos_token_id=1,
                eos_token_id=2)


def make_adapter(base_dir: Path, out_dir: Path, targets: list[str], seed: int, rank: int = 4,
                 parameters: list[str] | None = None):
    """A peft LoRA adapter of `rank` on the checkpoint in `base_dir`, with random B (peft
    starts B at zero: such an adapter would change nothing), saved to `out_dir`.
    parameters: peft's target_parameters (transformers 5's stacked experts, the router)."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    options = {"target_parameters": parameters} if parameters else {}
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False,
        **options)).eval()
    model.save_pretrained(out_dir)
    return model


def lora_checkpoint(family: str, tokenizer, root: Path, num_adapters: int = 3
                    ) -> LoraCheckpoint:
    """Writes a tiny `family` checkpoint under `root` and `num_adapters` adapters for it."""
    import torch
    import transformers

    directory = root / f"{family}-base"
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(_hf_config(family)).eval()
    hf_model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save(directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}))
    adapters = []
    for i in range(num_adapters):
        out = root / f"{family}-adapter-{i}"
        adapters.append((out, make_adapter(directory, out, TARGETS[family], seed=i + 1)))
    return LoraCheckpoint(family, directory, hf_model, adapters)


def reference_greedy(hf_model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """transformers' (+ peft's) greedy tokens, exactly `max_tokens` of them."""
    import torch

    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
"""The first MoE adapter's targets: the attention projections only."""
MOE_EXPERT_TARGETS = (["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj",
                       "shared_expert_gate"], ["mlp.gate.weight", "gate_up_proj", "down_proj"])
"""The second MoE adapter's target_modules (on transformers 5, the shared expert's
projections and gate where the family has one) and target_parameters (the router, the
stacked experts)."""
MOE_AROUND_TARGETS = (["q_proj", "gate_proj", "up_proj", "down_proj", "shared_expert_gate"],
                      ["mlp.gate.weight"])
"""The third's on Qwen2-MoE: the router and the shared expert, not the routed experts (on
the others, q_proj and the router: peft 0.21 turns gate_proj / up_proj / down_proj targets
into the experts' stacked parameters on Qwen3-MoE and OLMoE, whatever path names them)."""


def moe_lora_checkpoint(family: str, tokenizer, root: Path, num_adapters: int = 2
                        ) -> LoraCheckpoint:
    """A tiny mixture-of-experts checkpoint (support.moe_checkpoints.hf_model's `family`:
    mixtral, qwen2moe, qwen3moe, olmoe) under `root`, with `num_adapters` peft adapters: the
    first on its attention projections, the second on attention, experts, shared expert and
    router too (MOE_EXPERT_TARGETS), the others on the router and shared expert
    (MOE_AROUND_TARGETS)."""
    from support.moe_checkpoints import hf_model, save_hf

    # OLMoE as tests/model/test_moe_import.py holds it to transformers: 16 experts, top-4
    options = dict(num_experts=16, top_k=4) if family == "olmoe" else {}
    directory = save_hf(root / f"{family}-base", hf_model(family, **options), tokenizer)
    import transformers

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    adapters = []
    for i in range(num_adapters):
        out = root / f"{family}-adapter-{i}"
        around = MOE_AROUND_TARGETS if family == "qwen2moe" else (["q_proj"],
                                                                  ["mlp.gate.weight"])
        targets, parameters = ((MOE_TARGETS, None), MOE_EXPERT_TARGETS, around)[min(i, 2)]
        adapters.append((out, make_adapter(directory, out, targets, seed=i + 1,
                                           parameters=parameters)))
    return LoraCheckpoint(family, directory, reloaded, adapters)
