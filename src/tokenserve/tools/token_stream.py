"""One sequence's tokens outside the engine, sampled exactly as the engine samples them.

`tokenserve generate` (`ExportedModel`, `LiteRTModel`) steps an export's own signatures and
picks each token here with the engine's sampler (`engine/sampler/`), so one seed gives the
same tokens on the command line as through the offline `LLM` and the server, given the same
logits (docs/architecture.md#one-host-sampler). Plain NumPy: no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from tokenserve.engine.sampler.draw import SequenceSampler, sample_batch
from tokenserve.sampling import SamplingParams


def sample_tokens(logits: np.ndarray, decode: Callable[[int, int], np.ndarray],
                  params: SamplingParams, prompt_ids: list[int], vocab_size: int,
                  eos_token_id: int) -> Iterator[int]:
    """Yields up to `params.max_tokens` token ids of one sequence, as the engine samples them.

    Args:
        logits: float [vocab], the prefill's next-token logits after `prompt_ids`.
        decode: (token id, its position) -> float [vocab], the logits after that token.
        params: the request's sampling parameters (its seed is the engine's sequence 0's).
        prompt_ids: the prompt, for the repetition penalty.
        vocab_size, eos_token_id: the model's; eos ends the sequence unless `ignore_eos`.
    """
    sampler = SequenceSampler(params, 0, vocab_size, prompt_ids)
    position = len(prompt_ids)
    for step in range(params.max_tokens):
        (token,), _ = sample_batch(logits[None], [sampler])
        sampler.observe(token)
        yield token
        if (token == eos_token_id and not params.ignore_eos) or step + 1 == params.max_tokens:
            return
        logits = decode(token, position + step)
