"""Families of generated Python tasks: one function to write from a one-line spec.

A family draws parameters (the function's name and one or two constants) and from them makes
the prompt, the stub the agent starts from, the reference body, and the inputs whose expected
outputs it computes here, in Python, never by running the reference. Every constant of the
solution is in the prompt, so a policy that reads and copies carefully solves a task it never
saw; a slip (`slipped`) changes one constant, so the expert's demonstrations can fail the
way a careless policy does.

    family = FAMILIES["affine"]
    params = family.draw(random.Random(0))  # {"fn": "scale", "arg": "x", "a": 7, "b": 3}
    family.prompt(params)                   # "Implement `scale(x)` in solution.py: ..."
    family.reference(params)                # "def scale(x): ... return x * 7 + 3"
    [family.value(params, x) for x in family.inputs(params, rng, 8)]

Difficulty 1 families have one constant, difficulty 2 families two.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Params = dict[str, Any]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
SEPARATORS = ("-", "+", ",", ":", "/", ".", "|", "_", ", ", " ", "; ", "=", "~", "#", "*", " - ")


@dataclass(frozen=True)
class Family:
    """How one kind of function task is made from its parameters."""

    name: str
    difficulty: int
    args: tuple[str, ...]  # names of the function's one argument, drawn from
    names: tuple[str, ...]  # function names drawn from
    draw_constants: Callable[[random.Random], Params]
    spec: Callable[[Params], str]  # what the function returns, the prompt's second half
    body: Callable[[Params], str]  # the reference's return expression
    value: Callable[[Params, Any], Any]
    draw_input: Callable[[Params, random.Random], Any]
    slip: Callable[[Params, random.Random], Params]  # one constant changed

    def draw(self, rng: random.Random) -> Params:
        """Parameters of a new task: the function's name and the family's constants."""
        fn, arg = rng.choice(self.names), rng.choice(self.args)
        return {"fn": fn, "arg": arg, **self.draw_constants(rng)}

    def prompt(self, params: Params) -> str:
        call = f"{params['fn']}({params['arg']})"
        return f"Implement `{call}` in solution.py: {self.spec(params)}"

    def reference(self, params: Params) -> str:
        """The solved solution.py: the stub's signature and docstring, then the return."""
        return self._function(params, f"return {self.body(params)}")

    def stub(self, params: Params) -> str:
        """The starting solution.py: the body raises NotImplementedError."""
        return self._function(params, "raise NotImplementedError")

    def _function(self, params: Params, line: str) -> str:
        head = f"def {params['fn']}({params['arg']}):"
        doc = self.spec(params)
        return f'{head}\n    """{doc[0].upper()}{doc[1:]}"""\n    {line}\n'

    def inputs(self, params: Params, rng: random.Random, count: int) -> list[Any]:
        """`count` distinct inputs (by repr), drawn for this task."""
        found: dict[str, Any] = {}
        for _ in range(50 * count):
            value = self.draw_input(params, rng)
            found.setdefault(repr(value), value)
            if len(found) == count:
                break
        return list(found.values())

    def slipped(self, params: Params, rng: random.Random) -> Params:
        """The parameters with one constant changed (the function's name kept)."""
        return {**params, **self.slip(params, rng)}


def _other(rng: random.Random, choices: str | tuple[str, ...], but: str) -> str:
    return rng.choice([c for c in choices if c != but])


def _off_by(rng: random.Random, value: int, low: int) -> int:
    """`value` moved by one or two, staying at least `low`."""
    step = rng.choice((-2, -1, 1, 2))
    return value + step if value + step >= low else value + abs(step)


def _last_letter_changed(text: str, rng: random.Random) -> str:
    return text[:-1] + _other(rng, LETTERS, text[-1])


def _scale_or_offset_slipped(p: Params, rng: random.Random) -> Params:
    """`a` or `b` of an `x * a + b` family moved by one or two."""
    if rng.random() < 0.5:
        return {"a": _off_by(rng, p["a"], 2)}
    return {"b": _off_by(rng, p["b"], 1)}


