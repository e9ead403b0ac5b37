"""docs/config.md is generated from the config schema (scripts/config_doc.py) and must not drift from it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from slimectl.contract.config_schema import SECTIONS, SlimectlConfig
from tests.helpers import ROOT

SCRIPT = ROOT / "scripts" / "config_doc.py"
_spec = importlib.util.spec_from_file_location("config_doc", SCRIPT)
config_doc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(config_doc)


def test_docs_config_md_matches_the_schema():
    assert config_doc.DOC_PATH.is_file(), f"docs/config.md is missing; run `{config_doc.REGENERATE}`"
    assert config_doc.DOC_PATH.read_text(encoding="utf-8") == config_doc.render_config_doc(), (
        f"docs/config.md is out of date with slimectl/contract/config_schema.py; run `{config_doc.REGENERATE}`")


def test_every_key_has_a_row_with_type_default_and_choices():
    text = config_doc.render_config_doc()
    for section in SECTIONS:
        model = SlimectlConfig.model_fields[section].annotation
        assert f"## `{section}`" in text
        for name in model.model_fields:
            assert f"| `{section}.{name}` |" in text, f"{section}.{name} has no row"
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| `")}
    assert rows["| `rollout.top_p`"].startswith("| `rollout.top_p` | float | `1.0` | > 0, <= 1 |")
    assert rows["| `sync.transport`"].startswith("| `sync.transport` | str | `\"disk\"` | `disk`, `distributed` |")
    assert "| How many rollouts (RL iterations) the run makes. |" in rows["| `rollout.num_rollout`"]
    assert rows["| `rollout.max_staleness`"].startswith("| `rollout.max_staleness` | int \\| null | `null` | >= 0 |")


def test_check_mode_names_the_command_that_regenerates(tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text("# old\n")
    assert config_doc.main(["--check", str(stale)]) == 1
    assert "run `python scripts/config_doc.py`" in capsys.readouterr().err
    assert config_doc.main([str(stale)]) == 0 and config_doc.main(["--check", str(stale)]) == 0


def test_the_script_runs_as_the_page_says():
    """`python scripts/config_doc.py --check`, from the top of the checkout: what docs/config.md names."""
    res = subprocess.run([sys.executable, "scripts/config_doc.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert f"`{config_doc.REGENERATE}`" in config_doc.DOC_PATH.read_text(encoding="utf-8").splitlines()[2]


def test_every_key_has_a_description():
    """A new key needs the docstring under it: that is its line in docs/config.md."""
    missing = [f"{prefix}{name}" for prefix, model in [("", SlimectlConfig)] + [
        (f"{s}.", SlimectlConfig.model_fields[s].annotation) for s in SECTIONS]
        for name, field in model.model_fields.items() if name not in SECTIONS and not field.description]
    assert not missing, f"config keys without a docstring in slimectl/contract/config_schema.py: {', '.join(missing)}"
