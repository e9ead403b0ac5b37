r"""The ``math_verify`` grader: Hugging Face's Math-Verify (``pip install 'slimectl[math]'``) decides, 1.0 / 0.0.

The label and the response are each parsed by Math-Verify's ``parse`` with the extraction configs set in
``rollout.math_verify`` (LaTeX and/or plain expressions, ``\boxed{}`` first or after "final answer is",
whether an answer without an anchor counts), and ``verify(label, answer)`` decides. A label with no LaTeX
delimiter (``34``, ``\frac{9}{2}``) is read as the content of a ``\boxed{}``, as verl's Math-Verify reward
does. A response Math-Verify extracts no answer from scores ``-format_penalty`` (0.0 by default).

Math-Verify bounds its own work with ``signal.alarm``, which only works in a main thread; a reward runs
on the rollout's event loop. So verification runs in worker processes (``workers`` of them, each a fresh
``python`` that imports only Math-Verify), fed by as many threads, so the event loop never waits:

- in the worker, Math-Verify's timeouts are off and one ``SIGALRM`` interval timer bounds the whole sample
  (parse of label and answer, then verify) at 0.8 x ``timeout_s``: past it the sample is 0.0 and the worker
  lives on;
- in slimectl's process, a sample whose worker has not answered ``timeout_s`` after it was sent (a signal
  cannot stop C code such as a regular expression backtracking) is 0.0, its worker is killed and the next
  sample starts a new one.

Math-Verify is imported only when this reward is used; without it :func:`require_math_verify` raises a
:class:`~slimectl.rewards.errors.RewardConfigError` naming the extra.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import RewardConfigError, one_line

log = logging.getLogger("slimectl.rewards")

MATH_VERIFY = "math_verify"
MISSING = "reward 'math_verify' needs Math-Verify, which is not installed: pip install 'slimectl[math]'"
#: How long a new worker may take to import Math-Verify (not counted in any sample's timeout).
STARTUP_TIMEOUT_S = 120.0
#: The worker's own alarm fires at this share of ``timeout_s``, before slimectl kills the worker.
SOFT_SHARE = 0.8
_LATEX_DELIMITERS = ("$", "\\(", "\\[", "\\boxed", "\\fbox")


@dataclass(frozen=True)
class MathVerifySettings:
    """What ``rollout.math_verify`` sets (see its fields in ``slimectl/contract/config_schema.py``)."""

    answer_extraction: tuple[str, ...] = ("latex", "expr")
    label_extraction: tuple[str, ...] = ("latex", "expr")
    boxed_first: bool = True
    last_answer: bool = True
    timeout_s: float = 5.0
    format_penalty: float = 0.0
    workers: int = 2


def settings_from(args: Any) -> MathVerifySettings:
    """The settings of ``args.config.rollout.math_verify`` (the rollout's args), else the defaults."""
    section = getattr(getattr(getattr(args, "config", None), "rollout", None), "math_verify", None)
    if section is None:
        return MathVerifySettings()
    values = section.model_dump() if hasattr(section, "model_dump") else dict(section)
    known = {k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items()
             if k in MathVerifySettings.__dataclass_fields__}
    return MathVerifySettings(**known)


_checked = False


def require_math_verify() -> None:
    """Raise the one-line error naming the ``math`` extra when Math-Verify cannot be imported."""
    global _checked
    if _checked:
        return
    try:
        import math_verify  # noqa: F401  (checked here; the workers import it themselves)
    except ImportError:
        raise RewardConfigError(MISSING) from None
    _checked = True


def label_text(label: Any) -> str | None:
    r"""The label as Math-Verify should read it: a bare one becomes ``\boxed{label}``; None when empty."""
    if label is None:
        return None
    text = str(label).strip()
    if not text:
        return None
    return text if any(d in text for d in _LATEX_DELIMITERS) else "\\boxed{" + text + "}"


# ------------------------------------------------------------------------------ the worker process

_WORKER = r"""
import json, logging, signal, sys
for p in reversed(json.loads(sys.argv[1])):
    if p not in sys.path:
        sys.path.insert(0, p)
logging.disable(logging.CRITICAL)  # Math-Verify warns on every timeout it is not asked to handle


class Deadline(BaseException):  # not an Exception: Math-Verify's `except Exception` must not swallow it
    pass


def on_alarm(signum, frame):
    raise Deadline()


try:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
except BaseException as exc:
    print(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
    sys.exit(0)
signal.signal(signal.SIGALRM, on_alarm)


def targets(kinds, boxed_first, anchorless):
    out = []
    for kind in kinds:
        if kind == "latex":
            out.append(LatexExtractionConfig(boxed_match_priority=0 if boxed_first else 50,
                                             try_extract_without_anchor=anchorless))
        elif kind == "expr":
            out.append(ExprExtractionConfig(try_extract_without_anchor=anchorless))
    return out


def grade(req):
    gold = parse(req["label"], targets(req["label_extraction"], True, True), parsing_timeout=None)
    if not gold:
        return {"verdict": False, "label_parsed": False, "answer_parsed": None}
    pred = parse(req["response"], targets(req["answer_extraction"], req["boxed_first"], req["last_answer"]),
                 parsing_timeout=None)
    if not pred:
        return {"verdict": False, "label_parsed": True, "answer_parsed": False}
    return {"verdict": bool(verify(gold, pred, timeout_seconds=None)), "label_parsed": True, "answer_parsed": True}


# warm up before "ready": the first parse loads the LaTeX grammar and sympy's lazy parts (a second or more on a
# busy machine), which must not count against the first sample's time bound
grade({"label": "1", "response": "\\boxed{1}", "label_extraction": ["latex", "expr"],
       "answer_extraction": ["latex", "expr"], "boxed_first": True, "last_answer": True})
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    try:
        signal.setitimer(signal.ITIMER_REAL, req["soft_s"])
        out = grade(req)
    except Deadline:
        out = {"timed_out": True}
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    print(json.dumps(out), flush=True)
"""


class _Worker:
    """One ``python -c _WORKER`` child: one JSON line in, one JSON line out."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER, json.dumps(sys.path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        self._buf = b""
        _ALL.add(self)
        hello = self._read_line(STARTUP_TIMEOUT_S)
        if hello is None or not hello.get("ready"):
            self.kill()
            why = (hello or {}).get("error", "it did not start")
            if "No module named" in why or "ModuleNotFoundError" in why or "ImportError" in why:
                raise RewardConfigError(f"{MISSING} ({one_line(why, 120)})")
            raise RewardConfigError(f"reward 'math_verify': its worker process failed: {one_line(why, 200)}")

    def _read_line(self, timeout: float) -> dict | None:
        """The next line as JSON, or None when none came within ``timeout`` or the worker died."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def ask(self, request: dict, timeout: float) -> dict | None:
        """The worker's answer to ``request``, or None (then the worker is dead: make a new one)."""
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError):
            self.kill()
            return None
        answer = self._read_line(timeout)
        if answer is None:
            self.kill()
        return answer

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        _ALL.discard(self)


