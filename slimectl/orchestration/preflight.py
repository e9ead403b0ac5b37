"""What ``slimectl rl`` settles before it launches anything: the run (initialized or resumed) and the
checks that would otherwise fail minutes later, on every rank or engine."""

from __future__ import annotations

from pathlib import Path

from slimectl.backends.hf.vlm import refuse_vlm_options
from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.rundir.run import RunDir


def check_train_sizes(cfg: SlimectlConfig) -> bool:
    """Refuse (exit 2, listing the sizes that work) a ``train.tp``/``train.pp`` the model cannot be
    split into, or a ``train.ep`` it cannot (a dense model, or one that does not divide the experts),
    reading only its config.json, as ``convert`` and ``train`` do. Returns False when the model is not
    there yet (``--tiny-model`` builds it at init), True when checked or not needed."""
    t = cfg.train
    if t.tp == 1 and t.pp == 1 and t.ep == 1 and not t.mtp.num_layers:  # (train.mtp: the model's MTP layers)
        return True
    if cfg.model.path is None or not (Path(cfg.model.path) / "config.json").is_file():
        return False
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.megatron.provider import check_train_layout

    check_train_layout(arch_from_dir(cfg.model.path), t)
    return True


def prepare_rl(config_path: str | Path | None, run_path: str | Path | None, overrides: list[str] | tuple[str, ...] = (),
               tiny_model: str | None = None, dry_run: bool = False,
               pretrained: str | None = None) -> tuple[RunDir | None, SlimectlConfig]:
    """The run ``slimectl rl`` works in and its config (see :func:`slimectl.stages.init.init_or_resume`),
    checked first: nothing is written when a check fails, except a model ``--tiny-model`` had to build
    before it could be checked. With ``dry_run`` nothing is written and the run is None."""
    from slimectl.stages.init import init_or_resume

    checked: list[bool] = []

    def check(cfg: SlimectlConfig) -> None:
        refuse_vlm_options(cfg.model.path, "rl", lora=cfg.train.lora is not None,
                           ppo=cfg.algorithm.advantage_estimator == "ppo",
                           fully_async=cfg.rollout.async_mode == "fully_async")
        checked.append(check_train_sizes(cfg))
        if not dry_run and cfg.data.prompt_data is not None:  # a bad dataset must not leave a new run behind
            from slimectl.stages.rollout.stage import check_prompt_data

            check_prompt_data(cfg)

    run, cfg = init_or_resume("rl", config_path, run_path, overrides, tiny_model, dry_run=dry_run,
                              pretrained=pretrained, check=check)
    if run is None:
        return None, cfg
    if not checked[-1]:  # the model --tiny-model built at init: its sizes now
        check_train_sizes(cfg)
    from slimectl.contract.metrics import configure_wandb

    configure_wandb(cfg, run.path)  # logging.wandb: every stage's metrics go to W&B too
    return run, cfg
