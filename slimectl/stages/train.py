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
import os
from dataclasses import dataclass
from pathlib import Path

from slimectl.backends.host_memory import release_free_memory
from slimectl.contract.config_checks import critic_layout_problem
from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.faults import fault_point
from slimectl.contract.errors import ConfigError, SlimectlError, UsageError
from slimectl.contract.rundir import RunDir
from slimectl.contract.rundir.ordered_writer import CheckpointWriter
from slimectl.contract.samples import SAMPLES_FILE, read_samples
from slimectl.orchestration.torchrun import launch_rank

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


def broadcast_from_rank0(obj):
    """Rank 0's ``obj`` on every rank (what rank 0 decides, the others follow); ``obj`` as is
    when there is one rank."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()

STATE_DIR = "state"


@dataclass
class TrainResult:
    trained: list[int]
    next_rollout: int
    weight_version: int


def _initial_arch(run: RunDir, cfg: SlimectlConfig):
    from slimectl.backends.hf.arch import arch_from_dir

    if run.checkpoints.exists(0):
        from slimectl.backends.megatron.checkpoint import arch_from_meta, read_checkpoint_meta

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


def resume_point(run: RunDir) -> tuple[object | None, int]:
    """(the latest checkpoint the trainer wrote or None, the next rollout to train): where training resumes."""
    last = _latest_train_checkpoint(run)
    return last, int(last.meta["next_rollout"]) if last is not None else 0


def plan_training(run: RunDir, cfg: SlimectlConfig, rollout_id: int | None = None, follow: bool = False,
                  max_rollouts: int | None = None, allow_empty: bool = False, check_published: bool = True) -> list[int]:
    """The rollout ids a ``train`` invocation will train, checked before anything expensive is built.

    Refuses (one line) a ``rollout_id`` that is not the next one, an empty plan without
    ``allow_empty``, and (``check_published`` without ``follow``) a first
    rollout that is not published yet, and a ``train.tp``/``train.pp``/``train.ep`` the model cannot be split into
    (listing the sizes that work). Reads only the run directory's small files.
    """
    if cfg.train.tp > 1 or cfg.train.pp > 1:
        from slimectl.backends.hf.arch import check_parallel_sizes

        check_parallel_sizes(_initial_arch(run, cfg)[0], cfg.train.tp, cfg.train.pp, "train.tp", "train.pp")
    problem = critic_layout_problem(cfg)  # `slimectl train` runs the critic on its own ranks
    if problem:
        raise ConfigError(problem)
    if cfg.train.ep > 1:
        from slimectl.backends.megatron.provider import check_expert_parallel

        check_expert_parallel(_initial_arch(run, cfg)[0], cfg.train.ep)
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


class Trainer:
    """The train stage as an object: the actor resumed from the run directory, trained one rollout
    at a time. ``run_train`` drives it alone; ``slimectl rl`` drives it between rollouts and syncs.

    Must be used inside ``run.lock("train")`` (pass the held lock).

    ``critic_factory(trainer, last, total_steps)``: PPO's critic when it runs elsewhere (``rl --launcher ray``:
    a proxy of the critic's own actor group, with :class:`~slimectl.backends.megatron.critic_trainer.MegatronCritic`'s
    interface: ``values``, ``advantages``, ``train_on_returns``, ``state_to_save``/``save_to``, ``step``,
    ``before_update``); None: :class:`MegatronCritic` in this process, on the actor's layout.
    """

    def __init__(self, run: RunDir, cfg: SlimectlConfig, lock, critic_factory=None):
        from slimectl.backends.megatron.actor import MegatronActor

        self.run, self.cfg, self.lock = run, cfg, lock
        self.rank0 = launch_rank() == 0
        t = cfg.train
        self.ppo = cfg.algorithm.advantage_estimator == "ppo"
        problem = critic_layout_problem(cfg, own_group=critic_factory is not None)
        if problem:
            raise ConfigError(problem)
        self.critic_factory = critic_factory
        self.cursor = run.cursor("train")
        self.arch, self.padded, init_dir = _initial_arch(run, cfg)
        total_steps = cfg.rollout.num_rollout * t.num_steps_per_rollout
        self.actor = MegatronActor(self.arch, self.padded, t, cfg.algorithm, tp=t.tp, pp=t.pp, dtype=cfg.model.dtype,
                                   total_steps=total_steps, ep=t.ep)
        if init_dir is not None:
            self.actor.load_checkpoint(init_dir)
        else:
            self.actor.load_hf(cfg.model.path)
        last, next_id = resume_point(run)
        self.critic = self._build_critic(last, total_steps) if self.ppo else None
        if last is not None:
            self.actor.load_state(last.path / STATE_DIR)
            fault_point("train.resumed")
        release_free_memory()  # the loads' staging copies: freed, not yet given back
        state = self.cursor.read()
        if not self.rank0:
            pass  # rank 0 reconciles the cursor; every rank derived next_id from the same checkpoint
        elif state.next < next_id:
            # Killed between publishing the checkpoint and committing the cursor: the checkpoint
            # holds those rollouts' effect, so they are consumed.
            for rid in range(state.next, next_id):
                self.cursor.commit(rid, {"weight_version": rid + 1}, lock=lock)
        elif state.next > next_id:
            self.cursor.rewind(next_id, {"checkpoint": last.id if last else None},
                               reason=f"training after checkpoint {last.id if last else 'initial'} was lost", lock=lock)
        self.next_rollout = next_id
        self.mid_rollout = False
        self.last_published = last.id if last is not None else 0
        # One trainer process: checkpoints are written in the background (several ranks: inline).
        self.writer = CheckpointWriter(background=t.tp * t.pp * self.actor.dp == 1)
        self.actor.before_update = self.writer.wait
        if self.critic is not None:
            self.critic.before_update = self.writer.wait

    def _build_critic(self, last, total_steps: int):
        """PPO's critic: from ``critic_checkpoints/N`` of the actor's checkpoint N on resume, else the
        trunk of ``critic.path`` (or the actor's ``model.path``) with a zero value head."""
        if self.critic_factory is not None:
            return self.critic_factory(self, last, total_steps)
        return build_critic(self.run, self.cfg, self.arch, self.padded, last.id if last is not None else None,
                            total_steps, tp=self.cfg.train.tp, pp=self.cfg.train.pp)

    def close(self) -> None:
        """Finish (publish) a checkpoint still being written; call before the train lock goes."""
        self.writer.close()

    @property
    def weight_version(self) -> int:
        """The version the actor's weights are: trained on rollouts 0 .. version-1."""
        return self.next_rollout

    def iter_hf_tensors(self):
        return self.actor.iter_hf_tensors()

    def train_rollout(self, rid: int, art, metrics, publish_weights: bool = True, last: bool = False) -> list[dict]:
        """Train on rollout ``rid`` (its READY artifact), publish at the save interval, commit the cursor."""
        if rid != self.next_rollout:
            raise UsageError(f"rollout {rid}: the next rollout to train is {self.next_rollout} (each is trained exactly "
                             f"once, in order)")
        self.lock.check()
        self.mid_rollout = True  # until this rollout is trained and its version counted (checkpoint_if_behind)
        samples = read_samples(art.file(SAMPLES_FILE))
        if self.critic is not None:
            steps = self._train_ppo(rid, samples)
        else:
            steps = self.actor.train_on_samples(samples, self.cfg.rollout.temperature, self.cfg.rollout.reward_key)
        release_free_memory()  # the step's activations (the next phases allocate other sizes)
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
        _barrier()
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

    def _train_ppo(self, rid: int, samples) -> list[dict]:
        """One PPO rollout: the critic's values (V_old), GAE, the actor's steps on the advantages (not
        during ``critic.num_critic_only_steps``), then the critic's steps on the returns."""
        import time

        import torch

        from slimectl.algorithms.rewards import normalize_rewards_by_group, reward_norm_mode_for
        from slimectl.backends.megatron.actor import _loss_mask, _pad
        from slimectl.backends.megatron.critic_trainer import rollout_critic_metrics

        cfg, critic, actor = self.cfg, self.critic, self.actor
        temp, key = cfg.rollout.temperature, cfg.rollout.reward_key
        t = time.perf_counter()
        values = critic.values(samples)
        t_values = time.perf_counter() - t
        box: dict = {}

        def advantage_fn(rewards, mask, log_probs, ref_log_probs):
            box["mask"] = mask
            box["res"] = critic.advantages(rewards, mask, values, log_probs, ref_log_probs)
            return box["res"].advantages

        critic_only = rid < cfg.critic.num_critic_only_steps
        if critic_only:  # the actor does not move: its log-probs only feed the KL reward
            algo = cfg.algorithm
            raw = torch.tensor([s.reward_value(key) for s in samples], dtype=torch.float32)
            rewards = normalize_rewards_by_group(raw, [s.group_index for s in samples],
                                                 reward_norm_mode_for(algo.advantage_estimator,
                                                                      configured=algo.reward_normalization))
            lp = ref = None
            if algo.kl_coef != 0:
                lp = _pad(actor.compute_log_probs(samples, temp))
                ref = _pad(actor.compute_log_probs(samples, temp, ref=True))
            advantage_fn(rewards, _pad([_loss_mask(s) for s in samples]), lp, ref)
            steps: list[dict] = []
        else:
            steps = actor.train_on_samples(samples, temp, key, advantage_fn=advantage_fn)
        res, mask = box["res"], box["mask"]
        lengths = [s.response_length for s in samples]
        masks = [mask[i, :n] for i, n in enumerate(lengths)]
        returns = [res.returns[i, :n] for i, n in enumerate(lengths)]
        critic_steps = critic.train_on_returns(samples, actor._step_batches(len(samples)), masks, values, returns)
        stats = rollout_critic_metrics(res, values, mask)
        if critic_only:
            steps = [dict(c) for c in critic_steps]
        else:
            for m, c in zip(steps, critic_steps):
                m.update(c)
        steps[0].update(stats)
        steps[0]["perf/critic_values_time"] = t_values
        return steps

    def publish(self, rid: int, version: int, checkpoint: bool = True, weights: bool = True) -> dict[str, float]:
        """Publish checkpoints/VERSION and/or weights/VERSION; their times (``perf/save_time``,
        ``perf/update_weights_time``). With a critic, ``critic_checkpoints/VERSION`` is written first,
        in the same background job (the actor's checkpoint READY is the commit point)."""
        phases = _publish(self.run, self.actor, self.arch, self.padded, self.cfg, rid, version, checkpoint, weights,
                          self.writer, critic=self.critic)
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


def build_critic(run: RunDir, cfg: SlimectlConfig, arch, padded: int, checkpoint_id: int | None, total_steps: int,
                 tp: int, pp: int):
    """PPO's :class:`~slimectl.backends.megatron.critic_trainer.MegatronCritic` at ``tp`` x ``pp`` (Megatron's
    parallel state already at that layout): from ``critic_checkpoints/N`` of the actor's checkpoint
    ``checkpoint_id`` on resume, else the trunk of ``critic.path`` (or the actor's ``model.path``) with a zero
    value head."""
    from slimectl.backends.megatron.critic_trainer import MegatronCritic

    critic = MegatronCritic(arch, padded, cfg.train, cfg.critic, cfg.algorithm, dtype=cfg.model.dtype,
                            total_steps=total_steps, tp=tp, pp=pp)
    critic.load_hf(cfg.critic.path or cfg.model.path)
    if checkpoint_id is not None:
        if not _critic_store(run).exists(checkpoint_id):
            raise SlimectlError(f"checkpoints/{checkpoint_id:06d} has no critic_checkpoints/{checkpoint_id:06d}: this "
                                f"run was not trained with algorithm.advantage_estimator = ppo up to there; resume it "
                                f"with the estimator it was trained with")
        critic.load_from(_critic_store(run).get(checkpoint_id).path)
    return critic


def build_critic_group_rank(run: RunDir, cfg: SlimectlConfig, checkpoint_id: int | None):
    """One rank of a critic running in processes of its own (``rl --launcher ray``: the critic's actor group):
    joins this process's torch.distributed world (``MASTER_ADDR``/``PORT``, ``RANK``, ``WORLD_SIZE`` set by the
    caller; ``critic.tp x critic.pp x critic.dp`` ranks), sets Megatron's parallel state up at the critic's
    layout and builds the critic as :func:`build_critic` does (resumed from ``critic_checkpoints/checkpoint_id``:
    torch_dist reshards a checkpoint saved at another layout)."""
    from slimectl.backends.hf.arch import check_parallel_sizes
    from slimectl.backends.megatron.parallel import init_parallel

    c, t = cfg.critic.resolved(cfg.train), cfg.train
    arch, padded, _ = _initial_arch(run, cfg)
    check_parallel_sizes(arch, c.tp, c.pp, "critic.tp", "critic.pp")
    if padded % c.tp:
        raise ConfigError(f"critic.tp = {c.tp} does not divide the model's padded vocabulary ({padded}); pick a "
                          f"critic.tp that does")
    init_parallel(tp=c.tp, pp=c.pp, seed=t.seed)
    return build_critic(run, cfg, arch, padded, checkpoint_id, cfg.rollout.num_rollout * t.num_steps_per_rollout,
                        tp=c.tp, pp=c.pp)


def _critic_store(run: RunDir):
    """``critic_checkpoints/``: PPO's critic, one per actor checkpoint of the same id."""
    return run.artifacts("critic_checkpoints")


def phase_line(m: dict) -> str:
    """``"log-probs 0.00 s, train 1.21 s, save 0.52 s"``: the phases a step's metrics ``m`` timed."""
    return ", ".join(f"{label} {m[key]:.2f} s" for key, label in PHASES
                     if key in m and (m[key] or key != "perf/save_wait_time"))  # (a wait of 0: not worth a word)


def run_train(run: RunDir, cfg: SlimectlConfig, rollout_id: int | None = None, follow: bool = False,
              max_rollouts: int | None = None, allow_empty: bool = False, wait_timeout: float | None = None) -> TrainResult:
    """Train on rollouts from the cursor onward (all of ``rollout.num_rollout``, or just ``rollout_id``)."""
    from contextlib import ExitStack

    from slimectl.contract.metrics import MetricsWriter

    rank0 = launch_rank() == 0
    with run.stage_log("train", enabled=rank0):  # rank 0 writes the log
        world = cfg.train.tp * cfg.train.pp * cfg.train.dp
        have = os.environ.get("WORLD_SIZE", "1")
        if int(have) != world:
            raise UsageError(f"train.tp*pp*dp = {world} processes are needed, this job has {have}; "
                             f"run `slimectl train` (it launches torchrun itself; on several nodes with --nnodes, "
                             f"--node-rank and --master-addr/--master-port on each)")
        if not rank0:
            logging.getLogger("slimectl").setLevel(logging.WARNING)
        # Cheap checks first (ids, cursor, files): a wrong --id fails in a second, not after building the
        # actor. Only rank 0 looks for the rollout: other nodes may see the shared filesystem a moment later.
        todo = plan_training(run, cfg, rollout_id, follow, max_rollouts, allow_empty, check_published=rank0)
        with ExitStack() as stack:
            lock = stack.enter_context(run.lock("train")) if rank0 else FollowerLock()
            trainer = Trainer(run, cfg, lock)  # also reconciles the cursor with the checkpoint
            stack.callback(trainer.close)  # the last checkpoint is published before the lock goes
            next_id = trainer.next_rollout
            if not todo:
                return TrainResult([], next_id, next_id)
            log.info("resuming at rollout %d, %d to go", next_id, len(todo))
            tb = run.tensorboard_dir("train") if cfg.logging.tensorboard else None
            trained: list[int] = []
            from slimectl.contract.logs import progress

            bar = stack.enter_context(progress(total=len(todo) * cfg.train.num_steps_per_rollout, desc="train",
                                               unit="step", mode=cfg.logging.progress if rank0 else "off"))
            with (MetricsWriter(run.metrics_path("train"), tb, resume_step=trainer.actor.step,
                                reason=f"resumed at rollout {next_id}") if rank0 else NullMetrics()) as metrics:
                for n, rid in enumerate(todo):
                    lock.check()
                    if follow:
                        art = run.rollouts.wait_for(rid, timeout=wait_timeout, should_stop=lambda: not lock.held)
                    elif broadcast_from_rank0(run.rollouts.exists(rid) if rank0 else None):
                        # Rank 0 decides: ranks on other nodes may see the shared filesystem a moment later.
                        art = run.rollouts.get(rid, verify="full") if rank0 else \
                            run.rollouts.wait_for(rid, timeout=60, verify="full")
                    else:
                        if trained:
                            if trainer.last_published != rid:  # stopping early: what was trained is checkpointed
                                trainer.publish(rid - 1, rid)
                            break
                        raise SlimectlError(f"rollouts/{rid:06d} is not published yet; run "
                                            f"`slimectl rollout -r {run.path}` or use --follow to wait for it")
                    bar.update(len(trainer.train_rollout(rid, art, metrics, publish_weights=False,
                                                         last=n == len(todo) - 1)))
                    trained.append(rid)
            return TrainResult(trained, trainer.next_rollout, trainer.next_rollout)


def _publish(run: RunDir, actor, arch, padded: int, cfg: SlimectlConfig, rid: int, version: int,
             checkpoint: bool = True, weights: bool = True, writer: CheckpointWriter | None = None,
             critic=None) -> dict[str, float]:
    """checkpoints/VERSION (model + optimizer) and/or weights/VERSION (HF safetensors); returns
    the seconds they held the training thread as ``perf/save_time`` and ``perf/update_weights_time``
    (only those published).

    The checkpoint is handed to ``writer`` (:class:`CheckpointWriter`: written and published in the
    background, ``perf/save_time`` is then the hand-over, including the wait for a previous save
    still running); the weights are written here (the engines load them next), streamed from the
    live parameters without a copy of the model.

    Collective under torchrun: every rank saves its shards into the staging directory rank 0
    opened (and joins the TP gather of the HF tensors); rank 0 alone seals and publishes.
    """
    from slimectl.backends.hf.checkpoint import write_safetensors_sharded
    from slimectl.backends.megatron.checkpoint import copy_hf_aux_files

    import time

    rank0 = launch_rank() == 0
    hf_src = Path(cfg.model.path)
    meta = {"source": "train", "next_rollout": rid + 1, "weight_version": version, "actor_step": actor.step}
    writer = writer or CheckpointWriter(background=False)
    phases: dict[str, float] = {}
    # weights/N first: the engines wait for it, and it is written alone, before the checkpoint's
    # background job competes with it for the disk.
    t = time.perf_counter()
    if weights:
        tensors = actor.iter_hf_tensors()  # collective under TP/PP; views of the parameters on rank 0
        if rank0:
            with run.weights.publish(version, meta={"source": "train", "rollout_id": rid, "weight_version": version},
                                     stage="train", overwrite=True) as staging:
                write_safetensors_sharded(tensors, staging)
                copy_hf_aux_files(hf_src, staging)
        else:
            for _ in tensors:
                pass
        del tensors
        phases["perf/update_weights_time"] = time.perf_counter() - t
        fault_point("train.weights_published")
        if rank0:
            log.info("published weights/%06d", version)
    t = time.perf_counter()
    if checkpoint:
        _publish_checkpoint(run, actor, arch, padded, cfg, meta, version, hf_src, rank0, writer, critic=critic)
        phases["perf/save_time"] = time.perf_counter() - t
    if weights and rank0 and cfg.sync.keep_weights:
        keep = cfg.sync.keep_weights
        writer.tidy(lambda: run.weights.prune(keep))
    _barrier()
    return phases


def _publish_checkpoint(run: RunDir, actor, arch, padded: int, cfg: SlimectlConfig, meta: dict, version: int,
                        hf_src: Path, rank0: bool, writer: CheckpointWriter, critic=None) -> None:
    """Hand checkpoints/VERSION to ``writer``: the state to save is taken now (the parameters and
    Adam moments by reference: the next optimizer step waits for the writer), written and
    published by the writer's job. With ``critic``, the same job publishes
    ``critic_checkpoints/VERSION`` first (collective like the actor's: every rank writes its file)."""
    import json
    import time
    from contextlib import ExitStack

    from slimectl.backends.megatron.checkpoint import HF_DIR, META, copy_hf_aux_files, save_torch_dist

    rid = meta["next_rollout"] - 1
    writer.wait()  # a previous save still running: never two at once (and its state is the older one)
    state = actor.state_to_save({"next_rollout": rid + 1})
    info = {"format": "torch_dist", "arch": arch.to_dict(), "padded_vocab_size": padded, "dtype": cfg.model.dtype,
            "saved_with": {"tp": cfg.train.tp, "pp": cfg.train.pp, "dp": cfg.train.dp,
                           **({"ep": cfg.train.ep} if cfg.train.ep > 1 else {})}, "iteration": actor.step}

    critic_state = critic.state_to_save() if critic is not None else None

    def job() -> None:
        t = time.perf_counter()
        if critic_state is not None:
            with ExitStack() as stack:
                staging = stack.enter_context(_critic_store(run).publish(
                    version, meta=dict(meta, critic_step=critic_state["step"], critic_saved_with=dict(
                        zip(("pp", "tp", "dp"), critic_state["parallel_layout"]))), stage="train", overwrite=True)) \
                    if rank0 else None
                critic.save_to(broadcast_from_rank0(str(staging) if rank0 else None), critic_state)
                _barrier()
            fault_point("train.critic_published")
        with ExitStack() as stack:
            staging = stack.enter_context(run.checkpoints.publish(version, meta=meta, stage="train", overwrite=True)) \
                if rank0 else None
            staging = Path(broadcast_from_rank0(str(staging) if rank0 else None))
            (staging / STATE_DIR).mkdir(parents=True, exist_ok=True)
            save_torch_dist(state, staging / STATE_DIR)  # collective: every rank's shards
            fault_point("train.state_saved")
            _barrier()
            if rank0:
                (staging / META).write_text(json.dumps(info, indent=2))
                copy_hf_aux_files(hf_src, staging / HF_DIR)
        fault_point("train.checkpoint_published")
        if rank0:
            if cfg.train.keep_checkpoints:
                run.checkpoints.prune(cfg.train.keep_checkpoints, protect={0})
            if critic_state is not None:  # the critic's follow the actor's (older than this one only)
                kept = set(run.checkpoints.ids())
                for i in _critic_store(run).ids():
                    if i < version and i not in kept:
                        _critic_store(run).remove(i)
            log.info("published checkpoints/%06d (%.2f s%s)", version, time.perf_counter() - t,
                     ", in the background" if writer.background else "")
        release_free_memory()  # the writer's buffers (in its own thread's malloc arena)

    writer.submit(job)
