"""EncoderBatchConfig: how the encoder batcher (encoder_batcher.py) batches and admits."""

from __future__ import annotations

from dataclasses import dataclass

from tokenserve.engine.config import EngineConfig
from tokenserve.errors import ConfigError


@dataclass(frozen=True)
class EncoderBatchConfig:
    """How the encoder batches and admits."""

    max_batch_inputs: int = 32
    """Most inputs (rows) in one batch."""
    max_batch_tokens: int = 8192
    """Most padded tokens (rows x longest) in one batch; one input always fits."""
    max_queue_requests: int = 1024
    """Waiting requests beyond this are refused with QueueFullError (HTTP 429)."""
    max_queue_tokens: int = 1_000_000
    """Waiting input tokens beyond this are refused with QueueFullError."""
    batch_wait_s: float = 0.0
    """When idle, wait this long after the first arrival for others to join the batch."""
    warm_up: bool = True
    """Compile the programs of one-sentence batches before serving (EncoderRunner.warm_up);
    False: each shape compiles when a batch first needs it."""

    def __post_init__(self) -> None:
        for name in ("max_batch_inputs", "max_batch_tokens", "max_queue_requests",
                     "max_queue_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_wait_s < 0:
            raise ConfigError(f"batch_wait_s must be >= 0, got {self.batch_wait_s}")

    @classmethod
    def from_engine_config(cls, engine: EngineConfig) -> "EncoderBatchConfig":
        """The server's engine flags, read for an encoder: --max_num_seqs rows a batch, the
        same queue limits and batch wait."""
        return cls(max_batch_inputs=engine.max_num_seqs,
                   max_queue_requests=engine.max_queue_requests,
                   max_queue_tokens=engine.max_queue_tokens, batch_wait_s=engine.batch_wait_s)
