"""Bad input to convert/export: a clear one-line error, a non-zero exit, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from slimectl.starter_models.tiny_models import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("m") / "llama")


def edit_config(d: Path, **changes) -> None:
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


def variant(llama: Path, tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    shutil.copytree(llama, d)
    return d


CASES = {
    "missing-dir": (lambda m, t: t / "nope", "does not exist"),
    "not-hf": (lambda m, t: (t / "empty").mkdir() or (t / "empty"), "has no config.json"),
    "mismatch": (lambda m, t: (edit_config(d := variant(m, t, "x"), intermediate_size=96), d)[1],
                 "model.layers.0.mlp.gate_proj.weight has shape [128, 64] but config.json implies [96, 64]"),
    "rope-scaling": (lambda m, t: (edit_config(d := variant(m, t, "x"), rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}), d)[1],
                     "rope scaling type 'llama3' is not supported"),
    "moe": (lambda m, t: (edit_config(d := variant(m, t, "x"), num_experts=8), d)[1], "MoE models"),
    "mistral": (lambda m, t: (edit_config(d := variant(m, t, "x"), model_type="mistral", architectures=["MistralForCausalLM"]), d)[1],
                "model_type 'mistral' is not supported"),
    "sliding": (lambda m, t: (edit_config(d := variant(m, t, "x"), layer_types=["sliding_attention", "full_attention"]), d)[1],
                "sliding-window attention"),
    "gelu": (lambda m, t: (edit_config(d := variant(m, t, "x"), hidden_act="gelu"), d)[1], "hidden_act 'gelu'"),
    "mtp": (lambda m, t: (edit_config(d := variant(m, t, "x"), num_nextn_predict_layers=1), d)[1],
            "num_nextn_predict_layers = 1 is not supported for llama"),
    "truncated": (lambda m, t: (d := variant(m, t, "x"), Path(d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]))[0],
                  "truncated or damaged"),
    "pickle-only": (lambda m, t: (d := variant(m, t, "x"), (d / "model.safetensors").rename(d / "pytorch_model.bin"))[0],
                    "never loads"),
    "missing-tensor": (lambda m, t: _drop_tensor(variant(m, t, "x"), "model.norm.weight"), "tensor model.norm.weight is missing"),
}


def _drop_tensor(d: Path, name: str) -> Path:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    del sd[name]
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_hf_input(cli, llama, tmp_path, case):
    make, needle = CASES[case]
    src = make(llama, tmp_path)
    out = tmp_path / "out"
    res = cli("convert", "--hf", src, "--out", out)
    # input errors exit 2: a missing or non-HF directory, a config slimectl does not convert (UnsupportedModel);
    # tensors that do not match their config or a damaged file exit 1
    config_refusals = ("rope-scaling", "moe", "mistral", "sliding", "gelu", "mtp")
    assert res.exit_code == (2 if case in ("missing-dir", "not-hf") + config_refusals else 1), res.output
    assert needle in res.output, res.output
    assert "Traceback" not in res.output and res.output.strip().count("\n") == 0
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_missing_shard(cli, llama, tmp_path):
    from transformers import AutoModelForCausalLM

    d = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(llama).save_pretrained(d, max_shard_size="100KB")
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    res = cli("convert", "--hf", d, "--out", tmp_path / "out")
    assert res.exit_code == 1 and f"shard {shards[1].name} listed in model.safetensors.index.json is missing" in res.output
    assert not (tmp_path / "out").exists()


def test_refuses_to_overwrite_and_bad_parallel_sizes(cli, llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    res = cli("convert", "--hf", llama, "--out", out)
    assert res.exit_code == 2 and "--force" in res.output and (out / "keep").exists()
    res = cli("convert", "--hf", llama, "--out", tmp_path / "o2", "--tp", "3")
    assert res.exit_code == 2 and "--tp 3 must divide num_attention_heads (4)" in res.output
    res = cli("convert", "--hf", llama, "--out", tmp_path / "o2", "--pp", "4")
    assert res.exit_code == 2 and "--pp 4 must divide num_hidden_layers (2)" in res.output
    assert not (tmp_path / "o2").exists()


def test_export_bad_checkpoint(cli, tmp_path):
    res = cli("export", "--checkpoint", tmp_path / "none", "--out", tmp_path / "o")
    assert res.exit_code == 2 and "does not exist" in res.output
    d = tmp_path / "notmcore"
    d.mkdir()
    res = cli("export", "--checkpoint", d, "--out", tmp_path / "o")
    assert res.exit_code == 2 and "slimectl_checkpoint.json" in res.output
    res = cli("export", "--checkpoint", d, "--out", tmp_path / "o", "--max-shard-size", "lots")
    assert res.exit_code == 2 and "--max-shard-size 'lots'" in res.output
    assert not (tmp_path / "o").exists()


def test_a_full_disk_while_writing_is_one_line_and_leaves_nothing(llama, tmp_path, monkeypatch):
    # torch_dist reports a writer's failure as CheckpointException, a BaseException with the
    # cause pickled away; convert must still say "no space left" in one line and clean up.
    # (In this process: the save writes synchronously from it, so the patched copy is the one called.)
    import errno

    import slimectl.backends.megatron.copy_save as cs
    from tests.helpers import slimectl_in_process

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cs, "copy_range", full)
    out = tmp_path / "out"
    res = slimectl_in_process("convert", "--hf", llama, "--out", out)
    assert res.returncode == 1, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "no space left on the device holding" in errors[0], res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
