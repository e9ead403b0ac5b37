"""The embedded engine's LoRA endpoints over HTTP, in SGLang's shapes: /load_lora_adapter and /unload_lora_adapter
(``success``, ``error_message``, ``loaded_adapters``), ``lora_path`` in /generate, the admin token, and
/load_lora_adapter_from_distributed over a gloo group; through the engine client's methods too."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
import warnings

import pytest

from tests.helpers import free_port, start_engine, stop_engine, wait_healthy

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.xdist_group("embedded_lora")  # xdist: one worker, the engine started once

TOKEN = "lora-token"
MODEL_KW = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                vocab_size=512, initializer_range=0.1)
PROMPT = [5, 6, 7, 8, 9, 10]


def _base(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _adapter(base, out, targets, seed, **save):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = peft.get_peft_model(_base(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                              init_lora_weights=False))
        m.save_pretrained(str(out), **save)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("lora-http")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llama = build_tiny_model("llama", root / "llama", seed=3, **MODEL_KW)
    return {"llama": llama,
            "a": _adapter(llama, root / "a", ["q_proj", "v_proj", "down_proj"], seed=1),
            "b": _adapter(llama, root / "b", ["k_proj", "o_proj", "gate_proj", "up_proj"], seed=2),
            "bin": _adapter(llama, root / "bin", ["q_proj"], seed=3, safe_serialization=False)}


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    log = tmp_path_factory.mktemp("lora-http-log") / "engine.log"
    proc, url = start_engine(models["llama"], log, "--admin-api-key-env", "SLIMECTL_TEST_TOKEN",
                             env={"SLIMECTL_TEST_TOKEN": TOKEN})
    try:
        wait_healthy(url)
    except Exception:
        proc.kill()
        raise AssertionError(log.read_text()[-3000:])
    yield url
    stop_engine(proc)


def call(url, path, body, token=TOKEN, timeout=60):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def generate(url, lora_path, ids=PROMPT, n=6):
    status, body = call(url, "/generate", {"input_ids": ids, "lora_path": lora_path, "return_logprob": True,
                                           "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                               "ignore_eos": True}})
    assert status == 200, body
    return body


def peft_logprobs(models, adapter, ids, out):
    model = _base(models["llama"])
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(models[adapter])).eval()
    with torch.inference_mode():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids + out])).logits[0].float(), dim=-1)
    return [lp[len(ids) - 1 + i, t].item() for i, t in enumerate(out)]


def client_call(url, method, *args, **kw):
    from slimectl.engines.client import EngineClient

    async def go():
        async with EngineClient(url, token=TOKEN, retries=0) as c:
            return await getattr(c, method)(*args, **kw)

    return asyncio.run(go())


def test_load_generate_replace_unload_in_sglang_shapes(engine, models):
    base = generate(engine, None)
    status, body = call(engine, "/load_lora_adapter", {"lora_name": "a", "lora_path": str(models["a"]),
                                                       "weight_version": "lora-1"})
    assert (status, body) == (200, {"success": True, "error_message": None, "loaded_adapters": {"a": str(models["a"])}})
    out = generate(engine, "a")
    assert out["meta_info"]["weight_version"] == "lora-1" and out["output_ids"] != base["output_ids"]
    got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(peft_logprobs(models, "a", PROMPT, out["output_ids"]), abs=1e-5)
    # a batch: one adapter per prompt (null: the base), as SGLang takes lora_path
    status, batch = call(engine, "/generate", {"input_ids": [PROMPT, PROMPT], "lora_path": [None, "a"],
                                               "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                   "ignore_eos": True}})
    assert status == 200 and [b["output_ids"] for b in batch] == [base["output_ids"], out["output_ids"]]
    # re-loading a name replaces it (SGLang refuses): the client's method, the new version reported
    answer = client_call(engine, "load_lora_adapter", "a", str(models["b"]), weight_version="lora-2")
    assert answer["success"] and answer["loaded_adapters"] == {"a": str(models["b"])}
    again = generate(engine, "a")
    assert again["meta_info"]["weight_version"] == "lora-2"
    assert [x[0] for x in again["meta_info"]["output_token_logprobs"]] == pytest.approx(
        peft_logprobs(models, "b", PROMPT, again["output_ids"]), abs=1e-5)
    info = json.loads(urllib.request.urlopen(engine + "/model_info", timeout=30).read())
    assert info["weight_version"] == "lora-2"
    assert client_call(engine, "unload_lora_adapter", "a") == {"success": True, "error_message": None,
                                                               "loaded_adapters": {}}
    assert generate(engine, None)["output_ids"] == base["output_ids"]


def test_unknown_names_and_bad_adapters_are_400_in_one_line(engine, models):
    assert call(engine, "/load_lora_adapter", {"lora_name": "keep", "lora_path": str(models["a"])})[0] == 200
    status, body = call(engine, "/generate", {"input_ids": PROMPT, "lora_path": "nope",
                                              "sampling_params": {"max_new_tokens": 2}})
    message = body["error"]["message"]
    assert status == 400 and "lora_path 'nope' is not a loaded LoRA adapter (loaded: ['keep'])" in message
    assert "\n" not in message
    status, body = call(engine, "/load_lora_adapter", {"lora_name": "keep", "lora_path": str(models["bin"])})
    assert status == 400 and body["success"] is False and "adapter_model.bin is pickle, never loaded" in body["error_message"]
    assert "\n" not in body["error_message"] and body["loaded_adapters"] == {"keep": str(models["a"])}
    status, body = call(engine, "/unload_lora_adapter", {"lora_name": "nope"})
    assert status == 400 and body["error_message"] == "LoRA adapter 'nope' is not loaded (loaded: ['keep'])"
    status, body = call(engine, "/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and "lora_name and lora_path must be non-empty strings" in body["error_message"]
    assert call(engine, "/unload_lora_adapter", {"lora_name": "keep"})[0] == 200


def test_the_lora_endpoints_need_the_admin_token(engine, models):
    for path, body in (("/load_lora_adapter", {"lora_name": "a", "lora_path": str(models["a"])}),
                       ("/unload_lora_adapter", {"lora_name": "a"}),
                       ("/load_lora_adapter_from_distributed", {"lora_name": "a"})):
        status, answer = call(engine, path, body, token=None)
        assert status == 401 and "admin token" in answer["error"]["message"], path


def test_an_adapter_over_a_gloo_group_equals_it_from_disk(engine, models):
    from safetensors.torch import load_file

    from slimectl.engines.weight_group import destroy_group, init_custom_process_group

    assert call(engine, "/load_lora_adapter", {"lora_name": "disk", "lora_path": str(models["b"])})[0] == 200
    port, box = free_port(), {}
    t = threading.Thread(target=lambda: box.__setitem__("init", call(engine, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "group_name": "lg",
        "backend": "gloo", "timeout": 90})))
    t.start()
    pg = init_custom_process_group("127.0.0.1", port, 0, 2, "lg", "gloo", timeout_s=60)
    t.join()
    assert box["init"][0] == 200, box
    try:
        sd = load_file(str(models["b"] / "adapter_model.safetensors"))
        names = sorted(sd)
        body = {"lora_name": "wire", "config": json.loads((models["b"] / "adapter_config.json").read_text()),
                "names": names, "dtypes": [str(sd[n].dtype).replace("torch.", "") for n in names],
                "shapes": [list(sd[n].shape) for n in names], "group_name": "lg", "weight_version": "wire-1"}
        bad = {**body, "shapes": [[s[0] + 1, s[1]] for s in body["shapes"]]}
        status, answer = call(engine, "/load_lora_adapter_from_distributed", bad)  # refused before any receive
        assert status == 400 and "the served model needs" in answer["error_message"], answer
        t = threading.Thread(target=lambda: box.__setitem__("load", call(
            engine, "/load_lora_adapter_from_distributed", body)))
        t.start()
        time.sleep(0.2)
        assert t.is_alive(), box.get("load")  # waiting for the tensors
        for n in names:
            torch.distributed.broadcast(sd[n].contiguous(), src=0, group=pg)
        t.join(timeout=60)
        status, answer = box["load"]
        assert status == 200 and answer["loaded_adapters"] == {"disk": str(models["b"]), "wire": "__distributed__"}
        wire, disk = generate(engine, "wire"), generate(engine, "disk")
        assert wire["meta_info"]["weight_version"] == "wire-1"
        assert wire["output_ids"] == disk["output_ids"]
        assert wire["meta_info"]["output_token_logprobs"] == disk["meta_info"]["output_token_logprobs"]
    finally:
        assert call(engine, "/destroy_weights_update_group", {"group_name": "lg"})[0] == 200
        destroy_group(pg)
        for name in ("disk", "wire"):
            call(engine, "/unload_lora_adapter", {"lora_name": name})
