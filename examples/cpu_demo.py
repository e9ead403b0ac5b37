"""The CPU demo: run every landed stage of slimectl, as separate commands on one run directory.

    python examples/cpu_demo.py [RUN_DIR]        (default: runs/demo)

1. ``slimectl init``     tiny offline Qwen2 + the demo config (examples/cpu_demo.yaml)
2. ``slimectl convert``  HF -> Megatron torch_dist, published as RUN/checkpoints/000000
3. ``slimectl serve``    an embedded engine, in the background, registered in RUN/engines
4. ``slimectl rollout``  two rollouts (prompts x 8 samples, math reward) -> RUN/rollouts/
5. ``slimectl inspect``  a look at the samples; ``slimectl status`` at the end

Rerunning continues the same run (init is idempotent, rollouts go on from --next). Once
``slimectl rl`` lands (issue #7) this script becomes one ``slimectl rl --config`` call.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def slimectl(*args: str, capture: bool = False) -> str:
    print(f"$ slimectl {' '.join(args)}", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, "-m", "slimectl", *args], text=True,
                          stdout=subprocess.PIPE if capture else None)
    if proc.returncode != 0:
        sys.exit(f"slimectl {args[0]} failed with exit code {proc.returncode}")
    return proc.stdout or ""


def main() -> None:
    run = sys.argv[1] if len(sys.argv) > 1 else "runs/demo"
    slimectl("init", run, "--config", str(HERE / "cpu_demo.yaml"), "--tiny-model", "qwen2")
    if not (Path(run) / "checkpoints" / "000000" / "READY").exists():
        slimectl("convert", "-r", run)
    print(f"$ slimectl serve -r {run} &", file=sys.stderr, flush=True)
    serve = subprocess.Popen([sys.executable, "-m", "slimectl", "serve", "-r", run], stdout=subprocess.PIPE, text=True)
    try:
        url = serve.stdout.readline().strip()
        if not url:
            sys.exit(f"slimectl serve exited with code {serve.wait()}")
        print(f"engine ready at {url}", file=sys.stderr)
        for _ in range(2):
            path = slimectl("rollout", "-r", run, "--next", capture=True).strip()
            rollout_id = int(Path(path).name)
        slimectl("inspect", "rollout", "-r", run, str(rollout_id), "--limit", "2")
        slimectl("status", "-r", run, "--no-probe")
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)


if __name__ == "__main__":
    main()
