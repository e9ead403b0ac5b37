"""The check an engine started again by the heartbeat passes before it takes requests: its weights read back
match ``weights/N`` (the sync's own verification, :func:`~slimectl.stages.sync.verify.verify_engines`).

``serve`` (the command) and ``rl`` hand :func:`weights_check` to the engines they launch
(:class:`~slimectl.stages.serve.EngineProcesses` ``verify``), which cannot reach the sync stage themselves."""

from __future__ import annotations

import asyncio
from typing import Callable

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.rundir import RunDir


def weights_check(run: RunDir, cfg: SlimectlConfig) -> Callable[[str, str], list[str]]:
    """``check(url, version)``: the problems found comparing the engine at ``url`` with ``weights/version``
    (``model.path`` for version 0), one line each; empty when they match (a
    :class:`~slimectl.stages.sync.verify.VerifyReport`: its ``verified`` is false when no tensor could be read
    back, e.g. SGLang's Qwen2)."""

    def check(url: str, version: str) -> list[str]:
        from slimectl.engines.client import EngineClient
        from slimectl.stages.sync.stage import weight_source
        from slimectl.stages.sync.verify import verify_engines

        source = weight_source(run, cfg, int(version))

        async def read_back() -> list[str]:
            async with EngineClient(url, token=cfg.engine.token(), timeout=cfg.sync.timeout_s, retries=1) as c:
                return await verify_engines({url: c}, source)

        return asyncio.run(read_back())

    return check
