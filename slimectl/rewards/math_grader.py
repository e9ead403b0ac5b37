r"""The ``math`` and ``deepscaler`` graders: last ``\boxed{}`` answer vs the label, 1.0 / 0.0.

Behaviour follows slime's ``slime/rollout/rm_hub/math_utils.py::grade_answer_verl`` (itself from
DeepScaleR / Hendrycks MATH) and ``deepscaler.py::get_deepscaler_rule_based_reward``:

1. the answer is the content of the last ``\boxed{...}`` (or ``\fbox{...}``) of the response; the
   label is used as is, or its own last box if it contains one; no box / empty label -> 0;
2. both are normalised (:func:`normalize_answer`) and compared as strings (case-insensitively);
3. failing that, sympy decides equivalence -- with slime's strictness: if either side is an
   integer both must be the same integer (``\sqrt{4}`` or ``2+2`` do not earn a ``4``), and two
   plain fractions must match exactly (an unreduced ``2/4`` does not earn ``1/2``);
   ``strict=False`` lifts both rules. Tuples/intervals are compared element-wise, brackets included.

Deliberate differences from slime (``docs/rewards.md``): ``6 \text{ and } 8`` is the list ``6,8``;
``32, 349`` (comma and space) is a list, not the number 32349; ``28 percent`` is ``28\%``;
``\geq``/``\ge``/``≥`` are ``>=`` (and ``x >= 5`` is no longer cut to ``5`` as an ``x =`` prefix);
a decimal of 6+ fractional digits equals a constant it rounds or truncates (``0.0833333333333333`` = ``1/12``).

Sympy never sees raw model text: :func:`_to_python` turns a short (<= :data:`MAX_SYMPY_CHARS`)
normalised answer into a whitelisted expression (numbers, + - * / ** and parentheses, ``sqrt``,
``pi``, a few functions, at most two one-letter variables, bounded exponents), parses it with an
empty builtins namespace and compares by high-precision numeric evaluation (exact for rationals,
at a few sample points for expressions with variables) instead of ``simplify``, so no input can
make it hang and no exception escapes.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from .boxed import last_boxed

#: Longest normalised answer that is handed to sympy.
MAX_SYMPY_CHARS = 120

# --------------------------------------------------------------------------------------------
# normalisation

_TEXT_CMD = r"\\(?:text|textrm|textnormal|textbf|mbox|mathrm|mathbf)"
_WHOLE_TEXT = re.compile(_TEXT_CMD + r"\{([^{}]*)\}")
_TRAILING_TEXT = re.compile(r"\s*" + _TEXT_CMD + r"\{[^{}]*\}(?:\s*\^\s*\{?\d\}?)?\s*$")
_INNER_TEXT = re.compile(_TEXT_CMD + r"\{([^{}]*)\}")
_UNIT_WORDS = (  # may touch the number: "5cm"
    "units?", "square units?", "sq units?", "cubic units?", "degrees?", "cm", "centimeters?", "mm",
    "millimeters?", "km", "kilometers?", "meters?", "metres?", "inch(?:es)?", "ft", "feet", "foot", "yards?",
    "miles?", "mph", "seconds?", "sec", "minutes?", "min", "hours?", "hrs?", "days?", "weeks?", "months?",
    "years?", "dollars?", "cents?", "pounds?", "lbs?", "kg", "grams?", "liters?", "ml", "points?", "ways",
    "people", "students", "integers?", "percent", "per cent", "pct",
)
_SHORT_UNITS = ("m", "s", "g", "in")  # need a space: "5 m" is metres, "5m" may be 5*m
_TRAILING_UNIT = re.compile(
    r"(?<=[\d})\].])(?:\s*(?:" + "|".join(_UNIT_WORDS) + r")|\s+(?:" + "|".join(_SHORT_UNITS) + r"))"
    r"\.?(?:\s*\^\s*\{?\d\}?)?\s*$", re.IGNORECASE)
_LEFT_RIGHT = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])")
_DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°|\\degree")
_SPACING = re.compile(r"\\(?:[,;: ]|q?quad)")
_FRAC_SHORT_2 = re.compile(r"\\frac\s*([0-9A-Za-z])\s*([0-9A-Za-z])")
_FRAC_SHORT_1 = re.compile(r"\\frac\s*([0-9A-Za-z])\s*\{")
_FRAC_SHORT_DEN = re.compile(r"(\\frac\{[^{}]*\})\s*([0-9A-Za-z])")
_SQRT_SHORT = re.compile(r"\\sqrt\s*([0-9A-Za-z])")
_LEADING_DOT = re.compile(r"(^|[^\d])\.(\d)")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d{1,3})?")
_INT = re.compile(r"-?\d+")
_SLASH_FRAC = re.compile(r"(-?)(\d+)/(\d+)")
_PLAIN_FRAC = re.compile(r"-?\\frac\{\d+\}\{\d+\}")
_AND_LIST = re.compile(r"\s*,?\s+and\s+")  # "6 and 8", "2, 3, and 4" (after \text{ and } is unwrapped)
_GE = re.compile(r"\\(?:geq?|geqslant)(?![A-Za-z])|≥")
_LE = re.compile(r"\\(?:leq?|leqslant)(?![A-Za-z])|≤")
_NE = re.compile(r"\\(?:neq?)(?![A-Za-z])|≠")
_BARE_EQ = re.compile(r"(?<![<>!=])=(?!=)")
#: A decimal with at least this many fractional digits earns a constant it is the rounding or the
#: truncation of (``0.0833333333333333`` earns ``1/12``); shorter ones stay exact (``0.333`` != ``1/3``).
LONG_DECIMAL_DIGITS = 6
_LONG_DECIMAL = re.compile(r"-?\d+\.(\d{%d,})" % LONG_DECIMAL_DIGITS)


def _canonical_number(s: str) -> str:
    """'+5' -> '5', '5.0' -> '5', '2.50' -> '2.5', '007' -> '7', '-0' -> '0'."""
    if len(s) > 60:
        return s
    try:
        d = Decimal(s)
    except InvalidOperation:
        return s
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def normalize_answer(answer: Any) -> str:
    r"""Normalise a math answer string for comparison (both the model's answer and the label).

    Strips ``\text{}``/``\mbox{}`` wrappers and trailing units (``\text{ cm}``, ``5 cm``), ``$``,
    ``\%``/``%``, degrees (``^\circ``, ``^{\circ}``, ``°``), ``\left``/``\right``, LaTeX spacing
    (``\!``, ``\,``, ``\;``, ``\quad``, ``~``), spaces, a trailing period and a short ``x =`` prefix;
    ``\dfrac``/``\tfrac`` become ``\frac``; ``\frac12`` and ``\sqrt3`` get their braces; thousands
    separators (``1,000``, ``1{,}000``, ``1\,000``) go; numbers become canonical (``5.0`` -> ``5``,
    ``.5`` -> ``0.5``); ``a/b`` and ``0.5`` become ``\frac{a}{b}`` and ``\frac{1}{2}``.
    """
    s = " ".join(str(answer).split())  # one space per run keeps every regex below linear
    m = _WHOLE_TEXT.fullmatch(s)
    if m:
        s = m.group(1).strip()
    s = s.replace("\\!", "").replace("\\\\", "\\")
    s = re.sub(r"\\[dt]frac", r"\\frac", s).replace("\\displaystyle", "")
    s = _LEFT_RIGHT.sub("", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.replace("\u2212", "-").replace("{,}", ",")
    s = " ".join(_SPACING.sub(" ", s).replace("~", " ").split())
    for _ in range(3):  # "5 \text{ cm}^2", "12 square units", "3\text{ m}\text{.}"
        before = s
        m = _TRAILING_TEXT.search(s)
        if m and re.search(r"[\d})\]]\s*$", s[: m.start()]):
            s = s[: m.start()]
        s = _TRAILING_UNIT.sub("", s).strip().rstrip(".").strip()
        if s == before:
            break
    s = _INNER_TEXT.sub(r"\1", s)
    s = _AND_LIST.sub(",", s)  # "6 \text{ and } 8" is the list 6,8
    s = _NE.sub("!=", _LE.sub("<=", _GE.sub(">=", s)))
    parts = _BARE_EQ.split(s)  # "x = 5" -> "5"; "x >= 5" stays an inequality
    if len(parts) == 2 and len(parts[0].strip()) <= 2:
        s = parts[1]
    list_commas = bool(re.search(r",\s", s))  # "32, 349" is a list of two numbers, not 32349
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = _FRAC_SHORT_2.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_SHORT_1.sub(r"\\frac{\1}{", s)
    s = _FRAC_SHORT_DEN.sub(r"\1{\2}", s)
    s = s.replace(" ", "").rstrip(".")
    s = _LEADING_DOT.sub(r"\g<1>0.\2", s)
    if _THOUSANDS.fullmatch(s) and not list_commas:
        s = s.replace(",", "")
    if _NUMBER.fullmatch(s):
        s = _canonical_number(s)
    m = _SLASH_FRAC.fullmatch(s)
    if m:
        s = f"{m.group(1)}\\frac{{{m.group(2)}}}{{{m.group(3)}}}"
    if s == "0.5":
        s = "\\frac{1}{2}"
    return s


# --------------------------------------------------------------------------------------------
# sympy, safely

_FRAC = re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}")
_SQRT_N = re.compile(r"\\sqrt\[([^\[\]{}]*)\]\{([^{}]*)\}")
_SQRT = re.compile(r"\\sqrt\{([^{}]*)\}")
_FUNCS = ("sqrt", "log", "ln", "exp", "sin", "cos", "tan")
_SAFE = re.compile(r"[0-9A-Za-z+\-*/(). ]*")
_POW_ATOM = re.compile(r"\s*[-+]?\s*[0-9A-Za-z.]+")
#: Upper bound on the product of all exponents (keeps exact big-integer powers small).
MAX_EXPONENT_PRODUCT = 10_000
_MIXED = re.compile(r"(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}")


def _exponent_bound(e: str) -> float:
    """An upper bound on the product of every exponent in ``e`` (inf for nested powers)."""
    bound = 1.0
    start = 0
    while (i := e.find("**", start)) >= 0:
        j = i + 2
        while j < len(e) and e[j] == " ":
            j += 1
        if j < len(e) and e[j] == "(":
            depth, k = 0, j
            while k < len(e):
                depth += {"(": 1, ")": -1}.get(e[k], 0)
                if depth == 0:
                    break
                k += 1
            group = e[j:k + 1]
        else:
            m = _POW_ATOM.match(e, j)
            group = m.group() if m else ""
        if "**" in group:
            return float("inf")
        # sums and products of numbers >= 2 never exceed the product of the numbers; letters count 4
        for n in re.findall(r"\d+", group):
            bound *= max(2, int(n[:6]))
        bound *= 4 ** len(re.findall(r"[A-Za-z]", group))
        start = j + max(len(group), 1)
    return bound


def _to_python(s: str) -> str | None:
    """A normalised LaTeX answer -> a whitelisted sympy-parsable string, or None if not allowed."""
    if not s or len(s) > MAX_SYMPY_CHARS:
        return None
    m = _MIXED.fullmatch(s)
    if m:  # a mixed number: 2\frac{1}{3} is 2 + 1/3 (as in slime)
        sign, whole, num, den = m.groups()
        return f"{sign}({whole}+({num})/({den}))"
    e = s.replace("\\pi", " pi ").replace("π", " pi ")
    e = re.sub(r"\\(?:cdot|times)", "*", e).replace("×", "*").replace("·", "*").replace("\\div", "/")
    e = re.sub(r"\\(ln|log|sin|cos|tan|exp)(?![A-Za-z])", r" \1 ", e)
    for _ in range(32):
        new = _FRAC.sub(r"((\1)/(\2))", e)
        new = _SQRT_N.sub(r"((\2)**(1/(\1)))", new)
        new = _SQRT.sub(r"sqrt(\1)", new)
        if new == e:
            break
        e = new
    if "\\" in e:
        return None
    e = e.replace("{", "(").replace("}", ")").replace("^", "**")
    if not _SAFE.fullmatch(e) or e.count("(") != e.count(")"):
        return None
    letters = set()
    for name in re.findall(r"[A-Za-z]+", e):
        if name in _FUNCS or name == "pi":
            continue
        if len(name) > 1:
            return None
        letters.add(name)
    if len(letters) > 2 or "***" in e or e.count("**") > 3 or re.search(r"\d{40}|\d\.?[eE][-+]?\d", e):
        return None
    if _exponent_bound(e) > MAX_EXPONENT_PRODUCT:
        return None
    return re.sub(r"\bln\b", "log", e)


def _parse(expr: str):
    import sympy
    from sympy.parsing.sympy_parser import (implicit_multiplication_application, parse_expr, rationalize,
                                            standard_transformations)

    names: dict[str, Any] = {"pi": sympy.pi, "sqrt": sympy.sqrt, "log": sympy.log, "exp": sympy.exp,
                             "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan}
    for name in re.findall(r"[A-Za-z]+", expr):
        if len(name) == 1:
            names[name] = sympy.Symbol(name)
    safe_globals = {"__builtins__": {}, "Integer": sympy.Integer, "Rational": sympy.Rational,
                    "Float": sympy.Float, "Symbol": sympy.Symbol}
    return parse_expr(expr, local_dict=names, global_dict=safe_globals,
                      transformations=standard_transformations + (implicit_multiplication_application, rationalize))


_POINTS = ((7, 3), (-5, 11), (13, 4), (2, 17))  # sample values (as p/q) for expressions with variables


def _close(a, b) -> bool | None:
    """True/False when both evaluate to finite numbers, None when they do not."""
    import sympy

    va, vb = sympy.N(a, 40), sympy.N(b, 40)
    if not (va.is_number and vb.is_number) or va.has(sympy.nan, sympy.zoo, sympy.oo, -sympy.oo) \
            or vb.has(sympy.nan, sympy.zoo, sympy.oo, -sympy.oo):
        return None
    diff = abs(complex(sympy.N(va - vb, 40)))  # computed at 40 digits; an exact identity leaves ~1e-40
    return diff <= 1e-25 * max(1.0, abs(complex(va)))


def _sympy_equal(given: str, truth: str) -> bool:
    """Numeric equivalence of two normalised answers; False on anything unexpected."""
    try:
        pg, pt = _to_python(given), _to_python(truth)
        if pg is None or pt is None:
            return False
        import sympy

        a, b = _parse(pg), _parse(pt)
        if not isinstance(a, sympy.Expr) or not isinstance(b, sympy.Expr):
            return False
        free = sorted(a.free_symbols | b.free_symbols, key=str)
        if not free:
            if a.is_Rational and b.is_Rational:
                return bool(a == b)
            return bool(_close(a, b))
        agree = 0
        for i in range(len(_POINTS)):
            subs = {sym: sympy.Rational(*_POINTS[(i + k) % len(_POINTS)]) for k, sym in enumerate(free)}
            verdict = _close(a.evalf(40, subs=subs), b.evalf(40, subs=subs))
            if verdict is False:
                return False
            agree += verdict is True
        return agree >= 2
    except Exception:  # sympy can raise almost anything on odd input; that is "not equal"
        return False


# --------------------------------------------------------------------------------------------
# comparison and graders

def _split_items(s: str) -> tuple[str, list[str]] | None:
    """'(1,2]' -> ('(]', ['1', '2']); '1,2' -> ('', ['1', '2']); None when not a list."""
    brackets = ""
    body = s
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        brackets, body = s[0] + s[-1], s[1:-1]
    items, depth, cur = [], 0, []
    for ch in body:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                return None  # "(1)+(2)": the outer pair is not one bracket
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    items.append("".join(cur))
    return (brackets, items) if len(items) > 1 else None


def _equivalent(given: str, truth: str, strict: bool) -> bool:
    if given == truth or given.lower() == truth.lower():
        return True
    if not given or not truth:
        return False
    if strict:
        if _INT.fullmatch(given) or _INT.fullmatch(truth):
            return False  # an integer answer must be that integer, written as one
        if _PLAIN_FRAC.fullmatch(given) and _PLAIN_FRAC.fullmatch(truth):
            return False  # unreduced or different fractions
    for dec, other in ((given, truth), (truth, given)):
        if _LONG_DECIMAL.fullmatch(dec):
            return _long_decimal_close(dec, other)
    return _sympy_equal(given, truth)


def _long_decimal_close(dec: str, other: str) -> bool:
    """A long decimal vs a constant expression: equal within one unit of the decimal's last digit."""
    try:
        po = _to_python(other)
        if po is None:
            return False
        import sympy

        b = _parse(po)
        if not isinstance(b, sympy.Expr) or b.free_symbols:
            return False
        digits = len(_LONG_DECIMAL.fullmatch(dec).group(1))
        v = sympy.N(b, 60)
        if not v.is_real or not v.is_finite:
            return False
        from decimal import ROUND_DOWN, ROUND_HALF_UP, localcontext

        with localcontext() as ctx:
            ctx.prec = 80
            exact = Decimal(str(v))
            unit = Decimal(1).scaleb(-digits)
            want = Decimal(dec)
            return want in (exact.quantize(unit, ROUND_HALF_UP), exact.quantize(unit, ROUND_DOWN))
    except Exception:
        return False


def answers_match(given: Any, truth: Any, *, strict: bool = True) -> bool:
    """Whether two extracted answers are the same (string after normalisation, else sympy)."""
    g, t = normalize_answer(given), normalize_answer(truth)
    if not g or not t:
        return False
    if g == t or g.lower() == t.lower():
        return True
    gs, ts = _split_items(g), _split_items(t)
    if gs is not None or ts is not None:
        if gs is None or ts is None or gs[0] != ts[0] or len(gs[1]) != len(ts[1]):
            return False
        return all(_equivalent(a, b, strict) for a, b in zip(gs[1], ts[1]))
    return _equivalent(g, t, strict)


def label_answer(label: Any) -> str | None:
    r"""The reference answer of a label: its last box if it has one; None for an empty label."""
    if label is None:
        return None
    if isinstance(label, float) and label.is_integer():
        label = int(label)
    s = str(label).strip()
    if "\\boxed" in s or "\\fbox" in s:
        s = last_boxed(s) or ""
    return s or None


def grade_math(response: str | None, label: Any, *, strict: bool = True) -> float:
    r"""1.0 if the last ``\boxed{}`` of ``response`` equals ``label`` (see the module doc), else 0.0."""
    truth = label_answer(label)
    given = last_boxed(response)
    if truth is None or not given:
        return 0.0
    return 1.0 if answers_match(given, truth, strict=strict) else 0.0


def grade_deepscaler(response: str | None, label: Any, *, strict: bool = True) -> float:
    r"""slime's ``deepscaler``: grade only the text after the last ``</think>`` (else after the first
    ``###Response``, up to a second one); 0.0 when neither marker is present."""
    if not response:
        return 0.0
    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[1]
    elif "###Response" in response:
        solution = response.split("###Response", 2)[1]
    else:
        return 0.0
    return grade_math(solution, label, strict=strict)
