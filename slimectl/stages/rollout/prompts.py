"""The prompt supply of a rollout producer: the dataset prepared once per process, where the previous
rollout left it, the groups it left unfinished, and the groups of samples made from its rows.

A published rollout holds ``data_state.json`` (the prompt source's position after it: the next rollout
starts from it) and, when groups go on across rollouts (partial rollout, fully async), ``buffer.parquet``
(the groups a later rollout continues first). :class:`PromptSupply` reads both back; :func:`new_group`
makes one prompt's group for a rollout and for eval alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slimectl.backends.hf.vlm import vlm_family
from slimectl.contract.config_schema import RolloutSection, SlimectlConfig
from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import Sample, Status
from slimectl.stages.rollout.data import PromptRow, PromptSource, load_tokenizer, tokenize_prompts

VLM_ROLLOUT_READY = True
"""Whether ``slimectl rollout`` takes a vision-language model (images stored in ``RUN/media``, samples'
``multimodal_inputs``, ``image_data`` in every request): on since ``rl`` trains them (issue 45); ``rollout --follow``
(``fully_async``) still refuses one in one line."""

DATA_STATE = "data_state.json"
BUFFER_FILE = "buffer.parquet"
"""Partial rollout: groups aborted when this rollout's batch filled; the next rollout continues them first."""


def next_rollout_id(run: RunDir) -> int:
    ids = run.rollouts.ids()
    return ids[-1] + 1 if ids else 0


def refuse_vlm_rollout(cfg: SlimectlConfig, stage: str) -> None:
    """Refuse a VLM's rollout in one line (exit 2) while :data:`VLM_ROLLOUT_READY` is off."""
    if not VLM_ROLLOUT_READY:
        from slimectl.backends.hf.vlm import refuse_vlm

        refuse_vlm(cfg.model.path, stage)


def require_prompt_data(cfg: SlimectlConfig) -> None:
    if cfg.data.prompt_data is None:
        raise UsageError("data.prompt_data is not set; point it at a .jsonl or .parquet prompt file")


def label_requirement(cfg: SlimectlConfig) -> tuple[str | None, str | None]:
    """(reward that needs a label, reward that may read one) for the configured ``rollout.reward``.

    Built-in graders but ``random`` need the label; custom functions and remote reward models may
    read it (they only get a warning when no row has ``data.label_key``); ``random`` reads none."""
    from slimectl.rewards import needs_label

    reward = cfg.rollout.reward
    needed = needs_label(reward)  # an unknown reward name fails here, before any engine is contacted
    return (reward if needed else None), (reward if needed is None else None)


def load_prompt_rows(cfg: SlimectlConfig, spec: str, skip_bad_rows: bool | None = None, key: str = "data.prompt_data"):
    """``load_prompts`` with the run's data keys and the label the configured reward needs
    (``key``: the config key holding ``spec``, for its errors)."""
    from slimectl.stages.rollout.data import load_prompts

    d = cfg.data
    needed_by, maybe_by = label_requirement(cfg)
    return load_prompts(spec, d.input_key, d.label_key, d.metadata_key, d.tools_key,
                        d.skip_bad_rows if skip_bad_rows is None else skip_bad_rows,
                        label_needed_by=needed_by, label_maybe_used_by=maybe_by, key=key,
                        multimodal_keys=multimodal_keys_for(cfg))


def multimodal_keys_for(cfg: SlimectlConfig) -> dict[str, str]:
    """``data.multimodal_keys``, refused in one line (exit 2) for a text-only model."""
    if cfg.data.multimodal_keys:
        from slimectl.stages.rollout.media import check_model_takes_images

        check_model_takes_images(cfg.data.multimodal_keys, cfg.model.path)
    return dict(cfg.data.multimodal_keys)


_prepared: dict[str, Any] = {}  # the last dataset prepared in this process: {"key": ..., "value": ...}


