"""slimectl convert / export on tiny random Llama, Qwen2 and Qwen3 models (real megatron-core, gloo).

First the run-directory path (convert -r / export -r, in this process). Then one module fixture
converts every family at TP=1 (in this process, tests.helpers.run_script_in_process) and at TP=2
(two ranks: Llama through the CLI, which launches torchrun itself; the rest, and the two-rank
logits checks, in the session's long-lived two_ranks worker, which every later test of the module
keeps, so a next module's two-rank tests can reuse it). The tests then check the round trip, logits
parity at TP=1/TP=2, and resharding a TP=2 checkpoint to TP=1 and PP=2; HF's logits are computed
once, in this process, and read by the ranks (they never import transformers).
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import SCRIPTS, run_script_in_process, script_results, slimectl, slimectl_in_process

pytestmark = pytest.mark.xdist_group("two_ranks")  # xdist: one worker, one two_ranks launch

FAMILIES = ("llama", "qwen2", "qwen3")
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from slimectl.starter_models.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for fam in FAMILIES:
        # initializer_range 0.3 makes attention/RoPE mistakes visible in the logits; Llama's
        # 300-token vocab is padded to 384 at TP=1 and 512 at TP=2, so padding is exercised.
        out[fam] = build_tiny_model(fam, root / fam, initializer_range=0.3, num_layers=2,
                                    vocab_size=300 if fam == "llama" else 512, seed=3)
    return out


@pytest.fixture(scope="module")
def hf_logits(models, tmp_path_factory) -> dict[str, str]:
    """The env for mcore_logits.py: HF's logits of every family on its token ids, computed here once
    (transformers is imported in this process anyway) instead of in each rank of each launch."""
    path = tmp_path_factory.mktemp("hf-logits") / "logits.pt"
    runpy.run_path(str(SCRIPTS / "mcore_logits.py"))["write_hf_logits"](path, [models[f] for f in FAMILIES], [(2, 24, 7)])
    return {"SLIMECTL_TEST_HF_LOGITS": str(path)}


FORKS: dict[str, int] = {}
COPIED: dict[str, list[int]] = {}


@pytest.fixture(scope="module")
def converted(models, tmp_path_factory, two_ranks) -> dict[tuple[str, int], Path]:
    root = tmp_path_factory.mktemp("mcore")
    ckpts = {(fam, 1): root / f"tp1-{fam}" for fam in FAMILIES}
    ckpts.update({(fam, 2): root / f"tp2-{fam}" for fam in FAMILIES})
    pairs = [str(x) for fam in FAMILIES for x in (models[fam], ckpts[(fam, 1)])]
    res = script_results(run_script_in_process(SCRIPTS / "convert_batch.py", "1", "1", *pairs))[-1]
    FORKS["tp1"], COPIED["tp1"] = res["forks"], res["copied"]
    cli = slimectl("convert", "--hf", str(models["llama"]), "--out", str(ckpts[("llama", 2)]), "--tp", "2")
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert cli.stdout.strip() == str(ckpts[("llama", 2)])
    pairs = [str(x) for fam in ("qwen2", "qwen3") for x in (models[fam], ckpts[(fam, 2)])]
    two_ranks.run(SCRIPTS / "convert_batch.py", "2", "1", *pairs)
    return ckpts


def test_convert_and_export_through_the_run_directory(models, tmp_path):
    run = tmp_path / "run"
    init = slimectl_in_process("init", str(run), "--set", f"model.path={models['qwen2']}")
    assert init.returncode == 0, init.stderr
    res = slimectl_in_process("convert", "-r", str(run))
    assert res.returncode == 0, res.stderr[-2000:]
    from slimectl.contract.rundir import RunDir

    r = RunDir.open(run)
    art = r.checkpoints.get(0, verify="full")
    assert art.meta["source"] == "convert" and art.meta["tp"] == 1
    assert "release/metadata.json" in art.files and "slimectl_checkpoint.json" in art.files
    again = slimectl_in_process("convert", "-r", str(run))
    assert again.returncode == 2 and "already exists" in again.stderr
    exp = slimectl_in_process("export", "-r", str(run))  # -> RUN/exports/000000 (never the run's weights/)
    assert exp.returncode == 0, exp.stderr[-2000:]
    assert exp.stdout.strip() == str(run / "exports" / "000000") and not r.weights.ids()
    ref = load_file(str(models["qwen2"] / "model.safetensors"))
    got = load_file(str(run / "exports" / "000000" / "model.safetensors"))
    assert all(torch.equal(got[k], ref[k]) for k in ref) and sorted(got) == sorted(ref)
    assert not list((run / ".staging").iterdir())
    assert " I slimectl.convert: converted " in (run / "logs" / "convert.log").read_text()  # the stage logs
    assert " I slimectl.export: exported iteration release -> " in (run / "logs" / "export.log").read_text()


def test_checkpoint_layout_is_megatron_lms(converted):
    root = converted[("qwen2", 2)]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert (root / "release" / "metadata.json").is_file() and (root / "release" / "common.pt").is_file()
    meta = json.loads((root / "slimectl_checkpoint.json").read_text())
    assert meta["saved_with"] == {"tp": 2, "pp": 1} and meta["arch"]["family"] == "qwen2"
    assert {"config.json", "tokenizer.json"} <= {p.name for p in (root / "hf").iterdir()}
    import argparse

    # plain values only: loads weights_only. (safe_globals' exit un-registers what it added, so it must not
    # add Namespace when megatron-core, imported in this process, has registered it for its own loads.)
    extra = [] if argparse.Namespace in torch.serialization.get_safe_globals() else [argparse.Namespace]
    with torch.serialization.safe_globals(extra):
        common = torch.load(root / "release" / "common.pt", weights_only=True)
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0
    assert common["args"].num_layers == 2 and common["args"].tensor_model_parallel_size == 2
    from megatron.core import dist_checkpointing

    keys = set(dist_checkpointing.load_tensors_metadata(str(root / "release")))
    assert "decoder.layers.self_attention.linear_qkv.weight" in keys  # stacked layers, no prefix
    assert "embedding.word_embeddings.weight" in keys
    assert json.loads((converted[("llama", 2)] / "slimectl_checkpoint.json").read_text())["padded_vocab_size"] == 512
    assert json.loads((converted[("llama", 1)] / "slimectl_checkpoint.json").read_text())["padded_vocab_size"] == 384


def test_synchronous_save_writes_from_this_process(converted):
    # megatron's writer forks per file for async saves; convert saves synchronously and pays for no fork
    assert FORKS["tp1"] == 0


def checkpoint_tensors(ckpt: Path, tmp_path: Path) -> dict:
    """Every tensor of a torch_dist checkpoint, read with torch's own DCP reader (as Megatron-LM reads)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{ckpt.name}-{len(list(tmp_path.iterdir()))}.pt"
    dcp_to_torch_save(str(ckpt / "release"), str(out))
    return torch.load(out, weights_only=True)


def assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b), what
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def test_convert_copies_whole_row_tensors_from_the_hf_files(models, converted, tmp_path):
    # At TP=1 in the model's dtype every tensor is whole HF rows: none is read into memory, all
    # are copied file to file. Reading them all instead gives the very same checkpoint tensors.
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.hf.mapping import all_rules

    expected = [len(all_rules(arch_from_dir(models[fam]))) for fam in FAMILIES]
    assert COPIED["tp1"] == expected
    pairs = [str(x) for fam in FAMILIES for x in (models[fam], tmp_path / f"read-{fam}")]
    proc = run_script_in_process(SCRIPTS / "convert_batch.py", "1", "1", *pairs, env={"SLIMECTL_TEST_READ_ALL": "1"})
    assert script_results(proc)[-1]["copied"] == [0, 0, 0]
    for fam in FAMILIES:
        assert_same_tensors(checkpoint_tensors(converted[(fam, 1)], tmp_path),
                            checkpoint_tensors(tmp_path / f"read-{fam}", tmp_path), f"{fam}: copied vs read")


def test_a_sharded_hf_checkpoint_converts_to_the_same_tensors(models, converted, tmp_path):
    # Rows are copied from whichever shard holds each HF tensor (model-0000N-of-M.safetensors + index).
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(models["llama"]).save_pretrained(sharded, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (models["llama"] / f).is_file():
            (sharded / f).write_bytes((models["llama"] / f).read_bytes())
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    res = script_results(run_script_in_process(SCRIPTS / "convert_batch.py", "1", "1", sharded, tmp_path / "out"))[-1]
    assert res["copied"] == [COPIED["tp1"][FAMILIES.index("llama")]]
    assert_same_tensors(checkpoint_tensors(converted[("llama", 1)], tmp_path),
                        checkpoint_tensors(tmp_path / "out", tmp_path), "llama: sharded vs single file")


def test_tp2_and_pp2_conversions_hold_the_tp1_tensors(models, converted, tmp_path, two_ranks):
    # A checkpoint's tensors are global: converting with TP=2 (column shards copied, row-parallel
    # shards written from memory) or PP=2 (the tied output layer of the last stage read, not
    # copied) must give exactly the TP=1 tensors.
    pairs = [str(x) for fam in ("llama", "qwen2") for x in (models[fam], tmp_path / f"pp2-{fam}")]
    two_ranks.run(SCRIPTS / "convert_batch.py", "1", "2", *pairs)
    for fam in ("llama", "qwen2"):
        ref = checkpoint_tensors(converted[(fam, 1)], tmp_path)
        assert_same_tensors(ref, checkpoint_tensors(tmp_path / f"pp2-{fam}", tmp_path), f"{fam}: pp2 vs tp1")
    for fam in ("qwen2", "qwen3"):  # same padded vocab at TP=1 and TP=2 (512)
        assert_same_tensors(checkpoint_tensors(converted[(fam, 1)], tmp_path),
                            checkpoint_tensors(converted[(fam, 2)], tmp_path), f"{fam}: tp2 vs tp1")


def test_roundtrip_is_bit_exact_for_every_tensor(models, converted, tmp_path):
    pairs, outs = [], {}
    for key, ckpt in converted.items():
        outs[key] = tmp_path / f"{key[0]}-tp{key[1]}"
        pairs += [str(ckpt), str(outs[key])]
    run_script_in_process(SCRIPTS / "export_batch.py", *pairs)
    for (fam, tp), out in outs.items():
        ref = load_file(str(models[fam] / "model.safetensors"))
        got = load_file(str(out / "model.safetensors"))
        assert sorted(got) == sorted(ref), (fam, tp)
        for name in ref:
            assert torch.equal(got[name], ref[name]), f"{fam} tp{tp}: {name} differs"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for fam in FAMILIES:
        m = AutoModelForCausalLM.from_pretrained(outs[(fam, 2)], dtype=torch.float32)
        assert type(m).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[fam]
        assert AutoTokenizer.from_pretrained(outs[(fam, 2)]).encode("7+8=") == AutoTokenizer.from_pretrained(models[fam]).encode("7+8=")


def parity_pairs(models, converted, tp_of_ckpt):
    return [str(x) for fam in FAMILIES for x in (converted[(fam, tp_of_ckpt)], models[fam])]


def check(res, n, tp, pp):
    assert len(res) == n
    for r in res:
        assert r["hf_logits_from"] == "file"  # the reference computed once in this process
        assert r["tp"] == tp and r["pp"] == pp
        assert r["max_abs_diff"] <= TOL, r
        assert r["scale"] > 1.0  # logits large enough for a mistake to show


def _parity(run, tp: int, pp: int, checkpoint_tp: int, models, converted, hf_logits) -> None:
    """The TP=``checkpoint_tp`` checkpoints loaded at tp x pp (``run``: this process or the two ranks)."""
    pairs = parity_pairs(models, converted, checkpoint_tp)
    check(script_results(run(SCRIPTS / "mcore_logits.py", str(tp), str(pp), *pairs, env=hf_logits)), 3, tp, pp)


def test_logits_parity_tp1(models, converted, hf_logits):
    _parity(run_script_in_process, 1, 1, 1, models, converted, hf_logits)


def test_logits_parity_tp2(models, converted, two_ranks, hf_logits):
    _parity(two_ranks.run, 2, 1, 2, models, converted, hf_logits)


def test_tp2_checkpoint_resharded_to_tp1(models, converted, hf_logits):
    _parity(run_script_in_process, 1, 1, 2, models, converted, hf_logits)


def test_tp2_checkpoint_resharded_to_pp2(models, converted, two_ranks, hf_logits):
    _parity(two_ranks.run, 1, 2, 2, models, converted, hf_logits)


def test_export_cli_and_dtype(converted, tmp_path):
    out = tmp_path / "bf16"
    res = slimectl_in_process("export", "--checkpoint", str(converted[("qwen3", 1)]), "--out", str(out), "--dtype", "bf16",
                   "--max-shard-size", "40KB")
    assert res.returncode == 0, res.stderr[-2000:]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(out)
    assert next(m.parameters()).dtype == torch.bfloat16
    again = slimectl_in_process("export", "--checkpoint", str(converted[("qwen3", 1)]), "--out", str(out))
    assert again.returncode == 2 and "--force" in again.stderr
