"""The interface of a weight-version format, and full HF weights (:class:`FullWeights`), the plain one.

A format is what a published weight version *is* (``weights/N``'s files, what a checkpoint holds besides the
model) and how it reaches an engine (over disk, over the distributed group), with the operations the stages
need: train writes it, serve starts engines on it, sync pushes it, export writes it out. The stages call these
and never ask which format they hold.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from slimectl.contract.rundir import RunDir
    from slimectl.weight_formats.source import WeightSource


@dataclass
class EngineStart:
    """How launched engines start on a version: the model directory they load, then (once healthy) ``after``
    pushed over disk (a LoRA adapter over the base); ``staging``, a directory to remove once they have loaded."""

    model_path: str
    after: WeightSource | None = None
    staging: Path | None = None


class WeightGroup(Protocol):
    """The distributed transport as a format sees it: a group the trainer broadcasts to, every engine rank
    receiving (``slimectl.stages.sync.distributed.DistributedTransport``)."""

    group_name: str
    bucket_bytes: int
    progress: str
    held: Any
    """What the engines hold as the format last left it (None: nothing known), for formats that send deltas."""

    async def exchange(self, calls: list, tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Run the engine ``calls`` (coroutines) while ``tensors`` are broadcast, in order; the bytes moved."""


class WeightFormat(ABC):
    """One form of a weight version. Subclasses: :class:`FullWeights`, ``DeltaWeights``, ``LoraAdapter``,
    ``MergedLoraAdapter``."""

    name = ""
    full = True
    """Its versions are full HF model directories (False: adapters)."""
    adapter_name: str | None = None
    """The adapter every ``/generate`` asks for (``lora_path``), None: the engine's own weights."""
    config: dict[str, Any] | None = None
    """An adapter format's ``adapter_config.json``."""

    # ------------------------------------------------------------------ train: publish
    @property
    def published_meta(self) -> dict[str, Any]:
        """What ``weights/N``'s meta records of the format."""
        return {}

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint's metadata records of the format (export reads it back)."""
        return {}

    def start_actor(self, actor) -> None:
        """What the actor starts from besides the model (on resume, the checkpoint's state replaces it)."""

    @abstractmethod
    def trained_tensors(self, actor) -> Iterable[tuple[str, torch.Tensor]]:
        """The actor's tensors a version holds (collective under TP/PP)."""

    @abstractmethod
    def write(self, tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path, aux_dir: str | Path) -> None:
        """``weights/N``'s files from ``tensors``; ``aux_dir``: the HF model whose config and tokenizer go along."""

    def write_version(self, run: RunDir, version: int, tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path,
                      aux_dir: str | Path) -> None:
        """``weights/VERSION``'s files (``out_dir``: its staging directory) in ``run``: :meth:`write`, unless the
        format needs the versions before (deltas)."""
        self.write(tensors, out_dir, aux_dir)

    # ------------------------------------------------------------------ sources
    def source_from_dir(self, version: int, path: str | Path) -> WeightSource:
        from slimectl.weight_formats.source import WeightSource

        return WeightSource.from_dir(version, path, form=self)

    def source_from_tensors(self, version: int, iter_fn) -> WeightSource:
        from slimectl.weight_formats.source import WeightSource

        return WeightSource.from_tensors(version, iter_fn, adapter=self.config, form=self)

    # ------------------------------------------------------------------ serve
    def publish_initial(self, run: RunDir) -> None:
        """``weights/0`` before any training, where the format needs one."""

    def engine_start(self, run: RunDir, path: str, version: str, base: str) -> EngineStart:
        """How engines start on the version at ``path`` (``weights/N`` or the base), over model ``base``."""
        return EngineStart(path)

    def engine_args(self, sglang_args: dict[str, Any]) -> dict[str, Any]:
        """The SGLang server arguments engines need to take this format (``sglang_args``: the configured ones)."""
        return {}

    # ------------------------------------------------------------------ sync
    @contextmanager
    def for_engines(self, source: WeightSource, transport: str) -> Iterator[WeightSource]:
        """``source`` as the engines take it over ``transport`` (disk, distributed)."""
        yield source

    @abstractmethod
    async def push_disk(self, clients: dict, source: WeightSource, flush_cache: bool = True) -> int:
        """Every engine loads ``source.hf_dir`` itself; the bytes read."""

    @abstractmethod
    async def push_group(self, group: WeightGroup, clients: dict, source: WeightSource,
                         flush_cache: bool = True) -> int:
        """Broadcast ``source``'s tensors over ``group`` to every engine; the bytes moved."""

    # ------------------------------------------------------------------ export
    def check_export(self) -> None:
        """Refuse (one line) an export this format cannot write here."""

    @abstractmethod
    def export(self, tensors: Iterable[tuple[str, torch.Tensor]], dest: Path, shard_bytes: int, dtype: str,
               aux_dir: Path) -> dict:
        """Write a checkpoint's ``tensors`` (what :func:`read_checkpoint_tensors` gives) into ``dest``; the index."""


