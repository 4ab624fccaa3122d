"""Built-in tasks: deterministic from their seed, the right size, answers that are right."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from shared.dataset.tasks import (
    BUILTIN_TASKS,
    CALCULATOR_EXAMPLES,
    ITEMS,
    WORDS,
    arithmetic_rows,
    calculator_rows,
    compare_rows,
    count_items_rows,
    count_letters_rows,
    held_out_rows,
    products_rows,
    sums_rows,
)


def _digest(rows: list[dict[str, str]]) -> str:
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def test_arithmetic_rows_are_unchanged():
    # Digests of the rows before the other tasks were added: a saved run's data must not move.
    demo = "9a8995d089e4bebae46196369bbab377d3f541d0cc269a074af1d886263136a6"
    assert _digest(arithmetic_rows(2000, 50, 1234)) == demo
    assert _digest(arithmetic_rows(200, 9, 7)) == "1dc7f5875ad1b67dc4dfc1d47cea676f54f05cfbe8a15a81928106e66e5d09a3"
    assert arithmetic_rows(1, 50, 1234) == [
        {"question": "Max has 6 shells and gives away 1. How many shells are left?", "answer": "5"}
    ]


@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
@pytest.mark.parametrize("max_operand", [1, 2, 9, 20, 50])
def test_every_task_is_seeded_sized_and_called_as_the_feeder_calls_it(name, max_operand):
    generate = BUILTIN_TASKS[name]
    rows = generate(300, max_operand, 1234)  # positionally, as feeder.load_rows calls it
    assert len(rows) == 300 and generate(0, max_operand, 1234) == []
    assert rows == generate(300, max_operand, 1234)
    assert rows != generate(300, max_operand, 1235) or max_operand == 1
    for row in rows:
        assert set(row) == {"question", "answer"}
        assert row["question"] and row["answer"].isdigit()


def _numbers(question: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", question)]


@pytest.mark.parametrize("max_operand", [9, 20])
def test_arithmetic_answers(max_operand):
    for row in arithmetic_rows(500, max_operand, 3):
        a, b = _numbers(row["question"])
        assert min(a, b) >= 1 and max(a, b) <= max_operand
        adds = "more" in row["question"] or "gave" in row["question"]
        assert int(row["answer"]) == (a + b if adds else a - b)


@pytest.mark.parametrize("max_operand", [9, 20])
def test_sums_answers(max_operand):
    rows = sums_rows(500, max_operand, 3)
    for row in rows:
        a, b = _numbers(row["question"])
        assert 0 <= a <= max_operand and 0 <= b <= max_operand
        assert int(row["answer"]) == a + b
    assert max(int(r["answer"]) for r in rows) == 2 * max_operand  # the whole range is drawn


def test_single_digit_sums_cover_every_pair():
    pairs = {tuple(_numbers(r["question"])) for r in sums_rows(2000, 9, 1234)}
    assert len(pairs) == 100


def test_products_answers():
    rows = products_rows(500, 9, 3)
    for row in rows:
        a, b = _numbers(row["question"])
        assert 2 <= a <= 9 and 2 <= b <= 9
        assert int(row["answer"]) == a * b
    assert products_rows(20, 1, 3)[0]["answer"] == "4"  # at least 2 x 2


def test_compare_answers():
    for row in compare_rows(500, 99, 3):
        a, b = _numbers(row["question"])
        assert a != b and min(a, b) >= 1 and max(a, b) <= 99
        assert int(row["answer"]) == max(a, b)
    assert {r["answer"] for r in compare_rows(50, 1, 3)} == {"2"}  # 1 and 2, the smallest it can ask


def test_count_items_answers():
    rows = count_items_rows(500, 9, 3)
    for row in rows:
        items = row["question"].split(": ", 1)[1].rstrip("?.").split(", ")
        assert len(set(items)) == len(items) and set(items) <= set(ITEMS)
        assert int(row["answer"]) == len(items)
    assert {int(r["answer"]) for r in rows} == set(range(1, 10))
    assert max(int(r["answer"]) for r in count_items_rows(500, 1000, 3)) == len(ITEMS)  # capped by the pool


def test_count_letters_answers():
    rows = count_letters_rows(500, 6, 3)
    for row in rows:
        [word] = re.findall(r'"([a-z]+)"', row["question"])
        assert word in WORDS and len(word) <= 6
        assert int(row["answer"]) == len(word)
    assert count_letters_rows(5, 1, 3)[0]["answer"] == "2"  # the shortest words still


def test_held_out_rows_avoid_the_training_questions_while_there_are_others():
    training = compare_rows(2000, 99, 1234)
    held_out = held_out_rows("compare", 200, 99, 99, training)
    assert len(held_out) == 200 and held_out == held_out_rows("compare", 200, 99, 99, training)
    questions = {r["question"] for r in held_out}
    assert len(questions) == 200 and not questions & {r["question"] for r in training}


def test_held_out_rows_of_a_small_task_still_have_the_size():
    training = sums_rows(2000, 9, 1234)  # every single-digit sum in every wording
    held_out = held_out_rows("sums", 200, 9, 99, training)
    assert len(held_out) == 200
    assert all(int(r["answer"]) == sum(_numbers(r["question"])) for r in held_out)


def test_calculator_products_are_right_in_range_and_never_a_worked_example():
    rows = calculator_rows(5000, 999, 1234)
    examples = {f"What is {a} times {b}?" for a, b in CALCULATOR_EXAMPLES}
    for row in rows:
        a, b = _numbers(row["question"])
        assert row["question"] == f"What is {a} times {b}?" and row["answer"] == str(a * b)
        assert 100 <= a <= 999 and 10 <= b <= 99
        assert row["question"] not in examples
    assert len({r["question"] for r in rows}) > 4800  # 81,000 possible products: nearly all distinct
    assert all(10 <= _numbers(r["question"])[0] <= 99 for r in calculator_rows(200, 99, 1))  # 2-digit x 2-digit


def test_calculator_draws_again_where_the_draw_is_a_worked_example():
    """Seed 136's 21st draw is a worked example's operands: that row is drawn again, not kept."""
    import random

    rng = random.Random(136)
    draws = [(rng.randint(100, 999), rng.randint(10, 99)) for _ in range(30)]
    assert draws[20] in CALCULATOR_EXAMPLES  # the raw stream does hit an example
    rows = calculator_rows(30, 999, 136)
    assert [r["question"] for r in rows[:20]] == [f"What is {a} times {b}?" for a, b in draws[:20]]
    assert rows[20]["question"] == "What is {} times {}?".format(*draws[21])


def test_calculator_held_out_rows_are_new_problems():
    """As read_held_out draws them for eval_data = "held_out": none a training row, none a worked example."""
    training = calculator_rows(2000, 999, 1234)
    held_out = held_out_rows("calculator", 100, 999, 4321, training)
    questions = {r["question"] for r in held_out}
    assert len(questions) == 100 and not questions & {r["question"] for r in training}
    assert not questions & {f"What is {a} times {b}?" for a, b in CALCULATOR_EXAMPLES}
