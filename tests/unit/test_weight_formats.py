"""The weight-version format: chosen once from the config and what the engine kind declares; its operations."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.engines.caps import EMBEDDED, SGLANG, SGLANG_CPU, engine_caps
from slimectl.weight_formats import FullWeights, WeightSource, export_format, weight_format
from slimectl.weight_formats.lora import LoraAdapter, MergedLoraAdapter


def config(engine: dict | None = None, lora: dict | None = None) -> SlimectlConfig:
    train = {"lora": lora} if lora is not None else {}
    return SlimectlConfig.model_validate({"model": {"path": "/base"}, "train": train, "engine": engine or {}})


@pytest.mark.parametrize("engine, lora, form, adapter", [
    ({}, None, FullWeights, None),
    ({"backend": "sglang", "sglang_args": {"device": "cpu"}}, None, FullWeights, None),
    ({}, {"rank": 4}, LoraAdapter, "policy"),
    ({"backend": "sglang"}, {"rank": 4}, LoraAdapter, "policy"),
    ({"backend": "sglang", "sglang_args": {"device": "cpu"}}, {"rank": 4}, MergedLoraAdapter, None),
    ({"backend": "sglang", "sglang_args": {"device": "cpu"}, "lora_merged": False}, {"rank": 4}, LoraAdapter,
     "policy"),
    ({"lora_merged": True}, {"rank": 4}, MergedLoraAdapter, None),
])
def test_the_format_is_chosen_from_the_config_and_the_engine_kind(engine, lora, form, adapter):
    f = weight_format(config(engine, lora))
    assert type(f) is form and f.adapter_name == adapter
    assert (f.published_meta, f.checkpoint_meta().keys()) == (({}, set()) if lora is None else
                                                              ({"format": "peft_lora"}, {"lora"}))


def test_engine_kinds_declare_what_they_take():
    assert engine_caps(config().engine) is EMBEDDED and EMBEDDED.adapters and EMBEDDED.adapters_over_group
    assert engine_caps(config({"backend": "sglang"}).engine) is SGLANG and not SGLANG.adapters_over_group
    assert engine_caps(config({"backend": "sglang", "sglang_args": {"device": "cpu"}}).engine) is SGLANG_CPU
    assert not SGLANG_CPU.adapters
    # a caller may say what its engines take
    assert type(weight_format(config(lora={"rank": 4}), caps=SGLANG_CPU)) is MergedLoraAdapter


def test_sglang_is_started_for_adapters_only_when_it_serves_them():
    lora = {"rank": 4, "target_modules": ["q_proj", "v_proj"]}
    gpu = weight_format(config({"backend": "sglang"}, lora)).engine_args({})
    assert gpu == {"enable_lora": True, "max_lora_rank": 4, "max_loras_per_batch": 1,
                   "lora_target_modules": ["q_proj", "v_proj"]}
    assert weight_format(config({"backend": "sglang"}, lora)).engine_args({"device": "cpu"})["lora_backend"] == \
        "torch_native"
    assert weight_format(config({"lora_merged": True}, lora)).engine_args({}) == {}
    assert weight_format(config()).engine_args({}) == {}


def test_export_format_reads_the_checkpoint_and_refuses_merging_full_weights():
    assert isinstance(export_format({}, False, "/ckpt"), FullWeights)
    with pytest.raises(UsageError, match="--merge merges a LoRA adapter into its base, but /ckpt holds full"):
        export_format({}, True, "/ckpt")
    conf = {"r": 4, "lora_alpha": 8, "base_model_name_or_path": "/nowhere"}
    assert type(export_format({"lora": conf}, False, "/ckpt")) is LoraAdapter
    merged = export_format({"lora": conf}, True, "/ckpt")
    with pytest.raises(UsageError, match="--merge needs the LoRA run's base model, '/nowhere'"):
        merged.check_export()


class Client:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        async def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
        return call


def test_each_format_pushes_over_disk_with_its_own_call(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    clients = {"a": Client(), "b": Client()}
    full = WeightSource.from_dir(3, tmp_path)
    assert full.form is weight_format(config()) and asyncio.run(full.form.push_disk(clients, full)) == 20
    assert clients["a"].calls == [("update_weights_from_disk", (str(tmp_path.resolve()),),
                                   {"weight_version": "3", "flush_cache": True})]
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    lora = weight_format(config(lora={"rank": 4}))
    adapter = lora.source_from_dir(4, tmp_path)
    assert adapter.form is lora and adapter.adapter["r"] == 4
    asyncio.run(adapter.form.push_disk(clients, adapter))
    assert clients["b"].calls[-1] == ("swap_lora_adapter", ("policy", str(tmp_path.resolve()), "4"), {})
    # an adapter directory read without a run's format is served as an adapter
    assert isinstance(WeightSource.from_dir(4, tmp_path).form, LoraAdapter)


def test_an_adapter_over_the_group_is_refused_for_engines_that_take_it_from_disk_only():
    form = weight_format(config({"backend": "sglang"}, {"rank": 4}))
    source = form.source_from_tensors(1, lambda: iter([("a", torch.zeros(2))]))
    group = SimpleNamespace(group_name="g", bucket_bytes=1 << 20, progress="off")
    with pytest.raises(SlimectlError, match="set sync.transport: disk, or engine.lora_merged: true"):
        asyncio.run(form.push_group(group, {"a": Client()}, source))


def test_a_merged_version_reaches_the_engines_as_full_weights(tmp_path):
    from slimectl.backends.hf.peft_adapter import adapter_config, zero_adapter
    from slimectl.starter_models.tiny_models import build_tiny_model
    from slimectl.backends.hf.arch import arch_from_dir

    base = build_tiny_model("llama", tmp_path / "base", hidden_size=32, num_layers=2, vocab_size=320)
    cfg = SlimectlConfig.model_validate({"model": {"path": str(base)}, "train": {"lora": {"rank": 2}},
                                         "engine": {"lora_merged": True}})
    form = weight_format(cfg)
    tensors = zero_adapter(arch_from_dir(base), cfg.train.lora)
    source = form.source_from_tensors(5, lambda: iter(tensors.items()))
    assert source.adapter == adapter_config(cfg.train.lora, str(base))
    with form.for_engines(source, "distributed") as full:
        assert isinstance(full.form, FullWeights) and full.version == 5
        names = [n for n, _ in full.iter_tensors()]
    assert names and not any("lora" in n for n in names)
