"""The train stage as an object: the actor resumed from the run directory (the cursor reconciled with the latest
checkpoint the trainer wrote), trained one rollout at a time, checkpointed at the save interval; and what its
ranks > 0 hold instead of rank 0's lock and metrics."""

from __future__ import annotations

import logging

from slimectl.backends.host_memory import release_free_memory
from slimectl.backends.megatron.checkpoint import TRAIN_STATE_DIR
from slimectl.backends.megatron.parallel import barrier
from slimectl.contract.config_checks import critic_layout_problem
from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import ConfigError, UsageError
from slimectl.contract.faults import fault_point
from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import SAMPLES_FILE, read_samples
from slimectl.contract.trace import NULL_TRACER, SpanRecorder
from slimectl.contract.ranks import launch_rank
from slimectl.stages.train.plan import initial_arch, resume_point
from slimectl.stages.train.ppo import CriticFactory, build_critic, train_ppo_rollout
from slimectl.stages.train.publish import publish
from slimectl.stages.train.staleness import drop_stale_samples
from slimectl.stages.train.vision import SampleVision
from slimectl.stages.train.writer import CheckpointWriter
from slimectl.weight_formats import weight_format

log = logging.getLogger("slimectl.train")


class FollowerLock:
    """What ranks > 0 hold instead of the stage lock: rank 0 owns the lock and every run-dir write."""

    held = True

    def check(self) -> None:
        pass