def prepared_prompts(cfg: SlimectlConfig, skip_bad_rows: bool | None):
    """``data.prompt_data`` read, checked and tokenized, with its tokenizer: ``(rows, bad rows skipped,
    prompts too long, tokenizer)``. A process that makes many rollouts (``slimectl rl``) prepares the
    dataset once, not once per rollout (the CPU demo spent ~15 % of its loop re-tokenizing 256
    prompts each rollout; a 100k-prompt dataset would take minutes per rollout). Prepared again when
    the data section, the reward, the tokenizer path or the file's size or mtime change. The rows
    are shared read-only: samples copy ``prompt_ids``."""
    from slimectl.contract.dataspec import parse_data_spec

    d = cfg.data
    file = Path(parse_data_spec(d.prompt_data, "data.prompt_data")[0])
    try:
        st = file.stat()
        stamp = (st.st_size, st.st_mtime_ns)
    except OSError:
        stamp = None  # load_prompt_rows names the missing file
    key = repr((d, cfg.rollout.reward, cfg.model.tokenizer_path or cfg.model.path, skip_bad_rows, str(file), stamp))
    if stamp is not None and _prepared.get("key") == key:
        return _prepared["value"]
    rows, bad = load_prompt_rows(cfg, d.prompt_data, skip_bad_rows)  # before the tokenizer and any engine
    from slimectl.contract.logs import quiet_hf_progress

    quiet_hf_progress()
    rows, too_long, tok = tokenize_rows(cfg, rows)
    _prepared.update(key=key, value=(rows, bad, too_long, tok))
    return _prepared["value"]


def tokenize_rows(cfg: SlimectlConfig, rows: list[PromptRow]) -> tuple[list[PromptRow], int, Any]:
    """``(rows kept, prompts too long, tokenizer)``: the rows' prompt ids as the engine will see them. A VLM with
    ``data.multimodal_keys``: through its HF processor (:func:`~slimectl.stages.rollout.media.tokenize_vlm_prompts`:
    each image's placeholder expanded to its token count); else the tokenizer's chat template."""
    d = cfg.data
    if d.multimodal_keys and vlm_family(cfg.model.path) is not None:
        from slimectl.backends.hf.vlm import load_processor
        from slimectl.stages.rollout.media import tokenize_vlm_prompts

        processor = load_processor(cfg.model.tokenizer_path or cfg.model.path)
        rows, too_long = tokenize_vlm_prompts(rows, processor, d.apply_chat_template, d.max_prompt_len)
        return rows, too_long, processor.tokenizer
    tok = load_tokenizer(cfg)
    rows, too_long = tokenize_prompts(rows, tok, d.apply_chat_template, d.max_prompt_len)
    return rows, too_long, tok


def data_state_before(run: RunDir, rollout_id: int) -> dict[str, Any] | None:
    if rollout_id == 0:
        return None
    if not run.rollouts.exists(rollout_id - 1):
        raise SlimectlError(
            f"rollouts/{rollout_id - 1:06d} is not published, so rollout {rollout_id} cannot know where the prompt data "
            f"continues; produce rollouts in order (--next)"
        )
    art = run.rollouts.get(rollout_id - 1)
    return json.loads(art.file(DATA_STATE).read_text())


def carries_groups(cfg: SlimectlConfig) -> bool:
    """Whether a rollout's unfinished groups go on in the next one: partial rollout, or fully async generation
    (the groups in flight when a rollout was published)."""
    return cfg.rollout.partial_rollout or cfg.rollout.async_mode == "fully_async"


def buffered_groups(run: RunDir, rollout_id: int) -> list[list[Sample]]:
    """Unfinished groups left by the previous rollout (partial rollout), in group order."""
    from slimectl.contract.samples import read_samples

    if rollout_id == 0 or not run.rollouts.exists(rollout_id - 1):
        return []
    art = run.rollouts.get(rollout_id - 1)
    if BUFFER_FILE not in art.files:
        return []
    groups: dict[int, list[Sample]] = {}
    for s in read_samples(art.file(BUFFER_FILE)):
        groups.setdefault(s.group_index, []).append(s)
    return [groups[g] for g in sorted(groups)]


def agent_fields(r: RolloutSection, row: PromptRow) -> dict[str, Any]:
    """What an agent program (``rollout.agent``) gets of its row besides the label and metadata: the dataset's
    messages (the rendered prompt is the harness's to make) and tools; nothing without an agent."""
    if not r.agent:
        return {}
    return {"agent_messages": row.prompt, **({"agent_tools": row.tools} if row.tools else {})}


