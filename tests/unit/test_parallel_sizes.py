"""TP/PP sizes a model cannot be split into are refused with one line that lists the sizes that work."""

from __future__ import annotations

import pytest

from slimectl.backends.hf.arch import arch_from_config, check_parallel_sizes, valid_pp_sizes, valid_tp_sizes
from slimectl.contract.errors import UsageError

# SmolLM2-135M's shape: 9 attention heads, 3 key/value heads, 30 layers.
SMOLLM2 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
           "max_position_embeddings": 8192, "tie_word_embeddings": True}


def test_valid_sizes_are_the_common_divisors():
    arch = arch_from_config(SMOLLM2)
    assert valid_tp_sizes(arch) == [1, 3]
    assert valid_pp_sizes(arch) == [1, 2, 3, 5, 6, 10, 15, 30]
    # the intermediate size counts too: 8 heads / 8 kv heads but 12 MLP rows -> 1, 2, 4
    assert valid_tp_sizes(arch_from_config({**SMOLLM2, "hidden_size": 64, "num_attention_heads": 8,
                                            "num_key_value_heads": 8, "intermediate_size": 12})) == [1, 2, 4]


def test_errors_list_the_valid_sizes():
    arch = arch_from_config(SMOLLM2)
    check_parallel_sizes(arch, 3, 5)  # fine
    with pytest.raises(UsageError) as exc:
        check_parallel_sizes(arch, 2, 1)
    assert str(exc.value) == ("--tp 2 must divide num_attention_heads (9), num_key_value_heads (3) and "
                              "intermediate_size (1536) of this model; valid --tp sizes: 1, 3")
    assert exc.value.exit_code == 2
    with pytest.raises(UsageError) as exc:
        check_parallel_sizes(arch, 1, 4, pp_name="train.pp")
    assert str(exc.value) == ("train.pp 4 must divide num_hidden_layers (30) of this model; "
                              "valid train.pp sizes: 1, 2, 3, 5, 6, 10, 15, 30")


@pytest.fixture(scope="module")
def nine_heads(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("m9") / "m9", hidden_size=72, num_heads=9, num_kv_heads=3,
                            intermediate_size=96, num_layers=3, vocab_size=300)


def test_convert_tp2_on_nine_heads(cli, nine_heads, tmp_path):
    res = cli("convert", "--hf", nine_heads, "--out", tmp_path / "o", "--tp", "2")
    assert res.exit_code == 2
    assert res.output.strip().splitlines()[-1].endswith("valid --tp sizes: 1, 3"), res.output
    res = cli("convert", "--hf", nine_heads, "--out", tmp_path / "o", "--pp", "2")
    assert res.exit_code == 2 and "valid --pp sizes: 1, 3" in res.output, res.output
    assert not (tmp_path / "o").exists()


def test_train_tp2_on_nine_heads_fails_before_launching(cli, nine_heads, tmp_path):
    assert cli("init", tmp_path / "run", "--set", f"model.path={nine_heads}").exit_code == 0
    res = cli("train", "-r", tmp_path / "run", "--set", "train.tp=2")
    assert res.exit_code == 2 and "launching" not in res.output, res.output
    assert res.output.strip().splitlines()[-1] == (
        "Error: train.tp 2 must divide num_attention_heads (9), num_key_value_heads (3) and intermediate_size (96) "
        "of this model; valid train.tp sizes: 1, 3"), res.output
