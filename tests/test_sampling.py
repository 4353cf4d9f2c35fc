"""The NumPy sampler used for token-by-token generation."""

import numpy as np
import pytest

from tokenserve.errors import InvalidRequestError
from tokenserve.sampling import Sampler, SamplingParams

LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05]))


def draws(params, n=2000):
    sampler = Sampler(params)
    return np.bincount([sampler(LOGITS) for _ in range(n)], minlength=4) / n


def test_greedy_takes_the_argmax():
    assert Sampler(SamplingParams())(LOGITS) == 0


def test_top_k_and_top_p_cut_the_tail():
    assert draws(SamplingParams(temperature=1.0, top_k=2, seed=0))[2:].sum() == 0
    # top_p=0.7: tokens 0 and 1 reach it (0.5 before token 1 < 0.7), token 2 does not
    assert draws(SamplingParams(temperature=1.0, top_p=0.7, seed=0))[2:].sum() == 0
    full = draws(SamplingParams(temperature=1.0, seed=0))
    np.testing.assert_allclose(full, [0.5, 0.3, 0.15, 0.05], atol=0.04)


def test_seed_reproduces_the_stream():
    params = SamplingParams(temperature=1.0, seed=11)
    a, b = Sampler(params), Sampler(params)
    assert [a(LOGITS) for _ in range(50)] == [b(LOGITS) for _ in range(50)]


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-1),
                                    dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)])
def test_absurd_parameters_are_rejected(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)