_ALL: set[_Worker] = set()


@atexit.register
def _kill_all() -> None:
    for w in list(_ALL):
        w.kill()


# ------------------------------------------------------------------------------ the pool


@dataclass
class Verdict:
    """One sample's outcome: the reward and what happened (for tests and the bench)."""

    reward: float
    timed_out: bool = False
    answer_parsed: bool | None = None
    seconds: float = 0.0
    error: str | None = None
    detail: dict = field(default_factory=dict)


class MathVerifyPool:
    """``workers`` threads, each owning one worker process (started at its first sample)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="math-verify")
        self._local = threading.local()

    def _worker(self) -> _Worker:
        w = getattr(self._local, "worker", None)
        if w is None or w.proc.poll() is not None:
            w = self._local.worker = _Worker()
        return w

    def verify(self, response: str, label: str, s: MathVerifySettings) -> Verdict:
        """Grade one sample in the calling thread (one of :attr:`executor`'s, or any for a blocking call)."""
        worker = self._worker()  # a new worker's start-up is not part of the sample's time
        request = {"response": response, "label": label, "soft_s": max(0.05, s.timeout_s * SOFT_SHARE),
                   **{k: v for k, v in asdict(s).items() if k in ("answer_extraction", "label_extraction",
                                                                  "boxed_first", "last_answer")}}
        t0 = time.monotonic()
        answer = worker.ask(request, s.timeout_s)
        took = time.monotonic() - t0
        if answer is None and took < s.timeout_s:  # the worker died on it (not the time bound)
            self._local.worker = None
            log.warning("math_verify: the worker died on a sample (response of %d characters); reward 0.0",
                        len(response))
            return Verdict(0.0, error="the worker process died", seconds=took)
        if answer is None or answer.get("timed_out"):
            self._local.worker = None if answer is None else worker
            log.warning("math_verify: a sample (response of %d characters) took over %.1f s to verify; reward 0.0",
                        len(response), s.timeout_s * (1 if answer is None else SOFT_SHARE))
            return Verdict(0.0, timed_out=True, seconds=took)
        if answer.get("error"):
            return Verdict(0.0, error=answer["error"], seconds=took)
        parsed = answer.get("answer_parsed")
        reward = 1.0 if answer.get("verdict") else (-s.format_penalty if parsed is False else 0.0)
        return Verdict(reward + 0.0, answer_parsed=parsed, seconds=took, detail=answer)

    def warm(self) -> None:
        """Start every worker now (each thread's), instead of at their first samples."""
        barrier = threading.Barrier(self.workers)

        def start() -> None:
            self._worker()
            barrier.wait(timeout=STARTUP_TIMEOUT_S)

        for f in [self.executor.submit(start) for _ in range(self.workers)]:
            f.result()


_pools: dict[int, MathVerifyPool] = {}
_pools_lock = threading.Lock()


def shared_pool(workers: int) -> MathVerifyPool:
    """The process's pool of ``workers`` workers (made once; Math-Verify checked first)."""
    require_math_verify()
    with _pools_lock:
        if workers not in _pools:
            _pools[workers] = MathVerifyPool(workers)
        return _pools[workers]


def verify_sample(response: str | None, label: Any, settings: MathVerifySettings | None = None) -> Verdict:
    """Grade one sample, blocking the calling thread (the bench, tests); see :func:`grade_math_verify_async`."""
    s = settings or MathVerifySettings()
    gold = label_text(label)
    if gold is None:
        return Verdict(0.0)
    pool = shared_pool(s.workers)
    return pool.executor.submit(pool.verify, response or "", gold, s).result()


def grade_math_verify(response: str | None, label: Any, settings: MathVerifySettings | None = None) -> float:
    """1.0 if Math-Verify finds the response's answer equal to the label, else 0.0 (or ``-format_penalty``)."""
    return verify_sample(response, label, settings).reward


async def verify_sample_async(response: str | None, label: Any,
                              settings: MathVerifySettings | None = None) -> Verdict:
    """:func:`verify_sample` on the pool's threads: the event loop goes on while the worker verifies."""
    s = settings or MathVerifySettings()
    gold = label_text(label)
    if gold is None:
        return Verdict(0.0)
    pool = shared_pool(s.workers)
    return await asyncio.get_running_loop().run_in_executor(pool.executor, pool.verify, response or "", gold, s)


async def grade_math_verify_async(response: str | None, label: Any,
                                  settings: MathVerifySettings | None = None) -> float:
    """The reward of one sample (the hub's path for ``math_verify``)."""
    return (await verify_sample_async(response, label, settings)).reward
