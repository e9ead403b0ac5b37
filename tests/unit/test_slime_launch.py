"""slime launch scripts -> slimectl config (slimectl.stages.init.slime_launch), on scripts written in the
style of slime's scripts/run-*.sh (tests/data/slime_scripts)."""

from __future__ import annotations

import pytest

from slimectl.contract.config import build_config
from slimectl.contract.errors import ConfigError
from slimectl.contract.rundir import RunDir
from slimectl.stages.init.slime_launch import (SLIME_DEFAULTS, parse_launch_script, translate_slime_args,
                                               translate_slime_script)
from tests.helpers import ROOT

SCRIPTS = ROOT / "tests" / "data" / "slime_scripts"


def flags_of(tr, kind="unmapped"):
    return {flag for flag, _ in getattr(tr, kind)}


def test_colocated_grpo_script_behind_ray_job_submit():
    tr = translate_slime_script(SCRIPTS / "run-qwen3-4B-grpo.sh")
    d = tr.data
    assert d["model"]["path"] == "/root/Qwen3-4B"  # ${BASE} expanded inside an array
    assert d["data"] == {"apply_chat_template": True, "shuffle": True, "label_key": "label", "input_key": "prompt",
                         "prompt_data": "/root/dapo-math-17k/dapo-math-17k.jsonl",
                         "eval_data": {"aime": "/root/aime-2024/aime-2024.jsonl"}}
    r = d["rollout"]
    assert (r["num_rollout"], r["batch_size"], r["n_samples_per_prompt"], r["max_response_len"]) == (3000, 32, 8, 8192)
    assert (r["temperature"], r["reward"], r["eval_interval"], r["eval_n_samples"]) == (0.8, "deepscaler", 20, 16)
    a = d["algorithm"]
    assert (a["advantage_estimator"], a["use_kl_loss"], a["kl_loss_type"], a["eps_clip_high"]) == ("grpo", True, "low_var_kl", 0.28)
    t = d["train"]
    # 8 GPUs at TP 2 -> DP 4; the script's own optimizer flags win over Megatron's defaults
    assert (t["tp"], t["pp"], t["dp"], t["global_batch_size"], t["max_tokens_per_micro_batch"]) == (2, 1, 4, 256, 9216)
    assert (t["weight_decay"], t["adam_beta2"], t["lr_decay_style"], t["save_interval"]) == (0.1, 0.98, "constant", 20)
    e = d["engine"]
    assert (e["backend"], e["tp_size"], e["num_engines"], e["mem_fraction_static"], e["offload_during_train"]) == \
        ("sglang", 2, 4, 0.7, True)  # colocated: the 8 actor GPUs hold 4 engines of 2
    assert d["sync"]["transport"] == "disk"
    # commented-out flags are not read; the multi-line JSON string and `ray start` do not confuse the parser
    assert "--hf-checkpoint" not in flags_of(tr) and "--runtime-env-json" not in flags_of(tr)
    assert {"--load", "--save", "--ref-load", "--attention-backend"} <= flags_of(tr, "ignored")
    assert (t["recompute"], t["recompute_method"], t["recompute_num_layers"]) == ("full", "uniform", 1)
    assert any("models/qwen3-4B.sh was not found" in n for n in tr.notes)
    assert build_config(d)  # a valid slimectl config as it stands


