"""The `calculator` environment: a `calc` tool that evaluates an arithmetic expression (integers and
decimals, + - * / // % **, parentheses) without `eval`: the expression is parsed with `ast` and
only those operations are computed, with bounds on exponents and on the size of results."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from typing import Any

from furlong.rollout.environments.tool_environment import ToolEnvironment, ToolError

MAX_EXPRESSION_CHARS = 512
MAX_EXPONENT = 64
MAX_ABS_RESULT = 10**30

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression and return its value.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 123 * 456"}},
            "required": ["expression"],
        },
    },
}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ToolError naming what is not allowed."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError(f"expression must be a non-empty string, got {expression!r}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression has {len(expression)} characters, more than {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"{expression!r} is not an arithmetic expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))  # type: ignore[no-any-return]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        if isinstance(result, complex) or abs(result) > MAX_ABS_RESULT:
            raise ToolError(f"result {result} is out of range")
        return result  # type: ignore[no-any-return]
    raise ToolError(f"{ast.unparse(node)!r} is not allowed (numbers and + - * / // % ** only)")


def show(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


class CalculatorEnvironment(ToolEnvironment):
    tools = [CALC_TOOL]

    def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        if name != "calc":
            raise ToolError(f"unknown tool {name!r}")
        return show(evaluate(arguments.get("expression")))  # type: ignore[arg-type]
