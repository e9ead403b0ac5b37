"""bench/ppo_vs_grpo.py's EV bound: the explained variance of the best critic that sees what ours
sees, on hand-made samples whose reward the critic can read only after a sampled token."""

from __future__ import annotations

import importlib.util

import pytest

from slimectl.contract.samples import Sample
from tests.helpers import ROOT


def bench():
    spec = importlib.util.spec_from_file_location("ppo_vs_grpo", ROOT / "bench" / "ppo_vs_grpo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sample(prompt, resp, reward):
    s = Sample(tokens=list(prompt) + list(resp), response_length=len(resp))
    s.reward = reward
    return s


def test_the_ev_bound_explains_only_what_follows_the_sampled_token():
    # response [7, d, 9]: reward d == 1, half the samples. The values of tokens 0 and 1 are read before d is
    # sampled (the prompt's mean, 0.5); the value of token 2 has seen d (the reward itself). With lambd = 1 every
    # return is the reward: residuals +-0.5 on two of three tokens, 0 on the third: EV = 1 - (2/3) = 1/3.
    samples = [sample([3, 4], [7, d, 9], float(d == 1)) for d in (1, 0, 1, 0)]
    b = bench()
    assert b.oracle_explained_variance(samples, 1.0, 1.0) == pytest.approx(1 / 3)
    # a reward fixed by the prompt: every value knows it, returns have no variance -> 0 (the metric's convention);
    # two prompts of different rewards: every value is exact -> 1
    assert b.oracle_explained_variance([sample([3, 4], [7, 9], 1.0)] * 2, 1.0, 1.0) == 0.0
    two = [sample([3, 4], [7, 9], 1.0), sample([3, 5], [7, 9], 0.0)]
    assert b.oracle_explained_variance(two, 1.0, 0.95) == pytest.approx(1.0)
