"""The embedded engine's LoRA adapters, in process: logits equal PEFT's on the same base + adapter, rows of one batch on
different adapters (or none) each get what they get alone, replace / unload, bad adapters refused with nothing
changed, the memory release unloading them, /generate's lora_path.

PEFT (a test-only dependency) makes the reference adapters (random non-zero A and B) and the reference logits.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from slimectl.engines.embedded.generate_protocol import BadRequest, parse_generate  # noqa: E402
from slimectl.engines.embedded.lora import FROM_DISTRIBUTED  # noqa: E402
from slimectl.engines.embedded.memory import EngineBusy, MemoryReleased  # noqa: E402
from slimectl.engines.embedded.requests import GenRequest  # noqa: E402
from slimectl.engines.embedded.sampling_params import SamplingParams  # noqa: E402
from slimectl.engines.embedded.scheduler import GenerationScheduler  # noqa: E402
from slimectl.starter_models.tiny_models import build_tiny_model  # noqa: E402

MODEL_KW = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                vocab_size=512, initializer_range=0.1)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
TIMEOUT = 30
PROMPTS = ([5, 6, 7, 8, 9, 10], [40, 41, 42], [300, 12, 99, 7, 250, 3, 18, 77, 401])


def base_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def make_adapter(base: Path, out: Path, targets, r: int = 4, alpha: float = 8, seed: int = 0, **save) -> Path:
    """A PEFT adapter directory on ``base`` with random non-zero A and B (init_lora_weights=False)."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(base_model(base), peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                                       init_lora_weights=False))
        model.save_pretrained(str(out), **save)
    return out


def peft_logits(base: Path, adapter: Path | None, ids: list[int]) -> torch.Tensor:
    model = base_model(base)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_models")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llama = build_tiny_model("llama", root / "llama", seed=3, **MODEL_KW)
        narrow = build_tiny_model("llama", root / "narrow", seed=4, **{**MODEL_KW, "hidden_size": 32})
    return {
        "llama": llama,
        "attn": make_adapter(llama, root / "attn", ATTENTION, r=4, alpha=8, seed=1),
        "mlp": make_adapter(llama, root / "mlp", MLP, r=8, alpha=4, seed=2),
        "all": make_adapter(llama, root / "all", ATTENTION + MLP, r=6, alpha=12, seed=3),
        "attn2": make_adapter(llama, root / "attn2", ATTENTION, r=4, alpha=8, seed=7),
        "narrow": make_adapter(narrow, root / "narrow_adapter", ATTENTION, seed=5),
        "bin": make_adapter(llama, root / "bin", ATTENTION, seed=6, safe_serialization=False),
    }


@pytest.fixture
def engine(models):
    r = GenerationScheduler(str(models["llama"]), max_batch_size=16)
    r.start()
    yield r
    r.stop()


def request(rid: str, ids, lora: str | None, n: int = 6, **sp) -> GenRequest:
    sp = sp or {"temperature": 0.0}
    return GenRequest(rid=rid, input_ids=list(ids), params=SamplingParams(max_new_tokens=n, ignore_eos=True, **sp),
                      return_logprob=True, lora_name=lora)


def generate(r: GenerationScheduler, ids, lora: str | None, **kw):
    return r.submit(request("one", ids, lora, **kw)).result(TIMEOUT)


def recording_logits(r: GenerationScheduler) -> list[torch.Tensor]:
    """Every logits tensor the engine samples from, in order (prefill's last position, then each decode step)."""
    seen: list[torch.Tensor] = []
    orig = r.batch._logits

    def record(hidden):
        out = orig(hidden)
        seen.append(out.clone())
        return out

    r.batch._logits = record
    return seen


# ------------------------------------------------------------------------------------------------ PEFT's logits


@pytest.mark.parametrize("adapter", ["attn", "mlp", "all"])
def test_logits_with_an_adapter_equal_peft_s(engine, models, adapter):
    """q/k/v/o, gate/up/down, and all seven: the engine's logits at every generated position are PEFT's within
    1e-5 (fp32), and far from the base model's (the adapter matters)."""
    loaded = engine.load_lora_adapter("ad", str(models[adapter]))
    assert loaded == {"ad": str(models[adapter])}
    ids = PROMPTS[0]
    seen = recording_logits(engine)
    res = generate(engine, ids, "ad", n=8)
    full = ids + res.output_ids
    want = peft_logits(models["llama"], models[adapter], full)[len(ids) - 1 : len(full) - 1]
    got = torch.cat(seen)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5
    base = peft_logits(models["llama"], None, full)[len(ids) - 1 : len(full) - 1]
    assert (base - want).abs().max().item() > 1e-2
    assert res.output_ids == want.argmax(-1).tolist()


