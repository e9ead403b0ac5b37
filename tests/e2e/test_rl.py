"""slimectl rl: the whole loop on the embedded engine and real Megatron (gloo) with eval and pass@k,
one step off with a distributed sync, resume after kill -9 and SIGTERM, the same artifacts by hand,
on-policy distillation from a served teacher."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from slimectl.stages.rollout.eval import pass_at_k
from slimectl.contract.rundir import RunDir
from tests.helpers import (ARITH, ENV, assert_trained_once, engine_pids, post, read_jsonl, slimectl_in_process, start_engine,
                           start_serve, wait_healthy, write_config)


def test_rl_synchronous_loop_end_to_end_and_evaluates_with_pass_at_k(tmp_path, clean_rl_run):
    """One synchronous run of 3 rollouts (engines offloaded while training) that also evaluates every
    2 rollouts and at the end (pass@1 and pass@4 on 3 eval prompts); the rerun has nothing to do.
    Offloading changes no sample: rollouts 0-1 equal those of the same config run without it."""
    cfg = write_config(tmp_path, engine={"offload_during_train": True},
                       rollout={"eval_interval": 2, "eval_n_samples": 4, "eval_pass_k": [1, 4]},
                       data={"eval_data": {"arith": f"{ARITH}@[0:3]"}})
    res = slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / "run", "--tiny-model", "qwen2")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "trained rollouts 0-2; weight version 3" in res.stdout
    run = RunDir.open(tmp_path / "run")
    assert_trained_once(run, 3)
    rl = read_jsonl(run.metrics_path("rl"))
    assert [r["step"] for r in rl] == [0, 1, 2] and all(r["rl/staleness"] == 0 for r in rl)
    assert all(r["perf/rl_step_time"] >= r["perf/rl_train_time"] > 0 for r in rl)
    assert [r["step"] for r in read_jsonl(run.metrics_path("sync"))] == [0, 1, 2, 3]
    # rollout N was generated on weight version N, and the engine ended on version 3
    assert [run.rollouts.get(i).meta["weight_version"] for i in range(3)] == ["0", "1", "2"]
    assert run.engines.list() == [] and engine_pids(run) == []
    logs = {p.stem: p.read_text() for p in (run.path / "logs").glob("*.log")}  # every stage's own log
    assert {"init", "rl", "rollout", "train", "sync"} <= set(logs)
    assert "rl 3/3: reward" in logs["rl"] and "step 3 (rollout 2)" in logs["rl"]  # the loop's log has everything
    assert "step 3 (rollout 2)" in logs["train"] and "rollout 2: reward" not in logs["train"]
    assert "rollout 2: reward" in logs["rollout"] and " D " in logs["rl"]  # DEBUG lines, though stderr is at INFO
    # the engine really freed its weights and KV cache for each training, and generated again only once
    # the sync had loaded a full set of weights into the reallocated parameters
    assert logs["engine-0"].count("Released memory occupation (tags kv_cache,weights)") == 3, logs["engine-0"][-3000:]
    assert logs["engine-0"].count("weights loaded after resume") == 3
    from slimectl.contract.samples import SAMPLES_FILE, read_samples

    clean, _ = clean_rl_run  # the same config without offload (2 rollouts, no eval): the same samples
    for rid in range(2):
        sa, sb = (read_samples(r.rollouts.get(rid).file(SAMPLES_FILE)) for r in (run, clean))
        assert [(x.tokens, x.reward) for x in sa] == [(x.tokens, x.reward) for x in sb], rid
        assert [x.rollout_log_probs for x in sa] == [pytest.approx(x.rollout_log_probs, abs=1e-5) for x in sb], rid
    # eval at every eval_interval-th weight version and after the last rollout (3 is no multiple of 2)
    assert run.evals.ids() == [2, 3]
    results = json.loads(run.evals.get(3).file("results.json").read_text())
    m = results["arith"]
    assert m["num_prompts"] == 3 and 0 <= m["pass@1"] <= m["pass@4"] <= 1
    assert abs(m["pass@1"] - m["reward_mean"]) < 1e-9 or m["reward_mean"] < 0  # random reward is 0/1: pass@1 = mean
    recs = read_jsonl(run.metrics_path("eval"))
    assert [r["step"] for r in recs] == [2, 3] and "eval/arith/pass@4" in recs[-1]
    again = slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / "run")
    assert again.returncode == 0 and "nothing to do" in again.stderr and "trained rollouts none;" in again.stdout


def test_rl_one_step_off_async_with_distributed_sync(tmp_path):
    cfg = write_config(tmp_path, rollout={"async_mode": "one_step_off", "num_rollout": 4},
                       sync={"transport": "distributed", "verify": True, "bucket_size_mb": 1})
    res = slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / "run", "--tiny-model", "qwen2")
    assert res.returncode == 0, res.stderr[-3000:]
    run = RunDir.open(tmp_path / "run")
    assert_trained_once(run, 4)
    assert [r["rl/staleness"] for r in read_jsonl(run.metrics_path("rl"))] == [0, 1, 1, 1]
    assert [run.rollouts.get(i).meta["weight_version"] for i in range(4)] == ["0", "0", "1", "2"]
    from slimectl.contract.samples import SAMPLES_FILE, read_samples

    samples = read_samples(run.rollouts.get(3).file(SAMPLES_FILE))
    assert {v for s in samples for v in s.weight_versions} == {"2"}  # each sample records its weight version
    # rollouts run beside training: each stage log holds its own thread's lines only
    train_log, rollout_log = (run.path / "logs" / "train.log").read_text(), (run.path / "logs" / "rollout.log").read_text()
    assert "step 4 (rollout 3)" in train_log and "rollout 3: reward" not in train_log
    assert "rollout 3: reward" in rollout_log and "(rollout 2)" not in rollout_log


def _rl_until(cfg, path, marker: str, sig: int) -> tuple[subprocess.Popen, list[str]]:
    """`slimectl rl` as a subprocess, sent SIG right after MARKER appears on its stderr, waited for."""
    proc = subprocess.Popen([sys.executable, "-m", "slimectl", "rl", "-c", str(cfg), "-r", str(path),
                             "--tiny-model", "qwen2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    seen = []
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            seen.append(line)
            if marker in line:
                proc.send_signal(sig)
                break
        if sig != signal.SIGKILL:  # (after kill -9 an orphaned engine may hold the pipe open a while)
            seen.extend(proc.stderr)  # the rest, until the process closes it
        proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert any(marker in x for x in seen), "".join(seen)[-3000:]
    return proc, seen


@pytest.mark.slow
def test_kill_9_then_sigterm_each_rerun_resumes_and_trains_each_rollout_once(tmp_path):
    """One run of 3 rollouts, stopped twice: kill -9 right after a marker on stderr ("step 1 " = step
    done, publish and sync next; the deterministic kill points are tests/e2e/test_fault_injection.py's),
    the rerun resuming where it left off; then SIGTERM ("rl 2/3"), which stops every stage cleanly
    (exit 143 with the command that resumes it, options kept; no engine, no lock), checkpointing first
    what it trained since the last checkpoint (save_interval 3: none before the end). The last rerun
    finishes, every rollout trained once."""
    cfg = write_config(tmp_path, rollout={"num_rollout": 3}, train={"lr": 1e-3, "save_interval": 3})
    path = tmp_path / "run"
    proc, seen = _rl_until(cfg, path, "step 1 ", signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)[-3000:]
    run = RunDir.open(path)
    deadline = time.monotonic() + 20
    while engine_pids(run) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert engine_pids(run) == []  # the engine noticed its parent died
    proc, seen = _rl_until(cfg, path, "rl 2/3", signal.SIGTERM)
    assert any("resuming at rollout" in x for x in seen), "".join(seen)[-3000:]
    assert proc.returncode == 143, "".join(seen)[-3000:]  # 128 + SIGTERM
    assert f"interrupted; resume with: slimectl rl -c {cfg} -r {path} --tiny-model qwen2" in "".join(seen)
    assert run.engines.list() == [] and engine_pids(run) == []
    assert not list((run.path / "locks").glob("*.lock"))
    assert run.cursor("train").read().next == 2  # stopped after "rl 2/3", before the end
    assert run.checkpoints.ids()[-1] == 2  # what it trained since the last checkpoint is not lost
    res = slimectl_in_process("rl", "-c", cfg, "-r", path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming at rollout 2, 1 to go" in res.stderr, res.stderr[-3000:]
    assert_trained_once(run, 3)
    assert engine_pids(run) == []


def test_stages_by_hand_make_the_same_artifacts_as_rl(tmp_path, clean_rl_run):

    cfg = write_config(tmp_path, rollout={"num_rollout": 2})
    assert slimectl_in_process("init", tmp_path / "hand", "-c", cfg, "--tiny-model", "qwen2").returncode == 0
    hand = RunDir.open(tmp_path / "hand")
    proc, urls = start_serve(hand)
    try:
        for rid in range(2):
            for cmd in (("rollout", "--next"), ("train", "--id", str(rid)), ("sync",)):
                res = slimectl_in_process(cmd[0], "-r", hand.path, *cmd[1:])
                assert res.returncode == 0, (cmd, res.stderr[-2000:])
        assert {r.weight_version for r in hand.engines.list()} == {"2"}
        # rl attaches to the running serve's engines instead of starting its own
        res = slimectl_in_process("rl", "-r", hand.path, "--set", "rollout.num_rollout=3")
        assert res.returncode == 0, res.stderr[-2000:]
        assert "using 1 engine(s) of the running `slimectl serve`" in res.stderr
        assert hand.cursor("train").read().consumed == [0, 1, 2]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert_traces_agree_with_metrics(hand, rollouts=3)
    res = slimectl_in_process("trace", "-r", hand.path, "--out", tmp_path / "trace.json")
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "trace.json").read_text())
    names = {e["args"]["name"].split(" (")[0] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rollout", "train", "sync"} and all(e["dur"] >= 0 for e in doc["traceEvents"] if e["ph"] == "X")
    assert [line.split()[0] for line in res.stdout.splitlines()[1:4]] == ["rollout", "train", "sync"]  # by first span
    auto, auto_cfg = clean_rl_run  # `rl` from scratch on the same config (made once, shared read-only)
    assert auto_cfg.read_text() == cfg.read_text()
    for kind in ("rollouts", "checkpoints", "weights"):
        assert (auto.path / kind).is_dir() and (hand.path / kind).is_dir()
    from safetensors.torch import load_file

    from slimectl.contract.samples import SAMPLES_FILE, read_samples

    for rid in range(2):  # the same samples: tokens and rewards exactly, rollout log-probs to float32 noise
        sa, sh = (read_samples(r.rollouts.get(rid).file(SAMPLES_FILE)) for r in (auto, hand))
        assert [(x.tokens, x.reward) for x in sa] == [(x.tokens, x.reward) for x in sh], rid
        assert [x.rollout_log_probs for x in sa] == [pytest.approx(x.rollout_log_probs, abs=1e-5) for x in sh], rid
    # Every metric of every step both runs made agrees, timings aside: rewards exactly, the rest
    # within rel 1e-5 / abs 1e-6. Both paths sample with the same per-sample seeds and run the same
    # deterministic single-rank Megatron steps on identical samples (a resumed train is bit-exact,
    # tests/integration/test_train_stage.py); measured, the losses were equal and only the engine's
    # log-probs moved, by ~5e-7 (separately started engines), hence train_rollout_logprob_abs_diff by ~2e-8.
    timing = lambda k: k in ("time", "sync/time") or k.startswith("perf/") or k.endswith("_time")  # noqa: E731
    for stage, steps in (("rollout", [0, 1]), ("train", [1, 2]), ("sync", [1, 2])):  # rollouts 0-1, weights 1-2
        a = {r["step"]: r for r in read_jsonl(auto.metrics_path(stage))}
        h = {r["step"]: r for r in read_jsonl(hand.metrics_path(stage))}
        assert sorted(set(a) & set(h)) == steps, (stage, sorted(a), sorted(h))
        for step in steps:
            assert set(a[step]) == set(h[step]), (stage, step)
            rewards = {k: v for k, v in a[step].items() if "reward" in k}
            assert rewards == {k: h[step][k] for k in rewards}, (stage, step)
            for k, want in h[step].items():
                if not timing(k):
                    numeric = isinstance(want, (int, float)) and not isinstance(want, bool)
                    assert a[step][k] == (pytest.approx(want, rel=1e-5, abs=1e-6) if numeric else want), (stage, step, k)
    wa = load_file(str(auto.weights.get(2).file("model.safetensors")))
    wh = load_file(str(hand.weights.get(2).file("model.safetensors")))
    assert sorted(wa) == sorted(wh) and max(float((wa[k] - wh[k]).abs().max()) for k in wa) <= 1e-6


def assert_traces_agree_with_metrics(run: RunDir, rollouts: int) -> None:
    """RUN/traces as the stages wrote them: every rollout's groups generated and scored, every optimizer step
    of metrics/train.jsonl a `step` span, every sync of metrics/sync.jsonl a `sync` span as long as its
    `sync/time` (within 20 ms or 5 %) holding its pause, update and continue."""
    from slimectl.contract.trace import read_traces

    files = read_traces(run)
    assert all(f.malformed == 0 for f in files)
    spans = {f.path.stem: f.spans for f in files}
    assert set(spans) == {"rollout", "train", "sync"}
    from slimectl.contract.samples import SAMPLES_FILE, read_samples

    for rid in range(rollouts):
        groups = sorted({x.group_index for x in read_samples(run.rollouts.get(rid).file(SAMPLES_FILE))})
        mine = [s for s in spans["rollout"] if s.args.get("rollout") == rid]
        assert sorted(s.args["group"] for s in mine if s.name == "generate") == groups, rid
        assert sorted(s.args["group"] for s in mine if s.name == "reward") == groups, rid
        (whole,) = [s for s in mine if s.name == "rollout"]
        assert all(whole.start <= s.start <= s.end <= whole.end for s in mine if s.name in ("generate", "reward"))
        assert len([s for s in mine if s.name == "publish"]) == 1
    steps = [s.args["step"] for s in spans["train"] if s.name == "step"]
    assert steps == [r["step"] for r in read_jsonl(run.metrics_path("train"))]
    assert sorted(s.args["rollout"] for s in spans["train"] if s.name == "train_rollout") == list(range(rollouts))
    assert any(s.name == "save" and s.thread == "save_0" for s in spans["train"])  # the background writer
    syncs = sorted((s for s in spans["sync"] if s.name == "sync"), key=lambda s: s.start)
    recs = read_jsonl(run.metrics_path("sync"))
    assert [s.args["version"] for s in syncs] == [r["step"] for r in recs]
    for s, r in zip(syncs, recs):
        assert abs(s.seconds - r["sync/time"]) <= max(0.02, 0.05 * r["sync/time"]), (s, r)
        parts = [p for p in spans["sync"] if p.name in ("pause", "update", "continue") and p.pid == s.pid
                 and s.start <= p.start <= p.end <= s.end]
        assert sorted(p.name for p in parts) == ["continue", "pause", "update"], s
        assert all(p.args["version"] == s.args["version"] for p in parts)


def test_a_bf16_model_trains_checkpoints_and_resumes_bit_exactly(tmp_path):
    """model.dtype bf16 (what GPU runs use): every parameter is bf16 (the local spec's norms too, as Megatron-LM's
    Float16Module makes them), the checkpoint holds the optimizer's fp32 main copies and Adam state, and 2
    rollouts then a resume to 3 end on the weights of 3 in one go, bit for bit. (An fp32 norm among the bf16
    parameters broke every bf16 checkpoint.)"""
    from safetensors.torch import load_file

    cfg = write_config(tmp_path, model={"dtype": "bf16"}, train={"save_interval": 1})
    for name, first in (("straight", 3), ("resumed", 2)):
        res = slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / name, "--tiny-model", "qwen2",
                                  "--set", f"rollout.num_rollout={first}")
        assert res.returncode == 0, res.stderr[-3000:]
    res = slimectl_in_process("rl", "-r", tmp_path / "resumed", "--set", "rollout.num_rollout=3")
    assert res.returncode == 0, res.stderr[-3000:]
    runs = [RunDir.open(tmp_path / name) for name in ("straight", "resumed")]
    weights = [load_file(str(next(r.weights.get(3).path.glob("*.safetensors")))) for r in runs]
    assert weights[0] and all(t.dtype == torch.bfloat16 for t in weights[0].values())
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    first = load_file(str(next(runs[0].weights.get(2).path.glob("*.safetensors"))))
    assert any(not torch.equal(first[k], weights[0][k]) for k in first)  # training moved them
    for m in read_jsonl(runs[0].metrics_path("train")):
        assert m["train/train_rollout_logprob_abs_diff"] <= 0.05, m  # the bf16 trainer against the bf16 engine


def test_pass_at_k_hand_computed():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # C(3,3) / C(5,3)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_rl_refuses_bad_input(tmp_path):
    res = slimectl_in_process("rl")
    assert res.returncode == 2 and "pass --config" in res.stderr
    cfg = write_config(tmp_path, rollout={"async_mode": "two_step"})
    res = slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / "run", "--tiny-model", "qwen2")
    assert res.returncode == 2 and "rollout.async_mode" in res.stderr


def test_on_policy_distillation_takes_teacher_log_probs_and_shapes_advantages(tmp_path):
    """A second embedded engine (another tiny model) is the teacher; each sample carries the teacher's
    log-probs of its response tokens (checked against the teacher directly), and with zero task reward
    the policy loss of the first (on-policy) step is exactly the reverse-KL estimate:
    A_t = -(lp_s - lp_t). One rollout is all the checks read (tests/e2e/test_opd_demo.py serves the
    teacher with `slimectl serve` and trains for many)."""
    from slimectl.starter_models.tiny_models import build_tiny_model

    teacher_model = build_tiny_model("qwen2", tmp_path / "teacher-model", seed=3, initializer_range=0.2)
    proc, teacher_url = start_engine(teacher_model, tmp_path / "teacher.log")
    try:
        wait_healthy(teacher_url)
        cfg = write_config(tmp_path, rollout={"num_rollout": 1, "batch_size": 2, "max_response_len": 6,
                                              "reward": "tests.helpers:zero_reward", "teacher_urls": [teacher_url]},
                           algorithm={"use_opd": True, "opd_kl_coef": 1.0})
        res = slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / "run", "--tiny-model", "qwen2")
        assert res.returncode == 0, res.stderr[-3000:]
        run = RunDir.open(tmp_path / "run")
        from slimectl.contract.samples import SAMPLES_FILE, read_samples

        s = read_samples(run.rollouts.get(0).file(SAMPLES_FILE))[0]
        direct = post(teacher_url, "/generate", {"input_ids": s.tokens, "return_logprob": True, "logprob_start_len": 0,
                                                 "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}})
        want = [x[0] for x in direct["meta_info"]["input_token_logprobs"][-s.response_length:]]
        assert s.teacher_log_probs == pytest.approx(want, abs=1e-5)
    finally:
        proc.kill()
        proc.wait()
    roll, train = read_jsonl(run.metrics_path("rollout")), read_jsonl(run.metrics_path("train"))
    assert roll[0]["rollout/opd_reverse_kl"] > 0.1  # a different model: a clear gap to distil
    m = train[0]
    assert m["train/opd_reverse_kl"] == pytest.approx(roll[0]["rollout/opd_reverse_kl"], abs=1e-3)
    assert m["train/pg_loss"] == pytest.approx(m["train/opd_reverse_kl"], abs=1e-5)


def test_opd_without_teacher_log_probs_fails_clearly(tmp_path):
    cfg = write_config(tmp_path, rollout={"num_rollout": 1}, algorithm={"use_opd": True})
    res = slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / "run", "--tiny-model", "qwen2")
    assert res.returncode == 1 and "set rollout.teacher_urls" in res.stderr and "Traceback" not in res.stderr
