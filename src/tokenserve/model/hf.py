"""Imports Hugging Face checkpoints (GPT-2, Llama, Qwen2) with exact parity.

Reads `config.json`, `*.safetensors` (one file or shards with
`model.safetensors.index.json`), `tokenizer.json` and, when present,
`tokenizer_config.json` and `generation_config.json`. Weights go through
safetensors only: nothing is unpickled.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tokenserve.config import GenerationConfig, TransformerConfig, gpt2_config, llama_config
from tokenserve.errors import ConfigError, ModelLoadError, ModelNotFoundError
from tokenserve.model import families
from tokenserve.model.families.rope_scaling import hf_rope
from tokenserve.model.hf_moe import (MOE_ARCHITECTURES, check_expert_count, expert_names,
                                     moe_fields, qwen3_moe_config, qwen3_moe_names)

SUPPORTED = ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", *MOE_ARCHITECTURES,
             *families.HF_ARCHITECTURES)
# Buffers some checkpoints carry that are not parameters.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


class UnsupportedArchitectureError(ConfigError):
    """The checkpoint's architecture is not one tokenserve imports."""


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _rope(hf: dict, head_dim: int) -> tuple[float, tuple[float, ...], float]:
    """(rope_theta, rope_freq_factors, rope_attention_factor) of a config.json: plain RoPE,
    or a scaling (llama3, linear, yarn) as the per-pair divisors it amounts to."""
    # transformers 5 moved rope_theta (and the scaling) into rope_parameters
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    return hf_rope(scaling, theta, head_dim, hf.get("max_position_embeddings", 0))


def architecture_config(hf: dict) -> TransformerConfig:
    """Our TransformerConfig for a Hugging Face config.json, its architecture recorded."""
    return dataclasses.replace(_architecture_config(hf), architecture=hf["architectures"][0])


def _architecture_config(hf: dict) -> TransformerConfig:
    arch = (hf.get("architectures") or ["<none>"])[0]
    if arch in families.HF_ARCHITECTURES:
        return families.hf_config(hf)
    if arch == "Qwen3MoeForCausalLM":
        return qwen3_moe_config(hf)
    if arch == "GPT2LMHeadModel":
        activation = hf.get("activation_function", "gelu_new")
        if activation not in ("gelu_new", "gelu_pytorch_tanh"):
            raise UnsupportedArchitectureError(f"GPT-2 activation {activation!r} is not supported")
        config = gpt2_config(vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"],
                             hidden_size=hf["n_embd"], num_layers=hf["n_layer"],
                             num_heads=hf["n_head"])
        inner = hf.get("n_inner") or 4 * hf["n_embd"]
        return dataclasses.replace(config, intermediate_size=inner,
                                   norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                                   tie_embeddings=hf.get("tie_word_embeddings", True))
    if arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", *MOE_ARCHITECTURES):
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        if head_dim * heads != hf["hidden_size"]:
            raise UnsupportedArchitectureError(
                f"head_dim {head_dim} x {heads} heads != hidden_size {hf['hidden_size']}")
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(f"activation {hf['hidden_act']!r} is not supported")
        theta, factors, attention_factor = _rope(hf, head_dim)

        config = llama_config(
            vocab_size=hf["vocab_size"], max_seq_len=hf["max_position_embeddings"],
            hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            intermediate_size=hf["intermediate_size"],
            tie_embeddings=hf.get("tie_word_embeddings", False), rope_theta=theta,
            rope_freq_factors=factors, norm_eps=hf.get("rms_norm_eps", 1e-6))
        attention_bias = (arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
                          or hf.get("attention_bias", False))
        return dataclasses.replace(
            config, qkv_bias=attention_bias, rope_attention_factor=attention_factor,
            out_bias=hf.get("attention_bias", False) and arch == "LlamaForCausalLM",
            mlp_bias=hf.get("mlp_bias", False), **moe_fields(hf, arch))
    raise UnsupportedArchitectureError(
        f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED)}")


def read_safetensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint as float32 NumPy (bf16 and fp16 are upcast)."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{directory} holds no *.safetensors weights")
    tensors = {}
    for name in files:
        # The TF framework reads bf16, which NumPy cannot represent.
        with safe_open(str(directory / name), framework="tf") as handle:
            for key in handle.keys():
                tensors[key] = handle.get_tensor(key).numpy().astype(np.float32)
    return tensors