def test_the_base_weights_stay_untouched(engine, models):
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    base_out = generate(engine, PROMPTS[1], None)
    engine.load_lora_adapter("ad", str(models["all"]))
    assert generate(engine, PROMPTS[1], "ad").output_ids != base_out.output_ids
    after = generate(engine, PROMPTS[1], None)
    assert (after.output_ids, after.output_token_logprobs) == (base_out.output_ids, base_out.output_token_logprobs)
    assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())


# ------------------------------------------------------------------------------------------------ one batch, many adapters


def test_a_batch_mixing_adapters_gives_each_row_what_it_gives_alone(engine, models):
    """Base rows and rows of two adapters (the same prompts under each: no shared prefill across adapters), greedy
    and sampled, admitted together: each row's tokens and log-probs are those it gets alone, and PEFT's."""
    engine.load_lora_adapter("a", str(models["attn"]))
    engine.load_lora_adapter("b", str(models["mlp"]))
    reqs = [request(f"{lora}-{i}", ids, lora, n=5 + i, **({"temperature": 1.0, "sampling_seed": 10 + i} if i else {}))
            for i, ids in enumerate(PROMPTS) for lora in (None, "a", "b")]
    alone = [engine.submit(q).result(TIMEOUT) for q in reqs]
    shapes = []
    dec = engine.model.get_decoder()
    orig = dec.forward
    dec.forward = lambda *a, **kw: shapes.append(tuple(kw["input_ids"].shape)) or orig(*a, **kw)
    try:
        engine.pause("in_place")  # queued first, so they are admitted together
        futs = [engine.submit(q) for q in reqs]
        engine.resume()
        together = [f.result(TIMEOUT) for f in futs]
    finally:
        dec.forward = orig
    assert shapes[0][0] == len(reqs)  # one prefill of every row, none shared
    for q, a, t in zip(reqs, alone, together):
        assert t.output_ids == a.output_ids, q.rid
        assert t.output_token_logprobs == pytest.approx(a.output_token_logprobs, abs=1e-5)
        adapter = {"a": models["attn"], "b": models["mlp"], None: None}[q.lora_name]
        full = q.input_ids + t.output_ids
        temp = q.params.temperature or 1.0
        ref = torch.log_softmax(peft_logits(models["llama"], adapter, full) / temp, dim=-1)
        n = len(q.input_ids)
        assert t.output_token_logprobs == pytest.approx([ref[n - 1 + i, tok].item()
                                                         for i, tok in enumerate(t.output_ids)], abs=1e-5)
    by_prompt = [{t.output_ids[0] for q, t in zip(reqs, together) if q.input_ids == list(p)} for p in PROMPTS]
    assert any(len(s) > 1 for s in by_prompt)  # the adapters changed what the same prompt gives


# ------------------------------------------------------------------------------------------------ replace, unload


def test_loading_a_name_again_replaces_it_and_labels_the_version(engine, models):
    engine.load_lora_adapter("pol", str(models["attn"]), weight_version="v1")
    first = generate(engine, PROMPTS[0], "pol")
    assert first.weight_version == "v1" and engine.weight_version == "v1"
    loaded = engine.load_lora_adapter("pol", str(models["attn2"]), weight_version="v2")
    assert loaded == {"pol": str(models["attn2"])}
    second = generate(engine, PROMPTS[0], "pol", n=8)
    assert second.weight_version == "v2" and second.weight_versions == [{"version": "v2", "start": 0, "end": 8}]
    full = PROMPTS[0] + second.output_ids
    want = torch.log_softmax(peft_logits(models["llama"], models["attn2"], full), dim=-1)
    n = len(PROMPTS[0])
    assert second.output_token_logprobs == pytest.approx([want[n - 1 + i, t].item()
                                                          for i, t in enumerate(second.output_ids)], abs=1e-5)
    assert second.output_token_logprobs[:6] != first.output_token_logprobs


def test_unload_stops_serving_the_adapter(engine, models):
    base = generate(engine, PROMPTS[2], None)
    engine.load_lora_adapter("a", str(models["attn"]))
    engine.load_lora_adapter("b", str(models["mlp"]))
    with_b = generate(engine, PROMPTS[2], "b")
    assert engine.unload_lora_adapter("a") == {"b": str(models["mlp"])}
    with pytest.raises(ValueError, match=r"lora_path 'a' is not a loaded LoRA adapter \(loaded: \['b'\]\)"):
        generate(engine, PROMPTS[2], "a")
    assert generate(engine, PROMPTS[2], "b").output_ids == with_b.output_ids
    assert generate(engine, PROMPTS[2], None).output_ids == base.output_ids
    with pytest.raises(ValueError, match=r"LoRA adapter 'a' is not loaded \(loaded: \['b'\]\)"):
        engine.unload_lora_adapter("a")


