"""How a documented command is checked (tests/test_doc_commands.py finds the commands).

- `rlpipe ...`: a concrete command must parse with the real parser (apps/cli.py), as the
  shell would pass it, and name real fields in its `--set`s; the quick, read-only ones
  (RLPIPE_RUN) run; a name in prose (`rlpipe weights relay-prune`) must name real commands;
  a synopsis (placeholders in capitals, [optional] parts, a|b alternatives, `...`) must name
  real subcommands, and every --option it shows must belong to the subcommand it follows.
  Why the other subcommands are only parsed: RLPIPE_NOT_RUN.
- Any other command: the rule for its program in RULES runs it where that is quick and
  harmless, and otherwise says why it is not run (it starts services, needs Docker, a
  cluster, a GPU or the network) and checks what can be checked here.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass

import yaml

from apps.cli import build_parser
from tests.compose_support import ROOT
from tests.signing_support import signing_environment

ENV_PREFIX = r"(?:[A-Z_][A-Z0-9_]*=\S*\s+)*"
BIN = ROOT / ".venv" / "bin"


def strip_comment(command: str) -> str:
    """The command without a trailing `# comment` or a `> file` redirection of its output."""
    command = re.sub(r"\s+#.*$", "", command)
    return re.sub(r"\s+\d?>>?\s*\S+$", "", command).strip()


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
    """The command parses, and every `--set SERVICE.FIELD=VALUE` names a real field."""
    argv = shlex.split(command)[1:]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code:
            raise AssertionError(errors.getvalue().strip().splitlines()[-1]) from None
        return
    check_overrides(getattr(args, "overrides", None) or [])


def check_overrides(texts: list[str]) -> None:
    from apps.cli import settings_classes
    from apps.config_cli import override_problems
    from libs.settings import merge_overrides

    problems = list(override_problems(merge_overrides(texts), settings_classes()))
    assert not problems, "; ".join(problems)


def check_synopsis(command: str) -> None:
    """Subcommands exist; each --option belongs to the subcommand it follows. `run|demo`
    (alternatives without spaces) is each of them in turn."""
    words = command.split()
    for i, word in enumerate(words):
        if re.fullmatch(r"[a-z][a-z-]*(\|[a-z][a-z-]*)+", word):
            for alternative in word.split("|"):
                check_synopsis(" ".join([*words[:i], alternative, *words[i + 1 :]]))
            return
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


# rlpipe commands run as written: quick, and they change nothing.
RLPIPE_RUN = (
    "rlpipe schema --check",
    "rlpipe nats-config render --check",
    "rlpipe nats-config passwords",
    "rlpipe config show ",
    "rlpipe config check",
    "rlpipe config reference",
    "rlpipe domain list",
)
# Why the other subcommands are only parsed.
RLPIPE_NOT_RUN = {
    "demo": "starts NATS and six services for minutes (tests/test_launcher.py runs it)",
    "run": "starts a service that runs until stopped (tests/test_readme_examples.py runs two)",
    "ray": "starts or needs a Ray cluster (tests/test_ray_deploy.py runs one)",
    "sft": "trains for minutes on a demonstrations file (tests/test_sft.py runs it)",
    "domain": "demos and evaluate run episodes for minutes (the domain tests run them)",
    "provision": "needs a NATS server (tests/test_provision.py runs it)",
    "weights": "needs safetensors files and a NATS server (tests/test_weights_cli.py runs it)",
    "sandbox": "needs the command's working folder (tests/test_sandbox.py runs it)",
    "report": "needs a run folder (tests/test_see_a_run.py runs it)",
    "region": "needs a hub's and a region's NATS servers (tests/test_region_outage.py runs it)",
    "feedback-key": "writes a key file (tests/test_readme_examples.py runs it)",
    "feedback-events": "needs a NATS server (tests/test_feedback_caps.py runs list and purge)",
    "schema": "writes proto/schema/ (`--check` runs)",
    "nats-config": "render writes deploy/nats/ (`--check` runs; passwords runs)",
    "config": "every form runs",
    "fleet": "needs serve replicas on a NATS server (tests/test_fleet_e2e.py runs two)",
}


def run_rlpipe(command: str) -> None:
    """Run a read-only rlpipe command as a user would, without the test's RLPIPE_ settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")}
    env |= signing_environment()  # a deployment's weight-signing keys (docs/weights.md)
    done = subprocess.run(
        [str(BIN / "rlpipe"), *shlex.split(command)[1:]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr.strip()[-500:]}"


# ---- the other commands of shell blocks ------------------------------------------------


def shell_statements(body: str) -> list[str]:
    """The block's statements, `# comments` dropped, continuation lines joined and a quoted
    string's newlines kept inside it."""
    statements, pending, quote = [], "", ""
    for line in body.splitlines():
        code, quote = without_comment(line, quote)
        pending = f"{pending}\n{code}" if pending else code
        if pending.endswith("\\") and not quote:
            pending = pending[:-1]
        elif not quote:
            statements.append(pending)
            pending = ""
    return [s for s in statements if s.strip()]


def without_comment(line: str, quote: str) -> tuple[str, str]:
    """The line up to a `#` comment, and the quote still open at its end ('' if none)."""
    outside, quote = scan(line, quote)
    for i in outside:
        if line[i] == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), ""
    return line, quote


