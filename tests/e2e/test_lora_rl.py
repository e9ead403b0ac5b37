"""LoRA end to end (train.lora): `slimectl rl` trains adapters on Megatron, publishes each weights/N as a PEFT
adapter the engines load over their base (disk and distributed sync), `export` writes the adapter or merges it;
the adapter in PEFT, the merged export and the engine after a sync give the same log-probs; kill -9 and rerun
ends on the same adapter, bit for bit; bad input is one line and exit 2."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

from slimectl.contract.rundir import RunDir
from tests.helpers import ENV, engine_pids, post, read_jsonl, slimectl_in_process, start_serve, write_config

pytestmark = pytest.mark.slow
LORA = {"rank": 4, "alpha": 8}
TOKENS = [3, 17, 42, 99, 5, 61, 7, 200, 11, 23]


def lora_config(tmp_path, **sections):
    train = {"lr": 1e-2, "lora": LORA, **sections.pop("train", {})}
    return write_config(tmp_path, rollout={"num_rollout": 2, **sections.pop("rollout", {})}, train=train, **sections)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """One LoRA `rl` (2 rollouts, disk sync) on the tiny qwen2; (run, config)."""
    tmp = tmp_path_factory.mktemp("lora_rl")
    cfg = lora_config(tmp, sync={"keep_weights": None})  # (weights/0 too: the initial adapter)
    res = slimectl_in_process("rl", "-c", cfg, "-r", tmp / "run", "--tiny-model", "qwen2")
    assert res.returncode == 0, res.stderr[-3000:]
    return RunDir.open(tmp / "run"), cfg


def peft_log_probs(base: str, adapter, tokens=TOKENS) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) under ``base`` with ``adapter`` (None: the base alone)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    ids = torch.tensor([tokens])
    with torch.no_grad():
        lp = torch.log_softmax(model.eval()(input_ids=ids).logits[0, :-1].float(), -1)
    return lp.gather(-1, ids[0, 1:, None])[:, 0]


def engine_log_probs(url: str, lora: str | None = "policy") -> torch.Tensor:
    body = {"input_ids": TOKENS, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0, **({"lora_path": lora} if lora else {})}
    out = post(url, "/generate", body)
    return torch.tensor([float(x[0]) for x in out["meta_info"]["input_token_logprobs"][1:]])


def test_weights_are_peft_adapters_and_only_adapters_are_checkpointed(lora_run):
    run, _ = lora_run
    base = run.config().model.path
    assert run.weights.ids() == [0, 1, 2]
    for v in (0, 1, 2):
        art = run.weights.get(v, verify="full")  # checksummed like any artifact
        assert sorted(art.files) == ["adapter_config.json", "adapter_model.safetensors"]
        assert art.meta["format"] == "peft_lora"
    conf = json.loads((run.weights.get(2).path / "adapter_config.json").read_text())
    assert (conf["r"], conf["lora_alpha"], conf["base_model_name_or_path"]) == (4, 8, base)
    # weights/0 changes nothing; training moved the policy
    base_lp = peft_log_probs(base, None)
    assert float((peft_log_probs(base, run.weights.get(0).path) - base_lp).abs().max()) == 0.0
    assert float((peft_log_probs(base, run.weights.get(2).path) - base_lp).abs().max()) > 1e-3
    # the checkpoint holds adapters and their Adam moments, no base weight
    from torch.distributed.checkpoint import FileSystemReader

    state = next(run.checkpoints.get(2).path.glob("*/.metadata")).parent
    keys = list(FileSystemReader(str(state)).read_metadata().state_dict_metadata)
    assert keys and all("lora_" in k for k in keys if "layers" in k) and not any("linear_qkv" in k for k in keys)
    # the engines sampled from the adapters: the trainer's log-probs of each rollout equal the engine's
    for m in read_jsonl(run.metrics_path("train")):
        assert m["train/train_rollout_logprob_abs_diff"] <= 1e-4, m


def test_export_writes_the_adapter_and_merge_gives_its_logits(lora_run, tmp_path):
    run, _ = lora_run
    from safetensors.torch import load_file

    res = slimectl_in_process("export", "-r", run.path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = run.path / "exports" / "000002"
    got, want = (load_file(str(d / "adapter_model.safetensors")) for d in (out, run.weights.get(2).path))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    merged = tmp_path / "merged"
    res = slimectl_in_process("export", "-r", run.path, "--merge", "--out", merged)
    assert res.returncode == 0, res.stderr[-3000:]
    base = run.config().model.path
    diff = (peft_log_probs(str(merged), None) - peft_log_probs(base, run.weights.get(2).path)).abs().max()
    assert float(diff) <= 1e-5
    res = slimectl_in_process("export", "--checkpoint", run.path / "checkpoints" / "000000", "--merge",
                              "--out", tmp_path / "x") if run.checkpoints.exists(0) else None
    if res is not None:  # (a converted checkpoint 0 holds full weights)
        assert res.returncode == 2 and "holds full weights" in res.stderr


def test_the_engine_serves_each_synced_adapter_with_peft_log_probs(lora_run, tmp_path):
    run, _ = lora_run
    base = run.config().model.path
    proc, (url,) = start_serve(run)
    try:
        lp = engine_log_probs(url)  # serve loaded the newest adapter, weights/2
        assert float((lp - peft_log_probs(base, run.weights.get(2).path)).abs().max()) <= 1e-5
        for v in (1, 0):
            res = slimectl_in_process("sync", "-r", run.path, "--version", str(v))
            assert res.returncode == 0, res.stderr[-3000:]
            lp = engine_log_probs(url)
            assert float((lp - peft_log_probs(base, run.weights.get(v).path)).abs().max()) <= 1e-5, v
        assert float((engine_log_probs(url, lora=None) - peft_log_probs(base, None)).abs().max()) <= 1e-5
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_distributed_sync_and_a_start_from_an_adapter(lora_run, tmp_path):
    """The same run with the distributed transport trains the same adapters (the engine received each over
    gloo: its samples' log-probs equal the trainer's); a run started from weights/2 (model.adapter_path)
    serves that adapter first."""
    run, _ = lora_run
    cfg = lora_config(tmp_path, sync={"transport": "distributed"})
    res = slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / "dist", "--tiny-model", "qwen2")
    assert res.returncode == 0, res.stderr[-3000:]
    dist = RunDir.open(tmp_path / "dist")
    for m in read_jsonl(dist.metrics_path("train")):
        assert m["train/train_rollout_logprob_abs_diff"] <= 1e-4, m
    assert dist.weights.get(2).files["adapter_model.safetensors"]["sha256"] == \
        run.weights.get(2).files["adapter_model.safetensors"]["sha256"]
    start = run.weights.get(2).path
    cfg = lora_config(tmp_path, model={"adapter_path": str(start)}, rollout={"num_rollout": 1})
    res = slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / "from", "--tiny-model", "qwen2")
    assert res.returncode == 0, res.stderr[-3000:]
    fr = RunDir.open(tmp_path / "from")
    assert fr.weights.get(0).files["adapter_model.safetensors"]["sha256"] == \
        run.weights.get(2).files["adapter_model.safetensors"]["sha256"]
    (m,) = read_jsonl(fr.metrics_path("train"))
    assert m["train/train_rollout_logprob_abs_diff"] <= 1e-4  # the trainer started from the same adapter


def test_kill_9_then_rerun_ends_on_the_same_adapter(lora_run, tmp_path, stage_forks):
    run, cfg = lora_run
    path = tmp_path / "run"
    for point in ("train.state_saved", "train.checkpoint_published"):
        err = tmp_path / f"{point}.err"
        rc = stage_forks.run(["rl", "-c", cfg, "-r", path, "--tiny-model", "qwen2"], tmp_path / f"{point}.out", err,
                             env={"SLIMECTL_FAULT": point}).wait(timeout=300)
        assert rc == -signal.SIGKILL and f"fault point {point} reached" in err.read_text(), err.read_text()[-2000:]
        deadline = time.monotonic() + 60
        while engine_pids(RunDir.open(path)) and time.monotonic() < deadline:
            time.sleep(0.2)
    res = slimectl_in_process("rl", "-c", cfg, "-r", path, "--tiny-model", "qwen2")
    assert res.returncode == 0, res.stderr[-3000:]
    again = RunDir.open(path)
    assert again.cursor("train").read().consumed == [0, 1]
    # the same adapter tensors, bit for bit (adapter_config.json names each run's own copy of the base)
    weights = "adapter_model.safetensors"
    assert again.weights.get(2, verify="full").files[weights] == run.weights.get(2, verify="full").files[weights]
    assert again.checkpoints.get(2).meta["next_rollout"] == 2


def _other_base_adapter(tmp_path):
    """A PEFT adapter trained on another base (hidden 32): what model.adapter_path must refuse."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from slimectl.starter_models.tiny_models import build_tiny_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other = build_tiny_model("qwen2", tmp_path / "other", seed=1, hidden_size=32, num_heads=4, num_kv_heads=2,
                                 intermediate_size=64)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(other)),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.save_pretrained(str(tmp_path / "adapter"))
    return tmp_path / "adapter"


