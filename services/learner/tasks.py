"""Built-in tasks: small generated datasets that need no download.

``arithmetic``: one-step word problems ("Mia has 12 shells and finds 7 more. How many shells does Mia have
now?") with integer answers, generated from a seed. Rows have ``question`` and ``answer`` columns, like
GSM8K without the worked solution.
"""

from __future__ import annotations

import random

_NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max", "Lily", "Ben")
_THINGS = ("apples", "shells", "stickers", "marbles", "books", "coins", "cards", "pencils", "stamps", "rocks")
_ADD = (
    "{name} has {a} {things} and finds {b} more. How many {things} does {name} have now?",
    "{name} had {a} {things}. A friend gave {name} {b} {things}. How many {things} does {name} have?",
)
_SUB = (
    "{name} has {a} {things} and gives away {b}. How many {things} are left?",
    "{name} had {a} {things} and lost {b} of them. How many {things} does {name} have now?",
)


def arithmetic_rows(size: int, max_operand: int = 50, seed: int = 1234) -> list[dict[str, str]]:
    """``size`` word problems with answers in 0..2*max_operand."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        name, things = rng.choice(_NAMES), rng.choice(_THINGS)
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        if rng.random() < 0.5:
            question, answer = rng.choice(_ADD).format(name=name, things=things, a=a, b=b), a + b
        else:
            a, b = max(a, b), min(a, b)
            question, answer = rng.choice(_SUB).format(name=name, things=things, a=a, b=b), a - b
        rows.append({"question": question, "answer": str(answer)})
    return rows


BUILTIN_TASKS = {"arithmetic": arithmetic_rows}
