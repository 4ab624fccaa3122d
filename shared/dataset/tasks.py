"""Built-in tasks: small generated datasets that need no download.

Every task is a pure function ``rows(size, max_operand, seed)`` -> ``size`` rows with ``question`` and
``answer`` columns (the answer an integer as text, like GSM8K without the worked solution); the same seed
gives the same rows. ``max_operand`` (``data.builtin_max_operand``) bounds the task's numbers:

=============  =====================================================================================
arithmetic     one-step word problems ("Mia has 12 shells and finds 7 more. How many shells does Mia
               have now?"): operands 1..max_operand, answers 0..2*max_operand
sums           bare sums ("What is 4 + 7?"): operands 0..max_operand (9: single-digit sums)
products       bare products ("What is 6 times 7?"): operands 2..max_operand (9: the times tables)
compare        "Which number is larger, 37 or 52?": two different numbers in 1..max_operand (at least 2)
count_items    "How many items are in this list: cat, pen, sun?": 1..max_operand distinct words, at most
               as many as the word pool holds (``len(ITEMS)``)
count_letters  "How many letters are in the word "garden"?": common words of 2..max_operand letters
calculator     "What is 417 times 36?": a number with max_operand's digit count (999: 100..999) times one
               in 10..99, products a small model gets wrong mentally (the tool-use demo's task); never
               one of ``CALCULATOR_EXAMPLES``, the worked calls of configs/demo-tools-cpu.toml
=============  =====================================================================================
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

# A run draws its built-in task's training rows with seed ``data.shuffle_seed + TRAINING_SEED_OFFSET`` and its
# held-out problems (``eval_data = "held_out"``) from another stream, ``data.shuffle_seed + HELD_OUT_SEED_OFFSET``;
# the benchmarks that judge or train the same task outside a run use the same two.
TRAINING_SEED_OFFSET = 1234
HELD_OUT_SEED_OFFSET = 4321

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
_SUM = ("What is {a} + {b}?", "What is the sum of {a} and {b}?", "Add {a} and {b}.")
_PRODUCT = ("What is {a} times {b}?", "What is {a} x {b}?", "Multiply {a} by {b}.")
_COMPARE = ("Which number is larger, {a} or {b}?", "Which is bigger: {a} or {b}?")
_COUNT_ITEMS = ("How many items are in this list: {items}?", "Count the words in this list: {items}.")
_COUNT_LETTERS = ('How many letters are in the word "{word}"?', 'How many letters does the word "{word}" have?')
ITEMS = (
    "apple", "ball", "cat", "dog", "egg", "fish", "hat", "kite", "lamp", "moon",
    "nest", "pen", "ring", "sun", "tree", "cup", "box", "car", "bird", "cake",
)  # fmt: skip
WORDS = (
    "at", "go", "up", "me", "cat", "dog", "sun", "hat", "red", "box", "tree", "fish", "book", "milk", "star",
    "frog", "apple", "house", "green", "water", "chair", "bread", "garden", "yellow", "purple", "rabbit",
    "window", "orange", "teacher", "kitchen", "chicken", "blanket", "elephant", "umbrella", "computer",
    "sandwich", "dinosaur", "butterfly", "telephone", "chocolate", "basketball", "strawberry", "television",
)  # fmt: skip

Rows = list[dict[str, str]]


def _row(question: str, answer: int) -> dict[str, str]:
    return {"question": question, "answer": str(answer)}


def arithmetic_rows(size: int, max_operand: int = 50, seed: int = TRAINING_SEED_OFFSET) -> Rows:
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
        rows.append(_row(question, answer))
    return rows


def sums_rows(size: int, max_operand: int = 9, seed: int = TRAINING_SEED_OFFSET) -> Rows:
    """``size`` bare sums of two numbers in 0..max_operand."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append(_row(rng.choice(_SUM).format(a=a, b=b), a + b))
    return rows