def scan(text: str, quote: str = "") -> tuple[list[int], str]:
    """Indices of the characters outside quotes and `$(...)`, and the quote open at the end
    (`quote`: the one open at the start)."""
    outside, depth = [], 0
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif text.startswith("$(", i):
            depth += 1
        elif c == ")" and depth:
            depth -= 1
        elif depth == 0:
            outside.append(i)
    return outside, quote


def split_commands(statement: str) -> list[str]:
    """Commands of one statement: split at top-level `&&`, `||`, `;` and `&`; of a pipeline,
    its first command."""
    commands, start = [], 0
    for i in scan(statement)[0]:
        if i < start:
            continue
        redirect = statement[i] == "&" and ">" in statement[i - 1 : i + 2]  # 2>&1, &> file
        if statement.startswith(("&&", "||"), i) or (statement[i] in ";&" and not redirect):
            commands.append(statement[start:i])
            start = i + (2 if statement[i : i + 2] in ("&&", "||") else 1)
    commands.append(statement[start:])
    return [c.strip() for c in map(first_of_pipeline, commands) if c.strip()]


def first_of_pipeline(command: str) -> str:
    pipes = [i for i in scan(command)[0] if command[i] == "|"]
    return command[: pipes[0]] if pipes else command


def words_of(command: str) -> list[str]:
    """The command's words after VAR=value prefixes, `$(...)` kept as written."""
    hidden = re.sub(r"\$\(([^)]*)\)", lambda m: m.group(0).replace(" ", "\0"), command)
    words = [w.replace("\0", " ") for w in shlex.split(hidden)]
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0], re.S):
        words.pop(0)
    return words


def program(command: str) -> str:
    words = words_of(command)
    return words[0] if words else ""


def substitutions(command: str) -> list[str]:
    return re.findall(r"\$\(([^)]*)\)", command)


@dataclass(frozen=True)
class Rule:
    """How a program's documented commands are checked: `check` runs it or checks what can
    be checked here; `why` says why it is not run as written (empty: it runs)."""

    check: Callable[[list[str], str], None]
    why: str


