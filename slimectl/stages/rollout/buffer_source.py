"""``slimectl rollout --source buffer URL``: collect one rollout's groups from a rollout buffer
service (:mod:`slimectl.services.rollout_buffer`) and publish them as ``rollouts/N``, each group once.

The steps are ordered so that the handoff is exactly-once even when this process dies:

1. under the run's ``rollout`` lock, acknowledge the lease recorded in the newest rollout that
   came from this buffer (an earlier collection may have died between publishing and
   acknowledging; acknowledging twice is harmless);
2. lease ``rollout.batch_size`` complete groups, waiting until the buffer has that many;
3. check every sample by the rules of ``slimectl rollout import`` and publish them with the same
   code, the buffer's id and the lease recorded in the manifest;
4. acknowledge the lease.

A death before step 3 completes publishes nothing; the lease expires and the groups are handed
out again. A death between 3 and 4 is repaired by step 1 of the next collection.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.contract.rundir import RunDir
from slimectl.contract.sample_checks import ImageCheck, check_sample, parse_sample
from slimectl.contract.samples import Sample
from slimectl.stages.rollout.importer import (ImportResult, image_check, model_vocab_size, publish_samples,
                                              resolve_rollout_id)
from slimectl.web.client import request_json
from slimectl.web.errors import HttpError

log = logging.getLogger("slimectl.rollout")


class RolloutBufferError(HttpError):
    """The rollout buffer could not be reached (``status`` None) or refused a request."""


class BufferClient:
    """Blocking JSON requests to a rollout buffer; failures raise :class:`RolloutBufferError` naming the URL."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 120.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        out = request_json(method, self.url, body, path=path, token=self.token, timeout=self.timeout,
                           what="rollout buffer", error=RolloutBufferError,
                           hint="is `slimectl rollout buffer serve` running there?")
        if not isinstance(out, dict):
            raise RolloutBufferError(f"{self.url}{path} did not answer with a JSON object; is {self.url} a rollout buffer?")
        return out


def collect_rollout(run: RunDir, cfg: SlimectlConfig, url: str, token: str | None = None, rollout_id: int | None = None,
                    force: bool = False, wait_timeout: float | None = None, poll_s: float = 1.0) -> ImportResult:
    """Lease ``rollout.batch_size`` complete groups from the buffer at ``url``, publish them as
    ``rollouts/N`` (default: the next id) and acknowledge the lease."""
    client = BufferClient(url, token)
    health = client.request("GET", "/health")
    buffer_id = health.get("buffer_id")
    if not isinstance(buffer_id, str):
        raise RolloutBufferError(f"{client.url}/health has no buffer_id; is {client.url} a slimectl rollout buffer?")
    if health.get("n_samples_per_prompt") != cfg.rollout.n_samples_per_prompt:
        raise UsageError(f"the rollout buffer at {client.url} completes groups at {health.get('n_samples_per_prompt')} "
                         f"samples but rollout.n_samples_per_prompt is {cfg.rollout.n_samples_per_prompt}; serve the "
                         f"buffer with --n-samples-per-prompt {cfg.rollout.n_samples_per_prompt} or change the config")
    vocab = model_vocab_size(cfg, allow_vlm=True)
    images = image_check(run, cfg)
    with run.lock("rollout") as lock:
        _ack_previous(run, client, buffer_id)
        rid = resolve_rollout_id(run, rollout_id, force)
        batch = _wait_for_groups(client, cfg.rollout.batch_size, wait_timeout, poll_s, lock)
        lease = batch["lease"]
        groups = [g["group_index"] for g in batch["data"]["meta_info"]["groups"]]
        try:
            samples = _checked(batch["data"]["data"], vocab, cfg.rollout.reward_key, images)
            lock.check()
            result = publish_samples(run, cfg, samples, rid, {"source": "buffer", "buffer": {
                "url": client.url, "buffer_id": buffer_id, "lease": lease, "groups": groups}}, "rollout-buffer", force)
        except BaseException:
            _release(client, lease)
            raise
        try:
            client.request("POST", "/ack", {"lease": lease})
        except RolloutBufferError as exc:
            if exc.status is not None:
                raise RolloutBufferError(f"rollouts/{rid:06d} is published, but the buffer refused to acknowledge its lease: "
                                  f"{exc}") from None
            log.warning("rollouts/%06d is published but the buffer did not answer the acknowledgement (%s); the next "
                        "`slimectl rollout --source buffer` acknowledges it", rid, exc)
    log.info("rollout %d: %d groups, %d samples from the rollout buffer at %s", rid, len(groups), len(samples), client.url)
    return result


def _ack_previous(run: RunDir, client: BufferClient, buffer_id: str) -> None:
    """Acknowledge the lease of the newest rollout published from this buffer (step 1 of the module docstring)."""
    for rid in reversed(run.rollouts.ids()):
        meta = run.rollouts.get(rid, verify="none").meta
        if meta.get("source") != "buffer":
            continue
        recorded = meta.get("buffer") or {}
        if recorded.get("buffer_id") != buffer_id:
            return
        try:
            client.request("POST", "/ack", {"lease": recorded.get("lease")})
        except RolloutBufferError as exc:
            if exc.status is None:
                raise
            log.warning("rollouts/%06d: the buffer refused the late acknowledgement of its lease (%s); its groups may "
                        "have been handed out again", rid, exc)
        return


def _wait_for_groups(client: BufferClient, size: int, wait_timeout: float | None, poll_s: float, lock) -> dict[str, Any]:
    deadline = None if wait_timeout is None else time.monotonic() + wait_timeout
    announced = False
    while True:
        lock.check()
        out = client.request("POST", "/get_rollout_data", {"size": size, "min": size})
        if out.get("success"):
            return out
        available = out.get("data", {}).get("meta_info", {}).get("available_groups", 0)
        if deadline is not None and time.monotonic() >= deadline:
            raise RolloutBufferError(f"the rollout buffer at {client.url} had {available} of the {size} complete groups a rollout "
                              f"needs (rollout.batch_size) after {wait_timeout:g} s; are its producers writing?")
        if not announced:
            log.info("waiting for %d complete groups in the rollout buffer at %s (%d now)", size, client.url, available)
            announced = True
        time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))


def _checked(items: list[Any], vocab_size: int | None, reward_key: str | None, images: ImageCheck) -> list[Sample]:
    samples = []
    for i, d in enumerate(items):
        where = f"buffer sample {i} (group {d.get('group_index') if isinstance(d, dict) else '?'})"
        try:
            s = parse_sample(where, d)
            check_sample(where, s, vocab_size, reward_key)
            images(where, s)
        except SlimectlError as exc:
            raise type(exc)(f"{exc}; serve the buffer with -r RUN (or --vocab-size/--reward-key) so that it refuses "
                            f"such trajectories when they are written") from None
        samples.append(s)
    return samples


def _release(client: BufferClient, lease: str) -> None:
    try:
        client.request("POST", "/release", {"lease": lease})
    except RolloutBufferError as exc:
        log.warning("could not release lease %s (%s); its groups come back when it expires", lease, exc)
