"""A distributed weight sync from a trainer with two ranks whose push fails partway (a dead engine):
rank 0 finishes the pass over its tensors it announced, so rank 1 finishes it too, both ranks stay in
step for the next operation and collective, and the next sync works.

Two real gloo ranks (torch.multiprocessing) run the launcher's own InProcessTrainer.sync (rank 0, its
followers announced over the protocol's control group) and the protocol's follow_rank0 (rank 1). What stands in: the trainer's pass over its tensors (one
all_reduce per tensor, as the Megatron actor's TP/PP gathers are one collective per tensor) and
the push to the engines (``sync_engines``: the first sync fails after two tensors, the second
pushes and verifies, two whole passes)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.helpers import ENV, free_port

SCRIPT = textwrap.dedent('''
    import asyncio, contextlib, json, sys, types
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    N = 6

    class Tensors:
        def iter_hf_tensors(self):
            for i in range(N):
                t = torch.full((4,), float(i))
                dist.all_reduce(t)  # a collective per tensor, as the TP/PP gathers
                yield f"w{i}", t

    def worker(rank, port, out):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=20))
        import slimectl.stages.sync as sync_pkg
        from slimectl.contract.errors import SlimectlError
        from slimectl.contract.loop_bridge import LoopBridge
        from slimectl.contract.trace import NULL_TRACER
        from slimectl.orchestration.local_launcher import InProcessTrainer
        from slimectl.orchestration.trainer_ranks import Followers, control_group, follow_rank0

        result = {}
        group = control_group()
        if rank == 0:
            calls = []

            async def sync_engines(clients, transport, source, pause_mode, verify, tracer, merge_into=None):
                calls.append(1)
                if len(calls) == 1:
                    for k, (name, t) in enumerate(source.iter_tensors()):
                        if k == 1:
                            raise SlimectlError("engine http://127.0.0.1:1 died during the weight update")
                pushed = {n: t.tolist() for n, t in source.iter_tensors()}  # push
                verified = {n: t.tolist() for n, t in source.iter_tensors()}  # read back
                result["pushed"], result["verified_same"] = pushed, pushed == verified
                return types.SimpleNamespace(metrics=lambda: {"ok": 1.0}, seconds=0.0)

            sync_pkg.sync_engines = sync_engines
            t = object.__new__(InProcessTrainer)
            t.run = types.SimpleNamespace(stage_log=lambda name: contextlib.nullcontext(),
                                          tracer=lambda stage: NULL_TRACER)
            t.cfg = types.SimpleNamespace(sync=types.SimpleNamespace(pause_mode="abort", verify=False, mode="full"),
                                          effective_pause_mode="abort", train=types.SimpleNamespace(lora=None),
                                          effective_lora_merged=False)
            t.disk, t.trainer, t.clients, t.transport, t._open_passes = False, Tensors(), {}, None, []
            t.followers = Followers(group)
            t.bridge = LoopBridge()  # rl's one loop: the push (and the pass over the tensors) runs on its thread
            try:
                t.sync(1)
                result["first"] = "no error"
            except SlimectlError as exc:
                result["first"] = str(exc)
            result["second"] = t.sync(2)[0]
            t.stop()
            t.bridge.close()
        else:
            result["operations"] = follow_rank0(None, Tensors(), group, disk=False)
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)  # still in step: the next collective pairs with the other rank's
        result["after"] = x.item()
        with open(f"{out}.{rank}", "w") as fh:
            json.dump(result, fh)
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
''')


def test_a_push_failing_partway_leaves_both_ranks_in_step(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    out = tmp_path / "result"
    res = subprocess.run([sys.executable, str(script), str(free_port()), str(out)], capture_output=True, text=True,
                         env={**ENV, "OMP_NUM_THREADS": "1"}, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"result.{r}").read_text()) for r in (0, 1))
    assert r0["first"] == "engine http://127.0.0.1:1 died during the weight update"  # the error reaches the loop
    assert r1["operations"] == 3  # the failed push's pass (finished by both ranks), the second's push and verify
    assert r0["second"] == {"ok": 1.0} and r0["verified_same"]
    # every tensor of the second sync is the sum over both ranks: each all_reduce paired with its twin
    assert r0["pushed"] == {f"w{i}": [2.0 * i] * 4 for i in range(6)}
    assert r0["after"] == r1["after"] == 3.0
