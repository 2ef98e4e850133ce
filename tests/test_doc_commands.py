"""Every command the docs show runs as written, or is checked as far as this machine allows.

The commands are read from README.md, deploy/nats/SECURITY.md, every page of docs/ (found by
glob: a new page is checked the day it lands), and the comments of compose.yaml, the
Dockerfile, the NATS configs and the Kubernetes manifests: every `rlpipe ...` wherever it
appears (inline code, any fenced block, a comment; after any VAR=value prefixes), and every
command of a shell block (```bash, ```sh, ```shell; split at `&&`, `;` and `&`; a pipeline
is its first command). tests/doc_checks.py says how each is checked: rlpipe's by its parser
(the read-only ones run), every other program by its rule, which runs the command where that
is quick and harmless and otherwise says why not and checks what it can. A program with no
rule fails the test: a new kind of command needs its rule. The docs' `RLPIPE_*` variables,
their links between pages and the benchmarks page's result files are checked too.

Run: .venv/bin/python -m pytest tests/test_doc_commands.py -q
"""

from __future__ import annotations

import functools
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from apps.cli import build_parser
from tests.compose_support import ROOT
from tests.doc_checks import (
    ENV_PREFIX,
    RLPIPE_NOT_RUN,
    RULES,
    check_concrete,
    check_shell_command,
    check_synopsis,
    checked,
    program,
    shell_statements,
    split_commands,
    strip_comment,
    subparsers,
    words_of,
)

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
SHELL_LANGUAGES = {"bash", "sh", "shell"}


def code_spans(text: str) -> list[str]:
    """Inline code that starts with rlpipe; a span wrapped over lines reads as one line."""
    return [" ".join(s.split()) for s in re.findall(rf"`({COMMAND_START}[^`]*)`", text)]


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return re.findall(r"^\s*```(\w*)[^\n]*\n(.*?)^\s*```", text, re.M | re.S)


def code_block_lines(text: str) -> list[str]:
    lines = [line.strip() for _, body in fenced_blocks(text) for line in body.splitlines()]
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


def shell_commands() -> list[tuple[str, str]]:
    """(where, command) of every command in a shell block (rlpipe's too: one that follows
    another on its line is found only here)."""
    found = []
    for path in MARKDOWN:
        for language, body in fenced_blocks(path.read_text()):
            if language not in SHELL_LANGUAGES:
                continue
            for statement in shell_statements(body):
                found += [(path.name, c) for c in split_commands(statement)]
    return found


COMMANDS = documented_commands()
SHELL = shell_commands()


def test_the_docs_show_commands_to_check() -> None:
    """The extraction finds what the docs show (so a silent regex cannot pass everything)."""
    commands = {command for _, command in COMMANDS}
    assert "rlpipe provision" in commands or any(c.startswith("rlpipe provision") for c in commands)
    assert any(c.startswith("rlpipe weights relay-setup") for c in commands)
    assert len(COMMANDS) >= 10, COMMANDS
    programs = {program(c) for _, c in SHELL}
    assert {"make", "curl", "docker", "export"} <= programs, programs
    assert {path.name for path in MARKDOWN if path.parent.name == "docs"} >= {
        "gpu.md",
        "recipes.md",
    }


def test_every_rlpipe_subcommand_runs_or_says_why_not() -> None:
    assert set(subparsers(build_parser())) <= set(RLPIPE_NOT_RUN)


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[f"{w}: {c}" for w, c in COMMANDS])
def test_a_documented_command_runs_as_written(where: str, command: str) -> None:
    try:
        checked(command)
    except AssertionError as exc:
        pytest.fail(f"{where} shows `{command}`: {exc}", pytrace=False)


@pytest.mark.parametrize(("where", "command"), SHELL, ids=[f"{w}: {c}" for w, c in SHELL])
def test_a_documented_shell_command_runs_or_is_checked(where: str, command: str) -> None:
    try:
        checked(command)
    except AssertionError as exc:
        why = RULES[program(command)].why if program(command) in RULES else ""
        pytest.fail(f"{where} shows `{command}` ({why or 'run'}): {exc}", pytrace=False)


# Variables the docs name on purpose though nothing reads them.
NAMED_NOT_READ = {"RLPIPE_TRAINER_LEARNIN_RATE": "the docs' example of a typo that is refused"}
READERS = (
    "libs/**/*.py",
    "apps/**/*.py",
    "services/**/*.py",
    "compose.yaml",
    "Dockerfile",
    "deploy/**/*",
)


