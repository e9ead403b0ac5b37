"""Delta weight sync (``sync.mode: delta``): full HF weights, plus what changed since the version before.

``weights/N`` holds the full safetensors as under :class:`~slimectl.weight_formats.format.FullWeights` (export,
verification, a restarted engine and any engine on another version need them) and, when ``weights/N-1`` is still
there as it is written, the delta against it (:mod:`slimectl.backends.hf.weight_delta`: ``delta.json`` naming the
base version and the base's digest, ``delta.bin``), sealed by the same READY manifest. An engine that applies
deltas (:attr:`EngineCaps.deltas <slimectl.engines.caps.EngineCaps.deltas>`) and serves the base version gets the
delta; one that cannot but loads from its host's disk (:attr:`~slimectl.engines.caps.EngineCaps.local_copy`:
SGLang), on the sync's host, loads the version from a host-local copy that the delta brings forward
(:mod:`slimectl.weight_formats.local_copy`); every other engine the full weights. An engine that finds its
weights are not the delta's base refuses (one line) and gets the full weights; a corrupt delta (a flipped byte,
truncated) fails the sync loudly and leaves the engine on its version.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Literal

from slimectl.weight_formats.format import FullWeights, dir_bytes

log = logging.getLogger("slimectl.weights")

#: The marker of an engine refusal that means "not my base" (the server's message carries it): full weights then.
BASE_REFUSAL = "(base)"

#: How one engine gets a version of this format: the delta applied by the engine, the version loaded from the
#: host-local copy the delta brought forward, or the full ``weights/N``.
Route = Literal["delta", "local_copy", "full"]


class DeltaWeights(FullWeights):
    """Full weights with a delta against the previous version (``sync``: the run's SyncSection; ``caps``: what
    the engines declare they take)."""

    name = "hf_delta"

    def __init__(self, sync=None, caps=None):
        self.encoding = getattr(sync, "delta_encoding", "xor")
        self.compression = getattr(sync, "delta_compression", "zstd")
        self.level = getattr(sync, "delta_level", 1)
        self.caps = caps
        self.local_copy = bool(getattr(sync, "local_copy", True))
        self.local_copy_dir = getattr(sync, "local_copy_dir", None)

    @property
    def published_meta(self) -> dict:
        return {"sync_mode": "delta", "delta_encoding": self.encoding}

    # ------------------------------------------------------------------ train: publish
    def write_version(self, run, version: int, tensors, out_dir: Path, aux_dir) -> None:
        """The full weights, and the delta against ``weights/N-1`` while it is there (none otherwise: version 0,
        pruned, or another shape)."""
        from slimectl.backends.hf.checkpoint import HFCheckpoint

        if version >= 1 and run.weights.exists(version - 1):
            base_dir = run.weights.get(version - 1).path
        elif version == 1 and (Path(aux_dir) / "config.json").is_file():
            base_dir = Path(aux_dir)  # the engines start on model.path as version 0
        else:
            log.info("weights/%06d: no weights/%06d to take a delta against; full weights only", version, version - 1)
            return self.write(tensors, out_dir, aux_dir)
        with HFCheckpoint(base_dir) as base:
            self.write(self._with_delta(tensors, base, out_dir, version - 1), out_dir, aux_dir)

    def _with_delta(self, tensors, base, out_dir: Path, base_version: int):
        """``tensors`` passed on, each also encoded against ``base`` into the delta beside them; a version whose
        names differ from the base's gets none."""
        from slimectl.backends.hf.weight_delta import DeltaError, DeltaWriter

        writer = DeltaWriter(out_dir, base_version, self.encoding, self.compression, self.level)
        seen: set[str] = set()
        for name, t in tensors:
            if writer is not None:
                try:
                    if name not in base:
                        raise DeltaError(f"{name!r} is not in weights/{base_version:06d}")
                    writer.add(name, base.get(name), t)
                    seen.add(name)
                except DeltaError as exc:
                    log.warning("no delta for this version (%s): full weights only", exc)
                    writer.abort()
                    writer = None
            yield name, t
        if writer is not None and seen != set(base.names()):
            log.warning("no delta for this version: weights/%06d has tensors this one lacks", base_version)
            writer.abort()
        elif writer is not None:
            header = writer.close()
            changed = sum(e["changed"] for e in header["tensors"])
            log.info("delta against weights/%06d: %d elements changed, %.2f MB", base_version, changed,
                     header["blob_bytes"] / 1e6)

    # ------------------------------------------------------------------ sync
    def _delta_of(self, source) -> dict | None:
        """The raw header of ``source``'s delta (None: it has none), checked with its blob's length before any
        engine is touched: a malformed header, an unknown encoding or a truncated blob is refused (UsageError,
        one line)."""
        from slimectl.backends.hf.weight_delta import DELTA_FILE, DELTA_META, DeltaError, read_header
        from slimectl.contract.errors import UsageError

        d = None if source.hf_dir is None else Path(source.hf_dir)
        if d is None or not (d / DELTA_META).is_file():
            return None
        try:
            try:
                raw = json.loads((d / DELTA_META).read_text())
            except ValueError as exc:
                raise DeltaError(f"{d / DELTA_META} is not JSON ({exc})") from None
            header = read_header(raw)
            size = (d / DELTA_FILE).stat().st_size if (d / DELTA_FILE).is_file() else None
            if size != header["blob_bytes"]:
                raise DeltaError(f"{d / DELTA_FILE} has {size} bytes, its header says {header['blob_bytes']}: "
                                 f"truncated")
        except DeltaError as exc:
            raise UsageError(f"the delta of weight version {source.version} is unusable: {exc}; republish "
                             f"weights/{source.version:06d} or remove its {DELTA_META} to sync full weights") from None
        return raw

    async def _on_base(self, clients: dict, header: dict | None) -> dict[str, bool]:
        """Which engines take the delta: they apply deltas and serve its base version."""
        if header is None or (self.caps is not None and not self.caps.deltas):
            return {u: False for u in clients}
        versions = await asyncio.gather(*(c.weight_version() for c in clients.values()), return_exceptions=True)
        base = str(header["base_version"])
        return {u: not isinstance(v, BaseException) and str(v) == base for u, v in zip(clients, versions)}

    async def _routes(self, clients: dict, header: dict | None) -> dict[str, Route]:
        """How each engine gets the version: engines that apply deltas by their base version; engines that cannot
        (``caps.deltas`` false) from the local copy when they take one (``caps.local_copy``, ``sync.local_copy``)
        and run on this host; the rest in full."""
        if header is not None and self.caps is not None and not self.caps.deltas:
            from slimectl.weight_formats.local_copy import on_this_host

            local = {u: self.caps.local_copy and self.local_copy and on_this_host(u) for u in clients}
            if self.caps.local_copy and self.local_copy and not all(local.values()):
                log.info("engines on other hosts (%s) get the full weights: the local copy is on this host",
                         ", ".join(u for u, here in local.items() if not here))
            return {u: "local_copy" if here else "full" for u, here in local.items()}
        on_base = await self._on_base(clients, header)
        return {u: "delta" if on_base[u] else "full" for u in clients}

    def local_copy_of(self, source):
        """The host-local copy of ``source``'s run (``sync.local_copy_dir``/<run>)."""
        import os

        from slimectl.weight_formats.local_copy import LocalCopy, default_root, run_key

        root = Path(os.path.expanduser(self.local_copy_dir)) if self.local_copy_dir else default_root()
        return LocalCopy(root / run_key(Path(source.hf_dir).parent))

    async def push_disk(self, clients: dict, source, flush_cache: bool = True) -> int:
        """The delta to the engines on its base (``/update_weights_from_delta``); the host-local copy, brought
        forward by the delta, to the engines that load from it; the full weights to the others and to any that
        refuses the delta as not its base. The bytes read from the run directory."""
        from slimectl.engines.client import EngineError

        header = self._delta_of(source)
        routes = await self._routes(clients, header)
        path, version = str(Path(source.hf_dir).resolve()), str(source.version)
        delta_bytes = header["blob_bytes"] if header else 0
        local_path, local_bytes = None, 0
        if "local_copy" in routes.values():
            copy, local_bytes = await asyncio.to_thread(self.local_copy_of(source).advance, source.version,
                                                        Path(source.hf_dir), header)
            local_path = str(copy.path)

        async def one(url: str, c) -> int:
            if routes[url] == "local_copy":
                await c.update_weights_from_disk(local_path, weight_version=version, flush_cache=flush_cache)
                return 0
            if routes[url] == "delta":
                try:
                    await c.update_weights_from_delta(version, delta_path=path, flush_cache=flush_cache)
                    return delta_bytes
                except EngineError as exc:
                    if not takes_full_instead(exc):
                        raise
                    log.warning("engine %s refused the delta of weight version %s (%s); it gets the full weights",
                                url, version, exc)
            await c.update_weights_from_disk(path, weight_version=version, flush_cache=flush_cache)
            return dir_bytes(source.hf_dir)

        return local_bytes + sum(await asyncio.gather(*(one(u, c) for u, c in clients.items())))

    async def push_group(self, group, clients: dict, source, flush_cache: bool = True) -> int:
        """When every engine is on the delta's base: the delta's blob in one broadcast, each engine applying it
        (``/update_weights_from_delta`` with the group); otherwise, or when one refuses it as not its base, the
        full bucketed broadcast to all (one group: a broadcast reaches every engine)."""
        import torch

        from slimectl.backends.hf.weight_delta import DELTA_FILE
        from slimectl.engines.client import EngineError

        if source.hf_dir is None:  # a live trainer's tensors: the delta against what the group last carried
            return await self._push_live(group, clients, source, flush_cache)
        header = self._delta_of(source)
        on_base = await self._on_base(clients, header)
        version = str(source.version)
        if header is not None and all(on_base.values()):
            data = bytearray((Path(source.hf_dir) / DELTA_FILE).read_bytes())
            blob = [("delta", torch.frombuffer(data, dtype=torch.uint8))] if data else []  # empty: nothing changed
            try:
                return await group.exchange([c.update_weights_from_delta(
                    version, header=header, group_name=group.group_name, flush_cache=flush_cache)
                    for c in clients.values()], blob)
            except EngineError as exc:
                if not takes_full_instead(exc):
                    raise
                log.warning("an engine refused the delta of weight version %s (%s); every engine gets the "
                            "full weights", version, exc)
        elif header is not None:
            log.info("weight version %s: not every engine is on weights/%06d, the delta's base; full weights to all",
                     version, header["base_version"])
        return await super().push_group(group, clients, source, flush_cache)


    async def _push_live(self, group, clients: dict, source, flush_cache: bool) -> int:
        """A version streamed from the trainer (``rl`` over the distributed transport: no ``weights/N``): the
        trainer keeps on ``group.held`` a copy of the version the engines were last sent (a second copy of the
        model in its memory, on the CPU), encodes the new one against it in memory and broadcasts that delta
        when every engine is on it; full weights otherwise (the first sync, a new group, an engine on another
        version or refusing). Either way ``group.held`` is then the new version."""
        from slimectl.engines.client import EngineError

        held = group.held
        version = str(source.version)
        if held is not None:
            on_base = await self._on_base(clients, {"base_version": held[0]})
            if all(on_base.values()):
                header, blob, kept = self._encode_live(source, held)  # on this thread: the pass is the trainer's
                try:
                    moved = await group.exchange([c.update_weights_from_delta(
                        version, header=header, group_name=group.group_name, flush_cache=flush_cache)
                        for c in clients.values()], blob)
                    group.held = (version, kept)
                    return moved
                except EngineError as exc:
                    if not takes_full_instead(exc):
                        raise
                    log.warning("an engine refused the delta of weight version %s (%s); every engine gets the full "
                                "weights", version, exc)
        group.held = None
        kept: dict = {}

        def keeping():
            for name, t in source.iter_tensors():
                kept[name] = t.detach().to("cpu", copy=True)
                yield name, t

        moved = await super().push_group(group, clients, type(source).from_tensors(
            source.version, keeping, form=self), flush_cache)
        group.held = (version, kept)
        return moved

    def _encode_live(self, source, held):
        """(header, the blob as the tensors to broadcast, the new version's CPU copies) of one pass over
        ``source`` against ``held`` = (version, tensors)."""
        import torch

        from slimectl.backends.hf.weight_delta import DeltaWriter

        writer = DeltaWriter(None, int(held[0]), self.encoding, self.compression, self.level)
        kept = {}
        for name, t in source.iter_tensors():
            kept[name] = t.detach().to("cpu", copy=True)
            writer.add(name, held[1][name], kept[name])
        header = writer.close()
        data = bytearray(writer.blob)
        return header, ([("delta", torch.frombuffer(data, dtype=torch.uint8))] if data else []), kept


def takes_full_instead(exc) -> bool:
    """An engine's refusal of a delta that full weights answer: not its base, or no delta endpoint (404: an
    engine started elsewhere, e.g. SGLang); anything else (a corrupt delta) is a failure."""
    return BASE_REFUSAL in str(exc) or getattr(exc, "status", None) == 404


def delta_format(cfg, caps) -> DeltaWeights:
    """``sync.mode: delta``'s format; refused (one line) for a LoRA run, whose versions are adapters already."""
    from slimectl.contract.errors import UsageError

    if cfg.train.lora is not None:
        raise UsageError("sync.mode: delta is for full weights; a LoRA run's versions are adapters of a few MB, "
                         "sent whole (a delta would not pay): set sync.mode: full")
    try:
        import xxhash  # noqa: F401
        if cfg.sync.delta_compression == "zstd":
            import zstandard  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"sync.mode: delta needs the {exc.name} package: pip install 'slimectl[delta]'") from None
    return DeltaWeights(cfg.sync, caps)