def test_async_script_with_a_sourced_model_file_and_quoted_arrays():
    tr = translate_slime_script(SCRIPTS / "run-qwen2.5-1.5B-async.sh")
    d = tr.data
    assert d["rollout"]["async_mode"] == "one_step_off"  # train_async.py
    assert d["model"] == {"path": "/data/models/Qwen2.5-1.5B-Instruct", "dtype": "bf16"}
    assert d["data"]["eval_data"] == {"gsm8k": "/data/gsm8k/test.parquet", "math500": "/data/gsm8k/math500.jsonl@[0:200]"}
    assert (d["data"]["seed"], d["rollout"]["seed"], d["data"]["input_key"]) == (7, 7, "question")
    r = d["rollout"]
    assert r["reward"] == "my_rewards.gsm8k:reward_fn"  # slime's dotted path -> module:function
    assert r["dynamic_filter"] == "nonzero_std" and r["stop"] == ["</answer>", "Question:"]
    assert (r["over_sampling_batch_size"], r["partial_rollout"], r["concurrency_per_engine"]) == (96, True, 256)
    assert (d["algorithm"]["advantage_estimator"], d["algorithm"]["use_tis"]) == ("gspo", True)
    assert d["algorithm"]["kl_loss_type"] == SLIME_DEFAULTS["algorithm.kl_loss_type"] == "k1"  # slime's default
    t = d["train"]
    assert (t["pp"], t["dp"], t["lr_warmup_steps"], t["lr_decay_style"], t["seed"], t["use_rollout_logprobs"]) == \
        (2, 4, 10, "cosine", 3407, True)
    assert (t["adam_beta2"], t["weight_decay"]) == (0.999, 0.01)  # Megatron's defaults, not slimectl's
    assert d["engine"]["num_engines"] == 8 and d["engine"]["sglang_args"] == {"context-length": 4096,
                                                                               "enable-dp-attention": True}
    assert d["sync"] == {"transport": "distributed", "backend": "nccl", "bucket_size_mb": 1024}
    # MODEL_ARGS came from models/qwen2.5-1.5B.sh (sourced with `.`): read and dropped on purpose
    assert {"--num-layers", "--hidden-size", "--num-query-groups"} <= flags_of(tr, "ignored")
    assert "--router-policy" in flags_of(tr)
    assert build_config(d)


def test_inline_command_lists_what_it_cannot_map_with_the_reason():
    tr = translate_slime_script(SCRIPTS / "run-llama-reinforce.sh")
    why = dict(tr.unmapped)
    assert "ifbench" in why["--rm-type"] and "last_number" in why["--rm-type"]
    assert "rows // rollout.batch_size" in why["--num-epoch"]
    assert why["--some-flag-from-the-future"] == "no slimectl equivalent"
    assert "context" in why["--context-parallel-size"]  # CP 2 is not silently dropped
    a = tr.data["algorithm"]
    assert (a["advantage_estimator"], a["reward_normalization"], a["gamma"], a["kl_loss_type"]) == \
        ("reinforce_plus_plus", "none", 0.99, "k3")
    assert tr.data["model"]["path"] == "./Llama-3.2-1B-Instruct"
    assert "not mapped" in tr.report() and "--some-flag-from-the-future" in tr.report()


def test_slime_defaults_apply_when_the_script_does_not_set_them():
    tr = translate_slime_args(["--hf-checkpoint", "/m", "--rollout-batch-size", "4", "--rollout-max-response-len", "64"])
    d = tr.data
    assert (d["data"]["apply_chat_template"], d["data"]["shuffle"], d["rollout"]["n_samples_per_prompt"]) == (False, False, 1)
    assert d["algorithm"]["kl_loss_type"] == "k1" and d["train"]["adam_beta2"] == 0.999
    assert d["train"]["dp"] == 8 and d["sync"]["transport"] == "distributed"  # slime's default 8 GPUs, not colocated
    cfg = build_config(d)
    assert cfg.rollout.batch_size == 4


def test_grpo_std_normalisation_switch_and_flag_with_equals_sign():
    assert translate_slime_args(["--disable-grpo-std-normalization"]).data["algorithm"]["reward_normalization"] == "group_mean"
    both = translate_slime_args(["--disable-rewards-normalization", "--disable-grpo-std-normalization"])
    assert both.data["algorithm"]["reward_normalization"] == "none"
    assert translate_slime_args(["--lr=3e-6"]).data["train"]["lr"] == 3e-6


