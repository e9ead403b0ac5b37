"""Prompt datasets (jsonl / parquet) and the resumable prompt data source.

A dataset spec is ``path`` or ``path@[a:b]`` (a Python-style row slice). Each row gives the
prompt (``input_key``: a string, or OpenAI-style messages), the label (``label_key``), metadata
(``metadata_key``) and tools (``tools_key``). Malformed rows raise an error naming the file and
line, or are skipped and counted with ``skip_bad_rows``. A key that no row has (the input key, or
the label key when the reward grades against a label) is one error naming the file, the key and
the keys the rows do have.

:class:`PromptSource` hands out prompts in a seeded shuffled order per epoch. Its state
(epoch, offset, seed) is a small JSON dict that the rollout stage stores with every rollout,
so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimectl.contract.dataspec import parse_data_spec
from slimectl.contract.errors import SlimectlError, UsageError

log = logging.getLogger("slimectl.rollout")

MAX_KEYS_SHOWN = 20


class DatasetError(UsageError):
    """A prompt dataset is missing or malformed (input: exit code 2)."""


@dataclass
class PromptRow:
    row: int
    """Row number in the (sliced) dataset, stable across epochs."""
    prompt: str | list[dict[str, Any]]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tools: Any = None
    prompt_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""
    images: list[Any] = field(default_factory=list)
    """The row's images (``data.multimodal_keys``): :class:`~slimectl.stages.rollout.media.ImageRef`, checked."""


def _read_rows(path: Path, key: str = "data.prompt_data") -> list[tuple[int, Any]]:
    """(line or row number, raw record) pairs; JSON syntax errors carry their line number.

    Lines are read as bytes and decoded one by one, so a line that is not UTF-8 is an error naming
    the file and the line (a bad row like any other), not a decoder's byte offset."""
    if not path.is_file():
        raise DatasetError(f"prompt dataset {path} does not exist; check {key}")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        out = []
        with open(path, "rb") as f:
            for lineno, raw_line in enumerate(f, 1):
                try:
                    line = raw_line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    out.append((lineno, DatasetError(
                        f"{path} line {lineno}: not UTF-8 text (byte {raw_line[exc.start]:#04x} at column "
                        f"{exc.start + 1}); re-save the file as UTF-8")))
                    continue
                if not line.strip():
                    continue
                try:
                    out.append((lineno, json.loads(line)))
                except json.JSONDecodeError as exc:
                    out.append((lineno, DatasetError(f"{path} line {lineno}: invalid JSON ({exc.msg})")))
        return out
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(str(path)).to_pylist()
        except Exception as exc:
            raise DatasetError(f"{path} is not a readable parquet file ({exc})") from None
        return [(i + 1, r) for i, r in enumerate(rows)]
    raise DatasetError(f"prompt dataset {path}: unsupported format {suffix!r}; use .jsonl or .parquet")


def _keys_seen(raw: list[tuple[int, Any]]) -> str:
    """The keys the dict rows have, in first-seen order (at most :data:`MAX_KEYS_SHOWN`)."""
    keys: dict[str, None] = {}
    for _, rec in raw:
        if isinstance(rec, dict):
            keys.update(dict.fromkeys(map(str, rec)))
    shown = list(keys)[:MAX_KEYS_SHOWN]
    more = f", ... ({len(keys) - len(shown)} more)" if len(keys) > len(shown) else ""
    return ", ".join(shown) + more if shown else "none"


