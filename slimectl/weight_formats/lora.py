"""A LoRA run's versions: the PEFT adapter (:class:`LoraAdapter`), served by name over the frozen base; or, for
engines that take full weights only, the same adapter merged into its base on the way (:class:`MergedLoraAdapter`).

Either way ``weights/N`` is the PEFT adapter directory (megabytes) and a checkpoint holds the adapters only
(its metadata's ``lora`` is the adapter config export reads them back with).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from slimectl.contract.errors import UsageError
from slimectl.weight_formats.format import EngineStart, WeightFormat, dir_bytes

log = logging.getLogger("slimectl.weights")


def mark_staging(path: Path, stage: str) -> None:
    """A directory in the run's .staging, its writer recorded (a dead writer's is removed by the next stage)."""
    from slimectl.contract.rundir.artifacts import WRITER_FILE, writer_info
    from slimectl.contract.rundir.atomic import atomic_write_json

    path.mkdir(parents=True)
    atomic_write_json(path / WRITER_FILE, writer_info(stage))


class LoraAdapter(WeightFormat):
    """A PEFT LoRA adapter, served by the engines as :data:`~slimectl.engines.pool.POLICY_ADAPTER` over their base
    (``/load_lora_adapter``; over the group our engine's ``/load_lora_adapter_from_distributed``).

    ``config``: its ``adapter_config.json`` (None for one read from a directory: the source carries it);
    ``lora``: the run's ``train.lora``; ``adapter_path``: ``model.adapter_path``, the adapter the run starts from;
    ``caps``: what the engines declare they take (None: not known, every push is tried)."""

    name = "peft_lora"
    full = False

    def __init__(self, config: dict[str, Any] | None = None, lora=None, adapter_path: str | None = None,
                 caps=None):
        from slimectl.engines.pool import POLICY_ADAPTER

        self.config, self.lora, self.adapter_path, self.caps = config, lora, adapter_path, caps
        self.adapter_name = POLICY_ADAPTER

    @property
    def base(self) -> str | None:
        """The model the adapter was trained on (``model.path``)."""
        return (self.config or {}).get("base_model_name_or_path")

    # ------------------------------------------------------------------ train: publish
    @property
    def published_meta(self) -> dict[str, Any]:
        return {"format": "peft_lora"}

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"lora": self.config}  # the checkpoint holds the adapters only: export reads them back with this

    def start_actor(self, actor) -> None:
        if self.adapter_path:  # LoRA from an existing adapter, not B = 0
            actor.load_adapter(self.adapter_path)

    def trained_tensors(self, actor):
        return actor.iter_adapter_tensors()

    def write(self, tensors, out_dir: Path, aux_dir) -> None:
        from slimectl.backends.hf.peft_adapter import write_adapter

        write_adapter(tensors, out_dir, self.config)

    # ------------------------------------------------------------------ serve
    def publish_initial(self, run) -> None:
        """``weights/0``: the adapter the engines serve before any training (``model.adapter_path``'s, or one that
        changes nothing: A and B zero), published once (by whichever process gets there first)."""
        from slimectl.backends.hf.arch import arch_from_dir
        from slimectl.backends.hf.peft_adapter import check_adapter_fits, check_adapter_shapes, read_adapter, \
            write_adapter, zero_adapter
        from slimectl.contract.errors import ArtifactExists

        if run.weights.exists(0):
            return
        if self.adapter_path:
            conf, tensors = read_adapter(self.adapter_path)
            where = f"model.adapter_path {self.adapter_path}"
            check_adapter_fits(conf, self.lora, where)
            check_adapter_shapes(tensors, arch_from_dir(self.base), self.lora, where)
        else:
            conf, tensors = self.config, zero_adapter(arch_from_dir(self.base), self.lora)
        try:
            with run.weights.publish(0, meta={"source": "serve", "weight_version": 0, **self.published_meta},
                                     stage="serve") as staging:
                write_adapter(tensors.items(), staging, conf)
        except ArtifactExists:
            return  # another stage published it meanwhile
        log.info("published weights/000000: the initial LoRA adapter (%s)", self.adapter_path or "B = 0")

    def engine_start(self, run, path: str, version: str, base: str) -> EngineStart:
        """The engines load the base, then the version's adapter over it."""
        from slimectl.weight_formats.source import WeightSource

        return EngineStart(base, after=WeightSource(int(version), Path(path), form=self))

    def engine_args(self, sglang_args: dict[str, Any]) -> dict[str, Any]:
        """SGLang serves adapters only when started for them."""
        args = {"enable_lora": True, "max_lora_rank": self.config["r"], "max_loras_per_batch": 1,
                "lora_target_modules": list(self.config["target_modules"])}
        if str(sglang_args.get("device", "")) == "cpu":
            args["lora_backend"] = "torch_native"  # SGLang's other LoRA backends are GPU kernels
        return args

    # ------------------------------------------------------------------ sync
    async def push_disk(self, clients: dict, source, flush_cache: bool = True) -> int:
        path, version = str(source.hf_dir.resolve()), str(source.version)
        await asyncio.gather(*(c.swap_lora_adapter(self.adapter_name, path, version) for c in clients.values()))
        return dir_bytes(source.hf_dir) * len(clients)

    async def push_group(self, group, clients: dict, source, flush_cache: bool = True) -> int:
        """The adapters (megabytes) in one broadcast, each engine receiving them as the served adapter
        (``/load_lora_adapter_from_distributed``, which carries the version)."""
        from slimectl.backends.hf.dtypes import dtype_name
        from slimectl.contract.errors import SlimectlError

        if self.caps is not None and not self.caps.adapters_over_group:
            raise SlimectlError("these engines take a LoRA adapter from disk only (SGLang has no "
                                "/load_lora_adapter_from_distributed); set sync.transport: disk, or "
                                "engine.lora_merged: true to send them merged full weights")
        tensors = list(source.iter_tensors())
        names, dtypes = [n for n, _ in tensors], [dtype_name(t.dtype) for _, t in tensors]
        shapes = [list(t.shape) for _, t in tensors]
        return await group.exchange([c.load_lora_adapter_from_distributed(
            self.adapter_name, source.adapter, names, dtypes, shapes, group.group_name,
            weight_version=str(source.version)) for c in clients.values()], tensors)

    # ------------------------------------------------------------------ export
    def export(self, tensors, dest: Path, shard_bytes: int, dtype: str, aux_dir: Path) -> dict:
        from slimectl.backends.hf.peft_adapter import ADAPTER_WEIGHTS, write_adapter

        tensors = dict(tensors)
        write_adapter(tensors.items(), dest, self.config)
        return {"weight_map": {k: ADAPTER_WEIGHTS for k in tensors}}


class MergedLoraAdapter(LoraAdapter):
    """A LoRA version for engines that take full weights only (``engine.lora_merged``; SGLang on CPU): published
    and checkpointed as the adapter, handed to the engines as their base with it merged in (rollouts then ask for
    no adapter). Exported with ``--merge``: the base with the adapter merged in."""

    name = "peft_lora_merged"

    def __init__(self, config: dict[str, Any] | None = None, lora=None, adapter_path: str | None = None,
                 caps=None):
        super().__init__(config, lora, adapter_path, caps)
        self.adapter_name = None

    def engine_start(self, run, path: str, version: str, base: str) -> EngineStart:
        """The base at version 0 (its adapter changes nothing) unless ``model.adapter_path`` gave one, else the base
        with the version's adapter merged in (in the run's .staging, removed once the engines have loaded it)."""
        from slimectl.backends.hf.peft_adapter import read_adapter, write_merged_model

        if version == "0" and not self.adapter_path:
            return EngineStart(base)
        conf, tensors = read_adapter(path)
        staging = run.path / ".staging" / f"merged.{version}.{uuid.uuid4().hex}"
        mark_staging(staging, "serve")
        log.info("engines get the base with the adapter of weight version %s merged in (engine.lora_merged)", version)
        return EngineStart(str(write_merged_model(base, conf, tensors, staging)), staging=staging)

    def engine_args(self, sglang_args: dict[str, Any]) -> dict[str, Any]:
        return {}

    @contextmanager
    def for_engines(self, source, transport: str):
        """The version as full weights: the base with its adapter merged in, written next to ``weights/N`` for the
        disk transport (where the engines read the run's files; removed after), streamed for the distributed one."""
        if source.adapter is None:  # not an adapter (version 0 from model.path): as it is
            yield source
            return
        staging = None
        if transport == "disk":
            staging = Path(source.hf_dir).resolve().parent.parent / ".staging" / \
                f"merged.{source.version}.{uuid.uuid4().hex}"
            mark_staging(staging, "sync")
        try:
            yield merged_source(source, self.base, staging)
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)

    def check_export(self) -> None:
        base = self.base
        if not (base and (Path(base) / "config.json").is_file()):
            raise UsageError(f"--merge needs the LoRA run's base model, {base!r}, which is not a model directory "
                             f"here; copy the base there (the run's model.path) or export the adapter without --merge")

    def export(self, tensors, dest: Path, shard_bytes: int, dtype: str, aux_dir: Path) -> dict:
        """The base (the adapter config's ``base_model_name_or_path``, the run's model.path) with the adapter
        merged in, in ``dtype``."""
        from slimectl.backends.hf.checkpoint import HFCheckpoint, copy_hf_aux_files, set_config_dtype, \
            write_safetensors_sharded
        from slimectl.backends.hf.dtypes import torch_dtype
        from slimectl.backends.hf.peft_adapter import merged_tensors

        with HFCheckpoint(self.base) as hf:
            index = write_safetensors_sharded(merged_tensors(hf, self.config, dict(tensors)), dest, shard_bytes,
                                              dtype=torch_dtype(dtype))
        copy_hf_aux_files(self.base, dest)
        set_config_dtype(dest, dtype)
        return index


