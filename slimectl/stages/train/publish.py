"""What training publishes: ``weights/N`` (HF safetensors for the engines, streamed from the live parameters) and
``checkpoints/N`` (model + optimizer + step, torch_dist; with PPO's ``critic_checkpoints/N`` first), the checkpoint
written by the ordered background writer.

Collective under torchrun: every rank saves its shards into the staging directory rank 0 opened (and joins the
TP gather of the HF tensors); rank 0 alone seals and publishes.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from pathlib import Path

from slimectl.backends.host_memory import release_free_memory
from slimectl.backends.megatron.checkpoint import (
    HF_DIR,
    TRAIN_STATE_DIR,
    checkpoint_meta,
    copy_hf_aux_files,
    save_torch_dist,
    write_checkpoint_meta,
)
from slimectl.backends.megatron.parallel import barrier, broadcast_from_rank0
from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.faults import fault_point
from slimectl.contract.ranks import launch_rank
from slimectl.contract.rundir import RunDir
from slimectl.stages.train.writer import CheckpointWriter
from slimectl.weight_formats import weight_format

log = logging.getLogger("slimectl.train")

def critic_store(run: RunDir):
    """``critic_checkpoints/``: PPO's critic, one per actor checkpoint of the same id."""
    return run.artifacts("critic_checkpoints")


def publish(run: RunDir, actor, cfg: SlimectlConfig, rid: int, version: int, checkpoint: bool = True,
            weights: bool = True, writer: CheckpointWriter | None = None, critic=None) -> dict[str, float]:
    """checkpoints/VERSION (model + optimizer) and/or weights/VERSION (HF safetensors); returns the seconds they
    held the training thread as ``perf/save_time`` and ``perf/update_weights_time`` (only those published).

    The checkpoint is handed to ``writer`` (:class:`CheckpointWriter`: written and published in the background,
    ``perf/save_time`` is then the hand-over, including the wait for a previous save still running); the weights
    are written here (the engines load them next), streamed from the live parameters without a copy of the model.
    """
    rank0 = launch_rank() == 0
    writer = writer or CheckpointWriter(background=False)
    phases: dict[str, float] = {}
    # weights/N first: the engines wait for it, and it is written alone, before the checkpoint's background job
    # competes with it for the disk.
    t = time.perf_counter()
    if weights:
        publish_weights(run, actor, cfg, rid, version, rank0)
        phases["perf/update_weights_time"] = time.perf_counter() - t
    t = time.perf_counter()
    if checkpoint:
        meta = {"source": "train", "next_rollout": rid + 1, "weight_version": version, "actor_step": actor.step}
        publish_checkpoint(run, actor, cfg, meta, version, rank0, writer, critic=critic)
        phases["perf/save_time"] = time.perf_counter() - t
    if weights and rank0 and cfg.sync.keep_weights:
        keep = cfg.sync.keep_weights
        writer.tidy(lambda: run.weights.prune(keep))
    barrier()
    return phases


def publish_weights(run: RunDir, actor, cfg: SlimectlConfig, rid: int, version: int, rank0: bool) -> None:
    """``weights/VERSION`` in the run's weight format (collective under TP/PP; written by rank 0): the actor's HF
    tensors and the HF config and tokenizer files of ``model.path``, or a LoRA run's PEFT adapter."""
    form = weight_format(cfg)
    tensors = form.trained_tensors(actor)  # collective under TP/PP; views of the parameters on rank 0
    if rank0:
        meta = {"source": "train", "rollout_id": rid, "weight_version": version, **form.published_meta}
        with run.weights.publish(version, meta=meta, stage="train", overwrite=True) as staging:
            form.write_version(run, version, tensors, staging, cfg.model.path)
    else:
        for _ in tensors:
            pass
    del tensors
    fault_point("train.weights_published")
    if rank0:
        log.info("published weights/%06d", version)


def publish_checkpoint(run: RunDir, actor, cfg: SlimectlConfig, meta: dict, version: int, rank0: bool,
                       writer: CheckpointWriter, critic=None) -> None:
    """Hand checkpoints/VERSION to ``writer``: the state to save is taken now (the parameters and Adam moments
    by reference: the next optimizer step waits for the writer), written and published by the writer's job.
    With ``critic``, the same job publishes ``critic_checkpoints/VERSION`` first (collective like the actor's:
    every rank writes its file)."""
    writer.wait()  # a previous save still running: never two at once (and its state is the older one)
    state = actor.state_to_save({"next_rollout": meta["next_rollout"]})
    t = cfg.train
    info = checkpoint_meta(actor.arch, actor.padded_vocab, cfg.model.dtype, iteration=actor.step,
                           saved_with={"tp": t.tp, "pp": t.pp, "dp": t.dp, **({"ep": t.ep} if t.ep > 1 else {})})
    info.update(weight_format(cfg).checkpoint_meta())
    critic_state = critic.state_to_save() if critic is not None else None

    def job() -> None:
        started = time.perf_counter()
        if critic_state is not None:
            _save_critic(run, critic, critic_state, meta, version, rank0)
        _save_actor(run, state, info, meta, version, cfg.model.path, rank0)
        if rank0:
            _prune(run, cfg, version, critic_state is not None)
            log.info("published checkpoints/%06d (%.2f s%s)", version, time.perf_counter() - started,
                     ", in the background" if writer.background else "")
        release_free_memory()  # the writer's buffers (in its own thread's malloc arena)

    writer.submit(job, version=version)


def _save_critic(run: RunDir, critic, critic_state: dict, meta: dict, version: int, rank0: bool) -> None:
    """``critic_checkpoints/VERSION`` (collective: every rank its shards; rank 0 publishes)."""
    with ExitStack() as stack:
        saved_with = dict(zip(("pp", "tp", "dp"), critic_state["parallel_layout"]))
        staging = stack.enter_context(critic_store(run).publish(
            version, meta=dict(meta, critic_step=critic_state["step"], critic_saved_with=saved_with), stage="train",
            overwrite=True)) if rank0 else None
        critic.save_to(broadcast_from_rank0(str(staging) if rank0 else None), critic_state)
        barrier()
    fault_point("train.critic_published")


def _save_actor(run: RunDir, state: dict, info: dict, meta: dict, version: int, hf_src, rank0: bool) -> None:
    """``checkpoints/VERSION`` (collective: every rank its shards into rank 0's staging directory)."""
    with ExitStack() as stack:
        staging = stack.enter_context(run.checkpoints.publish(version, meta=meta, stage="train", overwrite=True)) \
            if rank0 else None
        staging = Path(broadcast_from_rank0(str(staging) if rank0 else None))
        (staging / TRAIN_STATE_DIR).mkdir(parents=True, exist_ok=True)
        save_torch_dist(state, staging / TRAIN_STATE_DIR)  # collective: every rank's shards
        fault_point("train.state_saved")
        barrier()
        if rank0:
            write_checkpoint_meta(staging, info)
            copy_hf_aux_files(hf_src, staging / HF_DIR)
    fault_point("train.checkpoint_published")


def _prune(run: RunDir, cfg: SlimectlConfig, version: int, with_critic: bool) -> None:
    """Old checkpoints beyond ``train.keep_checkpoints`` (the initial one kept), and the critic's that follow them."""
    if cfg.train.keep_checkpoints:
        run.checkpoints.prune(cfg.train.keep_checkpoints, protect={0})
    if with_critic:  # the critic's follow the actor's (older than this one only)
        kept = set(run.checkpoints.ids())
        for i in critic_store(run).ids():
            if i < version and i not in kept:
                critic_store(run).remove(i)
