"""``slimectl status``: the run at a glance, for people (text) and scripts (JSON)."""

from __future__ import annotations

import json
from typing import Any

from slimectl.contract.errors import SlimectlError
from slimectl.contract.metrics import last_metrics
from slimectl.contract.rundir.artifacts import KINDS
from slimectl.contract.rundir.run import RunDir
from slimectl.contract.trace import read_traces, wait_seconds
from slimectl.web.client import probe_url

STAGES = ("serve", "rollout", "train", "sync", "rl", "convert", "export")


def probe_health(url: str, timeout: float = 1.0) -> str:
    """``ok``, or a short reason the engine's ``/health`` did not answer 200."""
    return probe_url(url.rstrip("/") + "/health", timeout)


def collect_status(run: RunDir, probe: bool = True, timeout: float = 1.0) -> dict[str, Any]:
    """Where the run stands: its config, artifacts, cursor, engines and routers (their ``/health`` with
    ``probe``), the stages running, and each stage's last metrics."""
    info = run.info()
    out: dict[str, Any] = {
        "run_dir": str(run.path),
        "contract_version": info.get("contract_version"),
        "created": info.get("created"),
        "slimectl_version": info.get("slimectl_version"),
    }
    out.update(_config_status(run))
    arts = {kind: {"count": len(ids), "latest": ids[-1] if ids else None}
            for kind, ids in ((k, run.artifacts(k).ids()) for k in KINDS)}
    out["artifacts"] = arts
    cursor = run.cursor("train").read()
    out["consumed"] = {"train": {"next": cursor.next, "count": len(cursor.consumed), "updated": cursor.updated}}
    out["rollouts_pending"] = len([i for i in run.rollouts.ids() if i >= cursor.next])
    out["rollouts_produced"] = arts["rollouts"]["count"]
    out["training"] = {"trained": len(cursor.consumed), "trained_through": cursor.next - 1 if cursor.next else None,
                       "next_to_train": cursor.next,
                       "num_rollout": out["config"]["num_rollout"] if "config" in out else None}
    out["engines"] = [_process_status(rec, {"id": rec.id, "url": rec.url, "backend": rec.backend, "host": rec.host,
                                            "pid": rec.pid, "weight_version": rec.weight_version,
                                            "started": rec.started}, probe, timeout) for rec in run.engines.list()]
    out["routers"] = [_process_status(rec, {"id": rec.id, "url": rec.url, "host": rec.host, "pid": rec.pid,
                                            "started": rec.started,
                                            "workers": list(rec.extra.get("workers") or [])
                                            if isinstance(rec.extra, dict) else []}, probe, timeout)
                      for rec in run.routers.list()]
    out["engine_groups"] = {name: [_process_status(rec, {"id": rec.id, "url": rec.url, "backend": rec.backend,
                                                         "host": rec.host, "pid": rec.pid,
                                                         "weight_version": rec.weight_version, "started": rec.started},
                                                   probe, timeout) for rec in run.engine_group(name).list()]
                            for name in run.engine_group_names()}
    locks = {}
    for stage in STAGES:
        holder = run.lock(stage).holder()
        if holder is not None:
            locks[stage] = {k: holder.get(k) for k in ("host", "pid", "acquired", "heartbeat_age_s", "stale")}
    out["running"] = locks
    out["staging_in_use"] = run.staging_in_use()  # leftovers not provably dead (a live or unknown writer)
    out["last_metrics"] = {p.stem: rec for p in sorted((run.path / "metrics").glob("*.jsonl"))
                           if (rec := last_metrics(p)) is not None}
    out["async"] = async_status(out)
    out["waits"] = trace_waits(run)
    return out