@pytest.mark.parametrize("argv,needle", [
    (["--rollout-batch-size", "many"], "--rollout-batch-size 'many': not a int"),
    (["--lr"], "--lr takes one value, got 0"),
    (["--eval-prompt-data", "aime"], "--eval-prompt-data takes NAME PATH pairs"),
])
def test_bad_values_name_the_flag(argv, needle):
    with pytest.raises(ConfigError, match="slime flag") as err:
        translate_slime_args(argv)
    assert needle in str(err.value)


def test_scripts_that_are_not_slime_launches_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse_launch_script(tmp_path / "nope.sh")
    other = tmp_path / "other.sh"
    other.write_text("#!/bin/bash\necho hello\npython3 serve.py --port 1\n")
    with pytest.raises(ConfigError, match=r"no `python3 train.py \.\.\.`"):
        parse_launch_script(other)
    binary = tmp_path / "bin.sh"
    binary.write_bytes(b"\xff\xfe\x00train.py")
    with pytest.raises(ConfigError, match="not UTF-8"):
        parse_launch_script(binary)


def test_unset_variables_are_reported_not_guessed(tmp_path):
    s = tmp_path / "run.sh"
    s.write_text('ARGS=(--hf-checkpoint $MODEL_DIR --num-rollout ${N:-12})\npython train.py "${ARGS[@]}"\n')
    argv, name, notes = parse_launch_script(s)
    assert argv == ["--hf-checkpoint", "$MODEL_DIR", "--num-rollout", "12"] and name == "train.py"
    assert any("MODEL_DIR" in n for n in notes)


def test_flags_slime_reads_only_with_another_are_dropped_with_the_reason():
    tr = translate_slime_args(["--custom-loss-function-path", "pkg.mod.loss", "--kl-coef", "0.05",
                               "--custom-tis-function-path", "pkg.mod.tis"])
    why = dict(tr.ignored)
    assert "--loss-type custom_loss" in why["--custom-loss-function-path"]
    assert "--use-tis" in why["--custom-tis-function-path"] and "grpo" in why["--kl-coef"]
    assert build_config(tr.data)  # the config slimectl would refuse is not produced
    kept = translate_slime_args(["--loss-type", "custom_loss", "--custom-loss-function-path", "pkg.mod.loss",
                                 "--advantage-estimator", "reinforce_plus_plus", "--kl-coef", "0.05", "--use-kl-loss"])
    a = kept.data["algorithm"]
    assert (a["custom_loss_function"], a["kl_coef"]) == ("pkg.mod:loss", 0.05)


def test_init_from_slime_freezes_the_translation_and_prints_what_it_left_out(cli, tmp_path, fake_model, monkeypatch):
    """`slimectl init RUN --from-slime LAUNCH.sh`: the slime user's first command."""
    import yaml

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"input": "1+1", "label": "2"}\n')
    script = tmp_path / "run.sh"
    script.write_text(
        "MODEL=./model\n"
        "ARGS=(\n  --hf-checkpoint $MODEL\n  --prompt-data ./train.jsonl --label-key label\n"
        "  --rollout-batch-size 2 --n-samples-per-prompt 4 --rollout-max-response-len 32 --num-rollout 6\n"
        "  --advantage-estimator reinforce_plus_plus_baseline --use-opsm --opsm-delta 1e-3\n"
        "  --router-policy round_robin\n)\n"
        "python3 train.py --actor-num-nodes 1 --actor-num-gpus-per-node 1 --colocate ${ARGS[@]}\n")
    res = cli("init", "--dry-run", "--from-slime", script)
    assert res.exit_code == 0, res.output
    assert "--router-policy" in res.stderr and "not mapped" in res.stderr
    cfg = yaml.safe_load(res.stdout)
    assert cfg["model"]["path"] == str(fake_model)  # ./model against the current directory, as bash would
    assert cfg["data"]["prompt_data"] == str(tmp_path / "train.jsonl")
    assert (cfg["rollout"]["batch_size"], cfg["rollout"]["n_samples_per_prompt"], cfg["rollout"]["num_rollout"]) == (2, 4, 6)
    assert (cfg["algorithm"]["use_opsm"], cfg["algorithm"]["opsm_delta"]) == (True, 1e-3)
    assert (cfg["train"]["dp"], cfg["engine"]["num_engines"], cfg["engine"]["offload_during_train"]) == (1, 1, True)
    res = cli("init", tmp_path / "run", "--from-slime", script, "--set", "engine.backend=embedded")
    assert res.exit_code == 0, res.output
    frozen = RunDir.open(tmp_path / "run").config()
    assert frozen.engine.backend == "embedded" and frozen.algorithm.advantage_estimator == "reinforce_plus_plus_baseline"
    res = cli("init", tmp_path / "other", "--from-slime", script, "--config", script)
    assert res.exit_code == 2 and "pass one of them" in res.output
    res = cli("init", tmp_path / "other", "--from-slime", tmp_path / "missing.sh")
    assert res.exit_code == 2 and "missing.sh does not exist" in res.output


