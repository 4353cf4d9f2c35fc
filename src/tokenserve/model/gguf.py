"""Imports GGUF files (llama.cpp, Ollama, LM Studio) with the `gguf` package from PyPI.

A GGUF file holds the architecture's hyper-parameters, the tensors (often quantized) and the
tokenizer as metadata. `load_gguf` turns one into the same (model, tokenizer, generation
config) triple as `tokenserve.model.hf.load_hf`:

- Architectures `llama` (Llama, SmolLM, TinyLlama, Mistral, with its sliding window), `qwen2`
  and `gpt2`; `qwen3`, `gemma2`, `gemma3` and `phi3` through model/families/; the mixtures
  of experts `qwen2moe`, `qwen3moe`, `olmoe` and Mixtral (`llama` with experts) through
  gguf_moe.py.
- Tensor types F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K- and I-quants that
  `gguf.quants.dequantize` implements; every tensor is dequantized to float32 once, at import.
  (`tokenserve export --quantize int8` then re-quantizes the float model for serving.)
- llama.cpp stores the Q and K rows of `llama` models interleaved for its rotary kernel;
  they are put back in Hugging Face order here, so the model matches `transformers`.
- The tokenizer is rebuilt as an HF `tokenizers` Tokenizer from the vocabulary, merges,
  token types and pre-tokenizer name (`tokenizer.ggml.pre`): byte-level BPE (`gpt2`) and
  SentencePiece BPE (`llama`), in gguf_tokenizer.py. The chat template and special tokens
  come from the file. Reading the file itself is gguf_file.py's.

Anything else is refused with a message naming the architecture, tensor type or
pre-tokenizer, before any weight is converted.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import numpy as np

from tokenserve.config import GenerationConfig, TransformerConfig, gpt2_config, llama_config
from tokenserve.errors import ConfigError, ModelLoadError
from tokenserve.model import families, gguf_moe
from tokenserve.model.families.rope_scaling import LONGROPE_TENSORS, gguf_rope
from tokenserve.model.gguf_file import (GGUFFile, UnsupportedGGUFError, dequantize, read_gguf,
                                        supported_tensor_types)
from tokenserve.model.gguf_tokenizer import build_tokenizer

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "gpt2", "qwen2moe", *families.GGUF_ARCHITECTURES,
                 "qwen3moe", "olmoe")


# ---------------------------------------------------------------------------------------------
# architecture


def architecture_config(file: GGUFFile, context: int | None = None) -> TransformerConfig:
    """Our TransformerConfig for the file's architecture hyper-parameters.

    context: cap the context length (and so the KV cache per sequence) below the file's.
    """
    arch = file.architecture
    if arch not in ARCHITECTURES:
        raise UnsupportedGGUFError(f"GGUF architecture {arch!r} is not supported; "
                                   f"supported: {', '.join(ARCHITECTURES)}")
    if arch in families.GGUF_ARCHITECTURES:
        return families.gguf_config(file, context)
    if arch == "qwen3moe":
        return gguf_moe.qwen3_moe_config(file, context)
    if arch == "llama" and file.get("attention.sliding_window"):  # Mistral
        return families.gguf_config(file, context)
    for key in ("attention.sliding_window",) + (("expert_count",) if arch == "gpt2" else ()):
        if file.get(key):
            raise UnsupportedGGUFError(f"{arch}.{key} = {file.get(key)} is not supported")
    hidden = int(file.require("embedding_length"))
    heads = int(file.require("attention.head_count"))
    kv_heads = file.get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per layer
        if len(set(kv_heads)) != 1:
            raise UnsupportedGGUFError(f"per-layer KV head counts {kv_heads} are not supported")
        kv_heads = kv_heads[0]
    head_dim = hidden // heads
    for key in ("attention.key_length", "attention.value_length"):
        if file.get(key) not in (None, head_dim):
            raise UnsupportedGGUFError(f"{arch}.{key} = {file.get(key)} differs from "
                                       f"embedding_length / head_count = {head_dim}")
    max_seq_len = int(file.require("context_length"))
    if context is not None:
        if context < 1:
            raise ConfigError(f"context must be positive, got {context}")
        max_seq_len = min(max_seq_len, context)
    vocab = _vocab_size(file)
    tie = "output.weight" not in file.tensors
    if arch == "gpt2":
        config = gpt2_config(vocab_size=vocab, max_seq_len=max_seq_len, hidden_size=hidden,
                             num_layers=int(file.require("block_count")), num_heads=heads)
        return dataclasses.replace(
            config, intermediate_size=int(file.get("feed_forward_length", 4 * hidden)),
            norm_eps=float(file.get("attention.layer_norm_epsilon", 1e-5)), tie_embeddings=tie)

    rotary = file.get("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise UnsupportedGGUFError(f"partial rotary embeddings ({arch}.rope.dimension_count = "
                                   f"{rotary}, head_dim {head_dim}) are not supported")
    # linear or YaRN (refusing the rest by name); Llama 3.1+'s divisors are rope_freqs.weight
    _, scaled, attention_factor = gguf_rope(file, float(file.get("rope.freq_base", 10000.0)),
                                            head_dim)
    # Llama 3.1+'s scaling, as convert_hf_to_gguf writes it: one frequency divisor per pair
    factors = ()
    if "rope_freqs.weight" in file.tensors:
        factors = tuple(float(f) for f in dequantize(file.tensors["rope_freqs.weight"]).ravel())
        if scaled:
            raise UnsupportedGGUFError(f"{file.path.name}: rope_freqs.weight beside "
                                       f"{arch}.rope.scaling.type is not supported")
        if len(factors) != head_dim // 2:
            raise ModelLoadError(f"{file.path.name}: rope_freqs.weight has {len(factors)} "
                                 f"values; head_dim {head_dim} rotates {head_dim // 2} pairs")
    config = llama_config(
        vocab_size=vocab, max_seq_len=max_seq_len, hidden_size=hidden,
        num_layers=int(file.require("block_count")), num_heads=heads,
        num_kv_heads=int(kv_heads), intermediate_size=int(file.require("feed_forward_length")),
        tie_embeddings=tie, rope_theta=float(file.get("rope.freq_base", 10000.0)),
        rope_freq_factors=factors,
        norm_eps=float(file.get("attention.layer_norm_rms_epsilon", 1e-5)))
    return dataclasses.replace(
        config, rope_freq_factors=factors or scaled, rope_attention_factor=attention_factor,
        qkv_bias="blk.0.attn_q.bias" in file.tensors,
        out_bias="blk.0.attn_output.bias" in file.tensors,
        mlp_bias="blk.0.ffn_up.bias" in file.tensors, **gguf_moe.moe_fields(file))


def _vocab_size(file: GGUFFile) -> int:
    embedding = file.tensors.get("token_embd.weight")
    if embedding is None:
        raise ModelLoadError(f"{file.path.name} has no tensor token_embd.weight")
    return int(embedding.shape[-1])  # GGUF shape is [hidden, vocab]


# ---------------------------------------------------------------------------------------------
# weights


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's convert_hf_to_gguf `permute` of Q/K rows (and biases) for rotary."""
    shape = weight.shape
    return (weight.reshape(heads, shape[0] // heads // 2, 2, *shape[1:])
            .swapaxes(1, 2).reshape(shape))


def _hf_name(config: TransformerConfig, arch: str, name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (the layout `hf.assign_weights` takes)."""
    if arch == "gpt2":
        fixed = {"token_embd.weight": "wte.weight", "position_embd.weight": "wpe.weight",
                 "output_norm.weight": "ln_f.weight", "output_norm.bias": "ln_f.bias",
                 "output.weight": "lm_head.weight"}
        per_layer = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn",
                     "attn_output": "attn.c_proj", "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc",
                     "ffn_down": "mlp.c_proj"}
        layer_prefix = "h.{}."
    else:
        fixed = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
        per_layer = dict(families.gguf_layer_names(arch))
        if not config.qk_norm:  # a stray QK-norm tensor is refused by name
            del per_layer["attn_q_norm"], per_layer["attn_k_norm"]
        layer_prefix = "model.layers.{}."
    if name in fixed:
        return fixed[name]
    match = re.fullmatch(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)", name)
    if match and int(match[1]) < config.num_layers and match[2] in per_layer:
        return layer_prefix.format(match[1]) + f"{per_layer[match[2]]}.{match[3]}"
    return None


def read_weights(file: GGUFFile, config: TransformerConfig) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 under its Hugging Face name and layout."""
    arch = file.architecture
    # the RoPE tables are read into the config (architecture_config), not weights
    rope_tables = ("rope_freqs.weight", *LONGROPE_TENSORS)
    unknown = sorted(n for n in file.tensors
                     if _hf_name(config, arch, n) is None and n not in rope_tables
                     and not (config.num_experts and gguf_moe.is_expert_tensor(n)))
    if unknown:
        shape = [int(n) for n in file.tensors[unknown[0]].shape]
        raise ModelLoadError(
            f"{file.path.name} has tensor {unknown[0]} (shape {shape}), which the "
            f"{arch} architecture does not use"
            + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    if config.num_experts:
        gguf_moe.check_experts(file, config)
    # refuse an unreadable type before spending time on the others
    readable = set(supported_tensor_types())
    for tensor in file.tensors.values():
        if tensor.tensor_type.name not in readable:
            dequantize(tensor)  # raises, naming the tensor and its type
    tensors = {}
    for name, tensor in file.tensors.items():
        if name in rope_tables:
            continue
        value = families.gguf_tensor_value(arch, name, dequantize(tensor))
        if config.num_experts and gguf_moe.is_expert_tensor(name):
            tensors.update(gguf_moe.hf_tensors(name, value, gguf_moe.hf_architecture(file)))
            continue
        if arch == "llama" and ".attn_q." in name:
            value = _unpermute(value, config.num_heads)
        elif arch == "llama" and ".attn_k." in name:
            value = _unpermute(value, config.num_kv_heads)
        elif arch == "gpt2" and name.endswith(("attn_qkv.weight", "attn_output.weight",
                                               "ffn_up.weight", "ffn_down.weight")):
            value = value.T  # GPT-2's Conv1D layout is [in, out]
        elif name == "position_embd.weight":
            value = value[:config.max_seq_len]  # a shorter context reads fewer positions
        tensors[_hf_name(config, arch, name)] = value
    return tensors


def hf_architecture(file: GGUFFile, config: TransformerConfig) -> str:
    """The Hugging Face architecture whose tensor layout the file's maps onto."""
    arch = gguf_moe.hf_architecture(file) or {"gpt2": "GPT2LMHeadModel",
                                               "qwen2": "Qwen2ForCausalLM",
                                               **families.GGUF_ARCHITECTURES}.get(
        file.architecture, "LlamaForCausalLM")
    if arch == "LlamaForCausalLM" and config.sliding_windows:
        arch = "MistralForCausalLM"
    return arch


def assign_weights(model, config: TransformerConfig, file: GGUFFile,
                   tensors: dict[str, np.ndarray]) -> None:
    """Copies the tensors into `model`, naming any missing or misshapen one by its GGUF name."""
    from tokenserve.model.hf import assign_weights as assign_hf

    arch = hf_architecture(file, config)
    if file.architecture == "gpt2" and not config.tie_embeddings:
        # hf.py maps only GPT-2's tied head; an untied one is assigned here
        head = next(w for w in model.weights if w.path.endswith("head/kernel"))
        head.assign(tensors.pop("lm_head.weight").T)
    try:
        assign_hf(model, config, arch, tensors)
    except ModelLoadError as error:
        message = re.sub(r"\b(?:model\.|h\.\d|wte\.|wpe\.|ln_f\.|lm_head\.)[\w.]*",
                         lambda m: _gguf_name_for(m[0], file.architecture), str(error))
        raise ModelLoadError(f"{file.path.name}: {message.replace('checkpoint', 'file')}") from None


def _gguf_name_for(hf: str, arch: str = "llama") -> str:
    """The GGUF name a missing Hugging Face tensor would have had (for messages)."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf)
    if match and arch != "gpt2":
        ours = {v: k for k, v in families.gguf_layer_names(arch).items()}.get(match[2])
        if ours is not None:
            return f"blk.{match[1]}.{ours}.{match[3]}"
    pairs = [("model.embed_tokens", "token_embd"), ("model.norm", "output_norm"),
             ("lm_head", "output"), ("model.layers.", "blk."), ("h.", "blk."),
             ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
             ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
             ("post_attention_layernorm", "ffn_norm"), ("input_layernorm", "attn_norm"),
             ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
             ("mlp.down_proj", "ffn_down"), ("attn.c_attn", "attn_qkv"),
             ("attn.c_proj", "attn_output"), ("mlp.c_fc", "ffn_up"), ("mlp.c_proj", "ffn_down"),
             ("ln_1", "attn_norm"), ("ln_2", "ffn_norm"), ("ln_f", "output_norm"),
             ("wte", "token_embd"), ("wpe", "position_embd")]
    for old, new in pairs:
        hf = hf.replace(old, new)
    return hf


def _tie_if_equal(config: TransformerConfig, tensors: dict) -> TransformerConfig:
    """A separate output.weight that equals the embedding (GPT-2 files repeat it) is tied."""
    head, embedding = tensors.get("lm_head.weight"), tensors.get(
        "wte.weight", tensors.get("model.embed_tokens.weight"))
    if (not config.tie_embeddings and head is not None and embedding is not None
            and head.shape == embedding.shape and np.array_equal(head, embedding)):
        return dataclasses.replace(config, tie_embeddings=True)
    return config


def load_gguf(path: str | Path, compute_dtype: str = "float32", context: int | None = None,
              name: str | None = None, keep_blocks: bool = False):
    """(model, tokenizer, generation config) from a GGUF file.

    compute_dtype: "float32" or "bfloat16" (as `load_hf`). context: cap the context length
    (the file's is the default). name: the generation config's name (default: the file's
    stem). keep_blocks: keep quantized tensors as the file stores them (gguf_stored.py; the
    model computes in float32), instead of dequantizing every tensor to compute_dtype.
    """
    from tokenserve.model import build_model

    file = read_gguf(path)
    config = architecture_config(file, context=context)
    config = dataclasses.replace(config, architecture=hf_architecture(file, config))
    tokenizer = build_tokenizer(file)
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(f"{file.path.name}: the tokenizer has {tokenizer.vocab_size} tokens "
                             f"but token_embd.weight only {config.vocab_size} rows")
    if keep_blocks:
        from tokenserve.model.gguf_stored import assign_stored, stored_config, tie_if_same_blocks

        config = stored_config(file, tie_if_same_blocks(file, config))
        model = build_model(config, dtype="float32")
        assign_stored(model, config, file)
    else:
        tensors = read_weights(file, config)
        config = _tie_if_equal(config, tensors)
        from tokenserve.model.layers import restoring_weights

        with restoring_weights():  # every weight is assigned below: no random draws first
            model = build_model(config, dtype=compute_dtype)
        assign_weights(model, config, file, tensors)
    template = file.metadata.get("tokenizer.chat_template")
    generation = GenerationConfig(
        model=config, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        chat_template=template if isinstance(template, str) else None,
        name=name or file.path.name.removesuffix(".gguf"),
        add_bos_token=bool(file.metadata.get("tokenizer.ggml.add_bos_token", False)))
    tokenizer.add_bos = generation.add_bos_token
    return model, tokenizer, generation
