"""Is the real server there? FAILS (one line: why, and how to build it) when it is not; the tests that need
it are then not run (tests/conformance/conftest.py)."""

from __future__ import annotations

import subprocess



def test_real_sglang_is_available(sglang_python):
    """The fixture fails with one line when the server is not there (waits for a background build)."""
    py = sglang_python
    # the pinned versions, read from the package metadata (cheap: sglang itself is not imported)
    out = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('sglang'), m.version('torch'))"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    sglang, torch = out.stdout.split()
    assert sglang == "0.5.23", f"{py} has sglang {sglang}; the suite is pinned to 0.5.23"
    assert torch.startswith("2.13.0"), f"{py} has torch {torch}, not the recipe's 2.13.0 (CPU)"
