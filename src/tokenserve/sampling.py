"""What a request asks of sampling: `SamplingParams` (and its structured-output constraint).

Plain Python, no TensorFlow: every layer from the frontends down to the engine reads it. The
one host sampler that applies it is the engine's (`engine/sampler/`); outside the engine,
`token_stream.sample_tokens` runs that same sampler for one sequence.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tokenserve.errors import InvalidRequestError


MAX_N = 16
"""Most completions one request may ask for; more is an abusive request, not a workload."""
MAX_LOGPROBS = 20
"""Most top alternatives per token, as in the OpenAI API."""


class GuideKind(enum.Enum):
    """What a structured-output constraint is written in."""

    JSON_SCHEMA = "json_schema"
    """A JSON schema (as JSON text); `{"type": "object"}` is OpenAI's json_object mode."""
    REGEX = "regex"
    CHOICE = "choice"
    """One of a list of strings, exactly."""
    GRAMMAR = "grammar"
    """A Lark grammar (llguidance's dialect) or a GBNF grammar (llama.cpp's, with `::=`)."""


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text; the engine masks tokens that would break it.

    Example:
        >>> StructuredOutput(GuideKind.REGEX, r"\\d{3}-\\d{4}")
    """

    kind: GuideKind
    spec: str | tuple[str, ...]
    """The schema (JSON text), regex or grammar; for CHOICE, the strings."""

    def __post_init__(self) -> None:
        if self.kind is GuideKind.CHOICE:
            object.__setattr__(self, "spec", tuple(self.spec))
        elif not isinstance(self.spec, str):
            raise InvalidRequestError(f"a {self.kind.value} constraint must be a string")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request; the defaults are greedy decoding of up to 128 tokens.

    Field meanings follow vLLM's SamplingParams, so OpenAI-style requests map one to one. A
    value out of range raises InvalidRequestError with `param` naming the field.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    """0 is greedy (argmax); higher flattens the distribution."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; 1 keeps all."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely token; 0 keeps all."""
    repetition_penalty: float = 1.0
    """>1 discourages any token already in the prompt or output (CTRL-style divide/multiply)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it has been generated."""
    seed: int | None = None
    """Fixes the random stream, so the same request gives the same tokens in any batch."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; the matched string is left out of the text."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation, in addition to the model's eos."""
    ignore_eos: bool = False
    n: int = 1
    """Completions to generate for the prompt, each with its own random stream."""
    logprobs: int | None = None
    """Return the chosen token's logprob and this many top alternatives; None returns none."""
    structured: StructuredOutput | None = None
    """Constrains the output (JSON schema, regex, choice, grammar); None leaves it free.
    A constrained sequence ends with STOP as soon as its constraint is complete."""
    skip_special_tokens: bool = True
    """Special tokens are left out of the text; False keeps them (a reply whose tool calls
    open with a special token, as Mistral's `[TOOL_CALLS]`, is parsed from its text)."""

    def __post_init__(self) -> None:
        # Accept lists from JSON callers; the dataclass stays hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not 1 <= self.max_tokens <= 1_000_000:
            raise InvalidRequestError(f"max_tokens must be between 1 and 1000000, "
                                      f"got {self.max_tokens}", "max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}",
                                      "temperature")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}", "top_k")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 10], "
                                      f"got {self.repetition_penalty}", "repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}",
                                          name)
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {self.n}", "n")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be between 0 and {MAX_LOGPROBS}, "
                                      f"got {self.logprobs}", "logprobs")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")
        if len(self.stop) > 16:
            raise InvalidRequestError(f"at most 16 stop strings, got {len(self.stop)}", "stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative integers",
                                      "stop_token_ids")

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def needs_only_argmax(self) -> bool:
        """Each token is the argmax of the model's logits as they are: greedy, with no
        penalties, logprobs or structured output (the engine may then compute only what
        decides the argmax)."""
        return (self.temperature == 0.0 and not self.needs_penalties and self.logprobs is None
                and self.structured is None)

    @property
    def samples_by_noise(self) -> bool:
        """Plain temperature sampling, with no top-k, top-p or min-p cut: each token is then
        drawn as the argmax of the (penalized) logits plus temperature times Gumbel noise
        (engine/sampler/draw.py), which is a draw from their softmax."""
        return (self.temperature > 0.0 and self.top_k == 0 and self.top_p >= 1.0
                and self.min_p == 0.0)

    @property
    def needs_only_noisy_argmax(self) -> bool:
        """Each token is the argmax of the model's logits plus the sequence's own noise
        (none when greedy): greedy or plain temperature sampling, with no penalties,
        logprobs or structured output. The engine may then compute only what decides that
        argmax."""
        return ((self.temperature == 0.0 or self.samples_by_noise) and not self.needs_penalties
                and self.logprobs is None and self.structured is None)