@pytest.mark.parametrize("case", ["unknown_module", "rank_0", "other_base"])
def test_bad_lora_input_is_one_line_and_exit_2(tmp_path, case):
    sets = {"unknown_module": ["--set", "train.lora.target_modules=[q_proj,qkv]"],
            "rank_0": ["--set", "train.lora.rank=0"],
            "other_base": ["--set", f"model.adapter_path={_other_base_adapter(tmp_path)}"] if case == "other_base"
            else []}[case]
    cfg = lora_config(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "slimectl", "rl", "-c", str(cfg), "-r", str(tmp_path / "run"),
                           "--tiny-model", "qwen2", *sets], capture_output=True, text=True, env=ENV, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("Error")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert {"unknown_module": "unknown target module 'qkv'", "rank_0": "train.lora.rank",
            "other_base": "does not fit model.path"}[case] in lines[0]
    if (tmp_path / "run").exists():
        assert engine_pids(RunDir.open(tmp_path / "run")) == []


def test_engines_given_merged_weights(lora_run, tmp_path):
    """engine.lora_merged (what SGLang on CPU gets, tests/conformance): the engine serves the base, each sync
    gives it the base with the adapter merged in (disk: a merged model in .staging, removed after), rollouts ask
    for no adapter, and the trainer's log-probs still equal the engine's."""
    run, _ = lora_run
    for transport in ("disk", "distributed"):
        cfg = lora_config(tmp_path, engine={"lora_merged": True}, sync={"transport": transport})
        res = slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / transport, "--tiny-model", "qwen2")
        assert res.returncode == 0, res.stderr[-3000:]
        merged = RunDir.open(tmp_path / transport)
        for m in read_jsonl(merged.metrics_path("train")):
            assert m["train/train_rollout_logprob_abs_diff"] <= 1e-4, (transport, m)
        assert not list((merged.path / ".staging").glob("merged.*"))
        assert merged.weights.get(2).files["adapter_model.safetensors"]["sha256"] == \
            run.weights.get(2).files["adapter_model.safetensors"]["sha256"]