def async_status(st: dict[str, Any]) -> dict[str, Any]:
    """The asynchronous picture from what :func:`collect_status` read: the newest rollout, the train cursor,
    the newest weights, each live engine's version, how far generation is ahead of the weights, and who waits."""
    c = st.get("config") or {}
    newest_rollout = st["artifacts"]["rollouts"]["latest"]
    next_rollout = 0 if newest_rollout is None else newest_rollout + 1
    weights = st["artifacts"]["weights"]["latest"] or 0  # none published: engines serve version 0
    engines = {e["id"]: e["weight_version"] for e in st["engines"] if e["process"] != "dead"}
    out = {"async_mode": c.get("async_mode"), "max_staleness": c.get("max_staleness"),
           "newest_rollout": newest_rollout, "next_rollout": next_rollout,
           "train_next": st["training"]["next_to_train"], "newest_weights": weights, "ahead": next_rollout - weights,
           "engine_versions": engines}
    out["waiting"] = who_waits(out, c.get("num_rollout"))
    return out


def who_waits(a: dict[str, Any], num_rollout: int | None) -> list[dict[str, str]]:
    """Who waits for whom in the state ``a`` (:func:`async_status`): rollout for train (the next rollout would be
    more than ``max_staleness`` versions ahead of the newest weights), train for rollout (its next rollout is not
    published), engines for a sync (serving older weights than the newest)."""
    waits = []
    more = (lambda i: True) if num_rollout is None else (lambda i: i < num_rollout)
    limit = a["max_staleness"]
    if limit is not None and more(a["next_rollout"]) and a["ahead"] > limit:
        waits.append({"who": "rollout", "waits_for": "train",
                      "why": f"rollout {a['next_rollout']} needs weights {a['next_rollout'] - limit} or newer "
                             f"(rollout.max_staleness {limit}); the newest are {a['newest_weights']}"})
    newest_rollout = -1 if a["newest_rollout"] is None else a["newest_rollout"]
    if more(a["train_next"]) and a["train_next"] > newest_rollout:
        waits.append({"who": "train", "waits_for": "rollout",
                      "why": f"rollouts/{a['train_next']:06d} is not published yet"})
    behind = []
    for engine, version in a["engine_versions"].items():
        try:
            if int(version) < a["newest_weights"]:
                behind.append(f"{engine} serves {version}")
        except (TypeError, ValueError):
            continue
    if behind:
        waits.append({"who": "engines", "waits_for": "sync",
                      "why": f"{', '.join(behind)}; the newest weights are {a['newest_weights']}"})
    return waits


def trace_waits(run: RunDir) -> dict[str, dict[str, float]] | None:
    """Seconds each stage spent in each kind of ``wait:*`` span, from ``RUN/traces``; None without traces."""
    files = read_traces(run, only='"wait:')  # (only the lines of waits are parsed)
    if not files:
        return None
    by_stage: dict[str, list] = {}
    for s in (s for f in files for s in f.spans):
        by_stage.setdefault(s.stage, []).append(s)
    return {stage: wait_seconds(spans) for stage, spans in sorted(by_stage.items())}


def _config_status(run: RunDir) -> dict[str, Any]:
    """The run's name and the config keys status shows (its length as extended), or the config's error."""
    try:
        cfg = run.config()
        n, source = effective_num_rollout(run, cfg.rollout.num_rollout)
    except SlimectlError as exc:  # (a bad extend.json, read last, leaves the run's length unknown)
        return {"name": None, "config_error": str(exc)}
    return {"name": cfg.name, "config": {
        "model": cfg.model.path,
        "dtype": cfg.model.dtype,
        "prompt_data": cfg.data.prompt_data,
        "advantage_estimator": cfg.algorithm.advantage_estimator,
        "loss_type": cfg.algorithm.loss_type,
        "num_rollout": n,
        "rollout_batch_size": cfg.rollout.batch_size,
        "n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
        "engine_backend": cfg.engine.backend,
        "num_engines": cfg.engine.num_engines,
        "train_parallel": {"tp": cfg.train.tp, "pp": cfg.train.pp},
        "lr": cfg.train.lr,
        "sync_transport": cfg.sync.transport,
        "async_mode": cfg.rollout.async_mode,
        "max_staleness": cfg.effective_max_staleness,
        "num_rollout_frozen": cfg.rollout.num_rollout,
        "num_rollout_from": source,
    }}


def _process_status(rec, entry: dict[str, Any], probe: bool, timeout: float) -> dict[str, Any]:
    """A registered engine's or router's ``entry`` with whether its process lives (and, probed, answers)."""
    alive = rec.alive()
    entry["process"] = {True: "alive", False: "dead", None: "remote"}[alive]
    if probe:
        entry["health"] = probe_health(rec.url, timeout) if alive is not False else "dead"
    return entry


