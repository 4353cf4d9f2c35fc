"""The perplexity gate a pruned model must pass before `tokenserve prune` exports it.

Pruning trades quality for size, and how much quality depends on the model, the fractions
removed and the fine-tune after: the built-in Transformer less a quarter of its heads is
+25 % held-out perplexity with no fine-tune and +1.7 % after 300 distilled steps. So the
pruned model and its source are scored on the same held-out windows (text that neither head
scoring nor the fine-tune learns from), and a rise past the limit (`tokenserve optimize`'s
gate, 5 % by default) is refused unless the user forces it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from tokenserve.errors import ConfigError
from tokenserve.tools.evaluate import perplexity, stream_windows
from tokenserve.tools.optimize import GATE_PERCENT, rejected

GATE_CONTEXT = 256  # tokens a held-out window reads (capped by the model's context), as optimize
GATE_TOKENS = 8192  # held-out tokens scored, as optimize's default --eval-tokens


@dataclass(frozen=True)
class GateConfig:
    """How a pruned model is held to its source."""

    max_increase_percent: float = GATE_PERCENT
    """Largest held-out perplexity rise accepted, in percent of the source's perplexity."""
    max_tokens: int = GATE_TOKENS
    """Held-out tokens scored, in windows spread evenly over the held-out text."""
    context: int = GATE_CONTEXT
    """Tokens each window reads (capped by the model's context length)."""

    def __post_init__(self):
        if not self.max_increase_percent >= 0:
            raise ConfigError(f"--max-perplexity-increase must be a percentage of at least 0, "
                              f"got {self.max_increase_percent}")
        if self.max_tokens < 1:
            raise ConfigError(f"--eval-tokens must be positive, got {self.max_tokens}")
        if self.context < 1:
            raise ConfigError(f"the gate's context must be positive, got {self.context}")


@dataclass(frozen=True)
class GateResult:
    """Held-out perplexity of a pruned model against its source, and the verdict."""

    source_perplexity: float
    pruned_perplexity: float
    delta_percent: float
    """(pruned / source - 1) * 100: positive when pruning made the model worse."""
    max_increase_percent: float
    num_tokens: int
    num_windows: int
    context: int
    held_out: str
    """What was scored, in words (`the built-in held-out split`, `the last 10 % of --data`)."""

    @property
    def passed(self) -> bool:
        return not rejected(self.delta_percent, self.max_increase_percent)

    def summary(self) -> str:
        """One line: both perplexities, the change and the limit."""
        return (f"held-out perplexity {self.source_perplexity:.3f} -> "
                f"{self.pruned_perplexity:.3f} ({self.delta_percent:+.2f} %, limit "
                f"+{self.max_increase_percent:g} %) on {self.num_tokens:,} tokens of "
                f"{self.held_out}")

    def refusal(self, finetune_steps: int) -> str:
        """Why the export was refused, and what to try instead."""
        advice = ("fine-tune after pruning (--finetune-steps 300, say)" if not finetune_steps
                  else f"fine-tune longer than --finetune-steps {finetune_steps}")
        return (f"refused to export: the pruned model's held-out perplexity is "
                f"{self.pruned_perplexity:.3f} against {self.source_perplexity:.3f} before "
                f"pruning ({self.delta_percent:+.2f} %), past the "
                f"+{self.max_increase_percent:g} % limit of --max-perplexity-increase. To "
                f"pass, {advice} or prune less (--heads, --mlp); --force exports it anyway.")

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), passed=self.passed)


def check_pruned(source, pruned, held_out_stream: np.ndarray, held_out: str,
                 config: GateConfig = GateConfig()) -> GateResult:
    """Scores `pruned` and `source` on the same windows of `held_out_stream` (token ids of
    text that head scoring and the fine-tune did not learn from), described by `held_out`."""
    context = min(config.context, pruned.config.max_seq_len, source.config.max_seq_len)
    windows = stream_windows(held_out_stream, context, config.max_tokens)
    scored = perplexity(pruned, windows, reference=source)
    return GateResult(source_perplexity=scored.reference_perplexity,
                      pruned_perplexity=scored.perplexity, delta_percent=scored.delta_percent,
                      max_increase_percent=config.max_increase_percent,
                      num_tokens=scored.num_tokens, num_windows=scored.num_windows,
                      context=scored.context, held_out=held_out)
