"""train.recompute and slime's --recompute-* flags (issue #16 item 5): config keys and the
``init --from-slime`` mapping, without building a model."""

from __future__ import annotations

import pytest

from slimectl.contract.config_schema import TrainSection
from slimectl.stages.init.slime_launch import translate_slime_args


def test_slime_full_recompute_maps_to_train_recompute():
    tr = translate_slime_args(["--recompute-granularity", "full", "--recompute-method", "block",
                               "--recompute-num-layers", "4"])
    t = tr.data["train"]
    assert (t["recompute"], t["recompute_method"], t["recompute_num_layers"]) == ("full", "block", 4)
    assert "--recompute-granularity" not in {f for f, _ in tr.ignored}


def test_slime_selective_recompute_is_left_out_with_the_reason():
    tr = translate_slime_args(["--recompute-granularity", "selective"])
    assert "recompute" not in tr.data.get("train", {})
    (why,) = [w for f, w in tr.ignored if f == "--recompute-granularity"]
    assert "selective" in why and "train.recompute" in why


def test_recompute_keys_are_checked():
    assert TrainSection().recompute == "auto"
    with pytest.raises(ValueError, match="recompute"):
        TrainSection(recompute="selective")
    with pytest.raises(ValueError, match="recompute_num_layers"):
        TrainSection(recompute_num_layers=0)


def test_auto_recompute_is_full_only_where_measured():
    from slimectl.backends.megatron.recompute import recompute_mode
    from slimectl.contract.errors import ConfigError

    assert recompute_mode(TrainSection()) == "full"
    assert recompute_mode(TrainSection(), pp=2) == "none"
    assert recompute_mode(TrainSection(), moe=True) == "none"
    assert recompute_mode(TrainSection(use_rollout_routing_replay=True)) == "none"
    assert recompute_mode(TrainSection(recompute="none")) == "none"
    assert recompute_mode(TrainSection(recompute="full"), pp=2) == "full"
    with pytest.raises(ConfigError, match="train.recompute full is not supported for MoE"):
        recompute_mode(TrainSection(recompute="full"), moe=True)