def products_rows(size: int, max_operand: int = 9, seed: int = TRAINING_SEED_OFFSET) -> Rows:
    """``size`` bare products of two numbers in 2..max_operand (at least 2)."""
    rng = random.Random(seed)
    top = max(2, max_operand)
    rows = []
    for _ in range(size):
        a, b = rng.randint(2, top), rng.randint(2, top)
        rows.append(_row(rng.choice(_PRODUCT).format(a=a, b=b), a * b))
    return rows


def compare_rows(size: int, max_operand: int = 99, seed: int = TRAINING_SEED_OFFSET) -> Rows:
    """``size`` questions asking for the larger of two different numbers in 1..max_operand (at least 2)."""
    rng = random.Random(seed)
    top = max(2, max_operand)
    rows = []
    for _ in range(size):
        a, b = rng.sample(range(1, top + 1), 2)
        rows.append(_row(rng.choice(_COMPARE).format(a=a, b=b), max(a, b)))
    return rows


def count_items_rows(size: int, max_operand: int = 9, seed: int = TRAINING_SEED_OFFSET) -> Rows:
    """``size`` lists of 1..max_operand distinct words (capped at ``len(ITEMS)``), asking for their count."""
    rng = random.Random(seed)
    top = max(1, min(max_operand, len(ITEMS)))
    rows = []
    for _ in range(size):
        items = rng.sample(ITEMS, rng.randint(1, top))
        rows.append(_row(rng.choice(_COUNT_ITEMS).format(items=", ".join(items)), len(items)))
    return rows


def count_letters_rows(size: int, max_operand: int = 10, seed: int = TRAINING_SEED_OFFSET) -> Rows:
    """``size`` questions asking how many letters a common word of 2..max_operand letters has."""
    words = [w for w in WORDS if len(w) <= max(2, max_operand)]
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        word = rng.choice(words)
        rows.append(_row(rng.choice(_COUNT_LETTERS).format(word=word), len(word)))
    return rows


CALCULATOR_EXAMPLES = ((417, 36), (528, 73))  # the tool-use demo's worked calls: never a task row


def calculator_question(a: int, b: int) -> str:
    return f"What is {a} times {b}?"


def calculator_rows(size: int, max_operand: int = 999, seed: int = TRAINING_SEED_OFFSET) -> Rows:
    """``size`` products of a number with as many digits as ``max_operand`` (up to it) and one in 10..99,
    none of them a worked example's (``CALCULATOR_EXAMPLES``)."""
    rng = random.Random(seed)
    low = 10 ** (len(str(max_operand)) - 1)
    examples = {calculator_question(a, b) for a, b in CALCULATOR_EXAMPLES}
    rows: Rows = []
    while len(rows) < size:
        a, b = rng.randint(low, max_operand), rng.randint(10, 99)
        if calculator_question(a, b) not in examples:
            rows.append(_row(calculator_question(a, b), a * b))
    return rows


BUILTIN_TASKS: dict[str, Callable[[int, int, int], Rows]] = {
    "arithmetic": arithmetic_rows,
    "sums": sums_rows,
    "products": products_rows,
    "compare": compare_rows,
    "count_items": count_items_rows,
    "count_letters": count_letters_rows,
    "calculator": calculator_rows,
}


def training_rows(task: str, size: int, max_operand: int, shuffle_seed: int) -> Rows:
    """The training rows of built-in ``task`` in a run with ``data.shuffle_seed`` = ``shuffle_seed``."""
    return BUILTIN_TASKS[task](size, max_operand, shuffle_seed + TRAINING_SEED_OFFSET)


def held_out_rows(task: str, size: int, max_operand: int, seed: int, exclude: Sequence[dict[str, str]] = ()) -> Rows:
    """``size`` rows of ``task`` from ``seed`` whose questions are not among ``exclude``'s (the training rows)
    where the task has that many other questions; else the rest are drawn without that condition (a small
    task such as single-digit sums has fewer distinct questions than a training set)."""
    generate = BUILTIN_TASKS[task]
    seen = {row["question"] for row in exclude}
    fresh: Rows = []
    for row in generate(50 * size, max_operand, seed):
        if row["question"] not in seen:
            fresh.append(row)
            seen.add(row["question"])
            if len(fresh) == size:
                return fresh
    return fresh + generate(size - len(fresh), max_operand, seed + 1)
