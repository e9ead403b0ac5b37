"""The harness's sessions become Samples: every field a segment's Sample holds is carried, the images of a VLM
prompt (``multimodal_inputs``) included, and the result reads back as `rollout import` reads it."""

from __future__ import annotations

import hashlib

from slimectl.agents.harness_sessions import Segment, Session, samples_from_sessions
from slimectl.contract.samples import Sample, Status


class ByteTokenizer:
    """A byte-level tokenizer: token id = UTF-8 byte."""

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def segment(prompt: str, answer: str, images: list[str] | None) -> Segment:
    src = Sample(prompt=[{"role": "user", "content": prompt}], tokens=list(prompt.encode()),
                 multimodal_inputs=None if images is None else {"image": list(images)})
    ids = list(answer.encode())
    src.append_response_tokens(ids, [-0.5] * len(ids), True, {"weight_version": "3"})
    src.status = Status.COMPLETED
    return Segment(src, prompt + answer, {"reason": "first request"})


def test_a_vlm_segments_images_are_carried_into_its_sample_and_survive_the_export_format():
    sha = [hashlib.sha256(b).hexdigest() for b in (b"red square", b"blue circle")]
    vlm = Session("s1", segments=[segment("what colour?", "red", sha[:1]), segment("and now?", "blue", sha)],
                  finished=True, reward=1.0, label="red")
    text = Session("s2", segments=[segment("2+2?", "4", None)], finished=True, reward=0.0, label="4")
    samples = samples_from_sessions([vlm, text], ByteTokenizer())
    assert [s.multimodal_inputs for s in samples] == [{"image": sha[:1]}, {"image": sha}, None]
    assert [s.image_hashes for s in samples] == [sha[:1], sha, []]
    # a copy, not the segment's own list: editing the sample leaves the recording as it was
    samples[0].multimodal_inputs["image"].append(sha[1])
    assert vlm.segments[0].sample.multimodal_inputs == {"image": sha[:1]}
    samples[0].multimodal_inputs["image"].pop()
    assert [s.response for s in samples] == ["red", "blue", "4"]
    assert [s.group_index for s in samples] == [0, 0, 1] and [s.index for s in samples] == [0, 1, 2]
    for s in samples:
        s.validate()
        back = Sample.from_dict(s.to_dict())  # what export_jsonl writes and `rollout import` parses
        assert back.multimodal_inputs == s.multimodal_inputs and back.tokens == s.tokens
        assert back.loss_mask == [1] * back.response_length
