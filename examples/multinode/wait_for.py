"""What the multi-host driver scripts ask the shared run directory (no engine, no GPU, no network).

    python wait_for.py [-r RUN] ready KIND ID [--timeout S]    block until KIND/ID is READY
    python wait_for.py [-r RUN] engines VERSION [--timeout S]  block until every live engine is at >= VERSION
    python wait_for.py [-r RUN] sync-target VERSION [--lag L] [--timeout S]
                                 block until a version newer than VERSION may be pushed; print it
    python wait_for.py [-r RUN] next-rollout                   print the next rollout id to generate
    python wait_for.py [-r RUN] engine-version                 print the lowest engine weight version (-1: none)
    python wait_for.py [-r RUN] num-rollout                    print rollout.num_rollout of the run

RUN defaults to $SLIMECTL_RUN_DIR. Everything is read from files that `slimectl` stages write
atomically (READY markers, the engine registry), so this is safe to poll from any host that
mounts the run directory; a timeout exits 3 with a one-line message.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

POLL_S = 0.5


def engine_versions(run) -> list[int]:
    """Weight versions the live engines report in the registry (`sync` records them)."""
    out = []
    for rec in run.engines.live():
        try:
            out.append(int(rec.weight_version))
        except (TypeError, ValueError):
            out.append(-1)  # an unknown version never satisfies a wait
    return out


def wait_engines(run, version: int, timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        versions = engine_versions(run)
        if versions and min(versions) >= version:
            return
        if deadline is not None and time.monotonic() >= deadline:
            from slimectl.contract.errors import WaitTimeout

            have = ", ".join(map(str, versions)) or "no live engines"
            raise WaitTimeout(f"the engines did not reach weight version {version} within {timeout:g} s "
                              f"(they report: {have}); is `slimectl sync` running?")
        time.sleep(POLL_S)


def sync_target(run, lag: int) -> int:
    """The newest weight version the engines may take now: published (``weights/V`` READY; 0 is
    the initial model), and past the rollout that must be generated on older weights.

    Rollout N runs on version >= N - lag, so version V may replace the engines' weights only once
    rollouts/V-1+lag is READY: then no rollout is in flight (the next one waits for V). Versions
    past the last rollout (the final one) have no such rollout to wait for.
    """
    total = run.config().rollout.num_rollout
    weights = run.weights.ids()
    newest = weights[-1] if weights else 0
    rollouts = run.rollouts.ids()
    last_rollout = rollouts[-1] if rollouts else -1
    if newest - 1 + lag >= total or newest - 1 + lag <= last_rollout:
        return newest
    return last_rollout + 1 - lag


def wait_sync_target(run, above: int, lag: int, timeout: float | None) -> int:
    """The first version newer than the engines' that may be pushed. ``above`` is their version
    when the wait began; the registry is read again on every poll, so engines that restarted on
    the initial weights meanwhile (a serve host killed and restarted) are caught up at once
    instead of waiting for a version that needs them to serve a newer one first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        target = sync_target(run, lag)
        have = min(engine_versions(run), default=above)
        if target > min(have, above):
            return target
        if deadline is not None and time.monotonic() >= deadline:
            from slimectl.contract.errors import WaitTimeout

            raise WaitTimeout(f"no weight version newer than {above} could be pushed within {timeout:g} s "
                              f"(newest allowed: {target}); is `slimectl train` running?")
        time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-r", "--run-dir", default=os.environ.get("SLIMECTL_RUN_DIR"))
    sub = ap.add_subparsers(dest="what", required=True)
    ready = sub.add_parser("ready")
    ready.add_argument("kind", choices=["rollouts", "weights", "checkpoints", "evals"])
    ready.add_argument("id", type=int)
    ready.add_argument("--timeout", type=float)
    eng = sub.add_parser("engines")
    eng.add_argument("version", type=int)
    eng.add_argument("--timeout", type=float)
    target = sub.add_parser("sync-target")
    target.add_argument("version", type=int)
    target.add_argument("--lag", type=int, choices=[0, 1], default=0)
    target.add_argument("--timeout", type=float)
    for name in ("next-rollout", "engine-version", "num-rollout"):
        sub.add_parser(name)
    args = ap.parse_args(argv)
    if not args.run_dir:
        ap.error("no run directory: pass -r RUN or set SLIMECTL_RUN_DIR")

    from slimectl.contract.errors import SlimectlError, WaitTimeout
    from slimectl.contract.rundir import RunDir

    try:
        run = RunDir.open(args.run_dir)
        if args.what == "ready":
            run.artifacts(args.kind).wait_for(args.id, timeout=args.timeout, poll=POLL_S)
        elif args.what == "engines":
            wait_engines(run, args.version, args.timeout)
        elif args.what == "sync-target":
            print(wait_sync_target(run, args.version, args.lag, args.timeout))
        elif args.what == "next-rollout":
            ids = run.rollouts.ids()
            print(ids[-1] + 1 if ids else 0)
        elif args.what == "engine-version":
            print(min(engine_versions(run), default=-1))
        else:
            print(run.config().rollout.num_rollout)
    except WaitTimeout as exc:
        print(f"wait_for.py: {exc}", file=sys.stderr)
        return 3
    except SlimectlError as exc:
        print(f"wait_for.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
