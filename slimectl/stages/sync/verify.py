"""``sync --verify``: read the weights back from every engine and compare them with the source's.

Two reads, both on every engine that answers them:

- **every tensor, by checksum** (the embedded engine's ``/get_weights_checksums``): the engine hashes the raw
  bytes of each of its weights (xxh3-128) and the source's tensors are hashed the same way, cast to the dtype the
  engine serves them in (exact both ways: a bf16 tensor widened to fp32, an fp32 one rounded as the engine's load
  rounds it). Bit for bit, every tensor, a few dozen bytes each on the wire: slime's
  ``--check-weight-update-equal``. A version a delta built (``sync.mode: delta``) is compared with the full
  ``weights/N``, not with the delta's own checksums.
- **a sample, by value**: SGLang's ``/get_weights_by_name`` (first ``truncate_size`` rows of a parameter, as float32
  lists) for a sample of tensors spread over the model — always the embedding and the last one —; bit-equal is
  required when the engine serves the source dtype, bf16 rounding is allowed otherwise.

SGLang has no checksum endpoint (a 404: the sample alone is compared), and not every engine can read its weights
back by name: SGLang implements ``get_weights_by_name`` per model class (Llama has it; Qwen2 answers
``400 {"error": {"message": "Get parameter by name failed"}}``). Verification runs after the weights were loaded
and the engine reported the new version, so a tensor the engine answers with an HTTP error is skipped, not a
failure: one warning per sync names the engines, how many tensors were skipped and the engine's reason (the same
skip again in the same process, e.g. at every sync of ``rl``, is logged at INFO), and everything else is still
compared. Only a mismatch, or an engine that no longer answers at all, is a problem.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from slimectl.backends.hf.dtypes import canonical_dtype_name, dtype_name
from slimectl.backends.hf.mtp import without_mtp_layers
from slimectl.engines.client import EngineError
from slimectl.weight_formats import WeightSource

log = logging.getLogger("slimectl.sync")

DEFAULT_NUM_TENSORS = 8
DEFAULT_ROWS = 4
# (engine url, reason) pairs already warned about in this process: later syncs (``rl`` syncs every
# rollout) log the same skip at INFO instead of repeating the warning.
_warned: set[tuple[str, str]] = set()


def pick_names(names: list[str], k: int = DEFAULT_NUM_TENSORS) -> list[str]:
    """``k`` names spread evenly over ``names`` (sorted), always including the first and the last."""
    names = sorted(names)
    if len(names) <= k:
        return names
    idx = sorted({round(i * (len(names) - 1) / (k - 1)) for i in range(k)})
    return [names[i] for i in idx]


def compare(expected: torch.Tensor, got: list, engine_dtype: str | None) -> float | None:
    """Max abs difference, or None when it is within tolerance."""
    got_t = torch.tensor(got, dtype=torch.float32)
    exp = expected.to(torch.float32)
    if got_t.shape != exp.shape:
        return float("inf")
    diff = (got_t - exp).abs()
    served = canonical_dtype_name(engine_dtype) if engine_dtype else None
    same_dtype = served is not None and served == dtype_name(expected.dtype)  # unknown: tolerant
    tol = torch.zeros_like(exp) if same_dtype else 2 ** -7 * exp.abs() + 1e-6
    return None if bool((diff <= tol).all()) else float(diff.max())


class VerifyReport(list):
    """The problems :func:`verify_engines` found, one line each (empty: no mismatch), plus what was done:
    ``checked`` and ``skipped`` (engine, tensor) pairs read back by value, ``digests`` (engine, tensor) pairs
    compared by checksum, ``verified`` (no problem, and every engine had at least one tensor compared) and the
    ``warning`` logged about skipped tensors (None if none)."""

    checked: int = 0
    skipped: int = 0
    digests: int = 0
    verified: bool = False
    warning: str | None = None


@dataclass
class EngineCheck:
    """What verification did on one engine (``sums``: its ``/get_weights_checksums`` answer, None without one)."""

    url: str
    kind: str = "engine"
    checked: int = 0
    digests: int = 0
    skipped: list[str] = field(default_factory=list)
    reason: str = ""
    problems: list[str] = field(default_factory=list)
    sums: dict | None = None


def engine_kind(server_info: Any) -> str:
    """``embedded engine`` / ``SGLang 0.5.23`` / ``engine``, from its ``/server_info``."""
    if not isinstance(server_info, dict):
        return "engine"
    if server_info.get("backend") == "embedded":
        return "embedded engine"
    return f"SGLang {server_info['version']}" if server_info.get("version") else "engine"


def _reason(exc: EngineError, url: str) -> str:
    """``POST /get_weights_by_name failed with HTTP 400: Get parameter by name failed`` (without the URL)."""
    msg = str(exc)
    prefix = f"engine {url}: "
    return msg[len(prefix):] if msg.startswith(prefix) else msg


def skipped_warning(checks: list[EngineCheck], num_tensors: int) -> str | None:
    """One line about every engine that skipped tensors (None when none did); engines that skipped
    the same tensors for the same reason share one clause."""
    groups: dict[tuple, list[str]] = {}
    for c in checks:
        if c.skipped:
            impossible = c.checked == 0 and not c.problems
            groups.setdefault((impossible, c.kind, c.reason, tuple(c.skipped), c.checked), []).append(c.url)
    if not groups:
        return None
    clauses = []
    for (impossible, kind, reason, skipped, checked), urls in groups.items():
        where, k = ", ".join(urls), len(skipped)
        if impossible:
            clauses.append(f"verification was not possible on {where} ({kind}): "
                           f"{'they cannot' if len(urls) > 1 else 'it cannot'} read weights back ({reason}), so "
                           f"all {k} sampled tensors were skipped")
        else:
            clauses.append(f"{where} ({kind}) cannot read back {k} of {num_tensors} sampled tensors ({reason}); "
                           f"skipped {', '.join(skipped[:3])}{' ...' if k > 3 else ''} and compared the other "
                           f"{checked}")
    tail = (" — the weights were loaded and the new version reported; only their values are unchecked "
            "(SGLang implements get_weights_by_name for some model classes only: Llama has it, Qwen2 does not)"
            if any(key[0] for key in groups) else "")
    return "sync --verify: " + "; ".join(clauses) + tail


async def verify_engines(clients: dict, source: WeightSource, num_tensors: int = DEFAULT_NUM_TENSORS,
                         rows: int = DEFAULT_ROWS) -> VerifyReport:
    """Problems found, one line each (empty: every tensor read back matches ``source``'s weights).

    Every tensor by checksum where the engine gives them, and a sample by value (see the module docstring); a
    tensor an engine answers with an HTTP error is skipped and one warning covers them all; an engine that does
    not answer at all is a problem."""
    checks = [EngineCheck(u) for u in clients]
    if source.adapter is None:  # full weights: every tensor has a counterpart in the engine
        await asyncio.gather(*(_engine_sums(c, clients[c.url]) for c in checks))
    wanted = {(n, e["dtype"]) for c in checks if c.sums for n, e in c.sums["checksums"].items()}
    expected_sums = source_checksums(source, wanted) if wanted else {}
    # (a model's multi-token-prediction layers are not served: slimectl.backends.hf.mtp)
    expected = source.heads(lambda names: pick_names(without_mtp_layers(names), num_tensors), rows)
    await asyncio.gather(*(_read_back(c, clients[c.url], expected, rows, source.version) for c in checks
                           if not c.problems))
    for c in checks:
        if c.sums and not c.problems:
            _compare_sums(c, expected_sums, source.version)
    report = VerifyReport(p for c in checks for p in c.problems)
    report.checked = sum(c.checked for c in checks)
    report.skipped = sum(len(c.skipped) for c in checks)
    report.digests = sum(c.digests for c in checks)
    report.verified = not report and all(c.checked or c.digests for c in checks)
    report.warning = skipped_warning(checks, len(expected))
    if report.warning:
        keys = {(c.url, c.reason) for c in checks if c.skipped}
        log.log(logging.INFO if keys <= _warned else logging.WARNING, "%s", report.warning)
        _warned.update(keys)
    if report.digests and not report:
        log.info("sync --verify: %d tensors bit-identical to weight version %s (xxh3-128) on %d engine(s)",
                 report.digests, source.version, sum(1 for c in checks if c.digests))
    return report


async def _engine_sums(check: EngineCheck, c) -> None:
    """The engine's checksums of every weight into ``check.sums``; an engine without the endpoint (SGLang: 404,
    or any HTTP error) has none; one that does not answer at all is a problem."""
    try:
        check.sums = await c.get_weights_checksums()
    except EngineError as exc:
        if exc.status is None:
            check.problems.append(f"engine {check.url} cannot report its weights' checksums ({exc})")
        return
    if not isinstance(check.sums, dict) or not isinstance(check.sums.get("checksums"), dict):
        check.sums = None


def source_checksums(source: WeightSource, wanted: set[tuple[str, str]]) -> dict[tuple[str, str], tuple]:
    """(name, dtype) -> (shape, xxh3-128 of the source tensor's bytes in that dtype), for every pair in
    ``wanted``: one pass over the source, each tensor cast to the dtypes engines serve it in (exact: see the
    module docstring)."""
    from slimectl.backends.hf.dtypes import torch_dtype
    from slimectl.backends.hf.weight_delta import checksum

    by_name: dict[str, set[str]] = {}
    for name, dtype in wanted:
        by_name.setdefault(name, set()).add(dtype)
    out = {}
    for name, t in source.iter_tensors():
        for dtype in by_name.get(name, ()):
            want = torch_dtype(dtype)
            out[(name, dtype)] = (list(t.shape), checksum(t if t.dtype == want else t.to(want)))
    return out


def _compare_sums(check: EngineCheck, expected: dict[tuple[str, str], tuple], version) -> None:
    """Every source tensor against the engine's checksum of it; a tensor the sample already named is not named
    twice."""
    named = {p.split(" weight ", 1)[1].split()[0] for p in check.problems if " weight " in p}
    for name, e in sorted(check.sums["checksums"].items()):
        want = expected.get((name, e["dtype"]))
        if want is None:  # the engine's own names (a fused parameter, a tied twin) the source does not carry
            continue
        check.digests += 1
        if name in named or (list(e["shape"]), e["xxh3_128"]) == tuple(want):
            continue
        what = (f"shape {e['shape']}, expected {want[0]}" if list(e["shape"]) != want[0] else
                f"xxh3-128 of its {e['dtype']} bytes {e['xxh3_128'][:12]}..., expected {want[1][:12]}...")
        check.problems.append(f"engine {check.url}: weight {name} differs from weight version {version} ({what})")


async def _read_back(check: EngineCheck, c, expected: dict, rows: int, version) -> None:
    """The sampled tensors read back by value (``/get_weights_by_name``) and compared with ``expected``."""
    try:
        info = await c.get_server_info()
        dtype = info.get("dtype") if isinstance(info, dict) else None
        check.kind = engine_kind(info)
    except EngineError:
        dtype = None
    for n in expected:
        try:
            got = await c.get_weights_by_name(n, rows)
        except EngineError as exc:
            if exc.status is None:  # no answer at all: the engine is gone, not merely unable to read back
                check.problems.append(f"engine {check.url} cannot report weight {n} ({exc})")
                return
            check.skipped.append(n)
            check.reason = check.reason or _reason(exc, check.url)
            continue
        check.checked += 1
        bad = compare(expected[n], got, dtype)
        if bad is not None:
            check.problems.append(f"engine {check.url}: weight {n} differs from weight version {version} "
                                  f"(max abs diff {bad:.3g})")
    if check.skipped:
        try:
            archs = (await c.get_model_info()).get("architectures")
        except (EngineError, AttributeError):
            archs = None
        if archs:
            check.kind += f" serving {', '.join(map(str, archs))}"
