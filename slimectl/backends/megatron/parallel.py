"""torch.distributed + Megatron model-parallel setup: NCCL on GPUs, gloo (with the CPU shim) on CPUs.

Works the same under ``torchrun`` (env:// rendezvous) and in a single plain process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from slimectl.contract.errors import SlimectlError
from slimectl.contract.net import free_port


@dataclass(frozen=True)
class ParallelInfo:
    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    backend: str

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def init_parallel(tp: int = 1, pp: int = 1, backend: str = "auto", seed: int = 1234,
                  timeout_minutes: int = 10, ep: int = 1) -> ParallelInfo:
    """Join (or create) the process group and set up Megatron's TP/PP/DP groups.

    ``ep``: the expert-parallel size (MoE models). Megatron lays the expert groups over the same
    ranks as the dense ones (expert-TP size = TP), so ``tp*ep*pp`` must divide the world size:
    EP=2 at TP=1 PP=1 is two data-parallel ranks whose MoE layers hold half the experts each.
    """
    cuda = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise SlimectlError("backend nccl needs CUDA; on CPU use gloo (backend auto picks it)")
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:  # a plain single process
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            os.environ.setdefault("LOCAL_RANK", "0")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))
    if not cuda:
        from slimectl.backends.megatron import cpu_compat

        cpu_compat.apply()
    world = dist.get_world_size()
    if world % (tp * pp):
        raise SlimectlError(f"world size {world} is not divisible by tp*pp = {tp}*{pp}; launch tp*pp*dp processes")
    if ep < 1 or (world // pp) % (ep * tp):
        raise SlimectlError(f"expert-parallel size {ep} does not fit world size {world} with tp={tp}, pp={pp}: "
                            f"tp*ep*pp = {tp * ep * pp} must divide the world size; launch tp*pp*dp processes "
                            f"with ep dividing dp (`slimectl train` relaunches itself under torchrun)")
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size() != tp or ps.get_pipeline_model_parallel_world_size() != pp
                or ps.get_expert_model_parallel_world_size() != ep):
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelInfo(
        rank=dist.get_rank(), world_size=world, tp=tp, pp=pp, dp=world // (tp * pp),
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(), backend=backend,
    )


def shutdown_parallel(destroy_process_group: bool = False) -> None:
    """Tear down Megatron's model-parallel groups.

    The default process group is kept: re-creating one under the same torchrun rendezvous hangs,
    and a later :func:`init_parallel` in this process reuses it. Pass ``destroy_process_group``
    only when the process is about to exit.
    """
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()


def from_last_stage(obj, pp_group):
    """The last pipeline stage's picklable ``obj`` on every stage of ``pp_group`` (only the last stage
    has logits and values; the actor's log-probs and the critic's values are shared this way)."""
    from megatron.core import parallel_state as ps

    box = [obj]
    dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=pp_group)
    return box[0]


def broadcast_from_rank0(obj):
    """Rank 0's picklable ``obj`` on every rank of the default group (what rank 0 decides, the others follow);
    ``obj`` as is when there is one rank or no process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait for every rank of the default group (nothing with one rank or no process group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
