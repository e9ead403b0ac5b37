"""``slimectl init``: resolve a config and freeze it into a new run directory.

The config comes from a YAML file, ``--set`` overrides, a model built offline (``--tiny-model``,
``--pretrained``: :mod:`slimectl.starter_models`), or a slime launch script (``--from-slime``), translated by
the modules beside this one:

- :mod:`~slimectl.stages.init.slime_launch` — :func:`~slimectl.stages.init.slime_launch.translate_slime_script`:
  a script's argv to config data, then the GPU layout;
- :mod:`~slimectl.stages.init.slime_flags` — the flag table: what each of slime's ``train.py`` flags becomes;
- :mod:`~slimectl.stages.init.slime_script` — the bash read, never run: variables, ``source``, the launch line.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from slimectl.contract.config import load_config
from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.dataspec import data_spec_path
from slimectl.contract.errors import ConfigError, UsageError
from slimectl.contract.logs import StageLog, quiet_hf_progress
from slimectl.contract.rundir.run import RunDir

log = logging.getLogger("slimectl.init")

@dataclass
class InitResult:
    config: SlimectlConfig
    run: RunDir | None
    outcome: str  # created | unchanged | config-replaced | dry-run
    translation: Any = None  # the SlimeTranslation of --from-slime


def _check_inputs(cfg: SlimectlConfig) -> None:
    if cfg.model.path is None:
        from slimectl.starter_models.tiny_models import FAMILIES as TINY_FAMILIES

        raise ConfigError(f"model.path is not set; set it in the config (an HF model directory) or pass "
                          f"--tiny-model {'|'.join(TINY_FAMILIES)}")
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
        if not Path(data_spec_path(cfg.data.prompt_data)).is_file():
            raise ConfigError(f"data.prompt_data = {cfg.data.prompt_data}: no such file; point it at a .jsonl or .parquet file")
    for name, spec in cfg.data.eval_data.items():
        if not Path(data_spec_path(spec)).is_file():
            raise ConfigError(f"data.eval_data.{name} = {spec}: no such file; point it at a .jsonl or .parquet file")


def init_run(run_path: str | Path, config_path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
             tiny_model: str | None = None, force: bool = False, dry_run: bool = False,
             pretrained: str | None = None, from_slime: str | Path | None = None,
             check: Callable[[SlimectlConfig], None] | None = None) -> InitResult:
    """Resolve the config, optionally build a tiny offline model into the run (or a real pretrained
    one into the shared cache, ``slimectl.starter_models.pretrained``), and freeze it. ``from_slime``: the
    config comes from a slime launch script (``slimectl.stages.init.slime_launch``); what it could not
    map is in the result's ``translation``. ``check(cfg)``: the caller's checks of the resolved config,
    run before anything is written (dry run included)."""
    translation = None
    if from_slime is not None:
        from slimectl.stages.init.slime_launch import translate_slime_script

        translation = translate_slime_script(from_slime)
        cfg = load_config(config_path, overrides, base=translation.data,
                          base_origin=f"--from-slime {from_slime}")
    else:
        cfg = load_config(config_path, overrides)
    run = RunDir(run_path)
    if pretrained is not None:
        from slimectl.starter_models.pretrained import model_dir

        if tiny_model is not None:
            raise ConfigError(f"--pretrained {pretrained} conflicts with --tiny-model {tiny_model}; use one of them")
        target = model_dir(pretrained)  # checks the name
        if cfg.model.path is not None and Path(cfg.model.path).resolve() != target.resolve():
            raise ConfigError(f"--pretrained {pretrained} conflicts with model.path = {cfg.model.path}; use one of them")
        cfg.model.path = str(target)
    if tiny_model is not None:
        from slimectl.starter_models.tiny_models import FAMILIES

        if tiny_model not in FAMILIES:
            raise ConfigError(f"--tiny-model {tiny_model!r}: expected one of {', '.join(FAMILIES)}")
        if cfg.model.path is not None:
            raise ConfigError(f"--tiny-model {tiny_model} conflicts with model.path = {cfg.model.path}; use one of them")
        cfg.model.path = str(run.path / "models" / f"tiny-{tiny_model}")
    if check is not None:
        check(cfg)
    if dry_run:
        return InitResult(cfg, None, "dry-run", translation)
    with StageLog() as stage_log:  # held until the run directory exists
        if tiny_model is not None:
            from slimectl.starter_models.tiny_models import build_tiny_model

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
        if pretrained is not None:
            from slimectl.starter_models.pretrained import ensure_pretrained

            if not run.initialized:
                RunDir.create_check(run.path)
            ensure_pretrained(pretrained)
        _check_inputs(cfg)
        run, outcome = RunDir.create(run.path, cfg, force=force)
        if cfg.logging.wandb:
            from slimectl.contract.metrics import WANDB_MISSING, wandb_available

            if not wandb_available():
                log.warning(WANDB_MISSING)
        log.debug("run directory %s: %s (config %s)", run.path, outcome, cfg.fingerprint()[:12])
        stage_log.write_to(run.log_path("init"))
        return InitResult(cfg, run, outcome, translation)


def frozen_tiny_model(path: str | Path) -> str | None:
    """The tiny-model family of an initialized run whose model.path is its own models/tiny-FAMILY."""
    run = RunDir(path)
    if not run.initialized:
        return None
    model = Path(run.config().model.path or "")
    if model.parent == run.path.resolve() / "models" and model.name.startswith("tiny-"):
        return model.name[len("tiny-"):]
    return None


def init_or_resume(stage: str, config_path: str | Path | None, run_path: str | Path | None,
                   overrides: list[str] | tuple[str, ...] = (), tiny_model: str | None = None,
                   dry_run: bool = False, pretrained: str | None = None,
                   check: Callable[[SlimectlConfig], None] | None = None) -> tuple[RunDir | None, SlimectlConfig]:
    """The run ``stage`` (``rl``) works in, initialized first when a config is given, and its config.

    With ``config_path`` the run is initialized as ``slimectl init`` does (default directory
    ``runs/NAME``; rerunning the same command finds it unchanged and resumes it, rebuilding no
    tiny model; ``pretrained`` as ``init --pretrained``, built once into the cache); without, ``run_path`` must be an initialized run and ``overrides`` apply to
    ``stage``'s sections; ``rollout.num_rollout`` is the one ``slimectl extend`` recorded unless an
    override sets it. The effective config is saved as ``configs/STAGE.yaml``. With
    ``dry_run`` nothing is written and the run is None. ``check(cfg)`` runs before anything is written.
    """
    if config_path is None and run_path is None:
        raise UsageError("pass --config CFG (and -r RUN), or -r RUN of an initialized run")
    if config_path is not None:
        if run_path is None:
            cfg = load_config(config_path, overrides)
            run_path = Path("runs") / (cfg.name or Path(config_path).stem)
        if tiny_model is None:
            tiny_model = frozen_tiny_model(run_path)  # a rerun of the command that built it
        result = init_run(run_path, config_path, overrides, tiny_model=tiny_model, dry_run=dry_run,
                          pretrained=pretrained, check=check)
        if dry_run:
            return None, result.config
        overrides = ()  # frozen into the run's config by init
    elif tiny_model is not None:
        raise UsageError("--tiny-model needs --config (it builds the model of a new run)")
    elif pretrained is not None:
        raise UsageError(f"--pretrained {pretrained} needs --config (it sets the model of a new run)")
    run = RunDir.open(run_path)
    cfg = run.stage_config(stage, list(overrides))
    if check is not None and config_path is None:  # (with a config: checked by init_run)
        check(cfg)
    if dry_run:
        return None, cfg
    run.save_stage_config(stage, cfg)
    return run, cfg
