"""What a sync sends: one weight version, as an HF directory on disk and/or HF-named tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class WeightSource:
    """Weight version ``version``.

    ``hf_dir`` is an HF model directory holding exactly these weights (what the disk transport
    hands to engines); ``iter_tensors()`` yields ``(hf_name, tensor)`` for the distributed
    transport and for verification — read lazily from ``hf_dir``, or streamed from a live
    trainer (``from_tensors``). A LoRA run's version is an adapter: ``adapter`` is its ``adapter_config.json``
    (``hf_dir`` a PEFT adapter directory, the tensors PEFT-named), and engines load it over their base.
    """

    version: int
    hf_dir: Path | None = None
    _iter: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None
    _get: Callable[[str], torch.Tensor] | None = None
    adapter: dict | None = None

    @classmethod
    def from_dir(cls, version: int, hf_dir: str | Path) -> "WeightSource":
        from slimectl.backends.hf.peft_adapter import is_adapter_dir, read_adapter_config

        adapter = read_adapter_config(hf_dir) if is_adapter_dir(hf_dir) else None
        return cls(version, Path(hf_dir), adapter=adapter)

    @classmethod
    def from_tensors(cls, version: int, iter_fn: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                     hf_dir: str | Path | None = None, adapter: dict | None = None) -> "WeightSource":
        return cls(version, Path(hf_dir) if hf_dir is not None else None, iter_fn, adapter=adapter)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._iter is not None:
            yield from self._iter()
            return
        if self.adapter is not None:
            from slimectl.backends.hf.peft_adapter import read_adapter

            yield from read_adapter(self.hf_dir)[1].items()
            return
        with self._checkpoint() as ckpt:
            yield from ckpt.iter_tensors()

    def heads(self, pick: Callable[[list[str]], list[str]], rows: int) -> dict[str, torch.Tensor]:
        """The first ``rows`` rows of the tensors ``pick(all names)`` chooses, for verification.

        From a directory only the picked tensors are read; from a tensor stream one pass keeps
        every tensor's head (small) and then picks, so a live trainer is streamed once."""
        if self._iter is None:
            with self._checkpoint() as ckpt:
                return {n: ckpt.get(n)[:rows] for n in pick(ckpt.names())}
        every = {n: t.detach()[:rows].clone() for n, t in self._iter()}
        return {n: every[n] for n in pick(list(every))}

    def _checkpoint(self):
        from slimectl.backends.hf.checkpoint import HFCheckpoint

        if self.hf_dir is None:
            raise ValueError(f"weight version {self.version} has neither a directory nor a tensor stream")
        return HFCheckpoint(str(self.hf_dir))


def merged_source(source: WeightSource, base: str | Path, staging: Path | None):
    """A LoRA version as full weights: ``base`` with ``source``'s adapter merged in, for engines that are not
    serving adapters (``engine.lora_merged``). ``staging``: a directory to write the merged model into (the disk
    transport loads it from there; removed by the caller), None: a tensor stream (the distributed transport)."""
    from slimectl.backends.hf.checkpoint import HFCheckpoint
    from slimectl.backends.hf.peft_adapter import merged_tensors, write_merged_model

    tensors = dict(source.iter_tensors())  # the adapters: megabytes
    if staging is not None:
        return WeightSource.from_dir(source.version, write_merged_model(base, source.adapter, tensors, staging))

    def stream():
        with HFCheckpoint(str(base)) as hf:
            yield from merged_tensors(hf, source.adapter, tensors)

    return WeightSource.from_tensors(source.version, stream)