def effective_num_rollout(run: RunDir, frozen: int) -> tuple[int, str]:
    """``rollout.num_rollout`` as the run now has it, and where that comes from: the frozen
    ``config.yaml``, or ``extend.json`` (``slimectl extend``), unless a later ``slimectl rl``/``rollout``
    ran with another value of its own (``--set rollout.num_rollout``, saved in ``configs/STAGE.yaml``)."""
    import yaml

    from slimectl.contract.config import EXTEND_FILE, read_extension

    best, value, source = (run.path / "config.yaml"), frozen, "config.yaml"
    newest = best.stat().st_mtime if best.is_file() else 0.0
    ext = read_extension(run.path)  # a bad extend.json: status shows it as the config's error
    if ext is not None:
        newest = max(newest, (run.path / EXTEND_FILE).stat().st_mtime)
        value, source = ext["num_rollout"], EXTEND_FILE if ext["num_rollout"] != frozen else "config.yaml"
    for stage in ("rl", "rollout"):
        p = run.path / "configs" / f"{stage}.yaml"
        try:
            mtime = p.stat().st_mtime
            if mtime <= newest:
                continue
            n = (yaml.safe_load(p.read_text()) or {}).get("rollout", {}).get("num_rollout")
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        if isinstance(n, int) and n != value:
            newest, value, source = mtime, n, f"configs/{stage}.yaml" if n != frozen else "config.yaml"
    return value, source


