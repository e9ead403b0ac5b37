"""xdist_group marks that hold under pytest 9: each group's tests go to one pytest-xdist worker.

pytest-xdist's `--dist loadgroup` (README command 2) tags a grouped test's node id ``ID@GROUP`` in the
worker and its scheduler sends all tests of a tag to one worker. pytest-xdist 3.8 sets the tag on
``item._nodeid``, which pytest 9 no longer reads (node ids are structured, ``item._id``), so under
pytest 9 every group is split without a word (pytest-xdist#1386, fix pending in #1388) and each worker
starts the set-ups the group shares (a Ray cluster, two SGLang engines and a router, a pair of torchrun
ranks). :func:`tag_xdist_groups` sets the tag where the installed pytest reads it, and tags a test
without a mark with its module, so that a module's module-scoped fixtures are built once, on one worker.
"""

from __future__ import annotations


def xdist_groups(item) -> set[str]:
    """The names of ITEM's xdist_group marks."""
    return {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}


def _tagged(nodeid: str) -> bool:
    return nodeid.rfind("@") > nodeid.rfind("]")  # how pytest-xdist's loadgroup scheduler reads a tag


def tag_xdist_groups(config, items, by_module: bool = False) -> None:
    """In an xdist worker under ``--dist loadgroup``: tag each grouped item's node id ``ID@GROUP`` if
    pytest-xdist's own hook (which runs before) could not; with ``by_module``, an item without a group
    is tagged with its module (``tests/e2e/test_rl.py`` -> ``@tests_e2e_test_rl``). Call from a trylast
    collection hook."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        groups = xdist_groups(item)
        if _tagged(item.nodeid) or not (groups or by_module):
            continue
        name = "_".join(sorted(groups)) if groups else item.nodeid.split("::")[0].removesuffix(".py").replace("/", "_")
        tagged = f"{item.nodeid}@{name}"
        if hasattr(item, "_id"):  # pytest 9: a structured id; parse() keeps the string it was given
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(tagged)
        else:
            item._nodeid = tagged
        assert item.nodeid == tagged, (item.nodeid, tagged)
