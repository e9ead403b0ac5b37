"""What the Ray driver and every Ray worker of ``rl --launcher ray`` share: Ray imported with a one-line hint when
it is missing, remote failures as slimectl's one-line errors, a worker's logging and where it runs, and a
node's address with a free port (a rendezvous)."""

from __future__ import annotations

import logging
import os

from slimectl.contract.errors import SlimectlError, UsageError

INSTALL_HINT = "pip install 'slimectl[ray]'"


def import_ray():
    """The ``ray`` module, or a one-line error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UsageError(f"--launcher ray needs Ray, which is not installed; {INSTALL_HINT}") from None
    return ray


def worker_context() -> dict:
    """Where the calling actor runs: recorded in the engine registry and logged by the driver."""
    import ray

    from slimectl.contract.rundir.atomic import hostname

    ctx = ray.get_runtime_context()
    return {"ray_actor_id": ctx.get_actor_id(), "ray_node_id": ctx.get_node_id(), "actor_pid": os.getpid(),
            "actor_host": hostname()}


def worker_logging(level: int) -> None:
    """slimectl's log lines on the actor's stderr (Ray forwards them to the driver), at the driver's level."""
    from slimectl.contract.logs import setup_logging

    setup_logging(0)
    logging.getLogger("slimectl").setLevel(level)


def remote_result(refs, what: str):
    """``ray.get`` with remote failures turned into slimectl's one-line errors (the driver's, or a
    worker's own calls of other workers: trainer rank 0 calls the critic group)."""
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, SlimectlError):
            raise cause from None
        raise SlimectlError(f"the {what} actor failed: {type(cause).__name__}: {cause}") from None
    except ray.exceptions.RayActorError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SlimectlError(f"the {what} actor died ({first}); see its log under the Ray session's logs/ "
                            f"on its node") from None


def node_address() -> tuple[str, int]:
    """This node's address and a free port on it: the rendezvous of a group of ranks."""
    import ray

    from slimectl.contract.net import free_port

    host = ray.util.get_node_ip_address()
    return host, free_port(host)
