"""Distributed transport: the trainer broadcasts named tensors to every engine rank.

The trainer is rank 0 of a custom process group; engine ``i`` joins it with ranks
``rank_offset .. rank_offset + tp_size - 1`` (``/init_weights_update_group``). What a push calls on the
engines while the trainer broadcasts is the version's format's (:meth:`WeightFormat.push_group
<slimectl.weight_formats.WeightFormat.push_group>`): for full weights SGLang's sequence, per bucket of at most
``sync.bucket_size_mb``, ``/update_weights_from_distributed`` on every engine *while* the trainer broadcasts those
tensors in that order. NCCL on GPUs, gloo on CPUs — the same code.

Across hosts, ``sync.master_addr`` is this (rank-0) host's address as the engines reach it, and
``sync.master_port`` a port they can connect to; :func:`check_master_addr` refuses the settings
that would leave every engine waiting on an address it cannot reach.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import Iterable

import torch

from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.contract.net import free_port
from slimectl.weight_formats import WeightSource
from slimectl.weight_formats.format import buckets  # noqa: F401 (the full-weight buckets, named here too)
from slimectl.stages.sync.transport import WeightTransport

log = logging.getLogger("slimectl.sync")


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
        self.held = None  # the weights the engines hold, kept by a format that sends deltas (WeightGroup.held)

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

    @property
    def bucket_bytes(self) -> int:
        return self.cfg.bucket_size_mb << 20

    async def exchange(self, calls: list, tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Run the engine ``calls`` (coroutines) while ``tensors`` are broadcast in order; the bytes moved."""
        calls = [asyncio.ensure_future(c) for c in calls]
        sent = asyncio.ensure_future(asyncio.to_thread(self._broadcast, tensors))
        # An engine that refuses the call never joins the broadcast: fail fast on it
        # (the broadcast thread then ends at the group's timeout).
        done, pending = await asyncio.wait([*calls, sent], return_when=asyncio.FIRST_EXCEPTION)
        failed = [f.exception() for f in done if f.exception() is not None]  # (each retrieved: no asyncio warning)
        if failed:
            for f in pending:  # what fails after this one is the same failure's: retrieved when it ends
                f.add_done_callback(lambda f: f.cancelled() or f.exception())
            said = next((e for e in failed if isinstance(e, SlimectlError)), None)  # an engine's own failure first
            if said is not None:
                raise said
            if isinstance(failed[0], RuntimeError):  # the collective's (gloo/NCCL): a peer gone mid-broadcast
                first = (str(failed[0]).strip().splitlines() or [type(failed[0]).__name__])[0][:300]
                raise SlimectlError(f"the weight broadcast over group {self.group_name} failed ({first}): an engine "
                                    f"of the group died or left it") from failed[0]
            raise failed[0]
        await asyncio.gather(*calls, sent)
        return sum(t.numel() * t.element_size() for _, t in tensors) * (self.world_size - 1)

    async def push(self, clients: dict, source: WeightSource, flush_cache: bool = True) -> int:
        if self.pg is None:
            await self.connect(clients)
        return await source.form.push_group(self, clients, source, flush_cache)

    async def close(self, clients: dict) -> None:
        from slimectl.engines.weight_group import destroy_group

        if self.pg is None:
            return
        await asyncio.gather(*(c.destroy_weights_update_group(self.group_name) for c in clients.values()),
                             return_exceptions=True)
        destroy_group(self.pg)
        self.pg = None
        self.held = None
