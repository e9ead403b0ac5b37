"""A long-lived multi-rank worker: runs tests/scripts/*.py jobs one after another in the same ranks.

    torchrun --nproc_per_node N rank_worker.py JOB_DIR

Started once (tests.helpers.RankWorker) so that the tests' two-rank Megatron work pays one torchrun
launch (interpreter, torch, megatron-core and the gloo group) instead of one per check. Every rank
polls JOB_DIR for ``job-I.json`` ({"script", "argv", "env"}), runs the script's main() with
sys.argv set and stdout captured (run_name "__in_process__": the scripts keep the process group
and tear down only Megatron's groups, which the next job's init_parallel builds at its own TP/PP),
then writes ``job-I.rankR.json`` ({"stdout", "error", "cpu_s": this rank's CPU seconds for the job})
atomically. A file ``stop`` ends the loop.
Nothing waits in a collective between jobs, so an idle worker never hits gloo's timeout.
"""

import contextlib
import io
import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path


def cpu_seconds() -> float:
    import resource

    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def destroy_subgroups() -> None:
    """Destroy every process group but the default one. A job's init_parallel makes Megatron's groups and
    its teardown only forgets them: each gloo group kept ~25 threads per rank alive, and the pair's idle
    CPU grew by ~0.06 CPU-s per second with every job (0.39 after six; 0.025 with this, measured)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():  # a job that kept them: the next job's init_parallel makes new ones
        ps.destroy_model_parallel()
    default = c10d._get_default_group()
    for pg in list(c10d._world.pg_map):
        if pg is not default:
            dist.destroy_process_group(pg)


def main() -> None:
    jobs = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    i, nap = 0, 0.01
    while not (jobs / "stop").exists():
        job_file = jobs / f"job-{i}.json"
        if not job_file.exists():
            time.sleep(nap)
            nap = min(nap * 2, 0.2)  # quick after a job, cheap when idle
            continue
        nap = 0.01
        job = json.loads(job_file.read_text())
        saved_env, saved_argv = dict(os.environ), sys.argv
        out, error = io.StringIO(), None
        cpu0 = cpu_seconds()
        os.environ.update(job.get("env") or {})
        sys.argv = [job["script"], *job["argv"]]
        try:
            with contextlib.redirect_stdout(out):
                runpy.run_path(job["script"], run_name="__in_process__")["main"]()
        except BaseException:  # noqa: BLE001 - reported to the test, the worker serves the next job
            error = traceback.format_exc()
        finally:
            sys.argv = saved_argv
            os.environ.clear()
            os.environ.update(saved_env)
        try:
            destroy_subgroups()
        except BaseException:  # noqa: BLE001
            error = error or traceback.format_exc()
        tmp = jobs / f".job-{i}.rank{rank}.tmp"
        tmp.write_text(json.dumps({"stdout": out.getvalue(), "error": error, "cpu_s": cpu_seconds() - cpu0}))
        tmp.rename(jobs / f"job-{i}.rank{rank}.json")
        i += 1
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