def test_unload_is_refused_while_a_request_uses_the_adapter(engine, models):
    engine.load_lora_adapter("a", str(models["attn"]))
    engine.pause("in_place")
    fut = engine.submit(request("waits", PROMPTS[0], "a"))
    with pytest.raises(EngineBusy, match=r"cannot unload LoRA adapter 'a': 1 request\(s\) running or waiting use it"):
        engine.unload_lora_adapter("a")
    engine.resume()
    assert len(fut.result(TIMEOUT).output_ids) == 6
    assert engine.unload_lora_adapter("a") == {}


def test_replacing_an_adapter_mid_request_goes_on_with_the_new_one(engine, models):
    """A replace lands between two steps: a running request's later tokens come from the new adapter (its
    weight_versions say which tokens came from which)."""
    engine.load_lora_adapter("pol", str(models["attn"]), weight_version="v1")
    orig, steps, loader = engine.batch.decode, [], []

    def decode(version):  # at the 3rd decode step, a replace is queued: it lands before the 4th
        steps.append(version)
        if len(steps) == 3:
            loader.append(threading.Thread(target=engine.load_lora_adapter,
                                           args=("pol", str(models["attn2"]), "v2")))
            loader[0].start()
            while not engine._controls:
                time.sleep(0.001)
        return orig(version)

    engine.batch.decode = decode
    res = generate(engine, PROMPTS[1], "pol", n=10)
    loader[0].join(TIMEOUT)
    assert res.weight_versions == [{"version": "v1", "start": 0, "end": 4}, {"version": "v2", "start": 4, "end": 10}]
    assert res.weight_version == "v2" and engine.lora_adapters() == {"pol": str(models["attn2"])}


# ------------------------------------------------------------------------------------------------ bad adapters