def test_moe_flags_map_to_expert_parallelism_the_aux_loss_and_routing_replay():
    """slime's Qwen3-MoE scripts: --expert-model-parallel-size -> train.ep (it must divide the
    data-parallel ranks, as megatron-core requires), --moe-aux-loss-coeff, --use-rollout-routing-replay."""
    base = ["--hf-checkpoint", "/m", "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "8",
            "--moe-aux-loss-coeff", "1e-3", "--use-rollout-routing-replay"]
    tr = translate_slime_args(base + ["--expert-model-parallel-size", "4"])
    t = tr.data["train"]
    assert (t["tp"], t["dp"], t["ep"], t["moe_aux_loss_coeff"], t["use_rollout_routing_replay"]) == (2, 4, 4, 1e-3, True)
    assert not {"--expert-model-parallel-size", "--moe-aux-loss-coeff"} & flags_of(tr)
    cfg = build_config(tr.data)
    assert cfg.train.ep == 4 and cfg.rollout.return_routed_experts is False and cfg.train.use_rollout_routing_replay
    tr = translate_slime_args(base + ["--expert-model-parallel-size", "3"])  # 3 does not divide dp 4
    assert "ep" not in tr.data["train"] and "must divide the 4 data-parallel" in dict(tr.unmapped)["--expert-model-parallel-size"]
    tr = translate_slime_args(base + ["--expert-tensor-parallel-size", "2"])
    assert "expert TP = train.tp" in dict(tr.unmapped)["--expert-tensor-parallel-size"]


