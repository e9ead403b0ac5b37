"""Tests for slimectl.starter_models.tiny_models: offline tiny Llama / Qwen2 / Qwen3 checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from slimectl.starter_models.tiny_models import (
    EOS_TOKEN,
    TEXT_FAMILIES,
    FIXTURE_FILE,
    PAD_TOKEN,
    build_tiny_model,
)
from tests.helpers import ROOT

# family -> (model class, tied input/output embeddings by default)
EXPECTED = {
    "llama": ("LlamaForCausalLM", False),
    "qwen2": ("Qwen2ForCausalLM", True),
    "qwen3": ("Qwen3ForCausalLM", True),
    "qwen3-moe": ("Qwen3MoeForCausalLM", True),
    "glm4-moe": ("Glm4MoeForCausalLM", False),
    "deepseek-v3": ("DeepseekV3ForCausalLM", False),
}

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "The answer is \\boxed{42}."},
    {"role": "user", "content": "And 7 * 8?"},
]

TRICKY_STRINGS = [
    "What is 12 + 30? The answer is 42.",
    "1234567890 + 9876543210 = 11111111100",
    "-17.25 * 3/4 = -12.9375, 100% of $5",
    "\\boxed{12}",
    "So the final answer is \\boxed{-3}.",
    "x^2 + (y_1 - 2) = {a, b}",
    "don't WE'LL it's They'Re",
    "  leading and trailing spaces  ",
    "line one\nline two\r\n\n\ttabbed\n\n\n",
    "café naïve — “quotes” π ≈ 3.14, √2 ≠ 1, 3 × 4 ÷ 2, 日本語, emoji 😀",
    "e\u0301 decomposed vs é composed",  # NFC normalisation
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
]


def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import; if an earlier test imported it, the
    # env var alone would change nothing, so flip the module constant as well.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)


@pytest.fixture(scope="module", params=TEXT_FAMILIES)
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(family, directory) built once per family with the default sizes and seed 0."""
    family = request.param
    return family, build_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"))


def _load(d: Path, monkeypatch: pytest.MonkeyPatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _offline(monkeypatch)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    return tok, model


def test_loads_offline_as_expected_family(built, monkeypatch):
    family, d = built
    tok, model = _load(d, monkeypatch)
    model_class, tied = EXPECTED[family]
    assert type(model).__name__ == model_class
    assert model.config.model_type == family.replace("-", "_")

    attn = model.model.layers[0].self_attn
    if family == "llama":
        assert attn.q_proj.bias is None and model.model.layers[0].mlp.up_proj.bias is None
    if family == "qwen2":
        assert attn.q_proj.bias is not None and attn.k_proj.bias is not None
        assert attn.v_proj.bias is not None and attn.o_proj.bias is None
    if family == "qwen3":
        assert hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
        assert attn.q_proj.bias is None
        assert model.config.head_dim == model.config.hidden_size // model.config.num_attention_heads
    if family == "glm4-moe":  # GLM-4.5: QKV biases, no q/k norm, rotary on half of each head
        assert attn.q_proj.bias is not None and attn.o_proj.bias is None and not hasattr(attn, "q_norm")
        assert model.config.rope_parameters["partial_rotary_factor"] == 0.5
    if family == "deepseek-v3":  # DeepSeek-V3: multi-latent attention, YaRN, a dense first layer, no MTP layers
        assert attn.q_a_proj.weight.shape == (48, 64) and attn.kv_a_proj_with_mqa.weight.shape == (32 + 8, 64)
        assert model.config.rope_parameters["rope_type"] == "yarn" and model.config.num_nextn_predict_layers == 0
        assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"

    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert model.config.tie_word_embeddings is tied
    assert (emb.data_ptr() == head.data_ptr()) is tied

    # Vocabulary and special ids agree across tokenizer, config and generation_config.
    assert model.config.vocab_size >= len(tok)
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN and tok.bos_token is None
    for cfg in (model.config, model.generation_config):
        assert cfg.eos_token_id == tok.eos_token_id
        assert cfg.pad_token_id == tok.pad_token_id
        assert cfg.bos_token_id is None

    info = json.loads((d / FIXTURE_FILE).read_text())
    assert info["family"] == family and info["seed"] == 0 and info["model_class"] == model_class
    assert info["model_vocab_size"] == model.config.vocab_size
    assert info["tokenizer_size"] == len(tok)
    assert info["num_parameters"] == model.num_parameters()


def test_raw_and_auto_tokenizer_ids_match(built, monkeypatch):
    from tokenizers import Tokenizer

    family, d = built
    tok, _ = _load(d, monkeypatch)
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    chat = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    for s in TRICKY_STRINGS + [chat]:
        ids = tok(s)["input_ids"]
        assert raw.encode(s).ids == ids, (family, type(tok).__name__, s)
        # Byte-level BPE is lossless up to NFC: this also catches a swapped-in decoder
        # (a SentencePiece/Metaspace one drops the spaces).
        assert tok.decode(ids) == unicodedata.normalize("NFC", s), (family, s)
    # Digits are always single tokens (Qwen2's \p{N} pre-tokenisation).
    assert tok.tokenize("12345") == ["1", "2", "3", "4", "5"]
    # tokenize=True in apply_chat_template gives the same ids as encoding the rendered text.
    enc = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)
    assert enc["input_ids"] == raw.encode(chat).ids


def test_chat_template(built, monkeypatch):
    _, d = built
    tok, _ = _load(d, monkeypatch)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n"
        "<|im_start|>assistant\nThe answer is \\boxed{42}.<|im_end|>\n"
        "<|im_start|>user\nAnd 7 * 8?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text.endswith("<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(MESSAGES[:2], tokenize=False)
    assert no_prompt.endswith("What is 12 + 30?<|im_end|>\n")
    with pytest.raises(Exception, match="Unsupported chat role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_greedy_generate(built, monkeypatch):
    import torch

    _, d = built
    tok, model = _load(d, monkeypatch)
    tok.padding_side = "left"
    prompts = [MESSAGES[1:2], [{"role": "user", "content": "What is 3 + 4? Put it in \\boxed{}."}]]
    enc = tok.apply_chat_template(
        prompts, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (2, enc["input_ids"].shape[1] + 4)
    assert int(out.max()) < model.config.vocab_size


def test_builds_are_deterministic(built, tmp_path):
    import torch

    family, d = built
    rng_before = torch.random.get_rng_state()
    same = build_tiny_model(family, tmp_path / "same", seed=0)
    # The build seeds a forked RNG: the caller's global torch RNG is left alone.
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    other = build_tiny_model(family, tmp_path / "other", seed=1)

    for name in ("model.safetensors", "tokenizer.json", "config.json", FIXTURE_FILE):
        assert (same / name).read_bytes() == (d / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (d / "model.safetensors").read_bytes()


def test_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown family"):
        build_tiny_model("gpt2", tmp_path)
    with pytest.raises(ValueError, match="divisible"):
        build_tiny_model("llama", tmp_path, hidden_size=60, num_heads=8)
    assert not any(tmp_path.iterdir())  # validation happens before anything is written


def test_import_does_not_import_torch():
    pythonpath = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in pythonpath if p)}
    code = (
        "import sys, slimectl.starter_models.tiny_models; "
        "heavy = [m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT, timeout=60)
