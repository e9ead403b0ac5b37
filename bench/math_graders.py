"""bench/math_graders.py — how often `math` (slime's semantics) and `math_verify` (Hugging Face's Math-Verify)
give the expected verdict on the same table of cases.

The table is tests/data/math_cases.jsonl: one case a line, ``answer`` (the response as a model writes it),
``label``, ``expected`` (1 or 0: the verdict the source suite asserts), ``source`` (math-verify, slime or
verl: the test suite the case is drawn from) and a short ``note``. Both graders get the same response and
label; a verdict is "agreed" when it equals ``expected``. Prints the agreement of each grader per source
and in all, then the cases where they differ (``--all``: every case). Needs the `math` extra.

    python bench/math_graders.py [--cases tests/data/math_cases.jsonl] [--all] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "data" / "math_cases.jsonl"
GRADERS = ("math", "math_verify")


def load_cases(path: Path = CASES) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def grade_cases(cases: list[dict]) -> list[dict]:
    """Each case with both graders' verdicts (1 / 0) added under ``math`` and ``math_verify``."""
    from slimectl.rewards.math_grader import grade_math
    from slimectl.rewards.math_verify import verify_sample

    out = []
    for case in cases:
        mv = verify_sample(case["answer"], case["label"])
        out.append({**case, "math": int(grade_math(case["answer"], case["label"]) > 0),
                    "math_verify": int(mv.reward > 0), "math_verify_timed_out": mv.timed_out})
    return out


def agreement(graded: list[dict]) -> dict[str, dict[str, tuple[int, int]]]:
    """{source or "all": {grader: (agreed, cases)}}."""
    sources = sorted({c["source"] for c in graded}) + ["all"]
    table = {}
    for src in sources:
        rows = [c for c in graded if src in ("all", c["source"])]
        table[src] = {g: (sum(c[g] == c["expected"] for c in rows), len(rows)) for g in GRADERS}
    return table


def report(graded: list[dict], show_all: bool) -> str:
    lines = ["| cases from | cases | `math` agrees | `math_verify` agrees |", "|---|---|---|---|"]
    for src, by in agreement(graded).items():
        n = by["math"][1]
        lines.append(f"| {src} | {n} | {by['math'][0]} | {by['math_verify'][0]} |")
    unboxed = sum(c["math"] != c["expected"] and "\\boxed" not in c["answer"] and "\\fbox" not in c["answer"]
                  for c in graded)
    lines.append(f"\n`math` misses on a response with no \\boxed{{}} (it grades only the last box): {unboxed}")
    lines.append("")
    shown = graded if show_all else [c for c in graded if c["math"] != c["math_verify"]]
    lines.append(f"{'every case' if show_all else 'cases where the graders differ'} ({len(shown)}): "
                 "expected / math / math_verify, source, note, answer | label")
    for c in shown:
        lines.append(f"  {c['expected']} / {c['math']} / {c['math_verify']}  {c['source']:<11} {c['note']:<40} "
                     f"{c['answer'][:70]!r} | {c['label']!r}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=Path, default=CASES)
    ap.add_argument("--all", action="store_true", help="list every case, not only those where the graders differ")
    ap.add_argument("--json", type=Path, help="write the graded cases here")
    a = ap.parse_args(argv)
    cases = load_cases(a.cases)
    t0 = time.perf_counter()
    graded = grade_cases(cases)
    print(report(graded, a.all))
    print(f"\n{len(cases)} cases graded by both in {time.perf_counter() - t0:.1f} s")
    if a.json:
        a.json.write_text(json.dumps(graded, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
