"""A safe arithmetic evaluator for multi graders' ``calculate_output``.

Parsed with ``ast`` and checked node by node: numbers, grader names, + - * / (binary and
unary), parentheses, min(...) and max(...). Nothing else (no attributes, calls to other names,
powers, comparisons) gets through, so a job body cannot run code on a worker. x / 0 is 0.
"""
from __future__ import annotations

import ast
import operator
from typing import Callable, Mapping

from engine.rewards.base import finite, shown

MAX_LENGTH = 1000
_BINOPS: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: lambda a, b: a / b if b != 0 else 0.0,
}
_FUNCS = {"min": min, "max": max}
ALLOWED = "numbers, grader names, + - * /, parentheses, min(...), max(...)"


class Expression:
    def __init__(self, source: object, names: set[str], where: str) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{where} must be an expression string, e.g. \"0.2 * format + answer\"")
        if len(source) > MAX_LENGTH:
            raise ValueError(f"{where} is longer than {MAX_LENGTH} characters; shorten it")
        self.where = where
        self.names = names
        try:
            tree = ast.parse(source.strip(), mode="eval")
        except (SyntaxError, RecursionError, ValueError) as exc:
            raise ValueError(f"{where} is not a valid expression ({exc}); allowed: {ALLOWED}") from None
        self._check(tree.body)
        self.tree = tree.body
        self.used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id not in _FUNCS}

    def _check(self, node: ast.AST) -> None:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise ValueError(f"{self.where}: constant {node.value!r} is not a number; allowed: {ALLOWED}")
            if not finite(node.value):
                raise ValueError(f"{self.where}: constant {shown(node.value)} is out of range; use a finite number "
                                 "below 1e308")
        elif isinstance(node, ast.Name):
            if node.id not in self.names:
                raise ValueError(f"{self.where}: unknown name {node.id!r}; the graders are "
                                 f"{', '.join(sorted(self.names)) or '(none)'}")
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            self._check(node.left)
            self._check(node.right)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            self._check(node.operand)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
              and node.args and not node.keywords):
            for arg in node.args:
                if isinstance(arg, ast.Starred):
                    raise ValueError(f"{self.where}: *args is not allowed; allowed: {ALLOWED}")
                self._check(arg)
        else:
            raise ValueError(f"{self.where}: {type(node).__name__} is not allowed; allowed: {ALLOWED}")

    def evaluate(self, values: Mapping[str, float]) -> float:
        return float(self._eval(self.tree, values))

    def _eval(self, node: ast.AST, values: Mapping[str, float]) -> float:
        if isinstance(node, ast.Constant):
            return float(node.value)
        if isinstance(node, ast.Name):
            return float(values[node.id])
        if isinstance(node, ast.BinOp):
            return _BINOPS[type(node.op)](self._eval(node.left, values), self._eval(node.right, values))
        if isinstance(node, ast.UnaryOp):
            v = self._eval(node.operand, values)
            return -v if isinstance(node.op, ast.USub) else v
        assert isinstance(node, ast.Call)
        return _FUNCS[node.func.id](self._eval(a, values) for a in node.args)
