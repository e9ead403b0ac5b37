"""Graders that beat slime's on the cases slime (and Math-Verify-style checks) miss,
keeping slime's answers where slime is right. Each case is one (response box, label, expected)."""

from __future__ import annotations

import pytest

from slimectl.rewards import compute_reward, rm_types
from slimectl.rewards.hub import RewardInput
from slimectl.rewards.math_grader import grade_math
from slimectl.rewards.numeric import grade_gsm8k


@pytest.mark.parametrize("boxed, label, expected", [
    # lists written with "and" (slime passes; slimectl failed)
    (r"6 \text{ and } 8", "6,8", 1.0),
    (r"2, 3, \text{and } 4", "2,3,4", 1.0),
    (r"6 \text{ and } 9", "6,8", 0.0),
    # a comma and a space separate list items: no thousands-comma false positive (slime: 1.0)
    ("32, 349", "32349", 0.0),
    ("32,349", "32349", 1.0),  # a thousands comma without a space still is one (slime agrees)
    (r"1{,}000", "1000", 1.0),
    # percent in words
    ("28 percent", r"28\%", 1.0),
    ("28 per cent", "28", 1.0),
    ("29 percent", r"28\%", 0.0),
    # inequality notation
    (r"x \geq 5", "x >= 5", 1.0),
    (r"x \ge 5", r"x\geq 5", 1.0),
    ("x ≥ 5", "x>=5", 1.0),
    (r"x \leq 5", "x >= 5", 0.0),
    ("x >= 5", "5", 0.0),  # an inequality is not its bound (slimectl used to cut 'x >' as an 'x =' prefix)
    ("x = 5", "5", 1.0),
    # long decimals (6+ fractional digits) earn the constant they round or truncate
    ("0.0833333333333333", "1/12", 1.0),
    ("0.3333333333", r"\frac{1}{3}", 1.0),
    ("0.333333", r"\frac{1}{3}", 1.0),
    ("0.333", r"\frac{1}{3}", 0.0),  # short decimals stay exact, as slime
    ("0.0833334", "1/12", 0.0),  # neither the rounding (…333) nor the truncation
    ("0.6666667", "2/3", 1.0),  # rounded
    ("0.6666666", "2/3", 1.0),  # truncated
    ("0.9999999", "1", 0.0),  # an integer label still needs the integer (slime's strictness)
    ("1.4142135623", r"\sqrt{2}", 1.0),
])
def test_math_graders_beat_slime(boxed, label, expected):
    assert grade_math(f"so \\boxed{{{boxed}}}", label) == expected


@pytest.mark.parametrize("response, label, expected", [
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72", 1.0),
    ("... so the total is $1,000.\n#### 1,000", "She earns ... #### 1000", 1.0),
    ("#### 42.0", "42", 1.0),
    ("#### $42.", "42", 1.0),
    ("#### -3", "-3", 1.0),
    ("The answer is 42.", "42", 0.0),  # no #### -> 0 (the format is part of GSM8K)
    ("#### 41\nwait, #### 42", "42", 1.0),  # the last ####
    ("#### 43", "42", 0.0),
    ("#### 42", None, 0.0),
])
def test_gsm8k_grader(response, label, expected):
    assert grade_gsm8k(response, label) == expected


def test_gsm8k_is_a_hub_name():
    assert "gsm8k" in rm_types()
    import asyncio

    assert asyncio.run(compute_reward(RewardInput(response="#### 7", label="7"), rm_type="gsm8k")) == 1.0
