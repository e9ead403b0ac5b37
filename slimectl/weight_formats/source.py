"""What a sync sends: one weight version, as a directory on disk and/or named tensors, in its format."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from slimectl.weight_formats.format import WeightFormat


@dataclass
class WeightSource:
    """Weight version ``version`` in format ``form`` (full weights by default).

    ``hf_dir`` is a directory holding exactly these weights (what the disk transport hands to engines);
    ``iter_tensors()`` yields ``(name, tensor)`` for the distributed transport and for verification — read lazily
    from ``hf_dir``, or streamed from a live trainer (``from_tensors``). A LoRA version is an adapter: ``adapter``
    is its ``adapter_config.json`` (``hf_dir`` a PEFT adapter directory, the tensors PEFT-named).
    """

    version: int
    hf_dir: Path | None = None
    _iter: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None
    _get: Callable[[str], torch.Tensor] | None = None
    adapter: dict | None = None
    form: WeightFormat | None = None

    def __post_init__(self) -> None:
        if self.form is None:
            from slimectl.weight_formats.format import FULL_WEIGHTS
            from slimectl.weight_formats.lora import LORA_ADAPTER

            self.form = FULL_WEIGHTS if self.adapter is None else LORA_ADAPTER

    @classmethod
    def from_dir(cls, version: int, hf_dir: str | Path, form: WeightFormat | None = None) -> "WeightSource":
        """A published version's directory: an HF model, or a PEFT adapter (then in ``form``, a LoRA format)."""
        from slimectl.backends.hf.peft_adapter import is_adapter_dir, read_adapter_config

        adapter = read_adapter_config(hf_dir) if is_adapter_dir(hf_dir) else None
        keep = form is not None and form.full == (adapter is None)  # a LoRA run's version 0 is the full base
        return cls(version, Path(hf_dir), adapter=adapter, form=form if keep else None)

    @classmethod
    def from_tensors(cls, version: int, iter_fn: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                     hf_dir: str | Path | None = None, adapter: dict | None = None,
                     form: WeightFormat | None = None) -> "WeightSource":
        return cls(version, Path(hf_dir) if hf_dir is not None else None, iter_fn, adapter=adapter, form=form)

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