def _check_keys(path: Path, raw: list[tuple[int, Any]], input_key: str, label_key: str | None,
                label_needed_by: str | None, label_maybe_used_by: str | None) -> None:
    """File-level key checks: a key that no row has is one error, not a failure at line 1 (or,
    for the label, a run that trains on reward 0 because every label is None)."""
    dicts = [rec for _, rec in raw if isinstance(rec, dict)]
    if not dicts:
        return  # the per-row checks name the first bad line
    if not any(input_key in rec for rec in dicts):
        raise DatasetError(f"prompt dataset {path}: key {input_key!r} (data.input_key) is in no row; its rows have "
                           f"keys: {_keys_seen(raw)}; set the prompt's key with --set data.input_key=KEY")
    if label_needed_by:
        if label_key is None:
            raise DatasetError(f"reward {label_needed_by!r} grades against a label, but data.label_key is null; set the "
                               f"answer's key of {path} (keys: {_keys_seen(raw)}) with --set data.label_key=KEY")
        if not any(rec.get(label_key) is not None for rec in dicts):
            what = "is null in every row" if any(label_key in rec for rec in dicts) else "is in no row"
            raise DatasetError(f"prompt dataset {path}: key {label_key!r} (data.label_key) {what}, but reward "
                               f"{label_needed_by!r} grades against a label; its rows have keys: {_keys_seen(raw)}; "
                               f"set the answer's key with --set data.label_key=KEY")
    elif label_maybe_used_by and label_key is not None and not any(label_key in rec for rec in dicts):
        log.warning("prompt dataset %s has no key %r (data.label_key) in any row: reward %r gets label None for "
                    "every sample (set data.label_key: null if it needs none)", path, label_key, label_maybe_used_by)


def load_prompts(spec: str, input_key: str = "input", label_key: str | None = "label", metadata_key: str = "metadata",
                 tools_key: str = "tools", skip_bad_rows: bool = False, label_needed_by: str | None = None,
                 label_maybe_used_by: str | None = None, key: str = "data.prompt_data",
                 multimodal_keys: dict[str, str] | None = None) -> tuple[list[PromptRow], int]:
    """Load a dataset spec; returns (rows, number of skipped bad rows).

    ``label_needed_by`` names the reward when it grades against a label: then a row without one
    is a bad row, and a file where no row has ``label_key`` is an error listing the keys it has.
    ``label_maybe_used_by`` names a reward that may read the label (custom, remote): a file with
    no ``label_key`` at all only gets a warning. ``key`` is the config key holding ``spec``
    (``data.prompt_data``, ``data.eval_data.NAME``), named in errors about the spec itself.
    ``multimodal_keys`` (``data.multimodal_keys``): the columns of the rows' images, read and checked here
    (:mod:`~slimectl.stages.rollout.media`).
    """
    file, sl, rows_part = parse_data_spec(spec, key)
    path = Path(file)
    all_rows = _read_rows(path, key)
    raw = all_rows[sl]
    if rows_part and not raw:
        raise DatasetError(f"{key} = {spec}: the row slice {rows_part} selects no rows of {path} ({len(all_rows)} "
                           f"rows); fix the slice")
    _check_keys(path, raw, input_key, label_key, label_needed_by, label_maybe_used_by)
    if multimodal_keys:
        from slimectl.stages.rollout.media import check_media_columns, row_images

        check_media_columns(path, raw, multimodal_keys, _keys_seen)
    rows: list[PromptRow] = []
    skipped = 0
    unit = "line" if path.suffix.lower() != ".parquet" else "row"
    for lineno, rec in raw:
        try:
            if isinstance(rec, Exception):
                raise rec
            if not isinstance(rec, dict):
                raise DatasetError(f"{path} {unit} {lineno}: expected a JSON object, got {type(rec).__name__}")
            if input_key not in rec:
                raise DatasetError(f"{path} {unit} {lineno}: missing key {input_key!r} (data.input_key)")
            prompt = rec[input_key]
            if isinstance(prompt, list):
                if not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
                    raise DatasetError(f"{path} {unit} {lineno}: {input_key!r} messages need 'role' and 'content'")
            elif not isinstance(prompt, str) or not prompt:
                raise DatasetError(f"{path} {unit} {lineno}: {input_key!r} must be a non-empty string or a message list")
            label = rec.get(label_key) if label_key else None
            if label_needed_by and label is None:
                raise DatasetError(f"{path} {unit} {lineno}: no {label_key!r} (data.label_key), which reward "
                                   f"{label_needed_by!r} grades against; this row has keys: {', '.join(map(str, rec))}")
            meta = rec.get(metadata_key) or {}
            if isinstance(meta, str):
                try:
                    meta = json.loads(meta)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path} {unit} {lineno}: {metadata_key!r} is a string but not JSON ({exc.msg}); "
                                       f"give an object") from None
            if not isinstance(meta, dict):
                raise DatasetError(f"{path} {unit} {lineno}: {metadata_key!r} must be an object")
            images = row_images(rec, multimodal_keys, path.parent, f"{path} {unit} {lineno}") if multimodal_keys else []
            rows.append(PromptRow(row=len(rows), prompt=prompt, label=label, metadata=meta, tools=rec.get(tools_key),
                                  images=images))
        except (DatasetError, json.JSONDecodeError) as exc:
            if not skip_bad_rows:
                msg = str(exc) if isinstance(exc, DatasetError) else f"{path} {unit} {lineno}: {exc}"
                raise DatasetError(f"{msg} (or pass --skip-bad-rows to skip and count such rows)") from None
            skipped += 1
    if not rows:
        raise DatasetError(f"prompt dataset {spec} ({key}) has no usable rows")
    return rows, skipped


