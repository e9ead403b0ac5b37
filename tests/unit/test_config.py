"""Config: schema, YAML loading through init's resolver (the production loader), --set overrides, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from slimectl.contract.config import apply_overrides, config_diff, load_config, parse_override
from slimectl.contract.config_schema import SECTIONS, STAGE_SECTIONS, SlimectlConfig
from slimectl.contract.errors import ConfigError, UsageError


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_cover_every_section():
    cfg = load_config(None)
    assert set(SECTIONS) <= set(cfg.to_dict())
    assert cfg.algorithm.advantage_estimator == "grpo"
    assert cfg.engine.host == "127.0.0.1"  # engines bind to loopback unless told otherwise


def test_yaml_and_overrides_compose_later_wins(tmp_path):
    p = write(tmp_path, "train:\n  lr: 1.0e-5\nrollout:\n  batch_size: 4\n")
    cfg = load_config(p, ["train.lr=2e-5", "rollout.stop=['</s>', 'END']", "train.lr=3e-5", "engine.sglang_args={a: 1}"])
    assert cfg.train.lr == pytest.approx(3e-5)
    assert cfg.rollout.batch_size == 4
    assert cfg.rollout.stop == ["</s>", "END"]
    assert cfg.engine.sglang_args == {"a": 1}


def test_file_errors_are_reported_against_the_file_even_with_overrides(tmp_path):
    p = write(tmp_path, "train:\n  lrr: 1\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p, ["train.lr=1"])
    assert f"config file {p}:" in str(ei.value) and "--set" not in str(ei.value)


def test_relative_paths_resolve_against_the_file_and_overrides_against_cwd(tmp_path, monkeypatch):
    (tmp_path / "cfgdir").mkdir()
    p = write(tmp_path / "cfgdir", "model:\n  path: ../m\ndata:\n  prompt_data: d.jsonl@[0:4]\n  eval_data:\n    x: e.jsonl\n")
    cfg = load_config(p)
    assert cfg.model.path == str(tmp_path / "m")
    assert cfg.data.prompt_data == str(tmp_path / "cfgdir" / "d.jsonl") + "@[0:4]"  # the slice survives
    assert cfg.data.eval_data == {"x": str(tmp_path / "cfgdir" / "e.jsonl")}
    monkeypatch.chdir(tmp_path)
    cfg = load_config(p, ["model.path=other"])
    assert cfg.model.path == str(tmp_path / "other")


def test_parse_override_types():
    assert parse_override("a.b=1") == (["a", "b"], 1)
    assert parse_override("a.b=true") == (["a", "b"], True)
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a.b=x=y") == (["a", "b"], "x=y")
    assert parse_override("a.b=") == (["a", "b"], None)
    for bad in ("nodot", "=1", "a..b=1", ".a=1"):
        with pytest.raises(ConfigError):
            parse_override(bad)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("train:\n  lrr: 1\n", ["unknown config key 'train.lrr'", "did you mean 'train.lr'"]),
        ("trian:\n  lr: 1\n", ["unknown config key 'trian'", "did you mean 'train'"]),
        ("rollout:\n  temperature: -1\n", ["rollout.temperature = -1", "greater than or equal to 0"]),
        ("algorithm:\n  kl_loss_type: k9\n", ["algorithm.kl_loss_type = \"k9\"", "'k1'", "'low_var_kl'"]),
        ("train:\n  tp: two\n", ["train.tp = \"two\"", "valid integer"]),
        ("rollout:\n  batch_size: 8\n  over_sampling_batch_size: 4\n", ["over_sampling_batch_size (4)", "batch_size (8)"]),
        ("train:\n  lr: 1.0e-6\n  min_lr: 1.0e-3\n", ["train.min_lr", "<= train.lr"]),
        ("config_version: 9\n", ["config_version 9 is not supported"]),
        ("- a\n- b\n", ["must hold a mapping"]),
        ("train: [1\n", ["line 2", "invalid YAML"]),
    ],
)
def test_file_errors_name_file_key_value_and_allowed(tmp_path, text, expected):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert str(p) in msg
    assert "\n" not in msg
    for piece in expected:
        assert piece in msg, msg


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.lrr=1", "unknown config key 'train.lrr'"),
        ("train=1", "'train' is a section"),
        ("train.lr.x=1", "'train.lr' is a value, not a section"),
        ("rollout.top_p=1.5", "rollout.top_p = 1.5"),
    ],
)
def test_override_errors(override, expected):
    with pytest.raises(ConfigError) as ei:
        load_config(None, [override])
    assert expected in str(ei.value)
    assert f"--set {override}" in str(ei.value) or "--set overrides" in str(ei.value)


def test_config_errors_are_usage_errors_exit_2():
    assert issubclass(ConfigError, UsageError) and ConfigError.exit_code == 2


def test_stage_sections_restrict_overrides():
    base = SlimectlConfig().to_dict()
    apply_overrides(base, ["train.lr=1"], STAGE_SECTIONS["train"], "train")
    with pytest.raises(ConfigError, match="slimectl train may only override"):
        apply_overrides(base, ["rollout.batch_size=1"], STAGE_SECTIONS["train"], "train")
    for stage, sections in STAGE_SECTIONS.items():
        assert set(sections) <= set(SECTIONS) | {"name"}, stage


def test_yaml_roundtrip_and_fingerprint():
    cfg = load_config(None, ["train.lr=1e-4", "rollout.stop=[a]"])
    again = SlimectlConfig.model_validate(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg and again.fingerprint() == cfg.fingerprint()
    other = load_config(None, ["train.lr=2e-4"])
    assert other.fingerprint() != cfg.fingerprint()
    assert config_diff(cfg, other) == ["rollout.stop", "train.lr"]


def test_assignment_is_validated():
    cfg = SlimectlConfig()
    with pytest.raises(Exception):
        cfg.train.tp = 0


def test_the_loader_makes_paths_absolute_file_paths_against_the_file_set_paths_against_cwd(tmp_path, monkeypatch):
    """The loader ``slimectl init`` and ``rl --config`` use: relative paths never reach the frozen config."""
    conf = tmp_path / "conf"
    conf.mkdir()
    p = write(conf, "model:\n  path: models/m\ndata:\n  prompt_data: d.jsonl@[2:5]\n  eval_data: {aime: ../e.jsonl}\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(p)
    assert cfg.model.path == str(conf / "models" / "m")
    assert cfg.data.prompt_data == f"{conf / 'd.jsonl'}@[2:5]"
    assert cfg.data.eval_data == {"aime": str(tmp_path / "e.jsonl")}
    cfg = load_config(p, ["model.ref_path=ref", "data.prompt_data=/abs/x.parquet"])
    assert cfg.model.ref_path == str(tmp_path / "ref") and cfg.data.prompt_data == "/abs/x.parquet"
    assert cfg.model.path == str(conf / "models" / "m")


def test_a_bare_off_or_on_is_the_word_where_the_choice_offers_it(tmp_path):
    """YAML reads `off`/`on` as false/true; a choice that offers "off"/"on" takes the word back, from a file or
    from --set; elsewhere a boolean stays a boolean (and a wrong one is refused)."""
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  async_mode: off\nlogging:\n  progress: on\n")
    cfg = load_config(p)
    assert (cfg.rollout.async_mode, cfg.logging.progress) == ("off", "on")
    cfg = load_config(None, ["rollout.async_mode=fully_async", "rollout.async_mode=off", "logging.progress=off"])
    assert (cfg.rollout.async_mode, cfg.logging.progress) == ("off", "off")
    with pytest.raises(ConfigError, match="rollout.async_mode"):
        load_config(None, ["rollout.async_mode=on"])  # no "on" among its choices
    assert load_config(None, ["logging.tensorboard=off"]).logging.tensorboard is False
