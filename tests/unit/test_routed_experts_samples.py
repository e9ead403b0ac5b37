"""Routing replay, rollout side: the engine's routed_experts stored on the Sample and in samples.parquet."""

from __future__ import annotations

import base64
from array import array

import pytest

from slimectl.contract.samples import Sample, decode_routed_experts, read_samples, write_samples


def b64(rows: list[list[int]]) -> str:
    return base64.b64encode(array("i", [x for r in rows for x in r]).tobytes()).decode()


def route(pos: int, layers: int = 2, k: int = 2) -> list[int]:
    return [(pos * 7 + j) % 4 for j in range(layers * k)]


def test_routes_follow_the_response_through_turns_and_parquet(tmp_path):
    s = Sample(index=0, tokens=[1, 2, 3], prompt="p")
    # turn 1: prompt 3 + 2 generated -> T-1 = 4 rows, positions 0..3
    s.append_response_tokens([10, 11], [-0.1, -0.2], True,
                             {"routed_experts": b64([route(p) for p in range(4)]), "weight_version": "1"})
    assert s.rollout_routed_experts == [route(p) for p in range(4)]
    # an observation (tool output): no routes yet for it
    s.append_response_tokens([20, 21, 22], None, False)
    # turn 2 asked from position 4 on (routed_experts_start_len = rows so far): 8 tokens + 2 -> rows 4..8
    s.append_response_tokens([12, 13], [-0.3, -0.4], True,
                             {"routed_experts": b64([route(p) for p in range(4, 9)]), "routed_experts_start_len": 4})
    assert len(s.tokens) == 10 and s.rollout_routed_experts == [route(p) for p in range(9)]
    # a sample without routes stays None
    other = Sample(index=1, tokens=[1, 2], prompt="q")
    other.append_response_tokens([5], [-1.0], True, {"weight_version": "1"})
    path = tmp_path / "samples.parquet"
    write_samples([s, other], path)
    back = read_samples(path)
    assert back[0].rollout_routed_experts == [route(p) for p in range(9)]
    assert back[1].rollout_routed_experts is None
    assert back[0].tokens == s.tokens


def test_a_restart_from_position_zero_replaces_the_rows():
    s = Sample(index=0, tokens=[1, 2, 3], prompt="p")
    s.append_response_tokens([4], [-0.1], True, {"routed_experts": b64([[0, 1]] * 3)})
    s.append_response_tokens([5], [-0.1], True, {"routed_experts": b64([[2, 3]] * 4)})
    assert s.rollout_routed_experts == [[2, 3]] * 4


def test_bad_routes_are_rejected():
    with pytest.raises(ValueError, match="not a multiple of 3 positions"):
        decode_routed_experts(b64([[1, 2, 3, 4]]), 3)
    s = Sample(index=0, tokens=[1, 2], prompt="p", response_length=0, rollout_routed_experts=[[0]] * 2)
    with pytest.raises(ValueError, match="at most T-1"):
        s.validate()


def test_replay_refuses_samples_without_fitting_routes_and_dense_models():
    from slimectl.backends.megatron.routing_replay import RoutingReplay, RoutingReplayError, sample_routes
    from slimectl.contract.errors import ConfigError

    s = Sample(index=4, tokens=[1, 2, 3, 4], prompt="p", response_length=1,
               rollout_routed_experts=[[0, 1, 2, 3]] * 3)
    assert sample_routes(s, 2, 2).tolist() == [[[0, 1], [2, 3]]] * 3
    s.rollout_routed_experts = [[0, 1, 2, 3]] * 2  # one row short (the rollout stopped recording)
    with pytest.raises(RoutingReplayError, match=r"sample 4 has rollout_routed_experts of shape \(2, 4\), "
                                                 r"expected \[3, 4\]") as e:
        sample_routes(s, 2, 2)
    print(e.value)
    assert e.value.exit_code == 2
    s.rollout_routed_experts = None
    with pytest.raises(RoutingReplayError, match="sample 4 has no rollout_routed_experts; roll out with") as e:
        sample_routes(s, 2, 2)
    print(e.value)
    with pytest.raises(ConfigError, match="needs an MoE model") as e:
        RoutingReplay([], num_layers=2, topk=0)
    print(e.value)
