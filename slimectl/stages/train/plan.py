"""Which rollouts a ``train`` invocation trains and where training resumes, read from the run directory's small
files and checked before anything expensive is built."""

from __future__ import annotations

from slimectl.contract.config_checks import critic_layout_problem
from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import ConfigError, SlimectlError, UsageError
from slimectl.contract.rundir import RunDir


def initial_arch(run: RunDir, cfg: SlimectlConfig):
    """``(architecture, padded vocabulary, torch_dist directory or None)`` of the initial policy:
    ``checkpoints/000000`` when convert wrote it, else ``model.path``."""
    from slimectl.backends.hf.arch import arch_from_dir

    if run.checkpoints.exists(0):
        from slimectl.backends.megatron.checkpoint import arch_from_meta, read_checkpoint_meta

        meta, it_dir, _ = read_checkpoint_meta(run.checkpoints.get(0).path)
        return arch_from_meta(meta), meta["padded_vocab_size"], it_dir
    arch = arch_from_dir(cfg.model.path)
    return arch, arch.padded_vocab_size(cfg.train.tp), None


def resume_point(run: RunDir) -> tuple[object | None, int]:
    """(the latest checkpoint the trainer wrote or None, the next rollout to train): where training resumes."""
    for i in reversed(run.checkpoints.ids()):
        art = run.checkpoints.get(i)
        if art.meta.get("source") == "train":
            return art, int(art.meta["next_rollout"])
    return None, 0


def check_layout(run: RunDir, cfg: SlimectlConfig) -> None:
    """Refuse (one line) a ``train.tp``/``train.pp``/``train.ep`` the model cannot be split into (listing the
    sizes that work), ``train.mtp`` on a model without those MTP layers, and a critic layout the trainer's ranks
    cannot hold."""
    t = cfg.train
    if t.tp > 1 or t.pp > 1 or t.ep > 1 or t.mtp.num_layers:
        from slimectl.backends.megatron.provider import check_train_layout

        check_train_layout(initial_arch(run, cfg)[0], t)
    problem = critic_layout_problem(cfg)  # `slimectl train` runs the critic on its own ranks
    if problem:
        raise ConfigError(problem)


def plan_training(run: RunDir, cfg: SlimectlConfig, rollout_id: int | None = None, follow: bool = False,
                  max_rollouts: int | None = None, allow_empty: bool = False, check_published: bool = True) -> list[int]:
    """The rollout ids a ``train`` invocation will train, checked before anything expensive is built.

    Refuses (one line) a ``rollout_id`` that is not the next one, an empty plan without ``allow_empty``, and
    (``check_published`` without ``follow``) a first rollout that is not published yet, besides the layout
    checks of :func:`check_layout`. Reads only the run directory's small files.
    """
    from slimectl.backends.hf.vlm import refuse_vlm_options

    refuse_vlm_options(cfg.model.path, "train", lora=cfg.train.lora is not None,
                       ppo=cfg.algorithm.advantage_estimator == "ppo")
    check_layout(run, cfg)
    _, next_id = resume_point(run)
    if rollout_id is not None and rollout_id != next_id:
        raise UsageError(f"--id {rollout_id}: the next rollout to train is {next_id} (each is trained exactly once, in order)")
    todo = list(range(next_id, cfg.rollout.num_rollout)) if rollout_id is None else [rollout_id]
    if max_rollouts is not None:
        todo = todo[:max_rollouts]
    if not todo:
        if allow_empty:
            return []
        raise UsageError(f"nothing to train: all {cfg.rollout.num_rollout} rollouts (rollout.num_rollout) are trained; "
                         f"extend the run with `slimectl extend -r {run.path} --num-rollout N` or pass --allow-empty")
    if check_published and not follow and not run.rollouts.exists(todo[0]):
        raise SlimectlError(f"rollouts/{todo[0]:06d} is not published yet; run `slimectl rollout -r {run.path}` "
                            f"or use --follow to wait for it")
    return todo
