"""The rollout buffer service: real `slimectl rollout buffer serve` processes over real HTTP,
collected into real run directories (`slimectl rollout --source buffer URL`)."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from slimectl.contract.samples import SAMPLES_FILE, read_samples

N = 4  # the run_dir fixture's rollout.n_samples_per_prompt


class Buffer:
    """A `slimectl rollout buffer serve` subprocess and plain-HTTP calls to it."""

    def __init__(self, directory, *args: str, token: str | None = None):
        self.dir = directory
        self.token = token
        env = {**os.environ, "SLIMECTL_BUFFER_TOKEN": token or ""}
        self.proc = subprocess.Popen([sys.executable, "-m", "slimectl", "rollout", "buffer", "serve", "--dir", str(directory),
                                      "--port", "0", "--n-samples-per-prompt", str(N), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        self.url = self.proc.stdout.readline().strip() if ready else ""
        assert self.url.startswith("http://127.0.0.1:"), self.proc.stderr.read() if self.proc.poll() is not None else "no URL"

    def call(self, method: str, path: str, body=None, token: str | None = "default", raw: bytes | None = None):
        """(HTTP status, JSON answer)."""
        token = self.token if token == "default" else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def ok(self, method: str, path: str, body=None):
        status, out = self.call(method, path, body)
        assert status == 200, (status, out)
        return out

    def task(self, samples: list[dict], finish: bool = False) -> tuple[str, int]:
        """Start a task, write ``samples`` (one request each) and return (task id, group index)."""
        t = self.ok("POST", "/tasks", {"metadata": {"instance_id": f"inst-{len(samples)}"}})
        for s in samples:
            self.ok("POST", f"/tasks/{t['task_id']}/trajectories", s)
        if finish:
            self.ok("POST", f"/tasks/{t['task_id']}/finish")
        return t["task_id"], t["group_index"]

    def stats(self) -> dict:
        return self.ok("GET", "/stats")

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture
def serve(tmp_path):
    started: list[Buffer] = []

    def start(*args: str, directory=None, token: str | None = None) -> Buffer:
        b = Buffer(directory or tmp_path / "buffer", *args, token=token)
        started.append(b)
        return b

    yield start
    for b in started:
        b.stop()


@pytest.fixture(scope="module")
def tiny_model_config(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model

    return build_tiny_model("qwen2", tmp_path_factory.mktemp("buffer") / "model", seed=3) / "config.json"


@pytest.fixture
def fake_model(fake_model, tiny_model_config):
    """conftest's model directory with a real (tiny qwen2, 512 ids) config.json, so token ids are checked."""
    shutil.copy(tiny_model_config, fake_model / "config.json")
    return fake_model


def traj(i: int, reward: float, group: int | None = None, **kw) -> dict:
    d = {"index": i, "tokens": [11, 12, 13, 100 + i, 200 + i, 300 + i % 7], "response_length": 3, "reward": reward,
         "rollout_log_probs": [-0.5, -1.25, -0.125 * (i % 5)], "loss_mask": [1, 0, 1], "metadata": {"turn": i}}
    if group is not None:
        d["group_index"] = group
    d.update(kw)
    return d


def test_concurrent_producers_then_collect_publishes_their_tokens_and_rewards(serve, run_dir):
    from slimectl.stages.rollout.buffer_source import collect_rollout

    buf = serve()
    written = {}

    def producer(p: int) -> None:
        samples = [traj(10 * p + j, float((p + j) % 2)) for j in range(N)]
        _, g = buf.task(samples)
        written[g] = samples

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(producer, range(6)))
    stats = buf.stats()
    assert stats["trajectories"]["received"] == 24 and stats["groups"] == {
        "pending": 0, "ready": 6, "leased": 0, "acked": 0, "dropped_empty": 0}
    assert sorted(written) == list(range(6))

    cfg = run_dir.stage_config("rollout", ["rollout.batch_size=6"])
    result = collect_rollout(run_dir, cfg, buf.url)
    art = run_dir.rollouts.get(result.rollout_id, verify="full")
    assert result.rollout_id == 0 and art.meta["source"] == "buffer" and art.meta["num_groups"] == 6
    assert art.meta["buffer"]["buffer_id"] == stats["buffer_id"] and sorted(art.meta["buffer"]["groups"]) == list(range(6))
    published = read_samples(art.file(SAMPLES_FILE))
    assert len(published) == 24
    for s in published:
        want = next(w for w in written[s.group_index] if w["index"] == s.index)
        assert s.tokens == want["tokens"] and s.reward == want["reward"] and s.loss_mask == want["loss_mask"]
        assert s.rollout_log_probs == pytest.approx(want["rollout_log_probs"]) and s.metadata == want["metadata"]
        assert s.rollout_id == 0 and s.status.value == "completed"
    after = buf.stats()
    assert after["groups"]["acked"] == 6 and after["groups"]["ready"] == 0 and after["leases"]["acked"] == 1
    assert after["trajectories"]["buffered"] == 0