def load_tokenizer(cfg):
    """The tokenizer of ``model.tokenizer_path`` (or ``model.path``); a directory without one is one
    line naming the key (transformers' own error is a multi-line ValueError or OSError)."""
    from transformers import AutoTokenizer

    key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    path = cfg.model.tokenizer_path or cfg.model.path
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        why = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise UsageError(f"{key} = {path}: cannot load a tokenizer there ({why}); point {key} at an HF model "
                         f"directory with tokenizer files") from None


def tokenize_prompts(rows: list[PromptRow], tokenizer, apply_chat_template: bool = True,
                     max_prompt_len: int | None = None) -> tuple[list[PromptRow], int]:
    """Render (chat template) and tokenize prompts; drop those longer than ``max_prompt_len``."""
    kept, dropped = [], 0
    for r in rows:
        if apply_chat_template:
            msgs = r.prompt if isinstance(r.prompt, list) else [{"role": "user", "content": r.prompt}]
            kwargs = {"tools": r.tools} if r.tools else {}
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kwargs)
        else:
            if isinstance(r.prompt, list):
                raise DatasetError(f"row {r.row}: message-list prompts need data.apply_chat_template = true")
            text = r.prompt
        ids = tokenizer.encode(text, add_special_tokens=False)
        if max_prompt_len is not None and len(ids) > max_prompt_len:
            dropped += 1
            continue
        r.prompt_text, r.prompt_ids = text, ids
        kept.append(r)
    if not kept:
        raise DatasetError(f"every prompt is longer than data.max_prompt_len = {max_prompt_len}")
    return kept, dropped


class PromptSource:
    """Seeded per-epoch shuffled order over the rows; resumable from :meth:`state`."""

    def __init__(self, rows: list[PromptRow], seed: int = 42, shuffle: bool = True, state: dict[str, Any] | None = None):
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0
        self.next_group = 0
        if state:
            if state.get("num_rows") != len(rows) or state.get("seed") != seed:
                raise SlimectlError(
                    f"saved prompt-source state (rows {state.get('num_rows')}, seed {state.get('seed')}) does not match "
                    f"the dataset (rows {len(rows)}, seed {seed}); the dataset or data.seed changed mid-run"
                )
            self.epoch, self.offset, self.next_group = state["epoch"], state["offset"], state["next_group"]

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[tuple[int, PromptRow]]:
        """The next ``n`` prompts as (group index, row), crossing epochs as needed."""
        out = []
        while len(out) < n:
            order = self._order(self.epoch)
            while self.offset < len(order) and len(out) < n:
                out.append((self.next_group, self.rows[order[self.offset]]))
                self.offset += 1
                self.next_group += 1
            if self.offset >= len(order):
                self.epoch += 1
                self.offset = 0
        return out

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "next_group": self.next_group,
                "seed": self.seed, "num_rows": len(self.rows)}
