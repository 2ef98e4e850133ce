"""Every `rlpipe ...` command the docs show is one the CLI takes, as written.

The commands are read from README.md, deploy/nats/SECURITY.md, docs/*.md, and the comments of
compose.yaml, the Dockerfile, the NATS configs and the Kubernetes manifests: inline code spans
and lines of fenced code blocks that start with `rlpipe` (or `.venv/bin/rlpipe`, after any
VAR=value prefixes). A concrete command must parse with the real parser (apps/cli.py),
as the shell would pass it. A name in prose (`rlpipe weights relay-prune`: command names
only) must name real commands. A synopsis (placeholders in capitals, [optional] parts, a|b
alternatives, `...`) must name real subcommands, and every --option it shows must belong to
the subcommand it follows.

Run: .venv/bin/python -m pytest tests/test_doc_commands.py -q
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from apps.cli import build_parser
from tests.compose_support import ROOT

MARKDOWN = [
    ROOT / "README.md",
    ROOT / "deploy" / "nats" / "SECURITY.md",
    *sorted(ROOT.glob("docs/*.md")),
]
COMMENTED = [
    ROOT / "compose.yaml",
    ROOT / "Dockerfile",
    *sorted(ROOT.glob("deploy/nats/*.conf")),
    *sorted(ROOT.glob("deploy/k8s/*/*.yaml")),
]
COMMAND_START = r"(?:\.venv/bin/)?rlpipe [a-z-]"
ENV_PREFIX = r"(?:[A-Z_][A-Z0-9_]*=\S*\s+)*"


def code_spans(text: str) -> list[str]:
    return re.findall(rf"`({COMMAND_START}[^`]*)`", text)


def code_block_lines(text: str) -> list[str]:
    blocks = re.findall(r"^\s*```[^\n]*\n(.*?)^\s*```", text, re.M | re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    return [
        m.group(1) for line in lines if (m := re.match(rf"{ENV_PREFIX}({COMMAND_START}.*)", line))
    ]


def comment_lines(path: Path) -> list[str]:
    comments = [
        line.split("#", 1)[1].strip() for line in path.read_text().splitlines() if "#" in line
    ]
    text = "\n".join(comments)
    commands = code_spans(text)
    commands += [m.group(1) for c in comments if (m := re.match(rf"({COMMAND_START}.*)", c))]
    return commands


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) of every rlpipe command the docs show."""
    found = []
    for path in MARKDOWN:
        text = path.read_text()
        found += [(path.name, c) for c in code_spans(text) + code_block_lines(text)]
    for path in COMMENTED:
        found += [(str(path.relative_to(ROOT)), c) for c in comment_lines(path)]
    return [(where, strip_comment(command)) for where, command in found]


def strip_comment(command: str) -> str:
    return re.sub(r"\s+#.*$", "", command).strip()


def is_synopsis(command: str) -> bool:
    return bool(re.search(r"\[|\||\.\.\.|\b[A-Z][A-Z_]+\b|<", command))


def is_reference(command: str) -> bool:
    """Only command names (`rlpipe sft` in prose): the verb is named, not run."""
    words, parser = command.split()[1:], build_parser()
    while words and words[0] in subparsers(parser):
        parser = subparsers(parser)[words.pop(0)]
    return not words


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def check_concrete(command: str) -> None:
    argv = shlex.split(command)[1:]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code:
            raise AssertionError(errors.getvalue().strip().splitlines()[-1]) from None


def check_synopsis(command: str) -> None:
    """Subcommands exist; each --option belongs to the subcommand it follows."""
    first, *alternatives = command.split(" | ")
    words = first.split()[1:]
    parser, path = build_parser(), ["rlpipe"]
    while subparsers(parser) and words and re.fullmatch(r"[a-z][a-z-]*", words[0]):
        choices = subparsers(parser)
        if words[0] not in choices:
            raise AssertionError(f"{' '.join(path)} has no command {words[0]!r}: {sorted(choices)}")
        parent, parser = parser, choices[words[0]]
        path.append(words.pop(0))
    check_options(parser, words, path)
    for alternative in alternatives:
        head, *rest = alternative.split()
        sibling = subparsers(parent).get(head) if len(path) > 2 else None
        check_options(sibling or parser, rest if sibling else [head, *rest], path)


def check_options(parser: argparse.ArgumentParser, words: list[str], path: list[str]) -> None:
    shown = {m for word in words for m in re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", word)}
    unknown = shown - options(parser)
    assert not unknown, f"{' '.join(path)} has no option {sorted(unknown)}"


COMMANDS = documented_commands()


def test_the_docs_show_commands_to_check() -> None:
    """The extraction finds what the docs show (so a silent regex cannot pass everything)."""
    commands = {command for _, command in COMMANDS}
    assert "rlpipe provision" in commands or any(c.startswith("rlpipe provision") for c in commands)
    assert any(c.startswith("rlpipe weights relay-setup") for c in commands)
    assert len(COMMANDS) >= 10, COMMANDS


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[f"{w}: {c}" for w, c in COMMANDS])
def test_a_documented_command_runs_as_written(where: str, command: str) -> None:
    command = command.removeprefix(".venv/bin/")
    try:
        named_only = is_synopsis(command) or is_reference(command)
        (check_synopsis if named_only else check_concrete)(command)
    except AssertionError as exc:
        pytest.fail(f"{where} shows `{command}`: {exc}", pytrace=False)


def test_a_command_that_does_not_exist_is_caught() -> None:
    with pytest.raises(AssertionError, match="invalid choice: 'launch'"):
        check_concrete("rlpipe launch")
    with pytest.raises(AssertionError, match="no option"):
        check_synopsis("rlpipe demo [--no-such-flag N]")
