r"""The ``dapo`` grader: slime's ``math_dapo_utils.compute_score`` (Minerva-style "Answer:" lines).

Behaviour (``slime/rollout/rm_hub/math_dapo_utils.py``):

- only the last :data:`DAPO_TAIL` (300) characters of the response are read;
- the prediction is the last ``Answer: <rest of line>`` there (case-insensitive ``answer``; any
  spaces around the colon); none -> ``"[INVALID]"``;
- prediction and label go through :func:`normalize_dapo` (keep what follows the last ``=``, drop
  spaces, ``$``, units and filler words, unwrap ``\text``/``\textbf``/``\overline``/``\boxed``,
  ``<|im_end|>`` and friends, thousands commas in integers);
- the label is integral in DAPO-Math, so it becomes ``str(int(float(label)))``;
- result: ``{"score": 1.0 | -1.0, "acc": bool, "pred": str}`` -- use ``reward_key="score"``.

Deliberate differences: a label that is not a number is compared as a normalised string (slime
raises ``ValueError``), and a non-integral numeric label keeps its fraction part (slime truncates
``2.5`` to ``2``). ``strict_box=True`` is slime's ``strict_box_verify`` (exact ``\boxed{}`` content
in the last 100 characters).
"""

from __future__ import annotations

import re
from typing import Any

from .boxed import last_boxed

DAPO_TAIL = 300
INVALID = "[INVALID]"

_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)

# (old, new), applied in order, as plain string replacements.
_REPLACE = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
# Removed outright (units, filler words, dots, degree signs, chat end tokens, ...).
_DROP = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots", "<|im_end|>", "<|endoftext|>",
)
_DOLLAR_MATH = re.compile(r"^.*?\$(.*?)\$.*$", re.DOTALL)
_UNWRAP = tuple(re.compile(p) for p in (r"\\text\{(.*?)\}", r"\\textbf\{(.*?)\}", r"\\overline\{(.*?)\}"))
_UNBOX = re.compile(r"\\boxed\{(.*)\}")
_FRAC_SHORT = re.compile(r"frac([^{])(.)")
_SQRT_SHORT = re.compile(r"sqrt([^{])")


def normalize_dapo(answer: Any) -> str:
    """Normalise a final answer the way DAPO's Minerva checker does."""
    s = str(answer).split("=")[-1]
    for old, new in _REPLACE:
        s = s.replace(old, new)
    for junk in _DROP:
        s = s.replace(junk, "")
    s = _DOLLAR_MATH.sub(r"$\1$", s, count=1) if s.count("$") >= 2 else s
    for pat in _UNWRAP:
        s = pat.sub(r"\1", s)
    s = _UNBOX.sub(r"\1", s)
    s = _FRAC_SHORT.sub(r"frac{\1}{\2}", s)
    s = _SQRT_SHORT.sub(r"sqrt{\1}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def _label_text(label: Any) -> str:
    gt = normalize_dapo(label)
    try:
        value = float(gt)
    except (TypeError, ValueError, OverflowError):
        return gt
    if value != value or value in (float("inf"), float("-inf")):
        return gt
    return str(int(value)) if value.is_integer() else gt


def grade_dapo(response: str | None, label: Any, *, strict_box: bool = False) -> dict:
    """``{"score": 1.0 or -1.0, "acc": bool, "pred": str}`` for one response (see the module doc)."""
    text = (response or "")[-DAPO_TAIL:]
    if strict_box:
        pred = last_boxed(text[-100:])
        acc = pred is not None and pred == str(label)
        return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred if pred is not None else INVALID}
    found = _ANSWER_LINE.findall(text)
    pred = normalize_dapo(found[-1] if found else INVALID)
    acc = pred == _label_text(label)
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}