def test_the_report_names_each_flag_left_out_in_a_fixed_order_with_its_reason():
    """Flags that map one to one (or are dropped for one fixed reason) are reported first, in the
    script's order; flags with a rule of their own after them; the layout's problems last."""
    tr = translate_slime_args([
        "stray", "--load", "/ckpt", "--attention-backend", "flash", "--micro-batch-size", "1", "--offload-train",
        "--wandb-key", "k", "--tensorboard-dir", "/tb", "--num-layers", "2", "--eval-top-p", "0.9",
        "--rollout-function-path", "my.rollout.fn", "--data-source-path", "my.data.Source", "--use-slime-router",
        "--brand-new", "--save", "/s", "--rollout-function-path", "slime.rollout.sglang_rollout.generate_rollout",
        "--data-source-path", "slime.data.X", "--actor-num-gpus-per-node", "6", "--tensor-model-parallel-size", "4",
        "--rollout-num-gpus", "5", "--rollout-num-gpus-per-engine", "2"])
    perf = "Megatron/slime plumbing or performance setting that slimectl chooses itself"
    metrics = "metrics go to RUN/metrics and TensorBoard under RUN/tensorboard"
    assert tr.report().splitlines() == [
        "8 slime flag(s) not mapped:",
        "  stray: not a --flag; left out",
        "  --eval-top-p: slimectl has no rollout.eval_top_p yet",
        "  --rollout-function-path: custom rollout function my.rollout.fn: port it as rollout.custom_generate "
        "(one sample) or run it behind `slimectl harness`",
        "  --data-source-path: custom data source my.data.Source: slimectl reads data.prompt_data (jsonl/parquet) itself",
        "  --use-slime-router: slimectl's rollout balances requests over the engines itself (no router yet)",
        "  --brand-new: no slimectl equivalent",
        "  --actor-num-gpus-per-node: 6 trainer GPUs are not a multiple of TP x PP = 4; train.dp left at 1",
        "  --rollout-num-gpus: 5 GPUs do not split into engines of 2",
        "10 slime flag(s) not needed by slimectl:",
        f"  --attention-backend: {perf}",
        "  --micro-batch-size: slimectl packs micro-batches up to train.max_tokens_per_micro_batch tokens",
        "  --num-layers: model architecture: slimectl reads it from model.path's config.json",
        f"  --rollout-function-path: {perf}",  # slime's own rollout and data source: nothing to port
        f"  --data-source-path: {perf}",
        "  --load: slimectl resumes from RUN/checkpoints (rerun `slimectl rl -r RUN`); to start from a Megatron "
        "checkpoint, `slimectl export --checkpoint` it to HF first",
        "  --offload-train: the trainer runs in its own process; engine.offload_during_train frees the engine",
        f"  --wandb-key: {metrics}",
        f"  --tensorboard-dir: {metrics}",
        "  --save: checkpoints go to RUN/checkpoints, exports to RUN/exports",
        "note: no --rollout-max-response-len (slime generates up to the context length): rollout.max_response_len "
        "keeps slimectl's default; set it",
        "note: no --hf-checkpoint: set model.path to the HF model folder",
        "note: the layout asks for 6 trainer GPU(s) (train.dp = 1) and engines of 2; on a CPU machine use "
        "--set train.dp=1 --set engine.backend=embedded",
    ]
    assert "dp" not in tr.data["train"] and "num_engines" not in tr.data["engine"]
    assert (tr.data["train"]["tp"], tr.data["engine"]["tp_size"]) == (4, 2)


def test_stop_token_ids_and_the_dynamic_sampling_filters():
    tr = translate_slime_args(["--rollout-stop-token-ids", "151643", "151645", "--dynamic-sampling-filter-path",
                               "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback"])
    assert tr.data["rollout"]["stop_token_ids"] == [151643, 151645]
    assert tr.data["rollout"]["dynamic_filter"] == "nonzero_std"
    assert "--dynamic-sampling-filter-path ..._with_fallback: mapped to nonzero_std, which samples more groups " \
           "instead of keeping rejected ones" in tr.notes
    own = translate_slime_args(["--dynamic-sampling-filter-path", "slime.rollout.filter_hub.other"])
    assert "dynamic_filter" not in own.data["rollout"]
    assert dict(own.unmapped)["--dynamic-sampling-filter-path"] == \
        "slime.rollout.filter_hub.other is slime's own code; slimectl has rollout.dynamic_filter: nonzero_std"
    custom = translate_slime_args(["--dynamic-sampling-filter-path", "my_filters.keep_hard"])
    assert custom.data["rollout"]["dynamic_filter"] == "my_filters:keep_hard"


def test_fault_tolerance_and_the_health_check_timings_become_engine_health_check():
    tr = translate_slime_args(["--use-fault-tolerance", "--rollout-health-check-first-wait", "120",
                               "--rollout-health-check-interval", "5", "--rollout-health-check-timeout", "3"])
    assert tr.data["engine"]["health_check"] == {"enabled": True, "first_wait": 120.0, "interval": 5.0, "timeout": 3.0}
    assert build_config(tr.data).engine.health_check.timeout == 3.0
    assert not any(f.startswith(("--use-fault", "--rollout-health")) for f, _ in tr.ignored + tr.unmapped)
