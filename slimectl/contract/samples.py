"""The Sample schema (slime's fields) and the on-disk rollout format (Parquet).

Rollout writes ``rollouts/N/samples.parquet``; train reads it. Both import this module and
nothing of each other. One Parquet row per sample; list fields are Arrow lists (tokens,
loss mask, logprobs), free-form fields (reward dicts, metadata, chat prompts) are JSON strings.
Parquet is columnar and compressed (zstd), so a rollout of 100k samples stays small and train
reads only the columns it needs.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Iterable

from slimectl.contract.errors import SlimectlError

SAMPLES_FILE = "samples.parquet"
MEDIA_DIR = "media"
"""``RUN/media/<sha256>.png``: the images samples refer to (``Sample.multimodal_inputs``)."""
FORMAT_VERSION = 4  # 2: the rollout_routed_experts column (v1 files read as None); 3: weight_version_spans (older: []);
# 4: multimodal_inputs (older: None)
MODALITIES = ("image",)
"""The modalities a sample's ``multimodal_inputs`` may name (``data.multimodal_keys``'s)."""


class Status(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


FINISH_TO_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


@dataclass
class Sample:
    """One prompt + response, with everything training needs (field names follow slime)."""

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    """Prompt + response token ids."""
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    """One entry per response token; 1 = train on it (tool/observation tokens are 0)."""
    rollout_log_probs: list[float] | None = None
    """Per response token, from the engine (0.0 for tokens the model did not generate)."""
    weight_versions: list[str] = field(default_factory=list)
    """``meta_info.weight_version`` of every generation call that produced this sample."""
    weight_version_spans: list[dict[str, Any]] = field(default_factory=list)
    """The weight version that sampled each response token: ``{"version", "start", "end"}`` spans over the
    response tokens, in order (SGLang's ``meta_info.weight_versions`` of each call, offset by the response
    before it; a call whose engine reports none is its ``weight_version`` throughout). Tokens no engine
    generated (tool output) are in no span. Empty in files older than samples format 3."""
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    teacher_log_probs: list[float] | None = None
    rollout_id: int | None = None
    remove_sample: bool = False
    rollout_routed_experts: list[list[int]] | None = None
    """MoE routing replay (slime's ``rollout_routed_experts`` [T-1, layers, topk]): one row per token
    position except the last (``len(tokens) - 1`` rows once complete), each row the experts every MoE
    layer chose there, flattened layer-major (``layers * topk`` ints). None when not recorded."""
    multimodal_inputs: dict[str, list[str]] | None = None
    """The prompt's images as content-addressed references, per modality: ``{"image": ["<sha256>", ...]}`` in
    prompt order, each ``RUN/media/<sha256>.png`` (:mod:`slimectl.stages.rollout.media`); the prompt tokens hold
    their expanded placeholders (prompt tokens: never in the loss mask). None: a text-only sample (and files older
    than samples format 4)."""

    # ------------------------------------------------------------------ helpers
    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: self.prompt_length]

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length:]

    @property
    def oldest_version(self) -> int | str | None:
        """The oldest weight version of the response's tokens (:meth:`_versions`), None when unknown."""
        return self._versions()[0]

    @property
    def newest_version(self) -> int | str | None:
        """The newest weight version of the response's tokens (:meth:`_versions`), None when unknown."""
        return self._versions()[1]

    def _versions(self) -> tuple[int | str | None, int | str | None]:
        """(oldest, newest) of the spans' versions, else of ``weight_versions`` (files older than format 3):
        ints, min and max, when every version is an integer (slimectl's are); else the first and the last."""
        seen = [s["version"] for s in self.weight_version_spans] or list(self.weight_versions)
        if not seen:
            return None, None
        try:
            ints = [int(v) for v in seen]
        except (TypeError, ValueError):
            return seen[0], seen[-1]
        return min(ints), max(ints)

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def reward_value(self, reward_key: str | None = None) -> float:
        """The scalar reward (``reward[reward_key]`` for dict rewards)."""
        r = self.reward
        if isinstance(r, dict):
            if reward_key is None:
                raise SlimectlError(f"sample {self.index}: reward is a dict {sorted(r)}; set rollout.reward_key")
            r = r[reward_key]
        if r is None:
            raise SlimectlError(f"sample {self.index} has no reward")
        return float(r)

    def append_response_tokens(self, tokens: list[int], log_probs: list[float] | None, trainable: bool,
                               meta_info: dict[str, Any] | None = None, text: str = "") -> None:
        """Append a generation (trainable) or an observation (not trained on) to the response.

        Generated tokens need their log-probs; observation tokens get log-prob 0 and mask 0.
        ``meta_info`` of a /generate response sets the weight version, the tokens' version spans and the status.
        """
        if trainable and log_probs is None:
            raise ValueError("trainable tokens need their log-probs")
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(log_probs)} log-probs")
        spans = call_version_spans(meta_info, len(tokens)) if meta_info else []
        offset = self.response_length
        self.tokens = list(self.tokens) + list(tokens)
        self.response_length += len(tokens)
        self.response += text
        self.loss_mask = (self.loss_mask or []) + [1 if trainable else 0] * len(tokens)
        lp = list(log_probs) if trainable and log_probs is not None else [0.0] * len(tokens)
        self.rollout_log_probs = (self.rollout_log_probs or []) + lp
        if meta_info:
            if meta_info.get("routed_experts") is not None:
                self._append_routed_experts(meta_info)
            if meta_info.get("weight_version") is not None:
                self.weight_versions = list(self.weight_versions) + [str(meta_info["weight_version"])]
            self._append_version_spans(spans, offset)
            reason = (meta_info.get("finish_reason") or {}).get("type")
            if reason in FINISH_TO_STATUS:
                self.status = FINISH_TO_STATUS[reason]

    def _append_version_spans(self, spans: list[dict[str, Any]], offset: int) -> None:
        """Add one call's spans (over its own tokens), shifted by ``offset``; a span that goes on where the last
        one ends, with its version, extends it."""
        out = [dict(s) for s in self.weight_version_spans]
        for sp in spans:
            start, end = sp["start"] + offset, sp["end"] + offset
            if out and out[-1]["version"] == sp["version"] and out[-1]["end"] == start:
                out[-1]["end"] = end
            else:
                out.append({"version": sp["version"], "start": start, "end": end})
        self.weight_version_spans = out

    def drop_response_tail(self, n: int) -> None:
        """Forget the last ``n`` response tokens: their loss mask, log-probs, version spans and routes too."""
        if not 0 <= n <= self.response_length:
            raise ValueError(f"cannot drop {n} of {self.response_length} response tokens")
        if n == 0:
            return
        self.tokens, self.response_length = self.tokens[:-n], self.response_length - n
        for name in ("loss_mask", "rollout_log_probs", "teacher_log_probs"):
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, v[:-n])
        if self.rollout_routed_experts is not None:
            self.rollout_routed_experts = self.rollout_routed_experts[: max(len(self.tokens) - 1, 0)]
        end = self.response_length
        self.weight_version_spans = [{**s, "end": min(s["end"], end)} for s in self.weight_version_spans
                                     if s["start"] < end]

    def _append_routed_experts(self, meta_info: dict[str, Any]) -> None:
        """Store a /generate response's ``routed_experts`` (SGLang: base64 int32, rows for positions
        ``routed_experts_start_len`` .. T-2 of that call's prompt + output, whose prompt is this
        sample's tokens so far). Rows before the start are kept, the rest replaced: a multi-turn or
        partial-rollout call that asks from ``len(rollout_routed_experts)`` on just extends them."""
        start = int(meta_info.get("routed_experts_start_len") or 0)
        rows = decode_routed_experts(meta_info["routed_experts"], len(self.tokens) - 1 - start)
        kept = list(self.rollout_routed_experts or [])
        if start > len(kept):
            raise ValueError(f"routed_experts start at position {start} but only {len(kept)} rows are recorded")
        self.rollout_routed_experts = kept[:start] + rows

    def validate(self) -> None:
        """Raise ValueError when the fields are inconsistent (what train relies on)."""
        if self.response_length < 0 or self.response_length > len(self.tokens):
            raise ValueError(f"response_length {self.response_length} does not fit {len(self.tokens)} tokens")
        for name in ("loss_mask", "rollout_log_probs", "teacher_log_probs"):
            v = getattr(self, name)
            if v is not None and len(v) != self.response_length:
                raise ValueError(f"{name} has {len(v)} entries for {self.response_length} response tokens")
        re = self.rollout_routed_experts
        if re is not None and len(re) > max(len(self.tokens) - 1, 0):
            raise ValueError(f"rollout_routed_experts has {len(re)} rows for {len(self.tokens)} tokens (at most T-1)")
        if self.loss_mask is not None and any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask entries must be 0 or 1")
        check_version_spans(self.weight_version_spans, self.response_length, "weight_version_spans")
        check_multimodal_inputs(self.multimodal_inputs)

    @property
    def image_hashes(self) -> list[str]:
        """The SHA-256 names of the prompt's images (``multimodal_inputs["image"]``), in prompt order."""
        return list((self.multimodal_inputs or {}).get("image") or [])

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown Sample fields: {sorted(unknown)}")
        d = dict(d)
        if "status" in d:
            try:
                d["status"] = Status(d["status"])
            except ValueError:
                raise ValueError(f"status {d['status']!r} is not one of {', '.join(s.value for s in Status)}") from None
        return cls(**d)