def _gpt2_names(config: TransformerConfig, hf_name: Callable[[str], str]) -> dict:
    """our weight name -> (hf tensor names, how to combine them)."""
    keep = lambda x: x  # noqa: E731  Conv1D weights are already [in, out]
    names = {"token_embedding": ([hf_name("wte.weight")], keep),
             "position_embedding": ([hf_name("wpe.weight")], keep),
             "final_norm/scale": ([hf_name("ln_f.weight")], keep),
             "final_norm/bias": ([hf_name("ln_f.bias")], keep)}
    for i in range(config.num_layers):
        p, h = f"block_{i}/", hf_name(f"h.{i}.")
        names.update({
            p + "attn_norm/scale": ([h + "ln_1.weight"], keep),
            p + "attn_norm/bias": ([h + "ln_1.bias"], keep),
            p + "qkv/kernel": ([h + "attn.c_attn.weight"], keep),
            p + "qkv/bias": ([h + "attn.c_attn.bias"], keep),
            p + "out/kernel": ([h + "attn.c_proj.weight"], keep),
            p + "out/bias": ([h + "attn.c_proj.bias"], keep),
            p + "mlp_norm/scale": ([h + "ln_2.weight"], keep),
            p + "mlp_norm/bias": ([h + "ln_2.bias"], keep),
            p + "up/kernel": ([h + "mlp.c_fc.weight"], keep),
            p + "up/bias": ([h + "mlp.c_fc.bias"], keep),
            p + "down/kernel": ([h + "mlp.c_proj.weight"], keep),
            p + "down/bias": ([h + "mlp.c_proj.bias"], keep)})
    return names


