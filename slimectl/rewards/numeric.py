r"""The ``last_number`` grader: the last number written in the response equals the label.

For models that answer arithmetic in plain words ("2 + 3 = 5", "1 + 1 is equal to 2.") and write
no ``\boxed{}`` (SmolLM2-135M-Instruct, for one): ``math`` gives them 0 on every sample, so a
group-relative estimator learns nothing. Numbers are read with an optional sign, thousands commas
and a decimal part (``-1,234.50``); a trailing full stop is not a decimal point. The label is read
the same way (its last number; ``\boxed{12}`` and ``12.0`` both give 12). Equal as numbers:
``5.0`` earns ``5``. No number in the response, or none in the label: 0.0. Returns 1.0 / 0.0.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

_NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|(?<![\w.])-?\d+(?:\.\d+)?(?!\d)")


def last_number(text: Any) -> Decimal | None:
    """The value of the last number in ``text``, or None when there is none."""
    if text is None:
        return None
    found = _NUMBER.findall(str(text))
    if not found:
        return None
    try:
        return Decimal(found[-1].replace(",", ""))
    except InvalidOperation:  # pragma: no cover - the pattern only matches valid numbers
        return None


def grade_last_number(response: str | None, label: Any) -> float:
    """1.0 if the last number of ``response`` equals the label's number, else 0.0."""
    truth, given = last_number(label), last_number(response)
    if truth is None or given is None:
        return 0.0
    return 1.0 if given == truth else 0.0


_GSM8K = re.compile(r"####\s*\$?\s*(-?[0-9][0-9.,]*)")


def gsm8k_answer(text: Any) -> Decimal | None:
    """The number after the last ``####`` of ``text`` (commas, ``$`` and a trailing full stop dropped)."""
    if text is None:
        return None
    found = _GSM8K.findall(str(text))
    if not found:
        return None
    try:
        return Decimal(found[-1].replace(",", "").rstrip("."))
    except InvalidOperation:
        return None


def grade_gsm8k(response: str | None, label: Any) -> float:
    """The ``gsm8k`` grader (GSM8K's own format, as verl's strict ``gsm8k`` reward): 1.0 if the number
    after the last ``#### `` of the response equals the label's number, else 0.0.

    The label may be the bare answer (``42``, ``1,000``) or a full GSM8K solution ending in
    ``#### 42``. A response without ``####`` scores 0.0 (the format is part of the task); numbers are
    compared as numbers (``#### 42.0`` earns ``42``, ``#### 1,000`` earns ``1000``)."""
    truth = gsm8k_answer(label) if label is not None and "####" in str(label) else last_number(label)
    given = gsm8k_answer(response)
    if truth is None or given is None:
        return 0.0
    return 1.0 if given == truth else 0.0
