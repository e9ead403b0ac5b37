"""``slimectl train``: consume READY rollouts exactly once, train the Megatron actor, checkpoint, publish.

Version numbering: training on rollout N produces weight version N+1. After rollout N the stage
commits the consumption cursor (``cursors/train.json``); every ``train.save_interval`` rollouts
(and after the last one) it publishes ``checkpoints/N+1`` (model + optimizer + step, torch_dist)
and ``weights/N+1`` (HF safetensors for disk sync). ``checkpoints/000000`` is the initial policy
written by ``slimectl convert -r``.

Resume: a rerun loads the latest checkpoint the trainer wrote, rewinds the cursor to it when
training after it was lost in a crash (recorded in the cursor's ``rewinds``), and goes on — a
rollout's effect is in the model exactly once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from slimectl.config import SlimectlConfig
from slimectl.errors import SlimectlError, UsageError
from slimectl.rundir import RunDir
from slimectl.samples import SAMPLES_FILE, read_samples

log = logging.getLogger("slimectl.train")

STATE_DIR = "state"


@dataclass
class TrainResult:
    trained: list[int]
    next_rollout: int
    weight_version: int


def _initial_arch(run: RunDir, cfg: SlimectlConfig):
    from slimectl.models.arch import arch_from_dir

    if run.checkpoints.exists(0):
        from slimectl.megatron.checkpoint import arch_from_meta, read_checkpoint_meta

        meta, it_dir, _ = read_checkpoint_meta(run.checkpoints.get(0).path)
        return arch_from_meta(meta), meta["padded_vocab_size"], it_dir
    arch = arch_from_dir(cfg.model.path)
    return arch, arch.padded_vocab_size(cfg.train.tp), None


def _latest_train_checkpoint(run: RunDir):
    for i in reversed(run.checkpoints.ids()):
        art = run.checkpoints.get(i)
        if art.meta.get("source") == "train":
            return art
    return None


def run_train(run: RunDir, cfg: SlimectlConfig, rollout_id: int | None = None, follow: bool = False,
              max_rollouts: int | None = None, allow_empty: bool = False, wait_timeout: float | None = None) -> TrainResult:
    """Train on rollouts from the cursor onward (all of ``rollout.num_rollout``, or just ``rollout_id``)."""
    from slimectl.metrics import MetricsWriter
    from slimectl.train.actor import MegatronActor

    t = cfg.train
    with run.lock("train") as lock:
        cursor = run.cursor("train")
        arch, padded, init_dir = _initial_arch(run, cfg)
        total_steps = cfg.rollout.num_rollout * t.num_steps_per_rollout
        actor = MegatronActor(arch, padded, t, cfg.algorithm, tp=t.tp, pp=t.pp, dtype=cfg.model.dtype,
                              total_steps=total_steps)
        if init_dir is not None:
            actor.load_checkpoint(init_dir)
        else:
            actor.load_hf(cfg.model.path)
        next_id = 0
        last = _latest_train_checkpoint(run)
        if last is not None:
            actor.load_state(last.path / STATE_DIR)
            next_id = int(last.meta["next_rollout"])
        state = cursor.read()
        if state.next < next_id:
            # Killed between publishing the checkpoint and committing the cursor: the checkpoint
            # holds those rollouts' effect, so they are consumed.
            for rid in range(state.next, next_id):
                cursor.commit(rid, {"weight_version": rid + 1}, lock=lock)
        elif state.next > next_id:
            cursor.rewind(next_id, {"checkpoint": last.id if last else None},
                          reason=f"training after checkpoint {last.id if last else 'initial'} was lost", lock=lock)
        if rollout_id is not None and rollout_id != next_id:
            raise UsageError(f"--id {rollout_id}: the next rollout to train is {next_id} (each is trained exactly once, in order)")
        todo = list(range(next_id, cfg.rollout.num_rollout)) if rollout_id is None else [rollout_id]
        if max_rollouts is not None:
            todo = todo[:max_rollouts]
        if not todo:
            if allow_empty:
                return TrainResult([], next_id, next_id)
            raise UsageError(f"nothing to train: all {cfg.rollout.num_rollout} rollouts (rollout.num_rollout) are trained; "
                             f"raise rollout.num_rollout or pass --allow-empty")
        log.info("resuming at rollout %d, %d to go", next_id, len(todo))
        tb = run.tensorboard_dir("train") if cfg.logging.tensorboard else None
        trained: list[int] = []
        with MetricsWriter(run.metrics_path("train"), tb) as metrics:
            for n, rid in enumerate(todo):
                lock.check()
                if follow:
                    art = run.rollouts.wait_for(rid, timeout=wait_timeout, should_stop=lambda: not lock.held)
                elif run.rollouts.exists(rid):
                    art = run.rollouts.get(rid, verify="full")
                else:
                    if trained:
                        break
                    raise SlimectlError(f"rollouts/{rid:06d} is not published yet; run `slimectl rollout -r {run.path}` "
                                        f"or use --follow to wait for it")
                samples = read_samples(art.file(SAMPLES_FILE))
                steps = actor.train_on_samples(samples, cfg.rollout.temperature, cfg.rollout.reward_key)
                for m in steps:
                    rec = {k: v for k, v in m.items() if k != "train/step"}
                    rec["train/rollout_id"] = rid
                    metrics.log(actor.step, rec)
                    log.info("step %d (rollout %d): loss %.4f, pg_clipfrac %.3f, ppo_kl %.2e, grad_norm %.3f, lr %.2e, "
                             "%.0f ms", actor.step, rid, m.get("train/loss", float("nan")), m.get("train/pg_clipfrac", 0.0),
                             m.get("train/ppo_kl", 0.0), m.get("train/grad_norm", 0.0), m.get("train/lr", 0.0),
                             1e3 * m.get("perf/train_time", 0.0))
                version = rid + 1
                if version % t.save_interval == 0 or n == len(todo) - 1:
                    _publish(run, actor, arch, padded, cfg, rid, version)
                cursor.commit(rid, {"weight_version": version}, lock=lock)
                trained.append(rid)
        return TrainResult(trained, trained[-1] + 1 if trained else next_id, trained[-1] + 1 if trained else next_id)


def _publish(run: RunDir, actor, arch, padded: int, cfg: SlimectlConfig, rid: int, version: int) -> None:
    """checkpoints/VERSION (model + optimizer) and weights/VERSION (HF safetensors)."""
    import json

    from slimectl.megatron.checkpoint import HF_DIR, META, copy_hf_aux_files
    from slimectl.models.hf_io import write_safetensors_sharded

    hf_src = Path(cfg.model.path)
    meta = {"source": "train", "next_rollout": rid + 1, "weight_version": version, "actor_step": actor.step}
    with run.checkpoints.publish(version, meta=meta, stage="train", overwrite=True) as staging:
        actor.save_state(staging / STATE_DIR, {"next_rollout": rid + 1})
        (staging / META).write_text(json.dumps({"format": "torch_dist", "arch": arch.to_dict(), "padded_vocab_size": padded,
                                                "dtype": cfg.model.dtype, "saved_with": {"tp": cfg.train.tp, "pp": cfg.train.pp},
                                                "iteration": actor.step}, indent=2))
        copy_hf_aux_files(hf_src, staging / HF_DIR)
    with run.weights.publish(version, meta={"source": "train", "rollout_id": rid, "weight_version": version},
                             stage="train", overwrite=True) as staging:
        write_safetensors_sharded(actor.hf_state_dict().items(), staging)
        copy_hf_aux_files(hf_src, staging)
    if cfg.train.keep_checkpoints:
        run.checkpoints.prune(cfg.train.keep_checkpoints, protect={0})
    if cfg.sync.keep_weights:
        run.weights.prune(cfg.sync.keep_weights)
    log.info("published checkpoints/%06d and weights/%06d", version, version)
