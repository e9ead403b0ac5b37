"""Every response token's weight version on the Sample: the engine's spans offset and merged across calls, the
fallback for engines that report none, the oldest/newest version, and the samples file (older ones included)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slimectl.contract.errors import SlimectlError
from slimectl.contract.sample_checks import check_sample
from slimectl.contract.samples import Sample, read_samples, write_samples


def meta(version: str, *spans: tuple[str, int, int], reason: str = "length") -> dict:
    m = {"weight_version": version, "finish_reason": {"type": reason}}
    if spans:
        m["weight_versions"] = [{"version": v, "start": a, "end": b} for v, a, b in spans]
    return m


def two_call_sample() -> Sample:
    """A partial rollout: the first call spans an update (3 -> 4) and is aborted, a tool's output follows, the
    continuation spans another (4 -> 5)."""
    s = Sample(group_index=0, index=0, tokens=[1, 2, 3], reward=1.0)
    s.append_response_tokens([10, 11, 12, 13, 14], [-0.5] * 5, True,
                             meta("4", ("3", 0, 3), ("4", 3, 5), reason="abort"))
    s.append_response_tokens([15, 16, 17, 18], [-0.5] * 4, True, meta("5", ("4", 0, 1), ("5", 1, 4)))
    s.append_response_tokens([20, 21], None, False)  # tool output: no model sampled it
    s.append_response_tokens([22, 23], [-0.5] * 2, True, meta("5", ("5", 0, 2), ("5", 2, 2)))
    return s


def test_spans_are_offset_by_the_response_so_far_and_merged_across_calls():
    s = two_call_sample()
    assert s.weight_version_spans == [{"version": "3", "start": 0, "end": 3}, {"version": "4", "start": 3, "end": 6},
                                      {"version": "5", "start": 6, "end": 9}, {"version": "5", "start": 11, "end": 13}]
    assert s.weight_versions == ["4", "5", "5"]  # one per call, as before
    assert (s.oldest_version, s.newest_version) == (3, 5)
    s.validate()


def test_an_engine_without_spans_gives_the_calls_version_to_all_its_tokens():
    s = Sample(tokens=[1])
    s.append_response_tokens([2, 3, 4], [-1.0] * 3, True, meta("7"))
    s.append_response_tokens([5, 6], [-1.0] * 2, True, meta("8"))
    assert s.weight_version_spans == [{"version": "7", "start": 0, "end": 3}, {"version": "8", "start": 3, "end": 5}]
    assert (s.oldest_version, s.newest_version) == (7, 8)
    s.append_response_tokens([], [], True, meta("9"))  # no token: no span
    assert len(s.weight_version_spans) == 2 and s.newest_version == 8


def test_versions_that_are_not_integers_are_the_first_and_the_last_and_none_is_unknown():
    s = Sample(tokens=[1])
    s.append_response_tokens([2, 3], [-1.0] * 2, True, meta("b", ("b", 0, 1), ("a", 1, 2)))
    assert (s.oldest_version, s.newest_version) == ("b", "a")
    assert (Sample(tokens=[1]).oldest_version, Sample(tokens=[1]).newest_version) == (None, None)


@pytest.mark.parametrize("spans, why", [
    ([("1", 0, 2)], "do not cover the call's 3 output tokens"),
    ([("1", 0, 1), ("2", 2, 3)], "do not cover"),
    ([("1", 1, 3)], "do not cover"),
])
def test_spans_that_do_not_cover_the_calls_tokens_are_refused(spans, why):
    s = Sample(tokens=[1])
    with pytest.raises(ValueError, match=why):
        s.append_response_tokens([2, 3, 4], [-1.0] * 3, True, meta("2", *spans))
    assert s.response_length == 0 and s.weight_version_spans == []  # nothing appended
    with pytest.raises(ValueError, match="must be a list of"):
        s.append_response_tokens([2], [-1.0], True, {"weight_versions": [{"version": "1"}]})


def test_dropping_the_response_tail_trims_the_spans():
    s = two_call_sample()
    s.drop_response_tail(4)  # the tool output and the last call
    assert s.response_length == 9 and s.tokens[-1] == 18 and len(s.rollout_log_probs) == len(s.loss_mask) == 9
    assert s.weight_version_spans[-1] == {"version": "5", "start": 6, "end": 9}
    s.drop_response_tail(5)
    assert s.weight_version_spans == [{"version": "3", "start": 0, "end": 3}, {"version": "4", "start": 3, "end": 4}]
    with pytest.raises(ValueError, match="cannot drop 9 of 4"):
        s.drop_response_tail(9)


def test_spans_round_trip_and_bad_ones_are_refused(tmp_path):
    s = two_call_sample()
    write_samples([s], tmp_path / "s.parquet")
    back = read_samples(tmp_path / "s.parquet")[0]
    assert back == s and (back.oldest_version, back.newest_version) == (3, 5)
    s.weight_version_spans[1]["end"] = 20
    with pytest.raises(ValueError, match="past the 13 response tokens"):
        write_samples([s], tmp_path / "bad.parquet")
    s.weight_version_spans = [{"version": 3, "start": 0, "end": 1}]
    with pytest.raises(SlimectlError, match="line 1: weight_version_spans must be a list of"):
        check_sample("line 1", s, None, None)


def test_a_samples_file_older_than_the_spans_reads_back_without_them(tmp_path):
    s = two_call_sample()
    write_samples([s], tmp_path / "new.parquet")
    table = pq.read_table(tmp_path / "new.parquet")
    old = table.drop_columns(["weight_version_spans"]).replace_schema_metadata({b"slimectl_samples_format": b"2"})
    pq.write_table(old, tmp_path / "old.parquet")
    back = read_samples(tmp_path / "old.parquet")[0]
    assert back.weight_version_spans == [] and back.weight_versions == ["4", "5", "5"]
    assert (back.oldest_version, back.newest_version) == (4, 5)  # from the calls' versions
    back.validate()
    write_samples([back], tmp_path / "again.parquet")  # and it is written again in today's format
    assert pq.read_schema(tmp_path / "again.parquet").field("weight_version_spans").type == pa.list_(
        pa.struct([("version", pa.string()), ("start", pa.int32()), ("end", pa.int32())]))
