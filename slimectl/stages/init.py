"""``slimectl init``: resolve a config and freeze it into a new run directory."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimectl.contract.config import (
    STAGE_SECTIONS,
    SlimectlConfig,
    apply_overrides,
    build_config,
    load_yaml_file,
)
from slimectl.contract.errors import ConfigError
from slimectl.contract.logs import quiet_hf_progress
from slimectl.contract.rundir.run import RunDir

log = logging.getLogger("slimectl.init")

#: Config keys holding filesystem paths. Relative paths in a config file are relative to that
#: file; relative paths given with --set are relative to the current directory. The frozen
#: config always holds absolute paths, so stages started elsewhere read the same files.
PATH_KEYS: tuple[tuple[str, str], ...] = (
    ("model", "path"),
    ("model", "tokenizer_path"),
    ("model", "ref_path"),
    ("data", "prompt_data"),
)


def split_data_spec(spec: str) -> tuple[str, str]:
    """``file.jsonl@[0:100]`` -> (``file.jsonl``, ``@[0:100]``)."""
    if "@[" in spec and spec.endswith("]"):
        i = spec.rindex("@[")
        return spec[:i], spec[i:]
    return spec, ""


def _absolute(value: str, base: Path) -> str:
    path, suffix = split_data_spec(value)
    p = Path(os.path.expanduser(path))
    return str((base / p).resolve()) + suffix if not p.is_absolute() else value


def _absolutize(data: dict[str, Any], base: Path) -> None:
    evals = (data.get("data") or {}).get("eval_data") if isinstance(data.get("data"), dict) else None
    if isinstance(evals, dict):
        data["data"]["eval_data"] = {k: _absolute(v, base) if isinstance(v, str) and v else v for k, v in evals.items()}
    for section, key in PATH_KEYS:
        sec = data.get(section)
        if not isinstance(sec, dict):
            continue
        value = sec.get(key)
        if isinstance(value, str) and value:
            path, suffix = split_data_spec(value)
            p = Path(os.path.expanduser(path))
            if not p.is_absolute():
                sec[key] = str((base / p).resolve()) + suffix


@dataclass
class InitResult:
    config: SlimectlConfig
    run: RunDir | None
    outcome: str  # created | unchanged | config-replaced | dry-run


def resolve_init_config(config_path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> SlimectlConfig:
    """The config ``init`` would freeze: file + overrides, paths made absolute, validated."""
    data: dict[str, Any] = {}
    origin = "config"
    if config_path is not None:
        data = load_yaml_file(config_path)
        origin = f"config file {config_path}"
        build_config(data, origin)  # report the file's own mistakes against the file
        _absolutize(data, Path(config_path).resolve().parent)
    if overrides:
        data = apply_overrides(data, list(overrides), STAGE_SECTIONS["init"], "init")
        _absolutize(data, Path.cwd())
        origin += " with --set overrides"
    return build_config(data, origin)


def _check_inputs(cfg: SlimectlConfig) -> None:
    if cfg.model.path is None:
        raise ConfigError("model.path is not set; set it in the config (an HF model directory) or pass --tiny-model llama|qwen2|qwen3")
    mp = Path(cfg.model.path)
    if not mp.is_dir():
        raise ConfigError(f"model.path = {cfg.model.path}: no such directory; point it at an HF model directory")
    if not (mp / "config.json").is_file():
        raise ConfigError(f"model.path = {cfg.model.path}: no config.json there; point it at an HF model directory")
    for key in ("tokenizer_path", "ref_path"):
        value = getattr(cfg.model, key)
        if value is not None and not Path(value).is_dir():
            raise ConfigError(f"model.{key} = {value}: no such directory")
    if cfg.data.prompt_data is not None:
        path, _ = split_data_spec(cfg.data.prompt_data)
        if not Path(path).is_file():
            raise ConfigError(f"data.prompt_data = {cfg.data.prompt_data}: no such file; point it at a .jsonl or .parquet file")
    for name, spec in cfg.data.eval_data.items():
        if not Path(split_data_spec(spec)[0]).is_file():
            raise ConfigError(f"data.eval_data.{name} = {spec}: no such file; point it at a .jsonl or .parquet file")


def init_run(run_path: str | Path, config_path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
             tiny_model: str | None = None, force: bool = False, dry_run: bool = False) -> InitResult:
    """Resolve the config, optionally build a tiny offline model into the run, and freeze it."""
    cfg = resolve_init_config(config_path, overrides)
    run = RunDir(run_path)
    if tiny_model is not None:
        from slimectl.fixtures.tiny_models import FAMILIES

        if tiny_model not in FAMILIES:
            raise ConfigError(f"--tiny-model {tiny_model!r}: expected one of {', '.join(FAMILIES)}")
        if cfg.model.path is not None:
            raise ConfigError(f"--tiny-model {tiny_model} conflicts with model.path = {cfg.model.path}; use one of them")
        target = run.path / "models" / f"tiny-{tiny_model}"
        data = cfg.to_dict()
        data["model"]["path"] = str(target)
        cfg = build_config(data)
    if dry_run:
        return InitResult(cfg, None, "dry-run")
    if tiny_model is not None:
        from slimectl.fixtures.tiny_models import build_tiny_model

        # Refuse early (before building anything) when the directory is not ours to fill.
        if not run.initialized:
            RunDir.create_check(run.path)
        target = Path(cfg.model.path)  # type: ignore[arg-type]
        if not (target / "config.json").is_file():
            log.info("building tiny %s model in %s", tiny_model, target)
            quiet_hf_progress()
            # Build aside and rename, so a killed init never leaves a half-written model behind.
            tmp = target.parent / f".tmp-{target.name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            build_tiny_model(tiny_model, tmp)
            shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
    _check_inputs(cfg)
    run, outcome = RunDir.create(run.path, cfg, force=force)
    return InitResult(cfg, run, outcome)
