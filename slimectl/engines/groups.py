"""Engine groups by name (``engine.groups``): where a group's engines are registered, and their URLs.

The actor's group (``engine:``, named ``engine.name``) is registered in ``RUN/engines/``, a frozen group (a
teacher, a judge, a reference) in ``RUN/engines/groups/NAME/`` by ``serve`` or ``rl``
(:class:`~slimectl.stages.serve.FrozenGroups`). Sync and rollouts read ``RUN/engines/`` only, so they never reach a
frozen group; OPD (``rollout.teacher_group``) and the judge reward (``rollout.judge.group``) reach one by name here.
"""

from __future__ import annotations

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import SlimectlError
from slimectl.contract.rundir import RunDir
from slimectl.contract.rundir.registry import EngineRegistry


def group_registry(run: RunDir, cfg: SlimectlConfig, name: str) -> EngineRegistry:
    """The registry of group ``name``: ``RUN/engines/`` for the actor's, ``RUN/engines/groups/NAME/`` otherwise."""
    if name not in cfg.engine.group_names():
        raise SlimectlError(f"no engine group named {name!r} (groups: {', '.join(cfg.engine.group_names())}); add it "
                            f"to engine.groups")
    return run.engines if name == cfg.engine.name else run.engine_group(name)


def group_urls(run: RunDir, cfg: SlimectlConfig, name: str, key: str) -> list[str]:
    """The URLs of group ``name``'s live engines (``key``: the config key that named it, for the error)."""
    registry = group_registry(run, cfg, name)
    recs = registry.live()
    if not recs:  # its engines being healed (a heartbeat starting them again): wait for them
        from slimectl.engines.health import wait_healing

        wait_healing(registry, cfg.engine.startup_timeout_s)
        recs = registry.live()
    if not recs:
        raise SlimectlError(f"{key} = {name}: no live engines of that group are registered in {run.path}/engines; "
                            f"start `slimectl serve -r {run.path}` (it starts every group of engine.groups), or run "
                            f"`slimectl rl`, which starts them with its own engines")
    return [r.url.rstrip("/") for r in recs]
