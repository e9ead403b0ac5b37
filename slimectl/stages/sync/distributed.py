"""Distributed transport: the trainer broadcasts HF-named tensors to every engine rank.

The trainer is rank 0 of a custom process group; engine ``i`` joins it with ranks
``rank_offset .. rank_offset + tp_size - 1`` (``/init_weights_update_group``). A push is
SGLang's sequence: ``/begin_weight_update``; per bucket of at most ``sync.bucket_size_mb``,
``/update_weights_from_distributed`` (names, dtypes, shapes) on every engine *while* the
trainer broadcasts those tensors in that order; ``/end_weight_update``. The weight version
rides on the last bucket, so an engine reports the new version only once all of it landed.
NCCL on GPUs, gloo on CPUs — the same code.

Across hosts, ``sync.master_addr`` is this (rank-0) host's address as the engines reach it, and
``sync.master_port`` a port they can connect to; :func:`check_master_addr` refuses the settings
that would leave every engine waiting on an address it cannot reach.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import Iterable, Iterator

import torch

from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.contract.net import free_port
from slimectl.stages.sync.source import WeightSource
from slimectl.stages.sync.transport import WeightTransport

log = logging.getLogger("slimectl.sync")


def buckets(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
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


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def _addresses(host: str) -> list[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except (socket.gaierror, UnicodeError):
        return []


def _is_loopback(host: str) -> bool:
    import ipaddress

    addrs = _addresses(host)
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def _is_this_host(host: str) -> bool:
    """Does ``host`` name an address of this machine? (Binding to it succeeds only then.)"""
    for addr in _addresses(host):
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr, 0))
            return True
        except OSError:
            continue
    return False


def check_master_addr(addr: str, port: int, engine_urls: Iterable[str]) -> None:
    """Refuse a rendezvous the engines cannot reach, before any engine starts waiting on it."""
    from urllib.parse import urlsplit

    if addr in ("0.0.0.0", "::", ""):
        raise UsageError(f"sync.master_addr = {addr!r} is a wildcard, which engines cannot connect to; set it to "
                         f"this host's address as the engines reach it")
    if _is_loopback(addr):
        remote = [u for u in engine_urls if not _is_this_host(urlsplit(u).hostname or "")]
        if remote:
            raise UsageError(f"sync.master_addr = {addr} is loopback but engine {remote[0]} is on another host; set "
                             f"sync.master_addr to this host's address reachable from the engines (and "
                             f"sync.master_port to a port open between the hosts)")
    elif not port and not _is_this_host(addr):
        raise UsageError(f"sync.master_addr = {addr} is not an address of this host, where sync runs as rank 0 of "
                         f"the weight-update group; use this host's address, or set sync.master_port (behind NAT)")


class DistributedTransport(WeightTransport):
    name = "distributed"

    def __init__(self, sync_cfg):
        self.cfg = sync_cfg
        self.backend = resolve_backend(sync_cfg.backend)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.group_name = f"slimectl-sync-{uuid.uuid4().hex[:8]}"
        self.pg = None
        self.world_size = 0
        self._urls: list[str] = []

    async def connect(self, clients: dict) -> None:
        from slimectl.engines.weight_group import init_custom_process_group

        if self.pg is not None:
            if sorted(clients) != self._urls:
                raise SlimectlError("the set of engines changed since the weight-update group was built; "
                                    "restart the sync (a new group is built for the new engines)")
            return
        infos = await asyncio.gather(*(c.get_server_info() for c in clients.values()))
        tp_sizes = [int(info.get("tp_size", 1) or 1) * int(info.get("dp_size", 1) or 1) for info in infos]
        self.world_size = 1 + sum(tp_sizes)
        addr = self.cfg.master_addr
        check_master_addr(addr, self.cfg.master_port, clients)
        port = self.cfg.master_port or free_port(addr)
        offsets, off = [], 1
        for n in tp_sizes:
            offsets.append(off)
            off += n
        joins = [asyncio.ensure_future(c.init_weights_update_group(addr, port, o, self.world_size, self.group_name,
                                                                   self.backend))
                 for c, o in zip(clients.values(), offsets)]
        try:
            self.pg = await asyncio.to_thread(init_custom_process_group, addr, port, 0, self.world_size,
                                              self.group_name, self.backend, self.cfg.timeout_s)
        except Exception as exc:
            for j in joins:
                j.cancel()
            await asyncio.gather(*joins, return_exceptions=True)
            raise SlimectlError(f"cannot build the weight-update group at {addr}:{port} with "
                                f"{', '.join(clients)}: {exc}") from None
        await asyncio.gather(*joins)
        self._urls = sorted(clients)
        log.info("weight-update group %s: %d ranks over %s (%s)", self.group_name, self.world_size, addr, self.backend)

    def _broadcast(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        import torch.distributed as dist

        for _, t in bucket:
            t = t.detach().to(self.device).contiguous()
            dist.broadcast(t, src=0, group=self.pg)

    async def push(self, clients: dict, source: WeightSource, flush_cache: bool = True) -> int:
        from slimectl.backends.hf.dtypes import dtype_name

        if self.pg is None:
            await self.connect(clients)
        if source.adapter is not None:
            return await self._push_adapter(clients, source)
        await asyncio.gather(*(c.begin_weight_update() for c in clients.values()))
        from slimectl.contract.logs import progress

        moved = 0
        bar = progress(mode=self.progress, desc=f"sync v{source.version}", unit=" buckets")
        try:
            for bucket, last in buckets(source.iter_tensors(), self.cfg.bucket_size_mb << 20):
                names = [n for n, _ in bucket]
                dtypes = [dtype_name(t.dtype) for _, t in bucket]
                shapes = [list(t.shape) for _, t in bucket]
                version = str(source.version) if last else None
                calls = [asyncio.ensure_future(c.update_weights_from_distributed(
                    names, dtypes, shapes, self.group_name, weight_version=version, flush_cache=last and flush_cache))
                    for c in clients.values()]
                sent = asyncio.ensure_future(asyncio.to_thread(self._broadcast, bucket))
                # An engine that refuses the bucket never joins the broadcast: fail fast on it
                # (the broadcast thread then ends at the group's timeout).
                done, _ = await asyncio.wait([*calls, sent], return_when=asyncio.FIRST_EXCEPTION)
                for f in done:
                    if f.exception() is not None:
                        raise f.exception()
                await asyncio.gather(*calls, sent)
                moved += sum(t.numel() * t.element_size() for _, t in bucket) * (self.world_size - 1)
                bar.update(1)
        finally:
            bar.close()
            await asyncio.gather(*(c.end_weight_update() for c in clients.values()), return_exceptions=True)
        return moved

    async def _push_adapter(self, clients: dict, source: WeightSource) -> int:
        """A LoRA run's version: its adapters (megabytes) in one broadcast, each engine receiving them as
        :data:`POLICY_ADAPTER` (``/load_lora_adapter_from_distributed``, which carries the version)."""
        from slimectl.backends.hf.dtypes import dtype_name
        from slimectl.engines.pool import POLICY_ADAPTER

        tensors = list(source.iter_tensors())
        names, dtypes = [n for n, _ in tensors], [dtype_name(t.dtype) for _, t in tensors]
        shapes = [list(t.shape) for _, t in tensors]
        calls = [asyncio.ensure_future(c.load_lora_adapter_from_distributed(
            POLICY_ADAPTER, source.adapter, names, dtypes, shapes, self.group_name, weight_version=str(source.version)))
            for c in clients.values()]
        sent = asyncio.ensure_future(asyncio.to_thread(self._broadcast, tensors))
        done, _ = await asyncio.wait([*calls, sent], return_when=asyncio.FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                raise f.exception()
        await asyncio.gather(*calls, sent)
        return sum(t.numel() * t.element_size() for _, t in tensors) * (self.world_size - 1)

    async def close(self, clients: dict) -> None:
        from slimectl.engines.weight_group import destroy_group

        if self.pg is None:
            return
        await asyncio.gather(*(c.destroy_weights_update_group(self.group_name) for c in clients.values()),
                             return_exceptions=True)
        destroy_group(self.pg)
        self.pg = None