MALFORMED = [
    (traj(0, 1.0, group=0, tokens=[1, 2, 999999, 4, 5, 6]), "token id 999999 is outside the model's vocabulary"),
    (traj(0, 1.0, group=0, loss_mask=[1, 1]), "loss_mask has 2 entries for 3 response tokens"),
    (traj(0, None, group=0), "no usable reward"),
    (traj(0, 1.0), "group_index is missing"),
    (traj(0, 1.0, group=0, colour="red"), "unknown Sample fields: ['colour']"),
    (traj(0, 1.0, group=0, response_length="3"), "response_length must be an integer"),
    (traj(0, 1.0, group=0, rollout_log_probs=[-1, "x", -1]), "rollout_log_probs must be a list of finite numbers"),
    ({"trajectories": [traj(0, 1.0, group=0), "not a sample"]}, "trajectory 1: expected a JSON object"),
]


def test_malformed_trajectories_get_400_are_counted_and_never_stored(serve):
    """Each malformed body (and a body that is not JSON after it) on one service: a one-line 400,
    counted by reason, nothing stored."""
    buf = serve("--vocab-size", "512")
    for n, (body, message) in enumerate(MALFORMED, 1):
        status, out = buf.call("POST", "/buffer/write", body)
        assert status == 400 and message in out["message"] and "\n" not in out["message"], (message, out)
        status, out = buf.call("POST", "/buffer/write", raw=b'{"tokens": [1,')
        assert status == 400 and "not valid JSON" in out["message"]
        stats = buf.stats()
        assert stats["rejected"]["by_reason"] == {"invalid_json": n, "invalid_trajectory": n}, message
        assert stats["trajectories"]["received"] == 0 and stats["groups"]["pending"] == 0, message


def test_oversized_bodies_and_overfull_or_duplicate_groups_are_refused(serve):
    buf = serve("--max-body-mb", "0.01")
    status, out = buf.call("POST", "/buffer/write", {"trajectories": [traj(i, 1.0, group=0) for i in range(200)]})
    assert status == 413 and "larger than the buffer's limit" in out["message"]
    buf.ok("POST", "/buffer/write", [traj(0, 1.0, group=0), traj(1, 0.0, group=0)])
    status, out = buf.call("POST", "/buffer/write", traj(1, 0.0, group=0))
    assert status == 409 and "already has a sample with index 1" in out["message"]
    status, out = buf.call("POST", "/buffer/write", [traj(i, 0.0, group=0) for i in range(2, 5)])
    assert status == 409 and "would hold 5 samples" in out["message"]
    stats = buf.stats()
    assert stats["rejected"]["by_reason"] == {"duplicate_trajectory": 1, "group_full": 1, "too_large": 1}
    assert stats["trajectories"]["received"] == 2


def test_partial_groups_are_not_handed_out_unless_asked(serve):
    buf = serve()
    task_a, a = buf.task([traj(i, 1.0) for i in range(3)])
    task_b, b = buf.task([traj(i, 0.0) for i in range(2)])
    out = buf.ok("GET", "/batch?size=5")
    assert out["success"] is False and out["lease"] is None and out["data"]["data"] == []
    partial = buf.ok("GET", "/batch?size=1&partial=true")  # asked for: the oldest unfinished group
    assert partial["success"] and partial["data"]["meta_info"]["groups"][0]["complete"] is False
    leased = partial["data"]["meta_info"]["groups"][0]["group_index"]
    status, out = buf.call("POST", f"/tasks/{task_a if leased == a else task_b}/trajectories", traj(7, 1.0))
    assert status == 409 and "leased" in out["message"]
    buf.ok("POST", "/release", {"lease": partial["lease"]})
    buf.ok("POST", f"/tasks/{task_a}/trajectories", traj(3, 1.0))  # a is complete now
    buf.ok("POST", f"/tasks/{task_b}/finish")  # b is ready with the 2 samples it has
    out = buf.ok("POST", "/get_rollout_data", {"size": 5})
    groups = {g["group_index"]: g["num_samples"] for g in out["data"]["meta_info"]["groups"]}
    assert groups == {a: 4, b: 2} and len(out["data"]["data"]) == 6
    status, out = buf.call("POST", f"/tasks/{task_b}/trajectories", traj(5, 1.0))
    assert status == 409


