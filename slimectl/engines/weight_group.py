"""The weight-update process group between a trainer (rank 0) and engine ranks.

SGLang's ``/init_weights_update_group`` joins a *custom* process group: a TCP rendezvous at
``master_address:master_port`` whose store is prefixed with the group name, built without
touching the default process group (trainer and engines each have their own default group,
or none). This module builds the same group with plain torch, so the trainer side (``sync``)
and our embedded engine interoperate with real SGLang servers: NCCL on GPUs, gloo on CPUs.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from slimectl.backends.hf.dtypes import TORCH_DTYPES, dtype_name  # noqa: F401  (the one dtype table)

#: The dtype names a weight-update request may carry (SGLang sends the HF/torch names).
DTYPES = {name: dt for name, dt in TORCH_DTYPES.items() if dtype_name(dt) == name}


def init_custom_process_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                              backend: str = "gloo", timeout_s: float = 600.0):
    """Join (as ``rank``) the group named ``group_name``; blocks until all ``world_size`` ranks joined."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    # The group's own store, hosted by rank 0 (the trainer): not torch's tcp:// rendezvous, which under
    # torchrun (TORCHELASTIC_USE_AGENT_STORE) would connect to torchrun's agent store instead, where
    # the engines never come (`slimectl rl` with several trainer ranks hung at its first sync).
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                          multi_tenant=True)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, backend_options=None, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(pg) -> None:
    try:
        dist.destroy_process_group(pg)
    except Exception:  # a group whose peer died cannot always be torn down cleanly
        pass