def _word(rng: random.Random, letters: str, low: int, high: int) -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(low, high)))


def _ints(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(3, 7))]


NUMBER_ARGS = ("x", "n", "value")
TEXT_ARGS = ("s", "text", "word")
LIST_ARGS = ("xs", "items", "values")


def _count_text() -> Family:
    def draw_input(p: Params, rng: random.Random) -> str:
        parts = [_word(rng, LETTERS[:6], 0, 3) for _ in range(rng.randint(1, 4))]
        return p["t"].join(parts) if rng.random() < 0.7 else _word(rng, LETTERS, 3, 10)

    return Family(
        name="count_text",
        difficulty=1,
        args=TEXT_ARGS,
        names=("count_text", "tally", "occurrences", "how_many", "count_in", "frequency"),
        draw_constants=lambda rng: {"t": _word(rng, LETTERS, 1, 2)},
        spec=lambda p: f"return how many times {p['t']!r} occurs in {p['arg']}.",
        body=lambda p: f"{p['arg']}.count({p['t']!r})",
        value=lambda p, s: s.count(p["t"]),
        draw_input=draw_input,
        slip=lambda p, rng: {"t": _last_letter_changed(p["t"], rng)},
    )


def _keep_above() -> Family:
    def body(p: Params) -> str:
        return f"[item for item in {p['arg']} if item > {p['k']}]"

    return Family(
        name="keep_above",
        difficulty=1,
        args=LIST_ARGS,
        names=("keep_above", "above", "filter_big", "larger_than", "select_over", "drop_small"),
        draw_constants=lambda rng: {"k": rng.randint(0, 199)},
        spec=lambda p: f"return the items of the list {p['arg']} greater than {p['k']}, in order.",
        body=body,
        value=lambda p, xs: [x for x in xs if x > p["k"]],
        draw_input=lambda p, rng: _ints(rng, p["k"] - 6, p["k"] + 6),
        slip=lambda p, rng: {"k": _off_by(rng, p["k"], 0)},
    )


def _has_prefix() -> Family:
    def draw_input(p: Params, rng: random.Random) -> str:
        head = p["p"] if rng.random() < 0.5 else _word(rng, LETTERS, 1, 3)
        return head + _word(rng, LETTERS, 0, 5)

    return Family(
        name="has_prefix",
        difficulty=1,
        args=TEXT_ARGS,
        names=("has_prefix", "starts_right", "begins_with", "check_start", "is_tagged", "opens"),
        draw_constants=lambda rng: {"p": _word(rng, LETTERS, 2, 3)},
        spec=lambda p: f"return True when {p['arg']} starts with {p['p']!r}, else False.",
        body=lambda p: f"{p['arg']}.startswith({p['p']!r})",
        value=lambda p, s: s.startswith(p["p"]),
        draw_input=draw_input,
        slip=lambda p, rng: {"p": _last_letter_changed(p["p"], rng)},
    )


def _map_affine() -> Family:
    return Family(
        name="map_affine",
        difficulty=2,
        args=LIST_ARGS,
        names=("map_affine", "rescale_all", "shift_all", "each_scaled", "apply_all", "convert"),
        draw_constants=lambda rng: {"a": rng.randint(2, 9), "b": rng.randint(1, 30)},
        spec=lambda p: (
            f"return a list of each item of {p['arg']} times {p['a']} plus {p['b']}, in order."
        ),
        body=lambda p: f"[item * {p['a']} + {p['b']} for item in {p['arg']}]",
        value=lambda p, xs: [x * p["a"] + p["b"] for x in xs],
        draw_input=lambda p, rng: _ints(rng, -9, 20),
        slip=_scale_or_offset_slipped,
    )