def check_make(words: list[str], _: str) -> None:
    done = subprocess.run(
        ["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr.strip()[-500:]


def check_python(words: list[str], command: str) -> None:
    args = words[1:]
    if args[:2] == ["-m", "venv"]:
        assert importlib.util.find_spec("venv") is not None
    elif args[:1] == ["-m"]:
        assert importlib.util.find_spec(args[1]) is not None, f"no module {args[1]}"
    else:
        check_script_help(args[0], args[1:])


def check_script_help(script: str, args: list[str]) -> None:
    """The script exists, imports, parses `--help`, and knows every option shown."""
    assert (ROOT / script).is_file(), f"no file {script}"
    done = subprocess.run(
        [sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.strip()[-500:]
    unknown = {a for a in args if a.startswith("--") and a not in done.stdout}
    assert not unknown, f"{script} has no option {sorted(unknown)}"


def check_pip(words: list[str], _: str) -> None:
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    shown = {e for w in words for m in re.findall(r"\.\[([\w,-]+)\]", w) for e in m.split(",")}
    assert shown <= extras, f"no extra {sorted(shown - extras)} in pyproject.toml"
    assert "-e" not in words or any(w.startswith(".") for w in words), "installs no project"


def check_export(words: list[str], command: str) -> None:
    done = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for inner in substitutions(command):
        checked(inner)


def check_with_help(words: list[str], _: str) -> None:
    """The program is installed and every -option shown is in its (subcommand's) help."""
    binary = str(BIN / words[0]) if (BIN / words[0]).exists() else words[0]
    subcommand = [w for w in words[1:2] if not w.startswith("-")]
    done = subprocess.run(
        [binary, *subcommand, "--help"], capture_output=True, text=True, timeout=120
    )
    shown = {w.split("=")[0] for w in words[1:] if w.startswith("-")}
    missing = {o for o in shown if o not in done.stdout + done.stderr}
    assert not missing, f"{words[0]} --help does not list {sorted(missing)}"


def check_curl(words: list[str], _: str) -> None:
    [url] = [w for w in words if "localhost" in w or "127.0.0.1" in w]
    path = "/" + url.split("/", 1)[1] if "/" in url else "/"
    served = any(path in p.read_text() for p in ROOT.glob("libs/**/*.py"))
    assert served, f"no service serves {path}"


def check_docker(words: list[str], _: str) -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    profiles = {p for s in services.values() for p in s.get("profiles", [])}
    shown = [words[i + 1] for i, w in enumerate(words) if w == "--profile"]
    assert set(shown) <= profiles, f"no profile {sorted(set(shown) - profiles)} in compose.yaml"
    scaled = [words[i + 1].split("=")[0] for i, w in enumerate(words) if w == "--scale"]
    assert set(scaled) <= set(services), f"no service {sorted(set(scaled) - set(services))}"


def check_kubectl(words: list[str], _: str) -> None:
    folder = words[words.index("-k") + 1]
    assert (ROOT / folder / "kustomization.yaml").is_file(), f"{folder}: no kustomization.yaml"


def check_cp(words: list[str], _: str) -> None:
    source, target = words[-2:]
    assert (ROOT / source).exists(), f"no {source}"
    assert (ROOT / target).parent.is_dir(), f"no folder for {target}"


def check_torchrun(words: list[str], _: str) -> None:
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(words[1:])
    assert args.module and importlib.util.find_spec(args.training_script) is not None


def check_tracker(words: list[str], _: str) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert words[0] in extras, f"{words[0]} is not an extra of pyproject.toml"


def check_bash_script(words: list[str], _: str) -> None:
    done = subprocess.run(["bash", "-n", words[1]], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def run_in_tmp(words: list[str], command: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run(
            ["bash", "-c", command], cwd=folder, capture_output=True, text=True, timeout=60
        )
    assert done.returncode == 0, done.stderr


PYTHON = Rule(
    check_python,
    "a module or benchmark runs for minutes or starts a service: "
    "the module is found, a script parses --help and knows each option shown",
)
RULES: dict[str, Rule] = {
    "make": Rule(check_make, "`make demo` runs minutes and `make test` is the suite: `make -n`"),
    "python": PYTHON,
    "python3": PYTHON,
    "python3.11": PYTHON,
    ".venv/bin/python": PYTHON,
    "pip": Rule(check_pip, "installs from the network: its extras exist in pyproject.toml"),
    ".venv/bin/pip": Rule(check_pip, "installs from the network: its extras exist"),
    "export": Rule(check_export, "sets the caller's shell: bash -n, and each $(...) checked"),
    "nats-server": Rule(check_with_help, "starts a server (the test fixtures do): its flags"),
    "curl": Rule(
        check_curl,
        "needs the block's service running (tests/test_readme_examples.py "
        "runs the serve and feedback blocks whole): a service serves the path",
    ),
    "docker": Rule(
        check_docker,
        "needs a Docker engine (tests/test_compose_up.py runs the "
        "compose file's services as processes): its profiles and services exist",
    ),
    "kubectl": Rule(
        check_kubectl,
        "needs a cluster (tests/test_k8s_manifests.py validates the overlays): the overlay exists",
    ),
    "cp": Rule(check_cp, "writes into the checkout: the source and the target's folder exist"),
    "ray": Rule(check_with_help, "starts Ray nodes: its options are ray's"),
    "torchrun": Rule(
        check_torchrun,
        "starts trainer ranks (tests/test_sharded_trainer.py runs "
        "them): torchrun parses it and the module exists",
    ),
    "tensorboard": Rule(
        check_tracker,
        "needs a run's tracking folder (tests/test_see_a_run.py "
        "reads each tracker back): the extra exists",
    ),
    "wandb": Rule(check_tracker, "needs a run's tracking folder: the extra exists"),
    "mlflow": Rule(check_tracker, "needs a run's tracking folder: the extra exists"),
    "bash": Rule(check_bash_script, "a GPU script (needs CUDA): bash -n"),
    "printf": Rule(run_in_tmp, ""),
    "mkdir": Rule(run_in_tmp, ""),
    "openssl": Rule(run_in_tmp, ""),
}


def check_shell_command(command: str) -> None:
    words = words_of(command)
    rule = RULES.get(words[0])
    assert rule is not None, f"no rule for {words[0]!r}: add one to RULES, with its reason"
    rule.check(words, command)


@functools.cache
def checked(command: str) -> None:
    """Each distinct command checked once, however many pages show it."""
    if rlpipe := re.match(rf"{ENV_PREFIX}(?:\.venv/bin/)?(rlpipe\b.*)", command, re.S):
        command = rlpipe.group(1)
        named_only = is_synopsis(command) or is_reference(command)
        (check_synopsis if named_only else check_concrete)(command)
        if not named_only and command.startswith(RLPIPE_RUN):
            run_rlpipe(command)
    else:
        check_shell_command(command)