def _fmt_metric(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_status(st: dict[str, Any]) -> str:
    lines = [f"run        {st['run_dir']}" + (f"  ({st['name']})" if st.get("name") else "")]
    lines.append(f"contract   v{st['contract_version']}, created {st['created']} by slimectl {st['slimectl_version']}")
    c = st.get("config")
    if c:
        lines.append(f"model      {c['model']} ({c['dtype']})")
        lines.append(
            f"algorithm  {c['advantage_estimator']}/{c['loss_type']}, lr {c['lr']:g}, "
            f"{c['num_rollout']} rollouts x {c['rollout_batch_size']} prompts x {c['n_samples_per_prompt']} samples"
        )
        lines.append(
            f"engines    {c['engine_backend']} x{c['num_engines']}; train tp={c['train_parallel']['tp']} "
            f"pp={c['train_parallel']['pp']}; sync {c['sync_transport']}"
        )
    else:
        lines.append(f"config     ERROR: {st.get('config_error')}")
    a, t = st["artifacts"], st["training"]
    target = t["num_rollout"]
    source = c.get("num_rollout_from", "config.yaml") if c else "config.yaml"
    if source == "extend.json":
        lines.append(f"extended   to {target} rollouts by `slimectl extend` (extend.json; config.yaml says "
                     f"{c['num_rollout_frozen']})")
    elif source != "config.yaml":
        lines.append(f"extended   to {target} rollouts by the last `slimectl {source[8:-5]}` "
                     f"(--set rollout.num_rollout; config.yaml says {c['num_rollout_frozen']})")
    of = f" of {target}" if target is not None else ""
    if t["trained_through"] is None:
        lines.append(f"training   nothing trained yet (0{of} rollouts); next to train: rollout 0")
    elif target is not None and t["next_to_train"] >= target:
        lines.append(f"training   done: trained through rollout {t['trained_through']} ({t['trained']}{of} rollouts)")
    else:
        lines.append(f"training   trained through rollout {t['trained_through']} ({t['trained']}{of} rollouts); "
                     f"next to train: rollout {t['next_to_train']}")
    r = a["rollouts"]
    if r["count"]:
        pending = st["rollouts_pending"]
        which = f"rollouts 0-{r['latest']}" if r["count"] == r["latest"] + 1 > 1 else f"newest {r['latest']}"
        lines.append(f"rollouts   {r['count']} generated ({which}); "
                     + (f"{pending} waiting to be trained" if pending else "none waiting to be trained"))
    else:
        lines.append("rollouts   none generated yet")
    k = a["checkpoints"]
    if k["count"]:
        what = ("the initial policy (converted)" if k["latest"] == 0 else
                f"the policy after training on rollouts 0-{k['latest'] - 1}" if k["latest"] > 1 else
                "the policy after training on rollout 0")
        lines.append(f"checkpoint newest {k['latest']}: {what}; {k['count']} kept")
    else:
        lines.append("checkpoint none yet")
    w = a["weights"]
    lines.append(f"weights    newest published version {w['latest']} (what engines sync to); {w['count']} kept"
                 if w["count"] else "weights    none published yet (engines serve the initial model, version 0)")
    e = a["evals"]
    lines.append(f"evals      newest at weight version {e['latest']}; {e['count']} kept" if e["count"]
                 else "evals      none yet")
    if st["engines"]:
        for e in st["engines"]:
            lines.append(
                f"engine     {e['id']} {e['url']} [{e['backend']}] pid {e['pid']}@{e['host']}: serving weight version "
                f"{e['weight_version']}{_behind(e['weight_version'], a['weights']['latest'])}; "
                f"health {e.get('health', e['process'])}"
            )
    else:
        lines.append("engines    none registered")
    for name, engines in st.get("engine_groups", {}).items():
        lines += [f"group      {name} (frozen): {e['id']} {e['url']} [{e['backend']}] pid {e['pid']}@{e['host']}: "
                  f"serving weight version {e['weight_version']}; health {e.get('health', e['process'])}"
                  for e in engines]
    for r in st.get("routers", []):
        lines.append(f"router     {r['id']} {r['url']} [sglang-router] pid {r['pid']}@{r['host']}: routes /generate to "
                     f"{len(r['workers'])} engine(s); health {r.get('health', r['process'])}")
    for stage, h in st["running"].items():
        state = "STALE" if h["stale"] else "running"
        lines.append(f"{stage:<10} {state}: pid {h['pid']}@{h['host']} since {h['acquired']} (heartbeat {h['heartbeat_age_s']} s ago)")
    lines += [f"staging    .staging/{d['name']}: {d['bytes']} bytes, writer {d['stage']} pid {d['pid']}@{d['host']} "
              f"not provably dead (removed at a stage's start once it is)" for d in st.get("staging_in_use", [])]
    lines += async_lines(st)
    for stage, m in st["last_metrics"].items():
        shown = ", ".join(f"{k}={_fmt_metric(v)}" for k, v in m.items() if k not in ("time",))
        lines.append(f"metrics    {stage}: {shown}")
    return "\n".join(lines)


def async_lines(st: dict[str, Any]) -> list[str]:
    """The ``staleness``, ``waiting`` and ``waits`` lines of :func:`format_status`."""
    a = st["async"]
    limit = "unknown (config error)" if a["max_staleness"] is None else str(a["max_staleness"])
    newest = "none" if a["newest_rollout"] is None else str(a["newest_rollout"])
    lines = [f"staleness  generation {a['ahead']} ahead of the weights (next rollout {a['next_rollout']}, newest "
             f"weights {a['newest_weights']}; newest rollout {newest}, train next {a['train_next']}); "
             f"rollout.max_staleness {limit} (async_mode {a['async_mode']})"]
    lines += [f"waiting    {w['who']} waits for {w['waits_for']}: {w['why']}" for w in a["waiting"]] or \
        ["waiting    nothing waits"]
    waits = st.get("waits")
    if waits is not None:
        shown = "; ".join(f"{stage} " + ", ".join(f"{k} {v:.2f} s" for k, v in kinds.items())
                          for stage, kinds in waits.items() if kinds)
        lines.append(f"waits      {shown or 'none'} (traces/: `slimectl trace` shows each)")
    return lines


def _behind(version: Any, newest: int | None) -> str:
    try:
        v = int(version)
    except (TypeError, ValueError):
        return ""
    newest = newest or 0
    return f" ({newest - v} behind the newest, {newest})" if v < newest else " (the newest)" if v == newest else ""


def status_json(st: dict[str, Any]) -> str:
    return json.dumps(st, indent=2, sort_keys=False, default=str)
