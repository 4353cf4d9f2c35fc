"""SamplingParams' checks, and `token_stream.sample_tokens`: one sequence outside the engine,
sampled by the engine's own sampler (docs/architecture.md#one-host-sampler)."""

import numpy as np
import pytest

from tokenserve.engine.sampler.draw import SequenceSampler, sample_batch
from tokenserve.errors import InvalidRequestError
from tokenserve.sampling import SamplingParams
from tokenserve.tools.token_stream import sample_tokens

LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
EOS = 3


def stream(params, logits=LOGITS, prompt=(1, 2)):
    """sample_tokens over a model whose next-token logits are always `logits`."""
    return list(sample_tokens(logits, lambda token, position: logits, params, list(prompt),
                              len(logits), EOS))


def test_greedy_takes_the_argmax_until_max_tokens():
    assert stream(SamplingParams(max_tokens=5)) == [0] * 5


def test_the_stream_is_the_engines_sequence_zero():
    """Same seed, same tokens as the engine's SequenceSampler for the request's first
    sequence: the CLI and the server draw from one random stream."""
    params = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    engine = SequenceSampler(params, 0, len(LOGITS), [1, 2])
    expected = []
    for _ in range(40):
        expected.append(sample_batch(LOGITS[None], [engine])[0][0])
        engine.observe(expected[-1])
    assert stream(params) == expected
    assert len(set(expected)) > 1  # really sampled, not greedy


def test_eos_ends_the_stream_unless_ignored():
    eos_first = np.log(np.array([0.01, 0.01, 0.01, 0.97], np.float32))
    assert stream(SamplingParams(max_tokens=8), eos_first) == [EOS]
    assert stream(SamplingParams(max_tokens=8, ignore_eos=True), eos_first) == [EOS] * 8


def test_penalties_apply_outside_the_engine_too():
    """The engine's sampler counts what it emitted: a frequency penalty moves greedy off a
    token it keeps picking (the old CLI sampler ignored penalties)."""
    close = np.log(np.array([0.4, 0.35, 0.2, 0.05], np.float32))
    tokens = stream(SamplingParams(max_tokens=6, frequency_penalty=2.0), close)
    assert tokens[0] == 0 and 1 in tokens


def test_decode_gets_each_token_and_its_position():
    seen = []

    def decode(token, position):
        seen.append((token, position))
        return LOGITS

    list(sample_tokens(LOGITS, decode, SamplingParams(max_tokens=3), [5, 6, 7], 4, EOS))
    assert seen == [(0, 3), (0, 4)]  # the last token is not decoded


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-1), dict(top_k=-2),
                                    dict(top_p=0.0), dict(top_p=1.5), dict(min_p=2.0),
                                    dict(repetition_penalty=0.0), dict(presence_penalty=3.0),
                                    dict(frequency_penalty=-3.0), dict(n=17), dict(logprobs=21),
                                    dict(stop=("",)), dict(stop=tuple("abcdefghijklmnopq")),
                                    dict(stop_token_ids=(-1,))])
def test_absurd_parameters_are_rejected_naming_the_field(kwargs):
    """The error carries the field as data (frontends put it in their error bodies)."""
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**kwargs)
    assert caught.value.param == next(iter(kwargs))