def _llama_names(config: TransformerConfig) -> dict:
    # torch Linear weights are [out, in]; ours are [in, out], q/k/v and gate/up fused along out
    fuse = lambda *ws: np.concatenate([w.T for w in ws], axis=1)  # noqa: E731
    cat = lambda *bs: np.concatenate(bs)  # noqa: E731
    keep = lambda x: x  # noqa: E731
    names = {"token_embedding": (["model.embed_tokens.weight"], keep),
             "final_norm/scale": (["model.norm.weight"], keep)}
    if not config.tie_embeddings:
        names["head/kernel"] = (["lm_head.weight"], lambda w: w.T)
    for i in range(config.num_layers):
        p, h = f"block_{i}/", f"model.layers.{i}."
        attn = [h + f"self_attn.{x}_proj" for x in "qkv"]
        names.update({
            p + "attn_norm/scale": ([h + "input_layernorm.weight"], keep),
            p + "qkv/kernel": ([a + ".weight" for a in attn], fuse),
            p + "out/kernel": ([h + "self_attn.o_proj.weight"], lambda w: w.T),
            p + "mlp_norm/scale": ([h + "post_attention_layernorm.weight"], keep)})
        if not config.layer_has_experts(i):  # a mixture of experts': hf_moe.expert_names
            names.update({
                p + "up/kernel": ([h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"], fuse),
                p + "down/kernel": ([h + "mlp.down_proj.weight"], lambda w: w.T)})
        if config.qkv_bias:
            names[p + "qkv/bias"] = ([a + ".bias" for a in attn], cat)
        if config.qk_norm:  # OLMoE's, over the whole projections
            names[p + "q_norm/scale"] = ([h + "self_attn.q_norm.weight"], keep)
            names[p + "k_norm/scale"] = ([h + "self_attn.k_norm.weight"], keep)
        if config.out_bias:
            names[p + "out/bias"] = ([h + "self_attn.o_proj.bias"], keep)
        if config.mlp_bias:
            names[p + "up/bias"] = ([h + "mlp.gate_proj.bias", h + "mlp.up_proj.bias"], cat)
            names[p + "down/bias"] = ([h + "mlp.down_proj.bias"], keep)
    return names


def assign_weights(model, config: TransformerConfig, arch: str, tensors: dict) -> None:
    """Copies HF tensors into `model`; names any missing, unexpected or misshapen tensor."""
    if arch == "GPT2LMHeadModel":
        prefix = "transformer." if any(k.startswith("transformer.") for k in tensors) else ""
        names = _gpt2_names(config, lambda n: prefix + n)
        tied_head = "lm_head.weight"
    elif arch in families.HF_ARCHITECTURES:
        names = families.hf_tensor_names(config, arch)
        tied_head = "lm_head.weight" if config.tie_embeddings else None
    elif arch == "Qwen3MoeForCausalLM":
        check_expert_count(config, arch, tensors)
        names = qwen3_moe_names(config)
        tied_head = "lm_head.weight" if config.tie_embeddings else None
    else:
        names = _llama_names(config)
        tied_head = "lm_head.weight" if config.tie_embeddings else None
        if config.num_experts:
            check_expert_count(config, arch, tensors)
            names.update(expert_names(config, arch))
    used = set()
    variables = {v.path.split("/", 1)[1]: v for v in model.weights}
    for ours, (sources, combine) in names.items():
        missing = [s for s in sources if s not in tensors]
        if missing:
            raise ModelLoadError(f"checkpoint is missing tensor {missing[0]} (for {ours})")
        value = combine(*[tensors[s] for s in sources])
        variable = variables[ours]
        if tuple(value.shape) != tuple(variable.shape):
            shapes = ", ".join(f"{s} {tuple(tensors[s].shape)}" for s in sources)
            raise ModelLoadError(f"tensor {shapes} does not fit {ours}: expected "
                                 f"{tuple(variable.shape)}, got {tuple(value.shape)}")
        variable.assign(value)
        used.update(sources)
    if tied_head and tied_head in tensors:
        used.add(tied_head)  # a tied head saved explicitly is the embedding again
    extra = sorted(k for k in tensors if k not in used and not k.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise ModelLoadError(f"checkpoint has unexpected tensor {extra[0]} "
                             f"with shape {tuple(tensors[extra[0]].shape)}"
                             + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def load_hf(directory: str | Path, compute_dtype: str = "float32"):
    """(model, tokenizer, generation config) from a Hugging Face checkpoint directory.

    compute_dtype: "float32", or "bfloat16" (weights, activations and KV cache in bf16;
    norms, softmax and logits stay float32).
    """
    from tokenizers import Tokenizer as HFTokenizer

    from tokenserve.model import build_model
    from tokenserve.model.tokenizer import Tokenizer

    directory = Path(directory)
    if not (directory / "config.json").exists():
        raise ModelNotFoundError(f"{directory} has no config.json")
    hf = _read_json(directory / "config.json")
    config = architecture_config(hf)
    tokenizer_path = directory / "tokenizer.json"
    if not tokenizer_path.exists():
        raise ModelNotFoundError(f"{directory} has no tokenizer.json")
    hf_tokenizer = HFTokenizer.from_file(str(tokenizer_path))
    tokenizer_config = _read_json(directory / "tokenizer_config.json")
    generation = _read_json(directory / "generation_config.json")

    def special(name: str) -> int | None:
        text = _token_text(tokenizer_config.get(f"{name}_token"))
        if text is not None and hf_tokenizer.token_to_id(text) is not None:
            return hf_tokenizer.token_to_id(text)
        value = generation.get(f"{name}_token_id", hf.get(f"{name}_token_id"))
        return value[0] if isinstance(value, list) else value

    eos = special("eos")
    if eos is None:
        raise ModelLoadError(f"{directory} names no eos token")
    bos = special("bos")
    pad = special("pad")
    tokenizer = Tokenizer(hf_tokenizer, bos_token_id=eos if bos is None else bos,
                          eos_token_id=eos, pad_token_id=eos if pad is None else pad)
    from tokenserve.model.layers import restoring_weights

    with restoring_weights():  # every weight is assigned below: no random draws first
        model = build_model(config, dtype=compute_dtype)
    assign_weights(model, config, hf["architectures"][0], read_safetensors(directory))
    generation_config = GenerationConfig(
        model=config, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id, chat_template=tokenizer_config.get("chat_template"),
        name=directory.name, add_bos_token=bool(tokenizer_config.get("add_bos_token", False)))
    tokenizer.add_bos = generation_config.add_bos_token
    return model, tokenizer, generation_config
