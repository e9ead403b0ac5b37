"""The flag table of ``init --from-slime`` (slimectl.stages.init.slime_flags): every key it names is a
schema key, and each flag has one entry."""

from __future__ import annotations

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.stages.init.slime_flags import FLAGS, PREFIXES, Flag, Translator, flag_spec


def test_every_key_the_table_sets_is_a_schema_key_or_reported_as_missing():
    """A misspelt key would only show up as "slimectl has no X yet" in the report; these three are the
    flags slimectl knows but has no key for yet (the report says so)."""
    t = Translator(SlimectlConfig, seen={})
    named = {dotted for spec in FLAGS.values() for dotted in spec.keys}
    assert {dotted for dotted in named if not t.has_key(dotted)} == {
        "rollout.eval_top_p", "rollout.eval_reward_key", "logging.wandb_group"}


def test_each_entry_does_one_thing_and_prefixes_come_after_the_names():
    for flag, spec in FLAGS.items():
        kinds = [bool(spec.keys), spec.not_needed is not None, spec.not_mapped is not None, spec.rule is not None]
        assert sum(kinds) <= 1, flag
        assert bool(spec.keys) == (spec.convert is not None), flag
    assert flag_spec("--sglang-mem-fraction-static").keys == ("engine.mem_fraction_static",)  # the name wins
    assert flag_spec("--sglang-context-length") is PREFIXES[0][1]
    assert flag_spec("--no-such-flag") == Flag(not_mapped="no slimectl equivalent", late=True)
