"""Sample schema + Parquet format round trip, prompt datasets, resumable prompt source."""

from __future__ import annotations

import json

import pytest

from slimectl.contract.dataspec import parse_data_spec
from slimectl.stages.rollout.data import DatasetError, PromptSource, load_prompts, tokenize_prompts
from slimectl.contract.samples import Sample, Status, read_samples, write_samples


def make_sample(i: int) -> Sample:
    s = Sample(group_index=i // 2, index=i, prompt=[{"role": "user", "content": f"q{i}"}] if i % 2 else f"prompt {i}",
               tokens=[1, 2, 3], label=str(i), metadata={"row": i, "nested": {"a": [1, 2]}}, rollout_id=7)
    s.append_response_tokens([4, 5], [-0.25, -1.5], True, {"weight_version": "3", "finish_reason": {"type": "stop"}}, "ab")
    s.append_response_tokens([6], None, False, text="<tool>")
    s.append_response_tokens([7], [-0.125], True, {"weight_version": "4", "finish_reason": {"type": "length"}}, "c")
    s.reward = {"score": 1.0, "acc": True} if i % 2 else 0.5
    s.teacher_log_probs = [-0.5, -0.5, 0.0, -0.5]
    return s


def test_append_response_tokens_masks_and_status():
    s = make_sample(0)
    assert s.tokens == [1, 2, 3, 4, 5, 6, 7] and s.response_length == 4 and s.prompt_length == 3
    assert s.loss_mask == [1, 1, 0, 1] and s.rollout_log_probs == [-0.25, -1.5, 0.0, -0.125]
    assert s.weight_versions == ["3", "4"] and s.status == Status.TRUNCATED and s.response == "ab<tool>c"
    assert s.effective_response_length == 3
    with pytest.raises(ValueError, match="need their log-probs"):
        s.append_response_tokens([1], None, True)


def test_parquet_round_trip(tmp_path):
    samples = [make_sample(i) for i in range(6)]
    n = write_samples(samples, tmp_path / "s.parquet")
    back = read_samples(tmp_path / "s.parquet")
    assert n == 6 and back == samples  # exactly representable floats survive float32 storage
    assert back[1].reward_value("score") == 1.0 and back[0].reward_value() == 0.5


def test_inconsistent_sample_is_refused(tmp_path):
    s = make_sample(0)
    s.loss_mask = [1]
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 4 response tokens"):
        write_samples([s], tmp_path / "x.parquet")
    assert not (tmp_path / "x.parquet").exists()


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_dataset_keys_slices_and_bad_rows(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"q": f"What is {i}+1?", "a": str(i + 1), "meta": {"i": i}} for i in range(10)])
    rows, bad = load_prompts(f"{p}@[2:5]", input_key="q", label_key="a", metadata_key="meta")
    assert [r.label for r in rows] == ["3", "4", "5"] and rows[0].metadata == {"i": 2} and bad == 0
    assert parse_data_spec("x.jsonl@[:-2]") == ("x.jsonl", slice(None, -2), "@[:-2]")
    assert parse_data_spec("a@b.jsonl") == ("a@b.jsonl", slice(None), "")
    broken = write_jsonl(tmp_path / "b.jsonl", [{"q": "ok"}, "{not json", {"nope": 1}, {"q": ""}, {"q": "fine"}])
    with pytest.raises(DatasetError, match=r"b.jsonl line 2: invalid JSON.*--skip-bad-rows"):
        load_prompts(str(broken), input_key="q")
    rows, bad = load_prompts(str(broken), input_key="q", skip_bad_rows=True)
    assert [r.prompt for r in rows] == ["ok", "fine"] and bad == 3
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DatasetError, match="unsupported format"):
        load_prompts(str(write_jsonl(tmp_path / "d.csv", ["a"])))


def test_parquet_dataset(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"input": "hi", "label": "1"}, {"input": "yo", "label": "2"}]), tmp_path / "d.parquet")
    rows, _ = load_prompts(str(tmp_path / "d.parquet"))
    assert [(r.prompt, r.label) for r in rows] == [("hi", "1"), ("yo", "2")]


def test_chat_template_and_length_filter(tmp_path):
    from slimectl.starter_models.tiny_models import build_tokenizer

    tok = build_tokenizer(tmp_path / "tok")
    p = write_jsonl(tmp_path / "d.jsonl", [{"input": "short"}, {"input": "long " * 200},
                                           {"input": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}])
    rows, _ = load_prompts(str(p))
    kept, dropped = tokenize_prompts(rows, tok, True, max_prompt_len=64)
    assert dropped == 1 and len(kept) == 2
    assert kept[0].prompt_text.endswith("<|im_start|>assistant\n") and kept[1].prompt_text.startswith("<|im_start|>system")
    assert kept[0].prompt_ids == tok.encode(kept[0].prompt_text, add_special_tokens=False)


def test_prompt_source_is_seeded_and_resumable():
    from slimectl.stages.rollout.data import PromptRow

    rows = [PromptRow(row=i, prompt=str(i)) for i in range(5)]
    a = PromptSource(rows, seed=3)
    first = [r.row for _, r in a.take(7)]  # crosses into epoch 1
    assert sorted(first[:5]) == [0, 1, 2, 3, 4] and a.state()["epoch"] == 1 and a.state()["offset"] == 2
    b = PromptSource(rows, seed=3, state=a.state())
    c = PromptSource(rows, seed=3)
    c.take(7)
    assert [r.row for _, r in b.take(6)] == [r.row for _, r in c.take(6)]  # resume == uninterrupted
    assert [g for g, _ in PromptSource(rows, seed=3).take(3)] == [0, 1, 2]
    with pytest.raises(Exception, match="does not match the dataset"):
        PromptSource(rows[:4], seed=3, state=a.state())
