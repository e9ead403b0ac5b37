"""Import a Python object named by a config value (``module:attr`` or ``module.attr``): the one loader."""

from __future__ import annotations

import importlib
from typing import Any

from slimectl.contract.errors import UsageError


def _one_line(text: object, limit: int = 300) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def import_object(path: str, what: str, error: type[Exception] = UsageError, callable_as: str | None = None) -> Any:
    """Import ``module:attr`` (``attr`` may be dotted) or ``module.attr``.

    Every failure raises ``error`` with one line starting ``{what} {path!r}``: a malformed path, a
    module that is missing or fails to import, a missing attribute, and — with ``callable_as`` (how
    the object is called, e.g. ``"a function (args, sample)"``) — an object that is not callable.
    """
    text = str(path or "").strip()
    if ":" in text:
        module_name, _, attr = text.partition(":")
    else:
        module_name, _, attr = text.rpartition(".")
    if not module_name or not attr:
        raise error(f"{what} {path!r} is not 'module:function' or 'module.function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise error(f"{what} {path!r}: no module named {e.name!r} (is its folder on PYTHONPATH?)") from None
        raise error(f"{what} {path!r}: importing {module_name!r} failed: {_one_line(e)}") from None
    except Exception as e:
        raise error(f"{what} {path!r}: importing {module_name!r} failed: {type(e).__name__}: {_one_line(e)}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{what} {path!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if callable_as is not None and not callable(obj):
        raise error(f"{what} {path!r} is not callable ({type(obj).__name__}); it must be {callable_as}")
    return obj
