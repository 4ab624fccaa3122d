"""The reference calculator environment of ``make demo-tools`` (docs/concepts/multi-turn-design.md §3 step 19), in TRL's
``environment_factory`` shape: ``[environment] python = "calculator_env:CalculatorEnv"`` (found beside the
configuration file).

``calculate`` evaluates arithmetic exactly and safely: the expression is parsed with :mod:`ast` and only numbers,
``+ - * / // % **``, unary signs and parentheses are evaluated (no names, calls or attributes), with bounded
exponents and results. Anything else raises ValueError, which the model reads as ``{"error": "ValueError: ..."}``.

There is no ``get_reward``: the environment never sees the model's final answer, so the reward comes from the
scorer (the task's ``answer`` column), and the environment gives none.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

MAX_EXPONENT = 100  # 10**100 is already far past any answer the demo asks for
MAX_RESULT_DIGITS = 60  # keeps every intermediate result small (and its text short)
MAX_EXPRESSION_CHARS = 200

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _checked(value: int | float) -> int | float:
    if isinstance(value, int) and len(str(abs(value))) > MAX_RESULT_DIGITS:
        raise ValueError(f"the result has more than {MAX_RESULT_DIGITS} digits")
    if isinstance(value, float) and (value != value or abs(value) > 10.0**MAX_RESULT_DIGITS):
        raise ValueError("the result is not a finite number of reasonable size")
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponents are at most {MAX_EXPONENT} in size")
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError for anything that is not plain arithmetic."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None
    return _evaluate(tree.body)


class CalculatorEnv:
    """One calculator per trajectory; ``reset`` keeps the task's answer (if the row has one) for logs."""

    def __init__(self) -> None:
        self.answer: str | None = None

    def reset(self, **row: Any) -> None:
        answer = row.get("answer")
        self.answer = None if answer is None else str(answer)
        return None

    def calculate(self, expression: str) -> str:
        """
        Evaluate an arithmetic expression exactly.

        Args:
            expression: Numbers combined with + - * / // % ** and parentheses, e.g. "(12 + 3) * 47".

        Returns:
            The value of the expression.
        """
        value = evaluate(expression)
        if isinstance(value, float) and value.is_integer():
            return str(int(value))
        return str(value)