def buckets(tensors: Iterable[tuple[str, torch.Tensor]],
            bucket_bytes: int) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Group ``(name, tensor)`` into lists of at most ``bucket_bytes`` (a larger tensor goes alone);
    yields ``(bucket, is_last)``."""
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    pending: list[tuple[str, torch.Tensor]] | None = None
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if current and size + n > bucket_bytes:
            if pending is not None:
                yield pending, False
            pending, current, size = current, [], 0
        current.append((name, t))
        size += n
    if pending is not None:
        yield pending, not current
    if current:
        yield current, True


def dir_bytes(path: Path) -> int:
    """The bytes of a directory's safetensors."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


class FullWeights(WeightFormat):
    """Every weight, as an HF safetensors model directory (``/update_weights_from_disk``, or SGLang's bucketed
    ``/update_weights_from_distributed``)."""

    name = "hf"

    def trained_tensors(self, actor):
        return actor.iter_hf_tensors()

    def write(self, tensors, out_dir: Path, aux_dir) -> None:
        from slimectl.backends.hf.checkpoint import copy_hf_aux_files, write_safetensors_sharded

        write_safetensors_sharded(tensors, out_dir)
        copy_hf_aux_files(aux_dir, out_dir)

    async def push_disk(self, clients: dict, source: WeightSource, flush_cache: bool = True) -> int:
        path, version = str(source.hf_dir.resolve()), str(source.version)
        await asyncio.gather(*(c.update_weights_from_disk(path, weight_version=version, flush_cache=flush_cache)
                               for c in clients.values()))
        return dir_bytes(source.hf_dir) * len(clients)

    async def push_group(self, group: WeightGroup, clients: dict, source: WeightSource,
                         flush_cache: bool = True) -> int:
        """SGLang's sequence: ``/begin_weight_update``; per bucket, ``/update_weights_from_distributed`` (names,
        dtypes, shapes) on every engine while the trainer broadcasts; ``/end_weight_update``. The version rides on
        the last bucket, so an engine reports it only once all of it landed."""
        from slimectl.backends.hf.dtypes import dtype_name
        from slimectl.contract.logs import progress

        await asyncio.gather(*(c.begin_weight_update() for c in clients.values()))
        moved = 0
        bar = progress(mode=group.progress, desc=f"sync v{source.version}", unit=" buckets")
        try:
            for bucket, last in buckets(source.iter_tensors(), group.bucket_bytes):
                names, dtypes = [n for n, _ in bucket], [dtype_name(t.dtype) for _, t in bucket]
                shapes = [list(t.shape) for _, t in bucket]
                version = str(source.version) if last else None
                moved += await group.exchange([c.update_weights_from_distributed(
                    names, dtypes, shapes, group.group_name, weight_version=version, flush_cache=last and flush_cache)
                    for c in clients.values()], bucket)
                bar.update(1)
        finally:
            bar.close()
            await asyncio.gather(*(c.end_weight_update() for c in clients.values()), return_exceptions=True)
        return moved

    def export(self, tensors, dest: Path, shard_bytes: int, dtype: str, aux_dir: Path) -> dict:
        from slimectl.backends.hf.checkpoint import copy_hf_aux_files, set_config_dtype, write_safetensors_sharded
        from slimectl.backends.hf.dtypes import torch_dtype

        index = write_safetensors_sharded(tensors, dest, shard_bytes, dtype=torch_dtype(dtype))
        copy_hf_aux_files(aux_dir, dest)
        set_config_dtype(dest, dtype)
        return index


FULL_WEIGHTS = FullWeights()
