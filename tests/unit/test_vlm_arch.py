"""A VLM's config.json as slimectl reads it (slimectl/backends/hf/arch.py::_vlm_arch, mapping.py's vision rules): the
language model's family and M-RoPE, the HF name prefixes of both families, every tensor of the checkpoint accounted
for, and one-line refusals of what cannot be converted."""

from __future__ import annotations

import json

import pytest

from slimectl.backends.hf.arch import UnsupportedModel, arch_from_config, arch_from_dir, expected_hf_shapes, hf_prefixes
from slimectl.backends.hf.checkpoint import HFCheckpoint
from slimectl.backends.hf.mapping import all_rules, rule_for


@pytest.fixture(scope="module", params=["qwen2_5-vl", "qwen3-vl"])
def tiny(request, tmp_path_factory):
    from slimectl.starter_models.tiny_vlms import build_tiny_vlm

    return request.param, build_tiny_vlm(request.param, tmp_path_factory.mktemp(request.param) / "m")


def test_the_language_model_and_m_rope_are_read_from_text_config(tiny):
    family, d = tiny
    arch = arch_from_dir(d)
    assert arch.vlm == arch.family == family.replace("-", "_")
    assert arch.mrope_section == (2, 3, 3) and arch.mrope_interleaved == (family == "qwen3-vl")
    assert (arch.qkv_bias, arch.qk_norm) == ((True, False) if family == "qwen2_5-vl" else (False, True))
    assert json.loads(arch.vlm_config) == json.loads((d / "config.json").read_text())
    assert hf_prefixes(arch) == (("model.", "visual.") if family == "qwen2_5-vl" else ("model.language_model.", "model.visual."))


def test_every_tensor_of_the_checkpoint_has_its_rule(tiny):
    _, d = tiny
    arch = arch_from_dir(d)
    with HFCheckpoint(d) as hf:
        hf.validate(arch)  # nothing missing, nothing unexpected
        names = set(hf.names())
    rules = all_rules(arch)
    assert {n for r in rules for n in r.hf} == names == set(expected_hf_shapes(arch))
    vision = [r for r in rules if r.megatron.startswith("vision.tower.")]
    assert vision and all(r.kind == "copy" and r.tp_dim is None for r in vision)  # whole, replicated over TP
    assert all(rule_for(arch, r.megatron) == r for r in vision)


def _config(tiny, **text):
    _, d = tiny
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"] = {**cfg["text_config"], **text}
    return cfg


def test_transformers_4_style_mrope_rope_scaling_is_read(tiny):
    cfg = _config(tiny, rope_parameters=None, rope_theta=1e6, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    arch = arch_from_config(cfg)
    assert arch.mrope_section == (2, 3, 3) and arch.rope_theta == 1e6


@pytest.mark.parametrize("section", [[2, 3, 2], [8], "x"])
def test_a_bad_mrope_section_is_one_line(tiny, section):
    cfg = _config(tiny, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": section})
    with pytest.raises(UnsupportedModel, match=r"mrope_section = .* must be 3 non-negative integers summing to "
                                               r"head_dim / 2 = 8"):
        arch_from_config(cfg, where="m/config.json")


def test_a_vlm_without_vision_config_is_one_line(tiny):
    cfg = _config(tiny)
    del cfg["vision_config"]
    with pytest.raises(UnsupportedModel, match="needs a text_config and a vision_config object"):
        arch_from_config(cfg)
