"""The encoder family's configuration: a BERT-style encoder, how its token states become one
vector (pooling, normalization), and whether it embeds or scores pairs. Plain data: the
server reads it from an export's assets without TensorFlow."""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass

from tokenserve.errors import ConfigError

ENCODER_CONFIG_FILE = "encoder_config.json"
"""An encoder export's assets/ file; its presence marks a version as an encoder."""


@dataclass(frozen=True)
class EncodedInput:
    """One input as the encoder reads it: a text with its special tokens, a (query,
    document) pair, or token ids as a client sent them."""

    token_ids: list[int]
    type_ids: list[int]
    """0 for the first text (and its special tokens), 1 for a pair's second."""

    @classmethod
    def from_ids(cls, token_ids: list[int]) -> "EncodedInput":
        return cls(list(token_ids), [0] * len(token_ids))


class Pooling(str, enum.Enum):
    """How token states become one vector, as sentence-transformers' Pooling names them."""

    MEAN = "mean"
    """Average over the real (unpadded) tokens."""
    CLS = "cls"
    """The first token's state ([CLS])."""
    LAST = "last"
    """The last real token's state (decoder-style embedders)."""
    MAX = "max"
    """Elementwise maximum over the real tokens."""


class EncoderTask(str, enum.Enum):
    """What an encoder export serves."""

    EMBED = "embed"
    """One vector per input (/v1/embeddings, the `embed` signature)."""
    SCORE = "score"
    """One relevance score per (query, document) pair (/v1/rerank, the `score` signature)."""


@dataclass(frozen=True)
class EncoderConfig:
    """A post-norm BERT encoder: learned positions, token types, GELU MLP.

    Example:
        >>> EncoderConfig(vocab_size=30522, hidden_size=384, num_layers=6, num_heads=12,
        ...               intermediate_size=1536, max_seq_len=256)
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    """Rows of the learned position table."""
    max_seq_len: int | None = None
    """Longest input served (sentence-transformers' max_seq_length); None: all positions."""
    type_vocab_size: int = 2
    norm_eps: float = 1e-12
    activation: str = "gelu"
    """gelu (erf, BERT's) or gelu_new (tanh approximation)."""
    pooling: Pooling = Pooling.CLS
    normalize: bool = False
    """Scale each embedding to unit L2 norm (sentence-transformers' Normalize module)."""
    num_labels: int = 0
    """0: an embedding model; >0: a sequence classifier over pooler(CLS), used for scores."""
    pad_token_id: int = 0
    name: str = "encoder"

    def __post_init__(self) -> None:
        object.__setattr__(self, "pooling", Pooling(self.pooling))
        if self.max_seq_len is None:
            object.__setattr__(self, "max_seq_len", self.max_position_embeddings)
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                      "intermediate_size", "max_position_embeddings", "max_seq_len",
                      "type_vocab_size"):
            if getattr(self, field) < 1:
                raise ConfigError(f"encoder {field} must be >= 1, got {getattr(self, field)}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not a multiple of "
                              f"num_heads {self.num_heads}")
        if self.max_seq_len > self.max_position_embeddings:
            raise ConfigError(f"max_seq_len {self.max_seq_len} exceeds the "
                              f"{self.max_position_embeddings} learned positions")
        if self.activation not in ("gelu", "gelu_new"):
            raise ConfigError(f"encoder activation {self.activation!r} is not supported; "
                              f"supported: gelu, gelu_new")
        if self.num_labels < 0:
            raise ConfigError(f"num_labels must be >= 0, got {self.num_labels}")

    @property
    def task(self) -> EncoderTask:
        return EncoderTask.SCORE if self.num_labels else EncoderTask.EMBED

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def output_size(self) -> int:
        """Length of one embedding (or of one row of logits)."""
        return self.num_labels or self.hidden_size

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "pooling": self.pooling.value}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "EncoderConfig":
        values = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})
