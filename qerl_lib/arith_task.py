"""The synthetic arithmetic task's problems (`data.source: synthetic`): each one a pure function of its
coordinates (seed, split, index, attempt), drawn with sha256 (`derive_seed`), so the data never depends
on a library's random stream. `qerl_lib.data.synthetic_examples` turns them into the prepared splits.
"""

from __future__ import annotations

from qerl_lib.seeds import derive_seed

_NAMES = [("Tom", "he"), ("Anna", "she"), ("Sam", "he"), ("Mia", "she"), ("Ben", "he"), ("Lily", "she")]
_OBJECTS = [("apple", "apples"), ("marble", "marbles"), ("pencil", "pencils"), ("sticker", "stickers"),
            ("book", "books"), ("cookie", "cookies"), ("coin", "coins"), ("shell", "shells")]  # fmt: skip

SYNTHETIC_LEVELS = {
    1: "one-digit a + b (0-9)",
    2: "two-digit a + b or a - b (10-99, a >= b)",
    3: "two-digit times one-digit a * b, or a sum of three two-digit numbers",
    4: "three-digit a + b, a - b (a >= b) or three-digit times one-digit a * b",
}
"""What each synthetic difficulty level draws."""


def level_space(level: int) -> int:
    """Number of distinct problems (operand tuples) a level can produce."""
    return {1: 10 * 10, 2: 90 * 90 + 90 * 91 // 2, 3: 90 * 8 + 90**3, 4: 900 * 900 + 900 * 901 // 2 + 900 * 8}[level]


class _Draw:
    """Uniform integer draws that are a pure function of their coordinates (sha256 via
    `derive_seed`), so the data never depends on a library's RNG stream."""

    def __init__(self, *coords: object):
        self.coords = coords

    def int(self, name: str, lo: int, hi: int) -> int:
        """An integer in [lo, hi]."""
        return lo + derive_seed(*self.coords, name) % (hi - lo + 1)

    def choice(self, name: str, items: list):
        return items[derive_seed(*self.coords, name) % len(items)]


def _count(n: int, obj: tuple[str, str]) -> str:
    return f"{n} {obj[0] if n == 1 else obj[1]}"


def _problem(level: int, d: _Draw) -> tuple[str, tuple]:
    """(operator, operands) of one problem of `level`."""
    if level == 1:
        return "+", (d.int("a", 0, 9), d.int("b", 0, 9))
    if level == 2:
        a, b = d.int("a", 10, 99), d.int("b", 10, 99)
        if d.int("op", 0, 1):
            return "-", (max(a, b), min(a, b))
        return "+", (a, b)
    if level == 3:
        if d.int("op", 0, 1):
            return "*", (d.int("a", 10, 99), d.int("b", 2, 9))
        return "+", (d.int("a", 10, 99), d.int("b", 10, 99), d.int("c", 10, 99))
    if level == 4:
        op = d.choice("op", ["+", "-", "*"])
        a = d.int("a", 100, 999)
        if op == "*":
            return "*", (a, d.int("b", 2, 9))
        b = d.int("b", 100, 999)
        return op, ((max(a, b), min(a, b)) if op == "-" else (a, b))
    raise ValueError(f"synthetic level {level} does not exist (levels: {sorted(SYNTHETIC_LEVELS)})")


def _value(op: str, operands: tuple) -> int:
    if op == "+":
        return sum(operands)
    if op == "-":
        return operands[0] - operands[1]
    return operands[0] * operands[1]


def _words(op: str, operands: tuple, d: _Draw) -> str:
    """A one-sentence word problem stating the computation."""
    name, pron = d.choice("name", _NAMES)
    obj = d.choice("obj", _OBJECTS)
    if op == "+" and len(operands) == 3:
        a, b, c = operands
        return (f"{name} picks {_count(a, obj)} on Monday, {b} on Tuesday and {c} on Wednesday. "
                f"How many {obj[1]} does {pron} pick in total?")  # fmt: skip
    a, b = operands
    if op == "+":
        return f"{name} has {_count(a, obj)} and gets {b} more. How many {obj[1]} does {name} have now?"
    if op == "-":
        return f"{name} has {_count(a, obj)} and gives away {b}. How many {obj[1]} does {name} have left?"
    return f"{name} has {a} bags with {_count(b, obj)} in each bag. How many {obj[1]} does {name} have in total?"


def _plain(op: str, operands: tuple) -> str:
    return "What is " + f" {op} ".join(str(x) for x in operands) + "?"


def synthetic_problem(seed: int, split: str, index: int, attempt: int, levels: list[int], style: str) -> tuple:
    """(key, question, answer, level) of one synthetic problem at its coordinates.

    `key` identifies the arithmetic (`"+:3,4"`) whatever the wording, so train and test
    can be kept disjoint in substance, not just in text.
    """
    d = _Draw(seed, "synthetic", split, index, attempt)
    level = d.choice("level", list(levels))
    op, operands = _problem(level, d)
    if style == "mixed":
        style = d.choice("style", ["plain", "words"])
    question = _plain(op, operands) if style == "plain" else _words(op, operands, d)
    key = f"{op}:{','.join(map(str, operands))}"
    return key, question, _value(op, operands), level
