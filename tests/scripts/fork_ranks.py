"""N ranks of one gloo job forked from one interpreter: torch and megatron-core imported once, not N times.

    python fork_ranks.py N SCRIPT ARGV...

Answers like ``torchrun --nproc_per_node N SCRIPT ARGV``: each rank is a process of its own with
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, and runs SCRIPT's main() (as
``__main__``: the script tears its process group down) in a real gloo group; the ranks' stdout
is printed in rank order, a rank's traceback goes to stderr, and the exit code is 1 when any rank
failed. What torchrun itself does is not under test where this is used (test_moe_convert.py's
four-rank EP=2 x PP=2 logits): this spares the three more interpreters that would each import
torch and megatron-core (~7 CPU-s a rank) and torchrun's own process.
"""

import contextlib
import io
import os
import runpy
import signal
import socket
import sys
import tempfile
import traceback
from pathlib import Path


def preload() -> None:
    """What the scripts import, imported once before the fork (megatron-core through slimectl's import door)."""
    import torch  # noqa: F401

    import slimectl.backends.megatron.checkpoint  # noqa: F401
    import slimectl.backends.megatron.parallel  # noqa: F401
    import slimectl.backends.megatron.provider  # noqa: F401
    from megatron.core import pipeline_parallel, tensor_parallel  # noqa: F401


def rank_main(rank: int, n: int, port: int, script: str, argv: list[str], out: Path) -> int:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
                       "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    sys.argv = [script, *argv]
    buf, code = io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported by the parent's exit code
        sys.stderr.write(f"rank {rank}:\n{traceback.format_exc()}")
        code = 1
    out.write_text(buf.getvalue())
    return code


def main() -> None:
    n, script, argv = int(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3:]
    sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` would
    preload()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outs = Path(tempfile.mkdtemp(prefix="fork-ranks-"))
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = rank_main(rank, n, port, script, argv, outs / f"rank{rank}.out")
            finally:
                sys.stderr.flush()
                os._exit(code)
        pids[pid] = rank
    failed, left = [], dict(pids)
    while left:
        pid, status = os.wait()
        left.pop(pid, None)
        if os.waitstatus_to_exitcode(status) != 0:
            failed.append(pids[pid])
            for other in left:  # they may wait in a collective with the failed rank forever
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGKILL)
    for rank in range(n):
        f = outs / f"rank{rank}.out"
        sys.stdout.write(f.read_text() if f.exists() else "")
    sys.stdout.flush()
    if failed:
        sys.stderr.write(f"ranks {sorted(failed)} failed\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
