"""Text graders: ``f1`` (SQuAD token F1), ``gpqa`` (multiple-choice letter) and ``random`` (tests).

- ``f1`` follows ``slime/rollout/rm_hub/f1.py``: lower-case, drop punctuation, drop the articles
  a/an/the, collapse whitespace, then token-overlap F1; when either side normalises to ``yes``,
  ``no`` or ``noanswer`` the other must be identical (else 0).
- ``gpqa`` follows ``slime/rollout/rm_hub/gpqa.py::compute_gpqa_reward``: drop the chain of thought
  (text up to the last ``</think>``), find the chosen option letter, compare with
  ``metadata["correct_letter"]`` or the label (a letter, a 0-based index, or the text of one of
  ``metadata["choices"]``); with no usable letter, fall back to finding the normalised correct
  choice text as a phrase in the response. Valid letters: ``metadata["valid_letters"]``, else one
  per choice, else A-J. Differences from slime (on purpose): an explicit ``\\boxed{X}`` wins, the
  *last* "answer is X" phrase wins (slime takes the first), the letter after "answer"/"option" must
  be a capital standing alone (slime's case-insensitive match reads "the answer is clearly B" as
  C), and only the last :data:`GPQA_TAIL` characters are read.
- ``random``: 0.0 or 1.0, a pure function of ``(seed, rid)`` (slime's is ``random.randint(0, 1)``).
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from typing import Any

from .boxed import last_boxed

# ------------------------------------------------------------------------------------- f1

_PUNCT = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_EXACT_ONLY = ("yes", "no", "noanswer")


def normalize_squad(text: str) -> str:
    """SQuAD normalisation: lower-case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", str(text).lower().translate(_PUNCT)).split())


def f1_components(prediction: str | None, label: Any) -> tuple[float, float, float]:
    """(f1, precision, recall) of ``prediction`` against ``label``."""
    if prediction is None or label is None:
        return 0.0, 0.0, 0.0
    pred, truth = normalize_squad(prediction), normalize_squad(label)
    if (pred in _EXACT_ONLY or truth in _EXACT_ONLY) and pred != truth:
        return 0.0, 0.0, 0.0
    pred_tokens, truth_tokens = pred.split(), truth.split()
    same = sum((Counter(pred_tokens) & Counter(truth_tokens)).values())
    if same == 0:
        return 0.0, 0.0, 0.0
    precision, recall = same / len(pred_tokens), same / len(truth_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall


def grade_f1(response: str | None, label: Any) -> float:
    """Token-level F1 between the (normalised) response and label."""
    return f1_components(response, label)[0]


# ------------------------------------------------------------------------------------- gpqa

GPQA_TAIL = 8192
_DEFAULT_LETTERS = tuple(string.ascii_uppercase[:10])
_LETTER = r"\(?\**([A-Z])\**\)?(?![A-Za-z0-9])"
_CUE = re.compile(
    r"(?i:final\s+answer|answer|option|choice)\s*(?:(?i:is)\s*)?(?:[:：]\s*)?(?:(?i:the\s+)?(?i:option|choice)\s*)?"
    + _LETTER)
_CORRECT = re.compile(r"(?<![A-Za-z0-9])\(?([A-Z])\)?\s+(?i:is\s+(?:the\s+)?correct)")
_STANDALONE = re.compile(r"\b([A-Z])\b")


def _norm_choice(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", str(text).lower()).strip()


def extract_choice(response: str | None, valid_letters=_DEFAULT_LETTERS) -> str | None:
    r"""The option letter a response picks: ``\boxed{C}``, else the last "answer: C" / "answer is (C)"
    / "C is correct", else the last standalone valid capital letter; None if nothing fits."""
    if not response:
        return None
    valid = {str(x).upper() for x in valid_letters}
    text = response.rsplit("</think>", 1)[-1][-GPQA_TAIL:]
    boxed = last_boxed(text)
    if boxed:
        m = re.fullmatch(r"\s*(?:\\text\{)?\s*\(?([A-Za-z])\)?\s*\}?\s*", boxed)
        if m and m.group(1).upper() in valid:
            return m.group(1).upper()
    for pattern in (_CUE, _CORRECT):
        hits = [h for h in pattern.findall(text) if h in valid]
        if hits:
            return hits[-1]
    for letter in reversed(_STANDALONE.findall(text)):
        if letter in valid:
            return letter
    return None


def grade_gpqa(response: str | None, label: Any, metadata: dict | None = None) -> float:
    """1.0 if the response picks the correct option (see the module doc), else 0.0."""
    if response is None:
        return 0.0
    metadata = metadata if isinstance(metadata, dict) else {}
    choices = metadata.get("choices")
    if isinstance(choices, dict):
        choices = list(choices.values())
    elif choices is not None:
        choices = list(choices)
    if metadata.get("valid_letters"):
        valid = [str(x).strip().upper() for x in metadata["valid_letters"]]
    elif choices:
        valid = list(string.ascii_uppercase[: len(choices)])
    else:
        valid = list(_DEFAULT_LETTERS)

    correct = metadata.get("correct_letter")
    correct = correct.strip().upper() if isinstance(correct, str) and correct.strip() else None
    label_text = label.strip() if isinstance(label, str) else None
    label_is_letter = bool(label_text) and len(label_text) == 1 and label_text.upper() in valid
    if correct is None:
        if label_is_letter:
            correct = label_text.upper()
        elif isinstance(label, (int, float)) and not isinstance(label, bool) and 0 <= int(label) < len(valid):
            correct = valid[int(label)]
        elif choices and label_text:
            wanted = _norm_choice(label_text)
            for i, choice in enumerate(choices):
                if i < len(valid) and _norm_choice(choice) == wanted:
                    correct = valid[i]
                    break

    picked = extract_choice(response, valid)
    if picked and correct:
        return 1.0 if picked == correct else 0.0

    targets = []
    if correct and choices and correct in valid and valid.index(correct) < len(choices):
        targets.append(choices[valid.index(correct)])
    targets += [metadata[k] for k in ("correct_answer", "answer_text") if metadata.get(k)]
    if label_text and not label_is_letter:
        targets.append(label_text)
    haystack = f" {_norm_choice(response.rsplit('</think>', 1)[-1][-GPQA_TAIL:])} "
    if any(t and f" {t} " in haystack for t in map(_norm_choice, targets)):
        return 1.0
    return 0.0


# ------------------------------------------------------------------------------------- random

def grade_random(response: str | None = None, label: Any = None, *, seed: Any = 0, rid: Any = None) -> float:
    """0.0 or 1.0, deterministic in ``(seed, rid)`` (``rid`` defaults to the response text)."""
    key = rid if rid is not None else response
    return float(random.Random(f"slimectl-random:{seed}:{key}").randint(0, 1))
