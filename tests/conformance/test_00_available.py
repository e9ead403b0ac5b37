"""Is the real server there? Fails (one line: why, and how to build it) when it is not; the other
conformance modules are then not run (tests/conformance/conftest.py)."""

from __future__ import annotations

import subprocess


def test_real_sglang_is_available(sglang_python):
    # the pinned version, read from the package metadata (cheap: sglang itself is not imported)
    out = subprocess.run([sglang_python, "-c", "import importlib.metadata as m; print(m.version('sglang'), "
                          "m.version('torch'))"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    sglang, torch = out.stdout.split()
    assert sglang == "0.5.23", f"{sglang_python} has sglang {sglang}; the suite is pinned to 0.5.23"
    assert torch.startswith("2.13.0"), f"{sglang_python} has torch {torch}, not the recipe's 2.13.0 (CPU)"