def test_unacked_lease_expires_and_acked_groups_never_come_back(serve):
    buf = serve("--lease-timeout", "1")
    _, a = buf.task([traj(i, 1.0) for i in range(N)])
    _, b = buf.task([traj(i, 0.0) for i in range(N)])
    first = buf.ok("GET", "/batch?size=1")
    second = buf.ok("GET", "/batch?size=1")
    assert [first["data"]["meta_info"]["groups"][0]["group_index"], second["data"]["meta_info"]["groups"][0]["group_index"]] == [a, b]
    assert buf.ok("GET", "/batch?size=1")["success"] is False
    assert buf.ok("POST", "/ack", {"lease": second["lease"]})["groups"] == [b]
    time.sleep(1.3)
    again = buf.ok("GET", "/batch?size=5")  # the un-acked lease expired: a is back, b is not
    assert [g["group_index"] for g in again["data"]["meta_info"]["groups"]] == [a]
    assert again["data"]["data"] == first["data"]["data"]
    status, out = buf.call("POST", "/ack", {"lease": first["lease"]})  # too late: a was handed out again
    assert status == 409 and "handed out again" in out["message"]
    buf.ok("POST", "/ack", {"lease": again["lease"]})
    assert buf.ok("POST", "/ack", {"lease": again["lease"]})["message"] == "already acknowledged"
    time.sleep(1.3)
    assert buf.ok("GET", "/batch?size=5&partial=1")["success"] is False
    status, out = buf.call("POST", "/buffer/write", traj(9, 1.0, group=a))
    assert status == 409 and "acknowledged" in out["message"]
    stats = buf.stats()
    assert stats["groups"]["acked"] == 2 and stats["leases"]["expired"] == 1 and stats["leases"]["open"] == 0
    assert buf.call("POST", "/ack", {"lease": "nope"})[0] == 404


def test_restart_after_kill_keeps_tasks_groups_and_leases(serve):
    buf = serve()
    _, full0 = buf.task([traj(i, 1.0) for i in range(N)])
    _, full1 = buf.task([traj(i, 0.5) for i in range(N)])
    pending_task, pending = buf.task([traj(i, 0.0) for i in range(2)])
    lease = buf.ok("GET", "/batch?size=1")
    before = buf.stats()
    assert before["groups"] == {"pending": 1, "ready": 1, "leased": 1, "acked": 0, "dropped_empty": 0}
    second = subprocess.run([sys.executable, "-m", "slimectl", "rollout", "buffer", "serve", "--dir", str(buf.dir),
                             "--port", "0", "--n-samples-per-prompt", str(N)], capture_output=True, text=True, timeout=60)
    assert second.returncode == 1 and "in use by another rollout buffer service" in second.stderr
    buf.stop(signal.SIGKILL)
    with open(buf.dir / "journal.jsonl", "ab") as f:
        f.write(b'{"op":"write","t":1,"samp')  # a record torn by the crash

    again = serve(directory=buf.dir)
    after = again.stats()
    for key in ("buffer_id", "groups", "tasks", "trajectories", "leases"):
        assert after[key] == before[key], key
    again.ok("POST", "/ack", {"lease": lease["lease"]})
    again.ok("POST", f"/tasks/{pending_task}/trajectories", [traj(2, 1.0), traj(3, 1.0)])
    out = again.ok("GET", "/batch?size=5")
    assert sorted(g["group_index"] for g in out["data"]["meta_info"]["groups"]) == sorted({full0, full1, pending} - {
        lease["data"]["meta_info"]["groups"][0]["group_index"]})
    journal = (buf.dir / "journal.jsonl").read_bytes()
    assert journal.endswith(b"\n") and b'"samp\n' not in journal  # rewritten at start without the torn record
    status, out = again.call("GET", "/batch", token=None)
    assert status == 200  # no token configured: open


