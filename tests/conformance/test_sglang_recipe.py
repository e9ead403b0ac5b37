"""scripts/sglang_cpu/setup.sh without building SGLang (seconds): the cache key follows the recipe files, and
a killed or failed build leaves no venv where the tests look. Runs whether or not the real server is built."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.helpers import ROOT

RECIPE = ROOT / "scripts" / "sglang_cpu"


def setup_sh(recipe: Path, *args: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "SLIMECTL_SGLANG_VENV"}
    return subprocess.run(["bash", str(recipe / "setup.sh"), *args], capture_output=True, text=True,
                          env={**e, **(env or {})}, timeout=kw.pop("timeout", 120), **kw)


def test_cache_key_follows_the_recipe_files(tmp_path):
    here = setup_sh(RECIPE, "--print-path").stdout.strip()
    assert here.startswith(str(Path.home() / ".cache" / "slimectl" / "sglang-cpu-")), here
    copy = tmp_path / "recipe"
    shutil.copytree(RECIPE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert setup_sh(copy, "--print-path").stdout.strip() == here  # the same files: the same venv, wherever they lie
    (copy / "requirements.txt").write_text((copy / "requirements.txt").read_text() + "# edited\n")
    edited = setup_sh(copy, "--print-path").stdout.strip()
    assert edited != here and edited.startswith(here.rsplit("-", 1)[0])
    (copy / "stubs" / "sgl_kernel" / "__init__.py").write_text("# changed stub\n")
    assert setup_sh(copy, "--print-path").stdout.strip() not in (here, edited)
    assert setup_sh(copy, "--print-path", env={"SLIMECTL_SGLANG_VENV": str(tmp_path / "v")}).stdout.strip() == \
        str(tmp_path / "v")
    bad = setup_sh(RECIPE, "--bogus")
    assert bad.returncode == 1 and "unknown option --bogus" in bad.stderr


def test_killed_then_failed_builds_leave_no_venv(tmp_path):
    venv = tmp_path / "venv"
    env = {"SLIMECTL_SGLANG_VENV": str(venv)}
    # 1. killed mid-build (kill -9 of the whole build): only the temporary directory is left
    proc = subprocess.Popen(["bash", str(RECIPE / "setup.sh")], env={**os.environ, **env}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("venv.tmp-*/bin/python")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(tmp_path.glob("venv.tmp-*")), "the build never started"
    assert not venv.exists() and setup_sh(RECIPE, "--check", env=env).returncode == 1
    # 2. a build that fails (no package index: torch cannot be installed) says so, cleans up, installs nothing
    no_index = {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "", "PIP_NO_INDEX": "1"}
    res = setup_sh(RECIPE, env=no_index, timeout=300)
    assert res.returncode == 1 and "build failed" in res.stderr, res.stderr[-2000:]
    assert not venv.exists() and not list(tmp_path.glob("venv.tmp-*")), list(tmp_path.iterdir())