def call_version_spans(meta_info: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The version spans of one /generate call's ``n`` output tokens: its ``meta_info.weight_versions`` (SGLang's
    spans, the empty ones dropped), else its ``weight_version`` for every token (an engine reporting no
    spans), else none. ValueError when the reported spans do not cover the ``n`` tokens in order."""
    reported = meta_info.get("weight_versions")
    if reported is None:
        v = meta_info.get("weight_version")
        return [{"version": str(v), "start": 0, "end": n}] if v is not None and n else []
    try:
        spans = [{"version": str(s["version"]), "start": int(s["start"]), "end": int(s["end"])} for s in reported]
    except (TypeError, KeyError, ValueError):
        raise ValueError(f"meta_info.weight_versions must be a list of {{version, start, end}}, "
                         f"got {reported!r}") from None
    spans = [s for s in spans if s["end"] > s["start"]]
    ends = [0] + [s["end"] for s in spans]
    if [s["start"] for s in spans] != ends[:-1] or ends[-1] != n:
        raise ValueError(f"meta_info.weight_versions {reported} do not cover the call's {n} output tokens in order")
    return spans


def check_version_spans(spans: object, response_length: int, name: str) -> None:
    """ValueError unless ``spans`` are ``{version: str, start: int, end: int}`` in order, non-empty, disjoint and
    inside the response."""
    if not isinstance(spans, list):
        raise ValueError(f"{name} must be a list of {{version, start, end}} spans")
    last = 0
    for sp in spans:
        if not (isinstance(sp, dict) and set(sp) == {"version", "start", "end"} and isinstance(sp["version"], str)
                and all(isinstance(sp[k], int) and not isinstance(sp[k], bool) for k in ("start", "end"))):
            raise ValueError(f"{name} must be a list of {{version: string, start: int, end: int}}, got {sp!r}")
        if not last <= sp["start"] < sp["end"] <= response_length:
            raise ValueError(f"{name} span {sp} is empty, out of order or past the {response_length} response tokens")
        last = sp["end"]


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def check_multimodal_inputs(mm: object) -> None:
    """ValueError unless ``mm`` is None or ``{modality: [sha256 hex, ...]}`` with modalities in :data:`MODALITIES`."""
    if mm is None:
        return
    if not isinstance(mm, dict) or not all(k in MODALITIES for k in mm):
        raise ValueError(f"multimodal_inputs must be {{\"image\": [sha256, ...]}} (modalities: "
                         f"{', '.join(MODALITIES)}), got {mm!r:.120}")
    for modality, refs in mm.items():
        if not isinstance(refs, list) or not all(isinstance(r, str) and _SHA256.match(r) for r in refs):
            raise ValueError(f"multimodal_inputs[{modality!r}] must be a list of SHA-256 names (64 lowercase hex "
                             f"digits) of files in RUN/media, got {refs!r:.120}")


def decode_routed_experts(b64: str, positions: int) -> list[list[int]]:
    """SGLang's ``meta_info.routed_experts`` (base64 of int32, [positions, layers, topk]) as
    ``positions`` rows of ``layers * topk`` ints."""
    import base64
    import sys
    from array import array

    flat = array("i")
    flat.frombytes(base64.b64decode(b64))
    if sys.byteorder != "little":
        flat.byteswap()
    if positions <= 0:
        if len(flat):
            raise ValueError(f"routed_experts has {len(flat)} entries for no position")
        return []
    if len(flat) % positions:
        raise ValueError(f"routed_experts has {len(flat)} entries, not a multiple of {positions} positions")
    w = len(flat) // positions
    return [flat[i * w:(i + 1) * w].tolist() for i in range(positions)]


# ----------------------------------------------------------------------------- Parquet I/O

_JSON_FIELDS = ("prompt", "reward", "metadata")


def _schema():
    import pyarrow as pa

    return pa.schema([
        ("group_index", pa.int64()), ("index", pa.int64()), ("rollout_id", pa.int64()),
        ("prompt", pa.string()), ("tokens", pa.list_(pa.int32())), ("response", pa.string()),
        ("response_length", pa.int32()), ("label", pa.string()), ("reward", pa.string()),
        ("loss_mask", pa.list_(pa.int8())), ("rollout_log_probs", pa.list_(pa.float32())),
        ("weight_versions", pa.list_(pa.string())), ("status", pa.string()), ("metadata", pa.string()),
        ("teacher_log_probs", pa.list_(pa.float32())), ("remove_sample", pa.bool_()),
        ("rollout_routed_experts", pa.list_(pa.list_(pa.int32()))),
        ("weight_version_spans", pa.list_(pa.struct([("version", pa.string()), ("start", pa.int32()),
                                                     ("end", pa.int32())]))),
        ("multimodal_inputs", pa.struct([(m, pa.list_(pa.string())) for m in MODALITIES])),
    ], metadata={b"slimectl_samples_format": str(FORMAT_VERSION).encode()})


def _json_default(obj):
    """A dataclass inside a JSON field is written as ``asdict`` makes it (what ``to_dict`` did)."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return asdict(obj)
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def write_samples(samples: Iterable[Sample], path: str | Path) -> int:
    """Write samples to a Parquet file; returns how many. Float log-probs are stored as float32."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows: dict[str, list] = {f.name: [] for f in _schema()}
    n = 0
    for s in samples:
        s.validate()
        # The fields as they are (no deep copy as to_dict makes: Arrow and json copy them anyway).
        for k, col in rows.items():
            v = getattr(s, k)
            if k in _JSON_FIELDS:
                v = json.dumps(v, ensure_ascii=False, default=_json_default)
            elif k == "status":
                v = Status(v).value
            elif k == "label" and v is not None and not isinstance(v, str):
                v = json.dumps(v, default=_json_default)
            col.append(v)
        n += 1
    table = pa.Table.from_pydict(rows, schema=_schema())
    pq.write_table(table, str(path), compression="zstd")
    return n


def read_samples(path: str | Path) -> list[Sample]:
    """Read a samples Parquet file (errors name the file)."""
    import pyarrow.parquet as pq

    p = Path(path)
    try:
        table = pq.read_table(str(p))
    except Exception as exc:
        raise SlimectlError(f"{p} is not a readable samples file ({exc}); republish the rollout") from None
    meta = table.schema.metadata or {}
    version = int(meta.get(b"slimectl_samples_format", b"0"))
    if version > FORMAT_VERSION:
        raise SlimectlError(f"{p} uses samples format v{version}, newer than this slimectl (v{FORMAT_VERSION}); upgrade")
    out = []
    for row in table.to_pylist():
        for k in _JSON_FIELDS:
            row[k] = json.loads(row[k]) if row[k] is not None else None
        if row["metadata"] is None:
            row["metadata"] = {}
        row["status"] = Status(row["status"])
        out.append(Sample(**row))
    return out