def test_token_is_required_everywhere_but_health_and_stats(serve, run_dir, cli):
    buf = serve(token="s3cret")
    assert buf.call("POST", "/tasks", {}, token=None)[0] == 401
    assert buf.call("POST", "/tasks", {}, token="wrong")[0] == 401
    assert buf.call("GET", "/batch?size=1", token="wrong")[0] == 401
    assert buf.call("POST", "/ack", {"lease": "x"}, token=None)[0] == 401
    assert buf.call("GET", "/health", token=None)[0] == 200
    status, stats = buf.call("GET", "/stats", token=None)
    assert status == 200 and stats["rejected"]["by_reason"] == {"unauthorized": 4} and stats["tasks"]["started"] == 0
    buf.task([traj(i, 1.0) for i in range(N)])
    res = cli("rollout", "-r", run_dir.path, "--source", "buffer", buf.url, "--set", "rollout.batch_size=1",
              env={"SLIMECTL_BUFFER_TOKEN": "wrong"})
    assert res.exit_code == 1 and "HTTP 401" in res.output and run_dir.rollouts.ids() == []
    res = cli("rollout", "-r", run_dir.path, "--source", "buffer", buf.url, "--set", "rollout.batch_size=1",
              env={"SLIMECTL_BUFFER_TOKEN": "s3cret"})
    assert res.exit_code == 0, res.output
    assert run_dir.rollouts.ids() == [0]


def test_cli_collects_each_group_exactly_once_even_when_the_ack_was_lost(serve, run_dir, cli):
    from slimectl.stages.rollout.buffer_source import BufferClient
    from slimectl.contract.sample_checks import parse_sample
    from slimectl.stages.rollout.importer import publish_samples

    buf = serve("--lease-timeout", "2")
    groups = [buf.task([traj(10 * k + i, float(i % 2)) for i in range(N)])[1] for k in range(4)]
    res = cli("rollout", "-r", run_dir.path, "--source", "buffer", buf.url, "--set", "rollout.batch_size=2")
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == str(run_dir.rollouts.dir_for(0))
    first = set(run_dir.rollouts.get(0).meta["buffer"]["groups"])
    assert first == set(groups[:2]) and buf.stats()["groups"]["acked"] == 2

    # A collector that died after publishing rollout 1 but before acknowledging its lease:
    batch = BufferClient(buf.url).request("POST", "/get_rollout_data", {"size": 2, "min": 2})
    cfg = run_dir.stage_config("rollout")
    with run_dir.lock("rollout"):
        publish_samples(run_dir, cfg, [parse_sample("x", d) for d in batch["data"]["data"]], 1,
                        {"source": "buffer", "buffer": {"url": buf.url, "buffer_id": buf.stats()["buffer_id"],
                                                        "lease": batch["lease"], "groups": groups[2:]}}, "rollout-buffer")
    time.sleep(2.3)  # its lease expired: without the repair, groups[2:] would be handed out again
    assert buf.stats()["groups"]["ready"] == 2
    groups += [buf.task([traj(i, 1.0) for i in range(N)])[1] for _ in range(2)]
    res = cli("rollout", "-r", run_dir.path, "--source", "buffer", buf.url, "--set", "rollout.batch_size=2")
    assert res.exit_code == 0, res.output
    assert set(run_dir.rollouts.get(2).meta["buffer"]["groups"]) == set(groups[4:])
    published = [s.group_index for rid in (0, 1, 2) for s in read_samples(run_dir.rollouts.get(rid).file(SAMPLES_FILE))]
    assert sorted(set(published)) == sorted(groups) and len(published) == 6 * N  # every group once
    stats = buf.stats()
    assert stats["groups"]["acked"] == 6 and stats["groups"]["ready"] == 0 and stats["leases"]["open"] == 0

    # Not enough groups: a clear error after --wait-timeout, nothing leased or published.
    res = cli("rollout", "-r", run_dir.path, "--source", "buffer", buf.url, "--wait-timeout", "0.3")
    assert res.exit_code == 1 and "had 0 of the 8 complete groups" in res.output
    assert run_dir.rollouts.ids() == [0, 1, 2] and buf.stats()["leases"]["open"] == 0


def test_cli_usage_errors(run_dir, cli):
    res = cli("rollout", "-r", run_dir.path, "--source", "buffer")
    assert res.exit_code == 2 and "needs the buffer's URL" in res.output
    res = cli("rollout", "-r", run_dir.path, "--source", "buffer", "http://127.0.0.1:9", "--engine-url", "http://x")
    assert res.exit_code == 2 and "--source buffer uses neither" in res.output
    res = cli("rollout", "-r", run_dir.path, "--wait-timeout", "3")
    assert res.exit_code == 2 and "go with --source buffer" in res.output
    res = cli("rollout", "-r", run_dir.path, "--source", "buffer", "http://127.0.0.1:9")
    assert res.exit_code == 1 and "cannot reach the rollout buffer at http://127.0.0.1:9" in res.output
    res = cli("rollout", "buffer", "serve", "--dir", run_dir.path / "b")
    assert res.exit_code == 2 and "--n-samples-per-prompt" in res.output