def documented_variables() -> list[tuple[str, str]]:
    """(where, name) of every whole `RLPIPE_*` variable name the docs show."""
    pattern = re.compile(r"(?<![<\w])RLPIPE_[A-Z0-9_]*[A-Z0-9](?![\w<])")
    return sorted({(p.name, v) for p in MARKDOWN for v in pattern.findall(p.read_text())})


@functools.cache
def variables_read() -> frozenset[str]:
    """Every variable a service's settings read, and every RLPIPE_* literal of the code and
    the deployment files (the launcher's, compose's, the domain registry's own)."""
    from apps.cli import settings_classes
    from libs.settings import NOT_SETTINGS, variable_names

    names = set(NOT_SETTINGS)
    for load in settings_classes().values():
        names |= set(variable_names(load()))
    files = [f for pattern in READERS for f in ROOT.glob(pattern) if f.is_file()]
    for file in files:
        names |= set(re.findall(r"RLPIPE_[A-Z0-9_]+", file.read_text(errors="replace")))
    return frozenset(names)


VARIABLES = documented_variables()


@pytest.mark.parametrize(("where", "name"), VARIABLES, ids=[f"{w}: {v}" for w, v in VARIABLES])
def test_a_documented_variable_is_read(where: str, name: str) -> None:
    """A renamed setting leaves no stale variable in the docs."""
    from apps.config_cli import GLOBAL_PATTERN

    known = name in variables_read() or GLOBAL_PATTERN.fullmatch(name)
    assert known or name in NAMED_NOT_READ, f"{where} names {name}, which nothing reads"


def test_every_committed_result_is_on_the_benchmarks_page() -> None:
    """docs/benchmarks.md names each bench/results/<machine>/<benchmark>.json in git, and only
    those: a figure always says the file it comes from."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    named = set(re.findall(r"`([a-z0-9-]+/[a-z0-9_]+\.json)`", page))
    tracked = subprocess.run(
        ["git", "ls-files", "bench/results"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    committed = {path.removeprefix("bench/results/") for path in tracked}
    assert named - committed == set(), "the page names results not in bench/results/"
    assert committed - named == set(), "results the page does not name"


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as -."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


LINKS = [
    (path, link)
    for path in MARKDOWN
    for link in re.findall(r"\]\(([^)\s]+)\)", path.read_text())
    if not re.match(r"[a-z]+:", link)
]


@pytest.mark.parametrize(
    ("path", "link"), LINKS, ids=[f"{p.relative_to(ROOT)}: {link}" for p, link in LINKS]
)
def test_a_link_between_pages_resolves(path: Path, link: str) -> None:
    target, _, anchor = link.partition("#")
    page = (path.parent / target).resolve() if target else path
    assert page.exists(), f"{path.name} links to {target}, which does not exist"
    if anchor and page.suffix == ".md":
        assert anchor in heading_anchors(page.read_text()), f"{page.name} has no #{anchor}"


MISTAKES = [
    (check_concrete, "rlpipe launch", "invalid choice: 'launch'"),
    (check_synopsis, "rlpipe demo [--no-such-flag N]", "no option"),
    (check_concrete, "rlpipe demo --set trainer.learnin_rate=1e-4", "no such field"),
    (check_synopsis, "rlpipe run|schema --set trainer.learning_rate=1e-4", "has no option"),
    (check_shell_command, "frobnicate --now", "no rule for 'frobnicate'"),
    (check_shell_command, "docker compose --profile nosuch up", "no profile"),
    (check_shell_command, "nats-server -js --no-such-flag", "does not list"),
    (check_shell_command, "curl -s localhost:9104/nosuch", "no service serves /nosuch"),
    (check_shell_command, "make nosuchtarget", "No rule to make target"),
]


@pytest.mark.parametrize(("check", "command", "message"), MISTAKES, ids=[m[1] for m in MISTAKES])
def test_a_command_that_does_not_exist_is_caught(
    check: Callable[[str], None], command: str, message: str
) -> None:
    with pytest.raises(AssertionError, match=re.escape(message)):
        check(command)


def test_a_shell_block_splits_into_its_commands() -> None:
    block = "nats-server -js & X=1 make -n demo 2>&1 && curl -s a:1/x | head  # it's; not one\n"
    [statement] = shell_statements("echo 'a # b' \\\n  c\n")
    assert split_commands(shell_statements(block)[0]) == [
        "nats-server -js",
        "X=1 make -n demo 2>&1",
        "curl -s a:1/x",
    ]
    assert words_of(statement) == ["echo", "a # b", "c"]  # quoted `#` kept, lines joined
    assert program("A=$(openssl rand -hex 4) B=2 docker compose up") == "docker"
