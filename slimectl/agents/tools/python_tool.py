"""A Python calculator/interpreter tool: runs model-written code in a resource-limited subprocess.

Each call writes the code to a fresh scratch directory and runs ``python -I`` there (isolated
mode: no ``PYTHON*`` variables, no user site-packages, the script's directory not on
``sys.path``) with an almost empty environment, no stdin, in its own process group, and with
limits set in the child before the code runs:

* wall time: the whole process group is SIGKILLed when it runs past ``timeout_s`` (children the
  code forked die with it); ``RLIMIT_CPU`` is a second line of defence;
* memory: ``RLIMIT_AS`` (``memory_mb``), so a huge allocation raises ``MemoryError`` in the child;
* files: ``RLIMIT_FSIZE`` caps any file the code writes in its scratch directory;
* output: stdout and stderr (merged) are kept up to ``max_output_bytes``; longer output keeps its
  beginning and its end (where a traceback's error line is) and says how much was left out; a
  program that keeps printing far past the limit is stopped.

This bounds what a buggy or runaway program costs the rollout; it is not a security boundary
against deliberately hostile code (that needs a container or a VM around the rollout).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimectl.contract.errors import UsageError
from slimectl.agents.tools import ToolResult

# Runs in the child before the model's code: set the limits, then execute the snippet as
# __main__. The traceback of an exception leaves out this launcher's own frame, so the model sees
# only its code's lines.
_LAUNCHER = """
import resource, sys, traceback
mem, cpu, fsize, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
with open(path, encoding="utf-8") as f:
    source = f.read()
