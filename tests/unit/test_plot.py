"""slimectl plot: curves from the metrics files, a PNG written atomically, the text reward curve."""

from __future__ import annotations

import json

from slimectl.stages.plot import first_last_gain, load_curves, reward_table


def write(path, recs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_plot_writes_png_and_prints_the_curve(cli, run_dir):
    write(run_dir.metrics_path("rollout"), [{"step": i, "rollout/reward_mean": i / 10, "rollout/response_len_mean": 5 + i}
                                           for i in range(10)] + [{"step": 3, "rollout/reward_mean": 0.9,
                                                                   "rollout/response_len_mean": 1}])
    write(run_dir.metrics_path("train"), [{"step": i + 1, "train/ppo_kl": 0.01 * i, "perf/train_time": 0.5}
                                          for i in range(10)])
    write(run_dir.metrics_path("rl"), [{"step": i, "perf/rl_step_time": 1.0 + i} for i in range(10)])
    curves = load_curves(run_dir)
    assert dict(curves.reward)[3] == 0.9 and len(curves.reward) == 10  # a regenerated rollout replaces the old record
    assert curves.kl_name == "train/ppo_kl" and curves.step_time[-1] == (9, 10.0)
    res = cli("plot", "-r", run_dir.path)
    assert res.exit_code == 0, res.output
    png = run_dir.path / "plots" / "curves.png"
    assert res.output.strip().splitlines()[-1] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "first 20% of rollouts 0.050, last 20% 0.850 (+0.800)" in res.output
    assert not list(png.parent.glob(".*tmp*"))


def test_reward_table_and_gain():
    reward = [(i, float(i % 2)) for i in range(20)]
    table = reward_table(reward, rows=4)
    assert table.splitlines()[1].startswith("   0-4 ") and len(table.splitlines()) == 5
    assert first_last_gain([(0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0), (4, 1.0)]) == (0.0, 1.0)


def test_plot_without_metrics_fails_cleanly(cli, run_dir):
    res = cli("plot", "-r", run_dir.path)
    assert res.exit_code == 1 and "has no rollout metrics yet" in res.output