def _variant(src: Path, dst: Path, config=None, tensors=None) -> Path:
    """A copy of adapter ``src`` with its config edited (``config(dict)``) and/or tensors (``tensors(dict)``)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        config(cfg)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        sd = load_file(str(dst / "adapter_model.safetensors"))
        tensors(sd)
        save_file(sd, str(dst / "adapter_model.safetensors"))
    return dst


def _rename(sd: dict, old: str, new: str) -> None:
    for k in [k for k in sd if old in k]:
        sd[k.replace(old, new)] = sd.pop(k)


def _drop_first_b(sd: dict) -> None:
    del sd[next(k for k in sorted(sd) if k.endswith("lora_B.weight"))]


BAD = {
    "unknown target module": (dict(config=lambda c: c.update(target_modules=[*c["target_modules"], "rotary_proj"])),
                              "target module 'rotary_proj' is not a linear module of the served model's decoder"),
    "weights of a module the model lacks": (dict(tensors=lambda sd: _rename(sd, "layers.1.", "layers.7.")),
                                            "module 'model.layers.7.self_attn."),
    "wrong shape (r)": (dict(config=lambda c: c.update(r=2)), "has shape [4, 64], the served model needs [2, 64]"),
    "a module without lora_B": (dict(tensors=_drop_first_b), "no lora_B weight for module"),
    "rslora": (dict(config=lambda c: c.update(use_rslora=True)), "use_rslora = True is not supported (plain LoRA only)"),
    "dora": (dict(config=lambda c: c.update(use_dora=True)), "use_dora = True is not supported"),
    "bias": (dict(config=lambda c: c.update(bias="all")), "bias = 'all' is not supported"),
    "modules_to_save": (dict(config=lambda c: c.update(modules_to_save=["lm_head"])),
                        "modules_to_save = ['lm_head'] is not supported"),
    "lm_head target": (dict(config=lambda c: c.update(target_modules=["lm_head"])),
                       "target module 'lm_head' is not a linear module"),
    "not lora": (dict(config=lambda c: c.update(peft_type="IA3")), "only LoRA adapters are supported"),
}


@pytest.mark.parametrize("case", list(BAD) + ["wrong base hidden size", "missing weights file", "a .bin adapter",
                                             "not a directory"])
def test_a_bad_adapter_is_refused_in_one_line_and_changes_nothing(engine, models, tmp_path, case):
    engine.load_lora_adapter("good", str(models["attn"]), weight_version="v1")
    before = generate(engine, PROMPTS[0], "good")
    if case in BAD:
        edits, message = BAD[case]
        path = _variant(models["attn"], tmp_path / "bad", **edits)
    elif case == "wrong base hidden size":
        path, message = models["narrow"], "has shape [4, 32], the served model needs [4, 64]"
    elif case == "missing weights file":
        path = _variant(models["attn"], tmp_path / "bad")
        (path / "adapter_model.safetensors").unlink()
        message = "no adapter_model.safetensors"
    elif case == "a .bin adapter":
        path, message = models["bin"], "adapter_model.bin is pickle, never loaded"
    else:
        path, message = tmp_path / "nothing", "is not a directory"
    for name in ("good", "other"):  # neither a replace nor a new name goes through
        with pytest.raises(ValueError) as err:
            engine.load_lora_adapter(name, str(path), weight_version="v9")
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert engine.lora_adapters() == {"good": str(models["attn"])} and engine.weight_version == "v1"
    after = generate(engine, PROMPTS[0], "good")
    assert (after.output_ids, after.output_token_logprobs) == (before.output_ids, before.output_token_logprobs)


# ------------------------------------------------------------------------------------------------ received tensors


def test_a_received_adapter_equals_the_same_adapter_from_disk(engine, models):
    """The path the distributed load takes (PEFT-named tensors through ``recv``), checked before the first receive."""
    from safetensors.torch import load_file

    sd = load_file(str(models["mlp"] / "adapter_model.safetensors"))
    config = json.loads((models["mlp"] / "adapter_config.json").read_text())
    names = sorted(sd)
    specs = [(n, sd[n].dtype, tuple(sd[n].shape)) for n in names]
    engine.load_lora_adapter("disk", str(models["mlp"]))
    stream = iter(names)
    received = engine.receive_lora_adapter("wire", config, specs, lambda t: t.copy_(sd[next(stream)]),
                                           weight_version="v5")
    assert received == {"disk": str(models["mlp"]), "wire": FROM_DISTRIBUTED} and engine.weight_version == "v5"
    a, b = generate(engine, PROMPTS[2], "disk"), generate(engine, PROMPTS[2], "wire")
    assert (a.output_ids, a.output_token_logprobs) == (b.output_ids, b.output_token_logprobs)
    calls = []
    bad = [(n, dt, (s[0] + 1, s[1]) if i == 3 else s) for i, (n, dt, s) in enumerate(specs)]
    with pytest.raises(ValueError, match="the served model needs"):
        engine.receive_lora_adapter("wire", config, bad, calls.append)
    assert calls == []  # refused before the first receive


# ------------------------------------------------------------------------------------------------ memory release


def test_releasing_the_weights_unloads_the_adapters(engine, models):
    engine.load_lora_adapter("a", str(models["attn"]))
    freed = engine.release_memory_occupation(["weights"])
    assert freed["lora_bytes"] > 0 and engine.lora_adapters() == {}
    with pytest.raises(MemoryReleased, match="cannot load a LoRA adapter: the engine's weights are released"):
        engine.load_lora_adapter("a", str(models["attn"]))
    engine.resume_memory_occupation(["weights"])
    assert engine.load_lora_adapter("a", str(models["attn"])) == {"a": str(models["attn"])}


# ------------------------------------------------------------------------------------------------ /generate's lora_path


class _Tok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 500 for c in text]


def test_generate_bodies_carry_lora_path_as_sglang_does():
    one, _ = parse_generate({"input_ids": [1, 2], "lora_path": "a"}, _Tok())
    assert [r.lora_name for r in one] == ["a"]
    batch, batched = parse_generate({"text": ["x", "y", "z"], "lora_path": ["a", None, "b"]}, _Tok())
    assert batched and [r.lora_name for r in batch] == ["a", None, "b"]
    shared, _ = parse_generate({"text": ["x", "y"], "lora_path": "a"}, _Tok())
    assert [r.lora_name for r in shared] == ["a", "a"]
    base, _ = parse_generate({"text": "x"}, _Tok())
    assert base[0].lora_name is None
    with pytest.raises(BadRequest, match="lora_path has 1 entries for 2 inputs"):
        parse_generate({"text": ["x", "y"], "lora_path": ["a"]}, _Tok())
    with pytest.raises(BadRequest, match="lora_path must be a loaded LoRA adapter's name"):
        parse_generate({"text": "x", "lora_path": 3}, _Tok())
