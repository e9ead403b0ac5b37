"""A reference for the tests: an SGLang server argv validated with SGLang's own argparse, in a subprocess of the
interpreter that has sglang (slimectl builds the argv, ``engines/sglang/launch_spec.py``; it never runs this)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from typing import Mapping, Sequence

from slimectl.engines.sglang.launch_spec import SGLANG_SERVER_MODULE, SGLangArgError
from slimectl.engines.supervisor import redact_argv, redact_text, secrets_in_argv

#: What :func:`check_argv_with_sglang` returns when the interpreter cannot import sglang.
SGLANG_NOT_IMPORTABLE = "sglang not importable"

_CHECK_SCRIPT = r"""
import argparse, json, sys
req = json.load(sys.stdin)
def done(ok, error=None):
    sys.stdout.write("\n@@SLIMECTL@@" + json.dumps({"ok": ok, "error": error}) + "\n")
    sys.stdout.flush()
    sys.exit(0)
try:
    from sglang.srt.server_args import ServerArgs
except BaseException as e:
    done(False, "@@IMPORT@@%s: %s" % (type(e).__name__, e))
class _Err(Exception):
    pass
class P(argparse.ArgumentParser):
    def error(self, message):
        raise _Err(message)
p = P(prog="sglang.launch_server")
try:
    ServerArgs.add_cli_args(p)
    ns = p.parse_args(req["args"])
except _Err as e:
    done(False, "argparse: %s" % e)
except SystemExit as e:
    done(False, "argparse exited with %s" % e.code)
if not req["parse_only"]:
    try:
        ServerArgs.from_cli_args(ns)
    except BaseException as e:
        done(False, "ServerArgs: %s: %s" % (type(e).__name__, e))
done(True)
"""


def _server_args_part(argv: Sequence[str]) -> list[str]:
    argv = [str(a) for a in argv]
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] == SGLANG_SERVER_MODULE:
            return argv[i + 2:]
    if not argv or argv[0].startswith("--"):
        return argv
    raise SGLangArgError(f"argv does not run '-m {SGLANG_SERVER_MODULE}' and does not start with a flag: "
                         f"{shlex.join(redact_argv(argv[:4]))} ...")


def check_argv_with_sglang(argv: Sequence[str], python: str | None = None, *, timeout: float = 300.0,
                           parse_only: bool = False, env: Mapping[str, str] | None = None) -> str | None:
    """Validate a server argv with SGLang's own ``ServerArgs.add_cli_args`` + ``parse_args`` and
    (unless ``parse_only``) ``ServerArgs.from_cli_args`` -- what ``prepare_server_args`` does in
    ``python -m sglang.launch_server`` -- in a subprocess of ``python`` (default: this interpreter).

    Returns None when SGLang accepts it, :data:`SGLANG_NOT_IMPORTABLE` when ``python`` has no
    ``sglang`` package (or does not run), ``"sglang not importable: <why>"`` when sglang is there but
    ``sglang.srt.server_args`` fails to import, and otherwise the (redacted, one-line) error text.
    ``from_cli_args`` runs ``ServerArgs.__post_init__``, which may inspect the model path and the
    local devices: use ``parse_only=True`` on a machine that is not the target one."""
    args = _server_args_part(argv)
    secrets = secrets_in_argv(args)
    py = python or sys.executable
    run_env = dict(os.environ if env is None else env)
    try:
        probe = subprocess.run([py, "-c", "import importlib.util,sys; "
                                "sys.exit(0 if importlib.util.find_spec('sglang') else 3)"],
                               env=run_env, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return SGLANG_NOT_IMPORTABLE
    if probe.returncode != 0:
        return SGLANG_NOT_IMPORTABLE
    try:
        # args go over stdin, so the api key never shows up in this checker's command line
        res = subprocess.run([py, "-c", _CHECK_SCRIPT], input=json.dumps({"args": args, "parse_only": parse_only}),
                             env=run_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"sglang argv check timed out after {timeout:g}s"
    marker = "\n@@SLIMECTL@@"
    out = "\n" + res.stdout
    if marker not in out:
        tail = " | ".join(ln for ln in (res.stderr or res.stdout).strip().splitlines()[-5:])
        return redact_text(f"sglang argv check crashed (exit {res.returncode}): {tail}", secrets)
    verdict = json.loads(out.rsplit(marker, 1)[1].strip().splitlines()[0])
    if verdict["ok"]:
        return None
    err = str(verdict["error"])
    if err.startswith("@@IMPORT@@"):
        return f"{SGLANG_NOT_IMPORTABLE}: {redact_text(err[len('@@IMPORT@@'):], secrets)}".splitlines()[0]
    return " ".join(redact_text(err, secrets).split())
