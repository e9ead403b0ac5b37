"""The same weights at another memory alignment give the engine the same bits (issue 43).

A safetensors file puts each tensor at the offset its header gives (8-byte aligned); a tensor received over a
weight-update group or reallocated lands in fresh, 64-byte-aligned storage. MKL picks its kernels by the operands'
alignment, so with its reproducible mode off the same weights gave other bits at another alignment: on AMD EPYC
(Zen 2), an adapter read from disk gave other log-probs than the same adapter received over a gloo group. The
engine now serves copies in memory it owns, whatever the file's layout and whatever the transport.

Two checks, each on its own enough to have caught it on any machine: every tensor the engine and the adapter reader
hold is 64-byte aligned and not a map of the file; and two engines started with MKL's reproducible mode off
(``MKL_CBWR=""``: a value set wins over slimectl's default) from the same model written at two alignments, each
serving the same adapter written at two alignments, give bit-identical tokens and log-probs.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
import warnings
from pathlib import Path

import pytest

from tests.helpers import start_engine, stop_engine, wait_healthy

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.xdist_group("engine_alignment")

MODEL_KW = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                vocab_size=512, initializer_range=0.1)
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 3, 200, 17], [42]]


def data_start(path: Path) -> int:
    """The file offset of a safetensors file's first tensor byte (8-byte length + header)."""
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def rewrite_shifted(src: Path, dst: Path) -> None:
    """``src`` (a safetensors file) written again to ``dst`` with the same tensors and metadata plus a padding entry
    that moves every tensor to another offset modulo 64."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), "pt") as f:
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
        meta = dict(f.metadata() or {})
    start = data_start(src)
    for pad in range(1, 64):
        save_file(tensors, str(dst), metadata={**meta, "pad": "x" * pad})
        if (data_start(dst) - start) % 64 == 24:  # any shift not a multiple of 64 would do
            return
    raise AssertionError("no padding moved the tensors")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Two model dirs and two adapter dirs: the same tensors, the second of each at another alignment."""
    from slimectl.starter_models.tiny_models import build_tiny_model
    from tests.integration.test_embedded_lora_http import _adapter

    root = tmp_path_factory.mktemp("alignment")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_model("llama", root / "model", seed=3, **MODEL_KW)
    adapter = _adapter(model, root / "adapter", ["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"], seed=2)
    shifted = {}
    for name, d, file in (("model", model, "model.safetensors"), ("adapter", adapter, "adapter_model.safetensors")):
        shifted[name] = root / f"{name}-shifted"
        shutil.copytree(d, shifted[name])
        rewrite_shifted(d / file, shifted[name] / file)
        assert (data_start(shifted[name] / file) - data_start(d / file)) % 64 == 24
    return {"model": model, "adapter": adapter, "model2": shifted["model"], "adapter2": shifted["adapter"]}


def _maps(path: Path) -> bool:
    return any(str(path) in line for line in Path("/proc/self/maps").read_text().splitlines())


def test_the_engine_and_the_adapter_reader_hold_aligned_copies_not_the_file(layouts):
    from slimectl.backends.hf.peft_adapter import read_adapter
    from slimectl.engines.embedded.lora import LoraAdapters
    from slimectl.engines.embedded.model import load_model

    loaded = [load_model(str(layouts[m]), torch.float32) for m in ("model", "model2")]
    for lm, m in zip(loaded, ("model", "model2")):
        misaligned = {n: p.data_ptr() % 64 for n, p in lm.params.items() if p.data_ptr() % 64}
        assert not misaligned, misaligned  # transformers' own load leaves them in the file's map (40 mod 64)
        assert not _maps(layouts[m] / "model.safetensors")
    for (n, p), q in zip(loaded[0].params.items(), loaded[1].params.values()):
        assert torch.equal(p, q), n
    adapters = LoraAdapters(loaded[0].model, loaded[0].decoder)
    for a in ("adapter", "adapter2"):
        _, tensors = read_adapter(layouts[a])
        assert all(t.data_ptr() % 64 == 0 for t in tensors.values())
        served = adapters.read_dir(a, str(layouts[a]))
        assert all(t.data_ptr() % 64 == 0 for ab in served.weights.values() for t in ab)
        assert not _maps(layouts[a] / "adapter_model.safetensors")


def test_tied_embeddings_stay_one_parameter(tmp_path):
    from slimectl.engines.embedded.model import load_model, own_memory
    from slimectl.starter_models.tiny_models import build_tiny_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = build_tiny_model("qwen2", tmp_path / "m", seed=1, **MODEL_KW)
    lm = load_model(str(path), torch.float32)
    if not lm.config.tie_word_embeddings:
        lm.model.lm_head.weight = lm.model.model.embed_tokens.weight  # tie them here, as a tied family does
        own_memory(lm.model)
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
    assert lm.model.lm_head.weight.data_ptr() == lm.model.model.embed_tokens.weight.data_ptr()
    assert lm.model.lm_head.weight.data_ptr() % 64 == 0


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _outputs(url: str, lora: str | None) -> list:
    out = []
    for ids in PROMPTS:
        body = _post(url, "/generate", {"input_ids": ids, "lora_path": lora, "return_logprob": True,
                                        "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                            "ignore_eos": True}})
        out.append((body["output_ids"], body["meta_info"]["output_token_logprobs"]))
    return out


@pytest.mark.slow
def test_two_layouts_give_bit_identical_log_probs_with_mkl_reproducibility_off(layouts, tmp_path):
    engines, results = [], {}
    try:
        for m in ("model", "model2"):
            proc, url = start_engine(layouts[m], tmp_path / f"{m}.log", env={"MKL_CBWR": ""})
            engines.append(proc)
            wait_healthy(url)
            results[m, None] = _outputs(url, None)
            for a in ("adapter", "adapter2"):
                assert _post(url, "/load_lora_adapter", {"lora_name": a, "lora_path": str(layouts[a])})["success"]
                results[m, a] = _outputs(url, a)
    finally:
        for proc in engines:
            stop_engine(proc)
    base = results["model", None]
    assert results["model2", None] == base
    lora = results["model", "adapter"]
    assert lora != base  # the adapter changes the log-probs: the comparison below is not of the base twice
    for key in (("model", "adapter2"), ("model2", "adapter"), ("model2", "adapter2")):
        assert results[key] == lora, key