sys.argv = [path]
try:
    exec(compile(source, path, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except Exception as exc:
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
    sys.stderr.flush()
    sys.exit(1)
"""

SNIPPET_NAME = "snippet.py"

#: Keep reading (and dropping) output up to this many times the limit before stopping the program.
_DRAIN_FACTOR = 64
#: After the program ends, how long to wait for the rest of its output (a child that escaped the
#: process group may hold the pipe open).
_DRAIN_GRACE_S = 1.0
_POLL_S = 0.01
_MIN_TAIL_BYTES = 256


@dataclass
class PythonRun:
    """What one execution did (the tool turns it into the text the model sees)."""

    output: str
    exit_code: int | None
    timed_out: bool = False
    out_of_memory: bool = False
    output_bytes: int = 0
    truncated: bool = False
    flooded: bool = False
    """Printed more than ``_DRAIN_FACTOR`` times the output limit and was stopped there."""
    seconds: float = 0.0


class PythonTool:
    """The ``python`` tool: ``{"name": "python", "arguments": {"code": "print(1234 * 5678)"}}``.

    The model sees the program's printed output (stdout and stderr merged); only what is printed
    comes back, like running a script. ``max_concurrency`` bounds how many programs run at once
    across every sample sharing this tool, so a large rollout does not fork hundreds of
    interpreters onto a few cores; time spent waiting for a slot does not count against
    ``timeout_s``.
    """

    name = "python"

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_output_bytes: int = 2000,
                 max_file_mb: int = 16, max_concurrency: int | None = None, python: str | None = None):
        if timeout_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0 or max_file_mb <= 0:
            raise UsageError("PythonTool: timeout_s, memory_mb, max_output_bytes and max_file_mb must be positive")
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.max_output_bytes = int(max_output_bytes)
        self.max_file_mb = int(max_file_mb)
        self.python = python or sys.executable
        self.max_concurrency = max_concurrency or max(1, os.cpu_count() or 1)
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None

    @property
    def spec(self) -> dict[str, Any]:
        """OpenAI-style function schema (pass it as the dataset's ``tools`` for templates that list tools)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": "Run a Python 3 program and return what it prints (stdout and stderr). "
                               f"Limits: {self.timeout_s:g} s, {self.memory_mb} MB, "
                               f"{self.max_output_bytes} bytes of output. Use print() to see results.",
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "The program to run."}},
                    "required": ["code"],
                },
            },
        }

    def _semaphore(self) -> asyncio.Semaphore:
        # One per event loop: a semaphore is bound to the loop it was first used on.
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:
            self._slots, self._slots_loop = asyncio.Semaphore(self.max_concurrency), loop
        return self._slots

    async def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult('Error: the python tool needs {"code": "<program>"} with the program as a string.',
                              status="bad_arguments")
        run = await self.run(code)
        return self.to_result(run)

    def to_result(self, run: PythonRun) -> ToolResult:
        """The text the model sees for one run, with a status for metrics."""
        parts = [run.output.rstrip("\n")] if run.output.strip() else []
        if run.truncated:
            parts.append(f"[output truncated: the program printed {run.output_bytes} bytes; "
                         f"{self.max_output_bytes} are shown]")
        if run.flooded:
            parts.append(f"Error: the program printed more than {self.max_output_bytes * _DRAIN_FACTOR} bytes "
                         f"and was stopped.")
            status = "output_flood"
        elif run.timed_out:
            parts.append(f"Error: the program ran longer than {self.timeout_s:g} s and was stopped.")
            status = "timeout"
        elif run.out_of_memory:
            parts.append(f"Error: the program ran out of memory (limit {self.memory_mb} MB).")
            status = "memory"
        elif run.exit_code != 0:
            if run.exit_code is not None and run.exit_code < 0:
                sig = signal.Signals(-run.exit_code).name if -run.exit_code in signal.valid_signals() else -run.exit_code
                parts.append(f"Error: the program was killed by signal {sig}.")
            else:
                parts.append(f"Error: the program exited with code {run.exit_code}.")
            status = "error"
        else:
            status = "ok"
        if not parts:
            parts.append("(the program printed nothing; use print() to see a result)")
        if run.truncated and status == "ok":
            status = "truncated"
        return ToolResult("\n".join(parts), status=status)

    async def run(self, code: str) -> PythonRun:
        """Execute ``code`` under the limits; never raises for anything the code does."""
        async with self._semaphore():
            with tempfile.TemporaryDirectory(prefix="slimectl-py-") as scratch:
                return await self._run_in(code, Path(scratch))

    async def _run_in(self, code: str, scratch: Path) -> PythonRun:
        (scratch / SNIPPET_NAME).write_text(code, encoding="utf-8")
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(scratch), "TMPDIR": str(scratch),
               "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}
        cpu_s = int(self.timeout_s) + 1
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        proc = await asyncio.create_subprocess_exec(
            self.python, "-I", "-c", _LAUNCHER, str(self.memory_mb * 2**20), str(cpu_s),
            str(self.max_file_mb * 2**20), SNIPPET_NAME,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            cwd=str(scratch), env=env, start_new_session=True,
        )
        kept = bytearray()  # the first max_output_bytes
        tail = b""  # the last bytes: the end of long output, and a traceback's error line
        tail_size = max(self.max_output_bytes // 4, _MIN_TAIL_BYTES)
        total = 0
        timed_out = flooded = False
        hard_cap = self.max_output_bytes * _DRAIN_FACTOR

        async def read_output() -> None:
            nonlocal total, flooded, tail
            assert proc.stdout is not None
            while True:
                chunk = await proc.stdout.read(65536)
                if not chunk:
                    return
                total += len(chunk)
                tail = (tail + chunk)[-tail_size:]
                room = self.max_output_bytes - len(kept)
                if room > 0:
                    kept.extend(chunk[:room])
                if total > hard_cap:
                    flooded = True  # stop a runaway printer now rather than at the time limit
                    _kill_group(proc.pid)
                    return

        reader = asyncio.ensure_future(read_output())
        try:
            try:
                await asyncio.wait_for(_exited(proc), timeout=self.timeout_s)
            except asyncio.TimeoutError:
                timed_out = True
            # The program is done (or over time): end its process group, so that a child it left
            # behind holding the pipe open cannot keep us waiting, and drain what it printed.
            _kill_group(proc.pid)
            try:
                await asyncio.wait_for(asyncio.shield(reader), timeout=_DRAIN_GRACE_S)
            except asyncio.TimeoutError:
                pass
        finally:
            # Always, also when an outer timeout cancels us: leave no process of the group behind.
            _kill_group(proc.pid)
            reader.cancel()
            if proc.returncode is None:
                try:
                    await asyncio.wait_for(proc.wait(), timeout=5)
                except asyncio.TimeoutError:
                    pass
        if total <= self.max_output_bytes:
            output = bytes(kept).decode("utf-8", errors="replace")
        else:
            shown_tail = self.max_output_bytes // 4
            head = self.max_output_bytes - shown_tail
            output = (bytes(kept[:head]).decode("utf-8", errors="replace")
                      + f"\n[... {total - head - shown_tail} bytes left out ...]\n"
                      + (tail[-shown_tail:] if shown_tail else b"").decode("utf-8", errors="replace"))
        exit_code = proc.returncode
        if exit_code == -signal.SIGXCPU:
            timed_out = True
        oom = exit_code != 0 and not timed_out and not flooded and b"MemoryError" in tail
        return PythonRun(output=output, exit_code=exit_code, timed_out=timed_out, out_of_memory=oom,
                         output_bytes=total, truncated=total > self.max_output_bytes, flooded=flooded,
                         seconds=loop.time() - t0)


async def _exited(proc: asyncio.subprocess.Process) -> None:
    """Until the program itself exits. (``proc.wait()`` also waits for its pipes to close, which a
    child it forked can hold open.)"""
    while proc.returncode is None:
        await asyncio.sleep(_POLL_S)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
