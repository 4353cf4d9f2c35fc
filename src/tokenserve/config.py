"""Typed configs, one per concern, validated on construction.

Model configs are plain data so they can travel inside an exported model's
`assets/generation_config.json` and be rebuilt without tokenserve's Python
objects (any JSON reader can follow them).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from tokenserve.errors import ConfigError, UnknownPresetError


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only Transformer covering GPT-2 and the Llama family."""

    vocab_size: int
    """Rows of the token embedding (and columns of the LM head)."""
    max_seq_len: int
    """Context length; learned position tables and KV caches are this long."""
    hidden_size: int
    """Residual stream width."""
    num_layers: int
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads; fewer than `num_heads` is grouped-query attention."""
    intermediate_size: int
    """Hidden width of the MLP (per branch for SwiGLU)."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    position: Literal["learned", "rope"] = "learned"
    rope_theta: float = 10000.0
    rope_freq_factors: tuple[float, ...] = ()
    """RoPE frequency divisors, one per rotated pair (head_dim / 2): pair i turns at
    rope_theta ** (-2i / head_dim) / factor_i radians per position. Llama 3.1+'s "llama3"
    scaling is such a table (llama.cpp stores it as the tensor `rope_freqs.weight`); empty
    means plain RoPE."""
    mlp: Literal["gelu", "swiglu", "geglu"] = "gelu"
    """`gelu` is GPT-2's tanh-approximated GELU MLP; `swiglu` is Llama's gated MLP; `geglu`
    is Gemma's, gated by the tanh-approximated GELU."""
    tie_embeddings: bool = True
    """The LM head reuses the token embedding (GPT-2); False gives an untied head (Llama)."""
    qkv_bias: bool = True
    out_bias: bool = True
    mlp_bias: bool = True
    head_dim: int = 0
    """Width of one attention head; 0 means hidden_size // num_heads. A model pruned by
    `tokenserve prune` keeps its head width with fewer heads, so num_heads * head_dim can be
    less than hidden_size."""
    weight_format: Literal["float", "int8", "gguf"] = "float"
    """`float`: weights in the compute dtype. `int8`: the linear layers and the token
    embedding (and with it a tied LM head) hold int8 weights with one float32 scale per
    output channel (`tokenserve export --quantize int8`). `gguf`: each of them holds its GGUF
    file's blocks as stored, or int8 where no kernel reads its type (`gguf_block_types`)."""
    gguf_block_types: tuple[tuple[str, str], ...] = ()
    """With weight_format `gguf`: (layer, blocks) pairs, the layer as "block_3/qkv",
    "token_embedding" or "head", the blocks as kernels/gguf_types.py spells them ("q4_1",
    or "q4_k*576,q6_k*192" for rows of several types), or "int8"; a layer not listed is int8."""
    qk_norm: bool = False
    """An RMSNorm over each head's query and key, before RoPE (Qwen3, Gemma 3)."""
    sliding_windows: tuple[int, ...] = ()
    """Attention window of each layer, in positions: a query at p sees keys p - W + 1 .. p;
    0 is a global layer. Empty: every layer global (Mistral: all windowed; Gemma 2: every
    other one; Gemma 3: five local layers to one global)."""
    local_rope_theta: float = 0.0
    """RoPE base of the windowed layers (Gemma 3's 10k beside its global 1M); they then turn
    plain RoPE, without rope_freq_factors. 0: every layer uses rope_theta."""
    rotary_dim: int = 0
    """Leading dimensions of each head that RoPE turns (the rest pass through); 0: head_dim."""
    rope_attention_factor: float = 1.0
    """Scale of RoPE's cos and sin, so of q.k by its square (YaRN's attention factor)."""
    rope_long_freq_factors: tuple[float, ...] = ()
    """LongRoPE (Phi-3): the divisors that replace rope_freq_factors (then its short ones)
    for the tokens of a sequence that reaches past rope_original_context positions in the
    step that computes them; empty: none."""
    rope_original_context: int = 0
    """LongRoPE's switch: positions of pretraining (original_max_position_embeddings)."""
    attn_scale: float = 0.0
    """Score scale; 0 means 1 / sqrt(head_dim) (Gemma: query_pre_attn_scalar ** -0.5)."""
    attn_softcap: float = 0.0
    """Scores become cap * tanh(scores / cap) before the mask (Gemma 2); 0: none."""
    final_softcap: float = 0.0
    """Logits become cap * tanh(logits / cap) (Gemma 2); 0: none."""
    embedding_multiplier: float = 1.0
    """Token embeddings are scaled by this (Gemma: sqrt(hidden_size)); a tied head reads
    them unscaled."""
    post_norms: bool = False
    """Norms on the attention and MLP outputs too, before each residual add (Gemma 2 and 3)."""
    num_experts: int = 0
    """Routed experts in every block's MLP (a mixture of experts: Mixtral, Qwen-MoE); 0 is
    one dense MLP. Each expert is a SwiGLU MLP `expert_intermediate_size` wide."""
    num_experts_per_token: int = 0
    """Experts each token's row goes through (top-k of the router's softmax)."""
    expert_intermediate_size: int = 0
    """Hidden width of one expert (per SwiGLU branch); 0 means intermediate_size."""
    normalize_expert_weights: bool = True
    """The top-k router probabilities are renormalised to sum to 1 (Mixtral; Qwen-MoE's
    norm_topk_prob); False keeps them as the softmax gave them."""
    shared_expert_size: int = 0
    """Hidden width of a shared expert every row goes through, scaled by a sigmoid gate
    (Qwen2-MoE); 0: none."""
    dense_layers: tuple[int, ...] = ()
    """Layers of a mixture of experts whose MLP is one dense SwiGLU MLP `intermediate_size`
    wide, without router or experts (Qwen-MoE's mlp_only_layers and decoder_sparse_step);
    empty: every layer routes."""
    qk_norm_scope: Literal["head", "projection"] = "head"
    """What QK-norm normalises: each head's query and key on its own (scales [head_dim];
    Qwen3, Gemma 3), or the whole query and the whole key projection as one vector each
    (scales [num_heads * head_dim] and [num_kv_heads * head_dim]; OLMoE)."""
    architecture: str = ""
    """The Hugging Face architecture the weights came from (config.json's first
    `architectures`, or a GGUF file's as the layout its tensors map onto), e.g.
    "Phi3ForCausalLM"; empty: unknown (a model built here, or an export from before this was
    recorded). LoRA adapters made for another architecture are refused by it."""
    family: Literal["transformer"] = "transformer"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "hidden_size", "num_layers",
                     "num_heads", "num_kv_heads", "intermediate_size"):
            _check(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        _check(self.head_dim >= 0, f"head_dim must not be negative, got {self.head_dim}")
        if self.head_dim == 0:
            _check(self.hidden_size % self.num_heads == 0,
                   f"hidden_size {self.hidden_size} is not divisible by num_heads "
                   f"{self.num_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _check(self.num_heads % self.num_kv_heads == 0,
               f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        _check(self.norm in ("layernorm", "rmsnorm"), f"unknown norm {self.norm!r}")
        _check(self.position in ("learned", "rope"), f"unknown position {self.position!r}")
        _check(self.mlp in ("gelu", "swiglu", "geglu"), f"unknown mlp {self.mlp!r}")
        _check(self.weight_format in ("float", "int8", "gguf"),
               f"unknown weight_format {self.weight_format!r}; use float, int8 or gguf")
        # pairs from JSON are lists: tuples, so the frozen config stays hashable
        object.__setattr__(self, "gguf_block_types",
                           tuple((str(k), str(v)) for k, v in self.gguf_block_types))
        _check(not self.gguf_block_types or self.weight_format == "gguf",
               "gguf_block_types need weight_format='gguf'")
        _check(self.position != "rope" or self.head_dim % 2 == 0, "rope needs an even head_dim")
        # a list from JSON: a sorted tuple, so the frozen config stays hashable
        object.__setattr__(self, "dense_layers", tuple(sorted({int(i) for i in self.dense_layers})))
        if self.num_experts:
            _check(self.mlp == "swiglu" and not self.mlp_bias,
                   "experts are SwiGLU MLPs without biases (mlp='swiglu', mlp_bias=False)")
            _check(0 < self.num_experts_per_token <= self.num_experts,
                   f"num_experts_per_token must be in 1..{self.num_experts}, got "
                   f"{self.num_experts_per_token}")
            _check(self.expert_intermediate_size >= 0 and self.shared_expert_size >= 0,
                   "expert widths must not be negative")
            if self.expert_intermediate_size == 0:
                object.__setattr__(self, "expert_intermediate_size", self.intermediate_size)
            _check(all(0 <= i < self.num_layers for i in self.dense_layers),
                   f"dense_layers must be layer indices below {self.num_layers}, got "
                   f"{list(self.dense_layers)}")
        else:
            _check(self.num_experts == 0, f"num_experts must not be negative, got "
                                          f"{self.num_experts}")
            _check(self.num_experts_per_token == 0 and self.shared_expert_size == 0
                   and not self.dense_layers,
                   "num_experts_per_token, shared_expert_size and dense_layers need "
                   "num_experts > 0")
        # a list from JSON (exports store the config as JSON) or NumPy: a tuple of floats, so
        # the frozen config stays hashable and compares equal after a round trip
        object.__setattr__(self, "rope_freq_factors",
                           tuple(float(f) for f in self.rope_freq_factors))
        if self.rope_freq_factors:
            _check(self.position == "rope", "rope_freq_factors need position='rope'")
            _check(all(f > 0 and math.isfinite(f) for f in self.rope_freq_factors),
                   "rope_freq_factors must be positive and finite")
        self._check_families()

    def _check_families(self) -> None:
        """The fields the newer families (Qwen3, Mistral, Gemma, Phi-3) added."""
        object.__setattr__(self, "sliding_windows", tuple(int(w) for w in self.sliding_windows))
        if self.sliding_windows:
            _check(len(self.sliding_windows) == self.num_layers,
                   f"sliding_windows has {len(self.sliding_windows)} entries for "
                   f"{self.num_layers} layers")
            _check(all(w >= 0 for w in self.sliding_windows),
                   "sliding_windows must be 0 (global) or positive")
        _check(self.rotary_dim >= 0 and self.rotary_dim % 2 == 0
               and self.rotary_dim <= self.head_dim,
               f"rotary_dim must be even and at most head_dim {self.head_dim}, "
               f"got {self.rotary_dim}")
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.rope_freq_factors:
            width = "head_dim" if self.rotary_dim == self.head_dim else "rotary_dim"
            _check(len(self.rope_freq_factors) == self.rotary_dim // 2,
                   f"rope_freq_factors has {len(self.rope_freq_factors)} entries; {width} "
                   f"{self.rotary_dim} rotates {self.rotary_dim // 2} pairs")
        object.__setattr__(self, "rope_long_freq_factors",
                           tuple(float(f) for f in self.rope_long_freq_factors))
        if self.rope_long_freq_factors:
            _check(len(self.rope_long_freq_factors) == len(self.rope_freq_factors)
                   and self.rope_original_context > 0,
                   "rope_long_freq_factors need rope_freq_factors of the same length and "
                   "rope_original_context > 0")
            _check(all(f > 0 and math.isfinite(f) for f in self.rope_long_freq_factors),
                   "rope_long_freq_factors must be positive and finite")
        _check(self.qk_norm_scope in ("head", "projection"),
               f"unknown qk_norm_scope {self.qk_norm_scope!r}; use head or projection")
        _check(self.qk_norm or self.qk_norm_scope == "head",
               "qk_norm_scope 'projection' needs qk_norm")
        for name in ("local_rope_theta", "attn_scale", "attn_softcap", "final_softcap"):
            value = getattr(self, name)
            _check(value >= 0 and math.isfinite(value), f"{name} must be 0 or positive")
        for name in ("rope_attention_factor", "embedding_multiplier"):
            value = getattr(self, name)
            _check(value > 0 and math.isfinite(value), f"{name} must be positive")

    @property
    def qk_norm_widths(self) -> tuple[int, int]:
        """Widths of QK-norm's q and k scales: head_dim, or the whole projections'."""
        if self.qk_norm_scope == "projection":
            return self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.head_dim, self.head_dim

    def layer_has_experts(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (else one dense MLP)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def layer_window(self, layer: int) -> int:
        """Layer `layer`'s attention window (0: global)."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def layer_rope(self, layer: int) -> tuple[float, tuple[float, ...], float]:
        """(theta, freq_factors, attention_factor) of layer `layer`'s RoPE."""
        if self.local_rope_theta and self.layer_window(layer):
            return self.local_rope_theta, (), 1.0
        return self.rope_theta, self.rope_freq_factors, self.rope_attention_factor

    @property
    def score_scale(self) -> float:
        """What q.k is multiplied by before the softmax (and the soft cap)."""
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)


@dataclass(frozen=True)
class LSTMConfig:
    """A stacked-LSTM language model; its decoder state is (h, c) per layer."""

    vocab_size: int
    max_seq_len: int
    """Longest sequence served; an LSTM has no hard limit, but serving needs one."""
    hidden_size: int
    """Embedding width and LSTM units (equal so the head can be tied)."""
    num_layers: int
    tie_embeddings: bool = True
    family: Literal["lstm"] = "lstm"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "hidden_size", "num_layers"):
            _check(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")


ModelConfig = TransformerConfig | LSTMConfig


def model_config_from_dict(values: dict[str, Any]) -> ModelConfig:
    """Rebuilds a model config from `dataclasses.asdict` output."""
    family = values.get("family", "transformer")
    cls = {"transformer": TransformerConfig, "lstm": LSTMConfig}.get(family)
    if cls is None:
        raise ConfigError(f"unknown model family {family!r}; known: transformer, lstm")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"unknown {family} config keys: {sorted(unknown)}")
    return cls(**values)


def gpt2_config(vocab_size: int = 50257, max_seq_len: int = 1024, hidden_size: int = 768,
                num_layers: int = 12, num_heads: int = 12) -> TransformerConfig:
    """GPT-2's architecture (defaults: GPT-2 small, 124M parameters)."""
    return TransformerConfig(
        vocab_size=vocab_size, max_seq_len=max_seq_len, hidden_size=hidden_size,
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_heads,
        intermediate_size=4 * hidden_size)


def llama_config(vocab_size: int, max_seq_len: int, hidden_size: int, num_layers: int,
                 num_heads: int, num_kv_heads: int, intermediate_size: int,
                 tie_embeddings: bool = False, rope_theta: float = 10000.0,
                 norm_eps: float = 1e-5,
                 rope_freq_factors: tuple[float, ...] = ()) -> TransformerConfig:
    """The Llama family's architecture: RoPE, RMSNorm, SwiGLU, GQA, no biases."""
    return TransformerConfig(
        vocab_size=vocab_size, max_seq_len=max_seq_len, hidden_size=hidden_size,
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size, norm="rmsnorm", norm_eps=norm_eps,
        position="rope", rope_theta=rope_theta, rope_freq_factors=rope_freq_factors,
        mlp="swiglu", tie_embeddings=tie_embeddings, qkv_bias=False, out_bias=False,
        mlp_bias=False)


PRESETS: dict[str, ModelConfig] = {
    # The benchmark workload (docs/bench.md): GPT-2 small, random weights, never trained.
    "gpt2-small": gpt2_config(),
    "tiny-gpt2": gpt2_config(vocab_size=512, max_seq_len=128, hidden_size=64, num_layers=2,
                             num_heads=4),
    "tiny-llama": llama_config(vocab_size=512, max_seq_len=128, hidden_size=64, num_layers=2,
                               num_heads=4, num_kv_heads=2, intermediate_size=96),
    "tiny-lstm": LSTMConfig(vocab_size=512, max_seq_len=128, hidden_size=64, num_layers=2),
}


def preset(name: str) -> ModelConfig:
    """Returns a named architecture, or raises UnknownPresetError listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPresetError(
            f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None


@dataclass(frozen=True)
class GenerationConfig:
    """What an exported model carries besides its weights (assets/generation_config.json)."""

    model: ModelConfig
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    chat_template: str | None = None
    """A Jinja chat template (as in HF tokenizer_config.json), or None."""
    name: str = "model"
    add_bos_token: bool = False
    """Text prompts start with bos_token_id (Gemma): tokenizer_config.json's or the GGUF's
    `add_bos_token`."""

    def __post_init__(self) -> None:
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            _check(0 <= value < self.model.vocab_size,
                   f"{name} {value} is outside the vocabulary (size {self.model.vocab_size})")

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["family"] = self.model.family
        values["max_seq_len"] = self.model.max_seq_len
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "GenerationConfig":
        derived = ("family", "max_seq_len", "jit_compile", "cache_buckets")  # written by export
        values = {k: v for k, v in values.items() if k not in derived}
        values["model"] = model_config_from_dict(values["model"])
        return cls(**values)


@dataclass(frozen=True)
class TrainConfig:
    """How `tokenserve train` builds the built-in models."""

    seed: int = 0
    vocab_size: int = 8192
    """BPE vocabulary, special tokens included."""
    seq_len: int = 256
    batch_size: int = 16
    num_steps: int = 1600
    learning_rate: float = 1.5e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    holdout_fraction: float = 0.05
    """Share of corpus files held out for perplexity."""
    eval_batches: int = 20
    checkpoint_every: int = 250
    precision: Literal["bf16", "fp32"] = "bf16"
    """bf16 is mixed precision (float32 master weights) through oneDNN/AMX, measured 1.5x
    (Transformer) to 2.1x (LSTM) faster per step than float32 with XLA (a one-time
    comparison, in docs/benchmark-history.md)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "batch_size", "num_steps", "eval_batches",
                     "checkpoint_every"):
            _check(getattr(self, name) > 0, f"{name} must be positive")
        _check(0.0 < self.holdout_fraction < 0.5, "holdout_fraction must be in (0, 0.5)")
        _check(self.learning_rate > 0, "learning_rate must be positive")
        _check(self.precision in ("bf16", "fp32"), f"unknown precision {self.precision!r}")