def merged_source(source, base: str | Path, staging: Path | None):
    """A LoRA version as full weights: ``base`` with ``source``'s adapter merged in. ``staging``: a directory to
    write the merged model into (the disk transport loads it from there; removed by the caller), None: a tensor
    stream (the distributed transport)."""
    from slimectl.backends.hf.checkpoint import HFCheckpoint
    from slimectl.backends.hf.peft_adapter import merged_tensors, write_merged_model
    from slimectl.weight_formats.source import WeightSource

    tensors = dict(source.iter_tensors())  # the adapters: megabytes
    if staging is not None:
        return WeightSource.from_dir(source.version, write_merged_model(base, source.adapter, tensors, staging))

    def stream():
        with HFCheckpoint(str(base)) as hf:
            yield from merged_tensors(hf, source.adapter, tensors)

    return WeightSource.from_tensors(source.version, stream)


#: The format of an adapter directory read alone (``WeightSource.from_dir`` without a run's format).
LORA_ADAPTER = LoraAdapter()


def lora_format(cfg, caps) -> LoraAdapter:
    """A LoRA run's format: the adapter for engines that serve adapters (``caps``), else merged into the base;
    ``engine.lora_merged`` (when set) decides instead."""
    from slimectl.backends.hf.peft_adapter import adapter_config

    merged = cfg.engine.lora_merged if cfg.engine.lora_merged is not None else not caps.adapters
    return (MergedLoraAdapter if merged else LoraAdapter)(adapter_config(cfg.train.lora, cfg.model.path),
                                                          cfg.train.lora, cfg.model.adapter_path, caps)
