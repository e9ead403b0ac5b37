"""SGLang launch specs: the exact argv and environment of ``python -m sglang.launch_server`` and of the router.

Nothing here imports sglang: the argv is built as plain strings (the tests validate it with SGLang's own
parser, ``tests/sglang_argv_check.py``).

Flags and semantics this module relies on (SGLang 0.5.x, ``python/sglang/srt/server_args.py``):

* ``--model-path --host --port --tp-size --dp-size --mem-fraction-static --dtype --weight-version``
  (``--dtype`` choices: auto, half, float16, bfloat16, float, float32).
* ``--api-key`` protects every endpoint except ``/health*``, ``/ready*`` and ``/metrics*``
  (Bearer token or ``x-api-key`` header). ``--admin-api-key`` protects the management endpoints
  (``/update_weights_from_*``, ...); when it is set those endpoints accept *only* the admin key,
  when it is not they accept the api key (``python/sglang/srt/utils/auth.py``). The health check
  therefore never needs a token; ``serve`` starts SGLang with its token as the admin key.
* Secrets are passed on the command line (that is how SGLang takes them), are shown as ``***`` in
  every command line the supervisor logs, and are replaced by ``***`` in the engine log files (SGLang
  prints ``server_args=ServerArgs(... api_key='...')`` at startup, so its output is filtered
  through a redacting pump whenever a secret is involved).
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from slimectl.contract.errors import UsageError

SGLANG_SERVER_MODULE = "sglang.launch_server"
SGLANG_ROUTER_MODULE = "sglang_router.launch_router"
#: SGLang's ``--dtype`` choices (``ServerArgs.dtype``).
SGLANG_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
# extra_args keys that the spec owns (field name -> flag); aliases SGLang accepts for them too.
_MANAGED_SERVER_KEYS = {
    "model_path": "--model-path",
    "model": "--model-path",  # SGLang alias of --model-path
    "host": "--host",
    "port": "--port",
    "tp_size": "--tp-size",
    "tensor_parallel_size": "--tp-size",
    "dp_size": "--dp-size",
    "data_parallel_size": "--dp-size",
    "mem_fraction_static": "--mem-fraction-static",
    "dtype": "--dtype",
    "weight_version": "--weight-version",
    "api_key": "--api-key",
    "admin_api_key": "--admin-api-key",
}
_MANAGED_ROUTER_KEYS = {"host": "--host", "port": "--port", "worker_urls": "--worker-urls", "policy": "--policy"}
_KEY_RE = re.compile(r"^[a-z0-9][a-z0-9_]*$")


class SGLangArgError(UsageError, ValueError):
    """A launch spec or pass-through argument is invalid (a ValueError, and a UsageError for the CLI)."""


@dataclass
class SGLangLaunchSpec:
    """One SGLang server. ``launcher`` replaces ``[python, "-m", "sglang.launch_server"]`` (tests)."""

    model_path: str
    port: int
    host: str = "127.0.0.1"
    tp_size: int = 1
    dp_size: int = 1
    mem_fraction_static: float | None = None
    dtype: str | None = None
    gpu_ids: list[int] = field(default_factory=list)
    weight_version: str | None = None
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    extra_args: dict[str, Any] = field(default_factory=dict)
    python: str = field(default_factory=lambda: sys.executable)
    launcher: list[str] | None = None
    #: extra environment variables for this engine (e.g. ``SGLANG_USE_CPU_ENGINE=1`` on CPU); ``serve``
    #: fills them from the config's ``engine.env``
    env: dict[str, str] = field(default_factory=dict)

    def secrets(self) -> list[str]:
        return [s for s in (self.api_key, self.admin_api_key) if s]


def url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _norm_key(key: str) -> str:
    k = str(key).strip().lstrip("-").replace("-", "_").lower()
    if not _KEY_RE.match(k):
        raise SGLangArgError(f"extra arg {key!r}: not a flag name (use e.g. 'context_length' for --context-length)")
    return k


def translate_extra_args(extra: Mapping[str, Any] | None, managed: Mapping[str, str] = _MANAGED_SERVER_KEYS,
                         what: str = "sglang") -> list[str]:
    """``{"context_length": 4096, "enable_dp_attention": True}`` -> ``["--context-length", "4096",
    "--enable-dp-attention"]``. False/None (or an empty list) drop the flag; a list/tuple gives
    ``--flag v1 v2 ...`` (SGLang's list flags are ``nargs='+'``: repeating the flag would keep only
    the last value); a dict is passed as JSON. Keys the launcher manages itself are refused."""
    out: list[str] = []
    seen: dict[str, str] = {}
    for key, value in (extra or {}).items():
        k = _norm_key(key)
        if k in managed:
            raise SGLangArgError(
                f"{what} extra arg {key!r} duplicates the managed flag {managed[k]}: set it on the launch spec instead")
        if k in seen:
            raise SGLangArgError(f"{what} extra arg {key!r} given twice (also as {seen[k]!r})")
        seen[k] = str(key)
        flag = "--" + k.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            if not value:
                continue
            out.append(flag)
            out.extend(_scalar(v, key) for v in value)
        elif isinstance(value, dict):
            out += [flag, json.dumps(value, separators=(",", ":"), sort_keys=True)]
        else:
            out += [flag, _scalar(value, key)]
    return out


def _scalar(v: Any, key: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float, str, Path)):
        return str(v)
    if isinstance(v, dict):
        return json.dumps(v, separators=(",", ":"), sort_keys=True)
    raise SGLangArgError(f"extra arg {key!r}: unsupported value type {type(v).__name__}")


def _check_spec(spec: SGLangLaunchSpec) -> None:
    if not str(spec.model_path):
        raise SGLangArgError("sglang spec: model_path is empty")
    if not isinstance(spec.port, int) or isinstance(spec.port, bool) or not 0 < spec.port < 65536:
        raise SGLangArgError(f"sglang spec: port {spec.port!r} is not in 1..65535")
    for name in ("tp_size", "dp_size"):
        v = getattr(spec, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SGLangArgError(f"sglang spec: {name} {v!r} must be an integer >= 1")
    if spec.mem_fraction_static is not None and not 0.0 < float(spec.mem_fraction_static) <= 1.0:
        raise SGLangArgError(f"sglang spec: mem_fraction_static {spec.mem_fraction_static!r} must be in (0, 1]")
    if spec.dtype is not None and spec.dtype not in SGLANG_DTYPES:
        raise SGLangArgError(f"sglang spec: dtype {spec.dtype!r} is not one of {', '.join(SGLANG_DTYPES)}")
    for name in ("api_key", "admin_api_key"):
        v = getattr(spec, name)
        if v is not None and (not isinstance(v, str) or not v or any(c.isspace() for c in v)):
            raise SGLangArgError(f"sglang spec: {name} must be a non-empty string without whitespace")


def build_sglang_argv(spec: SGLangLaunchSpec) -> list[str]:
    """The exact argv for one SGLang server (contains the api keys in clear: log
    :func:`slimectl.engines.supervisor.redact_argv` of it)."""
    _check_spec(spec)
    launcher = list(spec.launcher) if spec.launcher else [spec.python, "-m", SGLANG_SERVER_MODULE]
    argv = launcher + [
        "--model-path", str(spec.model_path),
        "--host", spec.host,
        "--port", str(spec.port),
        "--tp-size", str(spec.tp_size),
    ]
    if spec.dp_size != 1:
        argv += ["--dp-size", str(spec.dp_size)]
    if spec.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(float(spec.mem_fraction_static))]
    if spec.dtype is not None:
        argv += ["--dtype", spec.dtype]
    if spec.weight_version is not None:
        argv += ["--weight-version", str(spec.weight_version)]
    if spec.api_key:
        argv += ["--api-key", spec.api_key]
    if spec.admin_api_key:
        argv += ["--admin-api-key", spec.admin_api_key]
    return argv + translate_extra_args(spec.extra_args)


def build_env(spec: SGLangLaunchSpec, base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base_env`` (default: this process's environment) plus ``spec.env``, with
    ``CUDA_VISIBLE_DEVICES`` set from ``spec.gpu_ids`` when they are given (otherwise inherited)."""
    env = dict(os.environ if base_env is None else base_env)
    env.update({str(k): str(v) for k, v in (spec.env or {}).items()})
    if spec.gpu_ids:
        ids = list(spec.gpu_ids)
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
            raise SGLangArgError(f"sglang spec: gpu_ids {ids!r} must be non-negative integers")
        if len(set(ids)) != len(ids):
            raise SGLangArgError(f"sglang spec: gpu_ids {ids!r} contain duplicates")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in ids)
    return env


def build_router_argv(python: str, host: str, port: int, worker_urls: Sequence[str], policy: str = "round_robin",
                      extra_args: Mapping[str, Any] | None = None, launcher: Sequence[str] | None = None) -> list[str]:
    """``python -m sglang_router.launch_router --host H --port P --worker-urls URL... --policy POLICY``."""
    urls = [str(u) for u in worker_urls]
    if not urls:
        raise SGLangArgError("router: worker_urls is empty")
    if not policy:
        raise SGLangArgError("router: policy is empty")
    prefix = list(launcher) if launcher else [python, "-m", SGLANG_ROUTER_MODULE]
    return prefix + ["--host", host, "--port", str(port), "--worker-urls", *urls, "--policy", policy] + \
        translate_extra_args(extra_args, _MANAGED_ROUTER_KEYS, what="router")

