"""The coding environment: its shipped tasks, an episode in-process, grading that cannot be
fooled, and every way sandboxed code can misbehave, through a real env-gateway on a real
nats-server, coming back as a tool error while the gateway keeps serving."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from libs.bus.connection import Bus
from libs.bus.provision import provision
from libs.domains import registry
from libs.domains.coding import DOMAIN as CODING
from libs.domains.coding import CodingConfig, CodingEnv, CodingEpisode, CodingTasks, load_tasks
from libs.domains.coding.grading import copy_final_files, grade_files, restore_protected
from libs.domains.coding.tasks import TASKS_DIR, CodingTask
from libs.domains.coding.tools import TOOLS, SandboxTools
from libs.envs.feeder import FeederConfig
from libs.envs.server import ServerLimits
from libs.sandbox import SandboxConfig, SandboxLimits, build_sandbox_factory
from libs.sandbox.limits import MIB
from proto import messages as m
from proto.messages import Task, ToolCall, ToolResult
from services.env_gateway.service import EnvGatewayService
from services.env_gateway.settings import EnvGatewaySettings

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

REPO = Path(__file__).resolve().parents[1]
CONFIG = CodingConfig(
    tool_limits=SandboxLimits(
        cpu_s=2, memory_bytes=256 * MIB, max_processes=32, file_size_bytes=1 * MIB, wall_s=4.0
    ),
    grade_limits=SandboxLimits(
        cpu_s=5, memory_bytes=256 * MIB, max_processes=16, file_size_bytes=1 * MIB, wall_s=10.0
    ),
    step_budget_s=12.0,
)
GRADING = build_sandbox_factory(SandboxConfig(limits=CONFIG.grade_limits))
FIZZBUZZ = Task(task_id="fb", env="coding", prompt="", spec={"task": "fizzbuzz"})
FIXED_FIZZBUZZ = (TASKS_DIR / "fizzbuzz" / "reference" / "solution.py").read_text()


def call(name: str, **arguments: object) -> ToolCall:
    return ToolCall(call_id=f"c-{name}", name=name, arguments=dict(arguments))


def with_reference(task: CodingTask, dest: Path) -> Path:
    shutil.copytree(task.files_dir, dest)
    shutil.copytree(task.reference_dir, dest, dirs_exist_ok=True)
    return dest


def test_at_least_twenty_tasks_ship_as_package_data() -> None:
    tasks = load_tasks()
    assert len(tasks) >= 20
    for task in tasks.values():
        assert task.cases and task.protected and (task.reference_dir / "solution.py").is_file()
        assert not (task.files_dir / "hidden_tests").exists()
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "tasks/**/*" in config["tool"]["setuptools"]["package-data"]["libs.domains.coding"]


def test_task_source_is_deterministic_and_covers_every_task() -> None:
    source = CodingTasks(difficulty=0, group_size=8, seed=3)
    names = {source.task(i).spec["task"] for i in range(len(load_tasks()))}
    assert names == set(load_tasks())
    assert source.task(40) == CodingTasks(difficulty=0, group_size=8, seed=3).task(40)
    easy = CodingTasks(difficulty=1, group_size=1, seed=0)
    assert all(load_tasks()[n].difficulty == 1 for n in easy.names)
    assert source.task(0).env == "coding" and source.task(0).group_size == 8


async def test_every_reference_passes_its_hidden_tests_and_every_start_fails(
    tmp_path: Path,
) -> None:
    async def check(task: CodingTask) -> None:
        reference = with_reference(task, tmp_path / task.name)
        solved = await grade_files(task, reference, GRADING)
        assert (solved.tests_passed, solved.grading_error) == (solved.tests_total, ""), task.name
        started = await grade_files(task, task.files_dir, GRADING)
        assert started.tests_passed < started.tests_total, task.name
        async with build_sandbox_factory(SandboxConfig(limits=CONFIG.tool_limits)).open(
            reference
        ) as sandbox:
            visible = await SandboxTools(sandbox).call(call("run_tests"), 10)
        assert visible.error == "" and "0 failed" in visible.content, (task.name, visible)

    tasks = list(load_tasks().values())
    for start in range(0, len(tasks), 4):
        await asyncio.gather(*(check(task) for task in tasks[start : start + 4]))


async def test_an_episode_lists_reads_writes_tests_and_is_graded() -> None:
    env = CodingEnv(CONFIG)
    episode, opening = await env.reset(FIZZBUZZ)
    assert isinstance(episode, CodingEpisode)
    assert [t.name for t in opening.tools] == [t.name for t in TOOLS]
    assert "solution.py" in opening.messages[-1].content
    try:
        listed = await episode.step("", [call("list_files")])
        sizes = [
            (p.name, str(p.stat().st_size)) for p in sorted(TASKS_DIR.glob("fizzbuzz/files/*"))
        ]
        assert listed.tool_results[0].content.split() == [x for pair in sizes for x in pair]
        read = await episode.step("", [call("read_file", path="solution.py")])
        assert "def fizzbuzz" in read.tool_results[0].content
        before = await episode.step("", [call("run_tests")])
        assert before.tool_results[0].error == m.TOOL_ERROR_FAILED
        assert "0 passed, 2 failed" in before.tool_results[0].content
        wrote = await episode.step(
            "", [call("write_file", path="/workspace/solution.py", content=FIXED_FIZZBUZZ)]
        )
        assert wrote.tool_results[0].error == ""
        after = await episode.step("", [call("run_tests"), call("run_python", code="print(1+1)")])
        assert [r.error for r in after.tool_results] == ["", ""]
        assert "2 passed, 0 failed" in after.tool_results[0].content
        assert "--- stdout ---\n2\n" in after.tool_results[1].content
        final = await episode.step("Done: fizzbuzz is implemented.")
    finally:
        await episode.close()
    assert final.done
    assert final.info["tests_passed"] == final.info["tests_total"] == 6
    assert final.info["grading_error"] == ""
    assert not episode.sandbox.workdir.exists(), "close removes the working folder"


async def test_a_file_rewritten_at_the_same_size_is_tested_as_rewritten() -> None:
    """A module's .pyc matches its source by mtime (in seconds) and size: a one-digit fix
    written in the second its last test run imported it must still be what the next runs."""
    env = CodingEnv(CONFIG)
    episode, _ = await env.reset(FIZZBUZZ)
    wrong = FIXED_FIZZBUZZ.replace('"Fizz"', '"Fozz"')
    assert len(wrong) == len(FIXED_FIZZBUZZ) and wrong != FIXED_FIZZBUZZ
    try:
        results = []
        for source in (wrong, FIXED_FIZZBUZZ):
            await episode.step("", [call("write_file", path="solution.py", content=source)])
            probe = "import solution; print(solution.fizzbuzz(3))"
            step = await episode.step("", [call("run_python", code=probe), call("run_tests")])
            results.append([r.content for r in step.tool_results])
    finally:
        await episode.close()
    assert "Fozz" in results[0][0] and "2 passed" not in results[0][1]
    assert "Fizz" in results[1][0] and "2 passed, 0 failed" in results[1][1]


async def test_bad_calls_are_tool_errors() -> None:
    episode, _ = await CodingEnv(CONFIG).reset(FIZZBUZZ)
    try:
        result = await episode.step(
            "",
            [
                call("read_file"),
                call("read_file", path="missing.py"),
                call("read_file", path="../../etc/passwd"),
                call("write_file", path="x.py", content=3),
                call("run_python", code="x", path="y.py"),
                call("run_python", code="raise SystemExit(3)"),
                call("delete_everything"),
                call("read_file", path="/etc/hostname"),
            ],
        )
    finally:
        await episode.close()
    assert [r.error for r in result.tool_results] == [
        m.TOOL_ERROR_BAD_ARGUMENTS,
        m.TOOL_ERROR_FAILED,
        m.TOOL_ERROR_DENIED,
        m.TOOL_ERROR_BAD_ARGUMENTS,
        m.TOOL_ERROR_BAD_ARGUMENTS,
        m.TOOL_ERROR_FAILED,
        m.TOOL_ERROR_UNKNOWN_TOOL,
        m.TOOL_ERROR_DENIED,
    ]


async def test_tampered_tests_are_restored_and_links_and_fifos_are_not_followed(
    tmp_path: Path,
) -> None:
    task = load_tasks()["fizzbuzz"]
    final = shutil.copytree(task.files_dir, tmp_path / "final")
    (final / "test_solution.py").write_text("def test_nothing():\n    pass\n")
    (final / "secret").symlink_to("/etc/shadow")
    os.mkfifo(final / "pipe")
    copy_final_files(final, tmp_path / "graded")
    restore_protected(task, tmp_path / "graded")
    graded = tmp_path / "graded"
    assert sorted(p.name for p in graded.iterdir()) == ["solution.py", "test_solution.py"]
    assert (graded / "test_solution.py").read_text() == (
        task.files_dir / "test_solution.py"
    ).read_text()

    episode, _ = await CodingEnv(CONFIG).reset(FIZZBUZZ)
    try:
        tamper = "def test_three():\n    pass\n\n\ndef test_plain():\n    pass\n"
        await episode.step("", [call("write_file", path="test_solution.py", content=tamper)])
        assert (await episode.step("", [call("run_tests")])).tool_results[0].error == ""
        final_step = await episode.step("All tests pass.")
    finally:
        await episode.close()
    assert final_step.info["tests_passed"] == 0 and final_step.info["tests_total"] == 6


@pytest.mark.parametrize(
    "cheat",
    [
        # Print what a passing run looks like, then leave with exit code 0.
        "import os, sys\nprint('6 passed, 0 failed\\nOK')\nsys.stdout.flush()\nos._exit(0)\n",
        # Return an object equal to everything.
        "class Anything(str):\n    def __eq__(self, other):\n        return True\n"
        "def fizzbuzz(n):\n    return Anything('FizzBuzz')\n",
        # Forge report lines for every case, with values guessed from the visible tests.
        "import json, os\nfor n in ('fifteen', 'ten', 'nine', 'seven', 'ninety', 'zero'):\n"
        "    print(json.dumps({'name': n, 'outcome': 'value', 'value': 'Fizz'}))\n"
        "    os.write(1, b'x ' + json.dumps({'end': True}).encode() + b'\\n')\n"
        "def fizzbuzz(n):\n    return 'Fizz'\n",
    ],
)
async def test_fake_output_does_not_fool_grading(cheat: str, tmp_path: Path) -> None:
    task = load_tasks()["fizzbuzz"]
    final = shutil.copytree(task.files_dir, tmp_path / "final")
    (final / "solution.py").write_text(cheat)
    grade = await grade_files(task, final, GRADING)
    assert grade.tests_total == 6 and grade.tests_passed <= 1, grade  # 'nine' is Fizz
    assert grade.grading_error == ""


# --- through env-gateway on a real nats-server ------------------------------------------------


@pytest.fixture
async def gateway(bus: Bus, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[EnvGatewayService]:
    configured = dataclasses.replace(CODING, env=lambda: CodingEnv(CONFIG))
    monkeypatch.setitem(registry._REGISTERED, "coding", configured)
    await provision(bus.js)
    service = EnvGatewayService(
        EnvGatewaySettings(
            feeder=FeederConfig(mode="off"), limits=ServerLimits(step_timeout_s=20.0)
        )
    )
    await service.start(bus)
    running = asyncio.create_task(service.run())
    yield service
    await service.stop()
    await asyncio.wait_for(running, timeout=10)


HIDDEN_FILE = TASKS_DIR / "fizzbuzz" / "hidden_tests" / "cases.toml"
SEARCH = f"""
import os
hits = []
for top in sorted(os.listdir("/")):
    if top in ("proc", "sys", "usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        continue  # the kernel's views, and the host's read-only system (not the repository)
    for folder, dirs, files in os.walk("/" + top):
        hits += [os.path.join(folder, n) for n in dirs + files
                 if n in ("cases.toml", "hidden_tests", "reference", "tasks")]
print("hits:", hits, os.path.exists({str(REPO)!r}))
"""

ATTACKS: list[tuple[str, str, set[str]]] = [
    (
        "network",
        "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)",
        {m.TOOL_ERROR_DENIED},
    ),
    ("dns", "import socket\nsocket.getaddrinfo('example.com', 80)", {m.TOOL_ERROR_DENIED}),
    ("write /usr", "open('/usr/evil', 'w').write('x')", {m.TOOL_ERROR_DENIED}),
    (
        "write repo",
        f"open({str(REPO / 'evil')!r}, 'w').write('x')",
        {m.TOOL_ERROR_FAILED, m.TOOL_ERROR_DENIED},
    ),
    ("read hidden", f"print(open({str(HIDDEN_FILE)!r}).read())", {m.TOOL_ERROR_FAILED}),
    ("fork bomb", "import os\nwhile True:\n    os.fork()", {m.TOOL_ERROR_LIMIT}),
    (
        "memory bomb",
        "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))",
        {m.TOOL_ERROR_LIMIT},
    ),
    ("infinite loop", "while True:\n    pass", {m.TOOL_ERROR_LIMIT}),
    ("sleep forever", "import time\ntime.sleep(600)", {m.TOOL_ERROR_TIMEOUT}),
    ("huge file", "open('big', 'wb').write(b'x' * (8 << 20))", {m.TOOL_ERROR_LIMIT}),
]


async def test_misbehaving_code_is_a_tool_error_and_the_gateway_keeps_serving(
    bus: Bus, gateway: EnvGatewayService
) -> None:
    from libs.envs.client import EnvClient

    client = EnvClient(bus.nc)
    opening = await client.reset(FIZZBUZZ, episode_id="attacks")
    assert {t.name for t in opening.tools} == {t.name for t in TOOLS}
    outcomes: dict[str, ToolResult] = {}
    for name, code, _ in ATTACKS:
        reply = await client.step(
            "attacks", "coding", "", tool_calls=[call("run_python", code=code)]
        )
        assert not reply.done
        outcomes[name] = reply.tool_results[0]
    wrong = {
        n: (r.error, r.content[-300:])
        for (n, _, kinds), r in zip(ATTACKS, outcomes.values(), strict=True)
        if r.error not in kinds
    }
    assert not wrong, wrong
    assert "No such file" in outcomes["read hidden"].content
    assert "limit hit: processes" in outcomes["fork bomb"].content
    assert "limit hit: memory" in outcomes["memory bomb"].content
    assert "limit hit: cpu" in outcomes["infinite loop"].content
    assert "limit hit: file_size" in outcomes["huge file"].content
    assert not (REPO / "evil").exists() and not Path("/usr/evil").exists()

    search = await client.step(
        "attacks", "coding", "", tool_calls=[call("run_python", code=SEARCH)]
    )
    assert search.tool_results[0].content.endswith("hits: [] False\n"), search.tool_results[0]
    big = await client.step(
        "attacks",
        "coding",
        "",
        tool_calls=[call("write_file", path="w.txt", content="x" * (2 * MIB))],
    )
    assert big.tool_results[0].error == m.TOOL_ERROR_LIMIT

    # The same episode goes on and is graded; a new episode opens and runs.
    fix = await client.step(
        "attacks",
        "coding",
        "",
        tool_calls=[call("write_file", path="solution.py", content=FIXED_FIZZBUZZ)],
    )
    assert fix.tool_results[0].error == ""
    final = await client.step("attacks", "coding", "I fixed it.")
    assert final.done and (final.info["tests_passed"], final.info["tests_total"]) == (6, 6)
    await client.reset(FIZZBUZZ, episode_id="after")
    again = await client.step(
        "after", "coding", "", tool_calls=[call("run_python", code="print(6*7)")]
    )
    assert again.tool_results[0].error == "" and "42" in again.tool_results[0].content
    assert await client.close("after", "coding") is True
    assert gateway.health()["episodes_open"] == 0