def _affine() -> Family:
    return Family(
        name="affine",
        difficulty=2,
        args=NUMBER_ARGS,
        names=("scale", "transform", "affine", "adjust", "linear", "score"),
        draw_constants=lambda rng: {"a": rng.randint(2, 19), "b": rng.randint(1, 99)},
        spec=lambda p: f"return {p['arg']} times {p['a']} plus {p['b']}.",
        body=lambda p: f"{p['arg']} * {p['a']} + {p['b']}",
        value=lambda p, x: x * p["a"] + p["b"],
        draw_input=lambda p, rng: rng.randint(-20, 50),
        slip=_scale_or_offset_slipped,
    )


def _clamp() -> Family:
    def draw_constants(rng: random.Random) -> Params:
        low = rng.randint(0, 50)
        return {"lo": low, "hi": low + rng.randint(5, 50)}

    def slip(p: Params, rng: random.Random) -> Params:
        if rng.random() < 0.5:
            return {"lo": _off_by(rng, p["lo"], 0)}
        return {"hi": _off_by(rng, p["hi"], p["lo"] + 3)}

    return Family(
        name="clamp",
        difficulty=2,
        args=NUMBER_ARGS,
        names=("clamp", "limit", "bound", "clip", "squeeze", "confine"),
        draw_constants=draw_constants,
        spec=lambda p: (
            f"return {p['arg']} limited to the range from {p['lo']} to {p['hi']} (inclusive)."
        ),
        body=lambda p: f"max({p['lo']}, min({p['hi']}, {p['arg']}))",
        value=lambda p, x: max(p["lo"], min(p["hi"], x)),
        draw_input=lambda p, rng: rng.choice((p["lo"], p["hi"])) + rng.randint(-3, 3),
        slip=slip,
    )


def _repeat_join() -> Family:
    def slip(p: Params, rng: random.Random) -> Params:
        if rng.random() < 0.5:
            return {"n": _off_by(rng, p["n"], 2)}
        return {"sep": _other(rng, SEPARATORS, p["sep"])}

    return Family(
        name="repeat_join",
        difficulty=2,
        args=TEXT_ARGS,
        names=("repeat", "echo", "repeat_join", "stutter", "chain", "copies"),
        draw_constants=lambda rng: {"n": rng.randint(2, 9), "sep": rng.choice(SEPARATORS)},
        spec=lambda p: f"return {p['arg']} repeated {p['n']} times, joined by {p['sep']!r}.",
        body=lambda p: f"{p['sep']!r}.join([{p['arg']}] * {p['n']})",
        value=lambda p, s: p["sep"].join([s] * p["n"]),
        draw_input=lambda p, rng: _word(rng, string.ascii_lowercase, 1, 4),
        slip=slip,
    )


def _swap_char() -> Family:
    def draw_constants(rng: random.Random) -> Params:
        old = rng.choice(LETTERS)
        return {"old": old, "new": _other(rng, LETTERS, old)}

    def draw_input(p: Params, rng: random.Random) -> str:
        return _word(rng, LETTERS, 0, 3) + p["old"] + _word(rng, LETTERS, 1, 6)

    return Family(
        name="swap_char",
        difficulty=2,
        args=TEXT_ARGS,
        names=("swap_letter", "replace_all", "substitute", "swap_char", "rewrite", "patch"),
        draw_constants=draw_constants,
        spec=lambda p: f"return {p['arg']} with every {p['old']!r} replaced by {p['new']!r}.",
        body=lambda p: f"{p['arg']}.replace({p['old']!r}, {p['new']!r})",
        value=lambda p, s: s.replace(p["old"], p["new"]),
        draw_input=draw_input,
        slip=lambda p, rng: {"new": _other(rng, LETTERS.replace(p["old"], ""), p["new"])},
    )


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        _count_text(),
        _keep_above(),
        _has_prefix(),
        _map_affine(),
        _affine(),
        _clamp(),
        _repeat_join(),
        _swap_char(),
    )
}
MAX_DIFFICULTY = max(family.difficulty for family in FAMILIES.values())