class NullMetrics:
    """What ranks > 0 log to: nothing (rank 0 writes the metrics)."""

    def log(self, step, metrics):
        return metrics

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class Trainer:
    """The train stage as an object: the actor resumed from the run directory, trained one rollout
    at a time. ``run_train`` drives it alone; ``slimectl rl`` drives it between rollouts and syncs.

    Must be used inside ``run.lock("train")`` (pass the held lock; ranks > 0 a :class:`FollowerLock`).

    ``critic_factory``: PPO's critic when it runs elsewhere (``rl --launcher ray``, a
    :data:`~slimectl.stages.train.ppo.CriticFactory`); None: :class:`MegatronCritic
    <slimectl.backends.megatron.critic_trainer.MegatronCritic>` in this process, on the actor's layout.
    """

    def __init__(self, run: RunDir, cfg: SlimectlConfig, lock, critic_factory: CriticFactory | None = None):
        from slimectl.backends.megatron.actor import MegatronActor

        self.run, self.cfg, self.lock = run, cfg, lock
        self.weight_format = weight_format(cfg)  # what a version is: full weights, or a LoRA run's adapter
        self.rank0 = launch_rank() == 0
        t = cfg.train
        problem = critic_layout_problem(cfg, own_group=critic_factory is not None)
        if problem:
            raise ConfigError(problem)
        self.cursor = run.cursor("train")
        arch, padded, init_dir = initial_arch(run, cfg)
        total_steps = cfg.rollout.num_rollout * t.num_steps_per_rollout
        # One trainer process: checkpoints are written in the background (several ranks: inline). The next
        # optimizer step of the actor (and of the critic) waits for a save still reading their state.
        self.tracer: SpanRecorder = run.tracer("train") if self.rank0 else NULL_TRACER  # traces/train.jsonl
        self.writer = CheckpointWriter(background=t.world_size == 1, tracer=self.tracer)
        self.actor = MegatronActor(arch, padded, t, cfg.algorithm, tp=t.tp, pp=t.pp, dtype=cfg.model.dtype,
                                   total_steps=total_steps, ep=t.ep, before_update=self.writer.wait,
                                   tracer=self.tracer)
        if init_dir is not None:
            self.actor.load_checkpoint(init_dir)
        else:
            self.actor.load_hf(cfg.model.path)
        self.weight_format.start_actor(self.actor)  # e.g. LoRA from model.adapter_path (a checkpoint's replace it)
        self.vision = SampleVision(run.path, cfg.model.path)  # a VLM's images and M-RoPE positions per sample
        last, next_id = resume_point(run)
        self.critic = None
        if cfg.algorithm.advantage_estimator == "ppo":
            # from critic_checkpoints/N of the actor's checkpoint N on resume, else the trunk of critic.path
            # (or the actor's model.path) with a zero value head
            self.critic = critic_factory(last, total_steps, self.writer.wait) if critic_factory is not None else \
                build_critic(run, cfg, arch, padded, last.id if last is not None else None, total_steps, tp=t.tp,
                             pp=t.pp, before_update=self.writer.wait)
        if last is not None:
            self.actor.load_state(last.path / TRAIN_STATE_DIR)
            fault_point("train.resumed")
        release_free_memory()  # the loads' staging copies: freed, not yet given back
        if self.rank0:  # rank 0 reconciles the cursor; every rank derived next_id from the same checkpoint
            self._reconcile_cursor(last, next_id)
        self.next_rollout = next_id
        self.mid_rollout = False
        self.last_published = last.id if last is not None else 0

    def _reconcile_cursor(self, last, next_id: int) -> None:
        """The cursor at ``next_id``, the rollout after the latest checkpoint ``last``."""
        state = self.cursor.read()
        if state.next < next_id:
            # Killed between publishing the checkpoint and committing the cursor: the checkpoint
            # holds those rollouts' effect, so they are consumed.
            for rid in range(state.next, next_id):
                self.cursor.commit(rid, {"weight_version": rid + 1}, lock=self.lock)
        elif state.next > next_id:
            self.cursor.rewind(next_id, {"checkpoint": last.id if last else None},
                               reason=f"training after checkpoint {last.id if last else 'initial'} was lost",
                               lock=self.lock)

    def close(self) -> None:
        """Finish (publish) a checkpoint still being written; call before the train lock goes."""
        self.writer.close()

    @property
    def weight_version(self) -> int:
        """The version the actor's weights are: trained on rollouts 0 .. version-1."""
        return self.next_rollout

    def iter_hf_tensors(self):
        """What a distributed sync moves: the version's tensors in the run's weight format (HF-named, or a LoRA
        run's PEFT-named adapters)."""
        return self.weight_format.trained_tensors(self.actor)

    def train_rollout(self, rid: int, art, metrics, publish_weights: bool = True, last: bool = False) -> list[dict]:
        """Train on rollout ``rid`` (its READY artifact), publish at the save interval, commit the cursor
        (the span ``train_rollout`` of the trace)."""
        with self.tracer.span("train_rollout", rollout=rid):
            return self._train_rollout(rid, art, metrics, publish_weights, last)

    def _train_rollout(self, rid: int, art, metrics, publish_weights: bool, last: bool) -> list[dict]:
        if rid != self.next_rollout:
            raise UsageError(f"rollout {rid}: the next rollout to train is {self.next_rollout} (each is trained exactly "
                             f"once, in order)")
        self.lock.check()
        self.mid_rollout = True  # until this rollout is trained and its version counted (checkpoint_if_behind)
        # at version rid (trained on rollouts 0 .. rid-1): stale groups dropped from the loss or kept, counted
        samples, staleness = drop_stale_samples(read_samples(art.file(SAMPLES_FILE)), rid, self.cfg)
        vision = self.vision.inputs(samples, rid)  # checked: one line, exit 2, before anything is trained
        if self.critic is not None:
            steps = train_ppo_rollout(self.actor, self.critic, self.cfg, rid, samples)
        else:
            steps = self.actor.train_on_samples(samples, self.cfg.rollout.temperature, self.cfg.rollout.reward_key,
                                                vision=vision)
        release_free_memory()  # the step's activations (the next phases allocate other sizes)
        for m in steps:
            m.update(staleness)
        version = rid + 1
        interval = self.cfg.algorithm.ref_update_interval
        if interval and version % interval == 0:  # slime: (rollout_id + 1) % ref_update_interval == 0
            self.actor.update_reference()
            if steps:
                steps[-1]["train/ref_updated"] = 1.0
        save = version % self.cfg.train.save_interval == 0 or last
        phases: dict[str, float] = {}
        if save or publish_weights:
            phases = self.publish(rid, version, checkpoint=save, weights=True)
        if steps:  # the rollout's publishing phases go with its last step (slime's names)
            steps[-1].update(phases)
        for m in steps if self.rank0 else ():
            rec = {k: v for k, v in m.items() if k != "train/step"}
            rec["train/rollout_id"] = rid
            metrics.log(self.actor.step, rec)
            log.info("step %d (rollout %d): loss %.4f, pg_clipfrac %.3f, ppo_kl %.2e, grad_norm %.3f, lr %.2e, %s%s",
                     self.actor.step, rid, m.get("train/loss", float("nan")), m.get("train/pg_clipfrac", 0.0),
                     m.get("train/ppo_kl", 0.0), m.get("train/grad_norm", 0.0), m.get("train/lr", 0.0), phase_line(m),
                     critic_line(m))
        if self.rank0:  # after the checkpoint that holds this rollout is published (a save in flight: behind it)
            def commit() -> None:
                self.cursor.commit(rid, {"weight_version": version}, lock=self.lock)
                fault_point("train.cursor_committed")

            self.writer.then(commit)
        barrier()
        self.next_rollout = version
        self.mid_rollout = False
        return steps

    def checkpoint_if_behind(self) -> bool:
        """Publish ``checkpoints/N`` (N = the next rollout) when rollouts were trained since the last
        checkpoint and no rollout is half trained: what a stop between two rollouts does (collective)."""
        if self.mid_rollout or self.last_published >= self.next_rollout:
            return False
        self.publish(self.next_rollout - 1, self.next_rollout, checkpoint=True, weights=False)
        return True

    def publish(self, rid: int, version: int, checkpoint: bool = True, weights: bool = True) -> dict[str, float]:
        """Publish checkpoints/VERSION and/or weights/VERSION; their times (``perf/save_time``,
        ``perf/update_weights_time``). With a critic, ``critic_checkpoints/VERSION`` is written first,
        in the same background job (the actor's checkpoint READY is the commit point)."""
        with self.tracer.span("publish", version=version, checkpoint=checkpoint, weights=weights):
            phases = publish(self.run, self.actor, self.cfg, rid, version, checkpoint, weights, self.writer,
                             critic=self.critic)
        if checkpoint:
            self.last_published = version
        return phases


PHASES = (("perf/log_probs_time", "log-probs"), ("perf/ref_log_probs_time", "ref log-probs"),
          ("perf/actor_train_time", "train"), ("perf/save_wait_time", "of which waiting for the last save"),
          ("perf/save_time", "save"), ("perf/update_weights_time", "weights"))
"""A step's phases as slime names them (metrics) and as the step line says them (``perf/save_time``: what
the checkpoint held the training thread, its writing runs in the background)."""


def critic_line(m: dict) -> str:
    """``", value_loss 0.0123, explained_variance 0.41"``: the critic's figures of a step, if any."""
    parts = [f"{label} {m[key]:.4g}" for key, label in (("critic/value_loss", "value_loss"),
                                                         ("critic/explained_variance", "explained_variance"))
             if key in m]
    return "".join(", " + p for p in parts)


def phase_line(m: dict) -> str:
    """``"log-probs 0.00 s, train 1.21 s, save 0.52 s"``: the phases a step's metrics ``m`` timed."""
    return ", ".join(f"{label} {m[key]:.2f} s" for key, label in PHASES
                     if key in m and (m[key] or key != "perf/save_wait_time"))  # (a wait of 0: not worth a word)