def new_group(row: PromptRow, g: int, n: int, first_seed: int, rollout_id: int | None = None,
              **metadata: Any) -> list[Sample]:
    """Prompt ``row``'s group ``g`` of ``n`` samples (indices ``g * n + j``; sampling seeds ``first_seed + j``),
    ``metadata`` added to the row's own. Its images (a VLM's) as references into ``RUN/media``: the caller stores
    them (:func:`~slimectl.stages.rollout.media.store_images`) before the group is generated."""
    label = None if row.label is None else (row.label if isinstance(row.label, str) else json.dumps(row.label))
    from slimectl.stages.rollout.media import image_refs

    images = image_refs(row.images)
    return [Sample(group_index=g, index=g * n + j, rollout_id=rollout_id, prompt=row.prompt_text,
                   tokens=list(row.prompt_ids), label=label,
                   multimodal_inputs=None if images is None else {k: list(v) for k, v in images.items()},
                   metadata={**row.metadata, "row": row.row, **metadata, "sampling_seed": first_seed + j})
            for j in range(n)]


class PromptSupply:
    """What feeds a rollout producer's generation: called as ``supply(n)``, the next ``n`` groups (default: a
    round of ``over_sampling_batch_size``, or ``batch_size``): the groups an earlier rollout left unfinished first
    (:attr:`buffered`, partial rollout or fully async), then new prompts' groups of ``n_samples_per_prompt``, their
    images (a VLM's) stored in ``RUN/media`` first."""

    def __init__(self, cfg: SlimectlConfig, rollout_id: int, source: PromptSource, buffered: list[list[Sample]],
                 tokenizer, dataset_metrics: dict[str, Any], media_root: str | Path | None = None):
        self.r, self.rollout_id, self.source, self.buffered, self.tokenizer = \
            cfg.rollout, rollout_id, source, buffered, tokenizer
        self.media_root = media_root
        """The run directory whose ``media/`` a new group's images are stored in before it is handed out."""
        self.round_size = self.r.over_sampling_batch_size or self.r.batch_size
        self.dataset_metrics = dataset_metrics
        """The dataset's counters (bad rows, prompts too long): in the first rollout published from this supply."""

    @classmethod
    def open(cls, run: RunDir, cfg: SlimectlConfig, rollout_id: int, skip_bad_rows: bool | None,
             carry: bool) -> "PromptSupply":
        """The supply for rollouts from ``rollout_id`` on: the prepared dataset from where rollout ``rollout_id - 1``
        left it, with the groups it left unfinished when ``carry``."""
        state = data_state_before(run, rollout_id)
        buffered = buffered_groups(run, rollout_id) if carry else []
        d = cfg.data
        rows, bad, too_long, tok = prepared_prompts(cfg, skip_bad_rows)
        source = PromptSource(rows, seed=d.seed, shuffle=d.shuffle, state=state)
        return cls(cfg, rollout_id, source, buffered, tok,
                   {"rollout/bad_rows_skipped": bad, "rollout/prompts_too_long": too_long}, media_root=run.path)

    def __call__(self, n: int | None = None) -> list[list[Sample]]:
        r, rid = self.r, self.rollout_id
        n = self.round_size if n is None else n
        groups = []
        while self.buffered and len(groups) < n:
            group = self.buffered.pop(0)
            for s in group:
                s.rollout_id = rid
                if s.status == Status.ABORTED and s.response_length:  # picks up where it stopped
                    s.metadata["partial_continued"] = True  # (a group-mate that had finished is not)
            groups.append(group)
        k = r.n_samples_per_prompt
        for g, row in self.source.take(n - len(groups)):
            if row.images:
                if self.media_root is None:
                    raise SlimectlError(f"row {row.row} has images but this prompt supply has no run to store them in")
                from slimectl.stages.rollout.media import store_images

                store_images(self.media_root, row.images)
            groups.append(new_group(row, g, k, (r.seed * 1_000_003 + rid) * 65_537 + g * k, rollout_id=rid,
                                    **agent_fields(self.r, row)))
        return groups

    def state(self) -> dict[str, Any]:
        """The prompt source's position after every group handed out so far."""
        return self.source.state()

    def take_dataset_metrics(self) -> dict[str, Any]:
        """The dataset's counters the first time, then nothing."""
        out, self.dataset_metrics = self.dataset_metrics, {}
        return out