def test_lora_on_a_bf16_base_trains_checkpoints_and_resumes(tmp_path):
    """model.dtype bf16 (a bf16 base, as LoRA runs on GPUs): the adapters take the base's dtype, Megatron's
    optimizer keeps their fp32 main copies, and the checkpoint (adapters, fp32 main copies, Adam) saves and
    resumes — a LoRA run on a bf16 base once failed in its first matmul and then in its checkpoint."""
    from safetensors.torch import load_file

    cfg = lora_config(tmp_path, model={"dtype": "bf16"}, train={"save_interval": 1})
    res = slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / "run", "--tiny-model", "qwen2")
    assert res.returncode == 0, res.stderr[-3000:]
    run = RunDir.open(tmp_path / "run")
    adapter = load_file(str(run.weights.get(2).path / "adapter_model.safetensors"))
    assert adapter and all(t.dtype == torch.bfloat16 for t in adapter.values())
    assert max(float(t.float().abs().max()) for k, t in adapter.items() if "lora_B" in k) > 0  # B moved from 0
    for m in read_jsonl(run.metrics_path("train")):
        assert m["train/train_rollout_logprob_abs_diff"] <= 0.1, m  # bf16 trainer against a bf16 engine
    res = slimectl_in_process("rl", "-r", tmp_path / "run", "--set", "rollout.num_rollout=3")
    assert res.returncode == 0, res.stderr[-3000:]
    assert RunDir.open(tmp_path / "run").cursor("train").read().consumed == [0, 1, 2]
