"""The bubblewrap sandbox, for real: what sandboxed code can and cannot do, and that every
way it can misbehave comes back as a result (a limit hit), never as a crash of the caller."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from apps.sandbox_cli import EXIT_LIMIT
from libs.sandbox import (
    SandboxConfig,
    SandboxError,
    SandboxFactory,
    SandboxLimits,
    build_sandbox_factory,
)
from libs.sandbox.limits import MIB
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

REPO = Path(__file__).resolve().parents[1]
LIMITS = SandboxLimits(
    cpu_s=2,
    memory_bytes=256 * MIB,
    max_processes=32,
    file_size_bytes=1 * MIB,
    wall_s=120.0,  # a deadline against a hung command only: generous for a loaded machine
    output_bytes=64 * 1024,
)


@pytest.fixture
def factory() -> SandboxFactory:
    return build_sandbox_factory(SandboxConfig(limits=LIMITS))


@pytest.fixture
def seed(tmp_path: Path) -> Path:
    folder = tmp_path / "seed"
    (folder / "pkg").mkdir(parents=True)
    (folder / "data.txt").write_text("21\n")
    (folder / "pkg" / "double.py").write_text("def double(x):\n    return 2 * x\n")
    return folder


def host_pids_with(token: str) -> list[int]:
    """Host processes whose command line contains `token`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.fixture
def listening_port() -> Iterator[int]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


async def test_python_reads_and_writes_in_working_folder(
    factory: SandboxFactory, seed: Path
) -> None:
    script = (
        "import sys; sys.path.insert(0, 'pkg'); from double import double\n"
        "n = int(open('data.txt').read())\n"
        "open('out.txt', 'w').write(str(double(n)))\n"
        "print(sys.executable, double(n))\n"
    )
    async with factory.open(seed) as sandbox:
        result = await sandbox.run(["python3", "-c", script])
        assert result.ok, result.stderr
        assert result.stdout.split() == [b"/usr/bin/python3", b"42"]
        assert (sandbox.workdir / "out.txt").read_text() == "42"
    assert not (seed / "out.txt").exists(), "the seed folder must never change"


async def test_exit_codes_signals_stdin_and_output_cap(factory: SandboxFactory) -> None:
    async with factory.open() as sandbox:
        assert (await sandbox.run(["sh", "-c", "exit 3"])).exit_code == 3
        killed = await sandbox.run(["python3", "-c", "import os; os.kill(os.getpid(), 15)"])
        assert (killed.exit_code, killed.killed_by_signal, killed.limit_hit) == (143, 15, None)
        echoed = await sandbox.run(["cat"], stdin=b"ping")
        assert echoed.ok and echoed.stdout == b"ping"
        flood = await sandbox.run(["python3", "-c", "print('x' * 1_000_000)"])
        assert flood.ok and flood.stdout_truncated
        assert len(flood.stdout) == LIMITS.output_bytes
        missing = await sandbox.run(["no-such-program"])
        assert missing.exit_code == 127 and missing.limit_hit is None


async def test_working_folders_are_private_and_removed(factory: SandboxFactory, seed: Path) -> None:
    async with factory.open(seed) as first, factory.open(seed) as second:
        assert first.workdir != second.workdir
        await first.run(["sh", "-c", "echo secret > mine.txt"])
        peek = await second.run(["sh", "-c", "ls; cat mine.txt"])
        assert peek.exit_code != 0 and b"mine.txt" not in peek.stdout
        workdirs = [first.workdir, second.workdir]
    assert not any(path.exists() for path in workdirs)


async def test_no_process_outlives_its_command(factory: SandboxFactory) -> None:
    async with factory.open() as sandbox:
        result = await sandbox.run(["sh", "-c", "sleep 987651 & echo started"])
        # Held open by the background child, the run would end at the wall limit instead.
        assert result.ok and not result.timed_out and result.stdout == b"started\n"
        assert host_pids_with("987651") == []
        hung = await sandbox.run(["sh", "-c", "sleep 987652 & sleep 987653"], timeout_s=0.5)
        assert hung.timed_out and hung.limit_hit == "wall"
        assert host_pids_with("98765") == []


async def test_cancelled_run_kills_its_sandbox(factory: SandboxFactory) -> None:
    async with factory.open() as sandbox:
        run = asyncio.create_task(sandbox.run(["sh", "-c", "sleep 987650; sleep 987650"]))
        await wait_for(lambda: bool(host_pids_with("987650")), 60, "the command to start")
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        await wait_for(lambda: not host_pids_with("987650"), 60, "the sandbox's processes gone")


async def test_network_is_unreachable(factory: SandboxFactory, listening_port: int) -> None:
    probe = f"""
import json, socket
report = {{"interfaces": [line.split(':')[0].strip() for line in open('/proc/net/dev')][2:]}}
try:
    socket.create_connection(("127.0.0.1", {listening_port}), timeout=2)
    report["connect"] = "connected"
except OSError as exc:
    report["connect"] = repr(exc)
try:
    report["dns"] = socket.getaddrinfo("example.com", 80)[0][4][0]
except OSError as exc:
    report["dns"] = "failed: " + repr(exc)
print(json.dumps(report))
"""
    async with factory.open() as sandbox:
        result = await sandbox.run(["python3", "-c", probe])
    report = json.loads(result.stdout)
    assert report["interfaces"] == ["lo"]
    assert report["connect"] != "connected"
    assert report["dns"].startswith("failed")


async def test_cannot_write_outside_working_folder(factory: SandboxFactory) -> None:
    targets = ["/usr/evil", "/etc/evil", "/evil", "/dev/evil", f"{REPO}/evil", "/root/evil"]
    probe = f"""
import json
outcome = {{}}
for path in {targets!r}:
    try:
        open(path, "w").write("x")
        outcome[path] = "written"
    except OSError as exc:
        outcome[path] = exc.strerror
print(json.dumps(outcome))
"""
    async with factory.open() as sandbox:
        result = await sandbox.run(["python3", "-c", probe])
    outcome = json.loads(result.stdout)
    assert all(verdict != "written" for verdict in outcome.values()), outcome
    assert not any(Path(path).exists() for path in targets)


async def test_host_files_are_not_visible(factory: SandboxFactory) -> None:
    hidden = [str(REPO), str(REPO / "pyproject.toml"), "/root", "/etc/shadow", "/etc/hostname"]
    probe = f"import json, os; print(json.dumps([os.path.exists(p) for p in {hidden!r}]))"
    async with factory.open() as sandbox:
        result = await sandbox.run(["python3", "-c", probe])
        top = await sandbox.run(["ls", "/"])
    assert json.loads(result.stdout) == [False] * len(hidden)
    assert set(top.stdout.split()) <= {
        *(b"bin sbin lib lib32 lib64 libx32 usr etc dev proc tmp workspace".split()),
    }


async def test_fork_bomb_hits_process_limit(factory: SandboxFactory) -> None:
    flat = (
        "import os, time\n"
        "for n in range(1000):\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(987654)\n"  # the token the straggler check looks for
    )
    recursive = "import os\nwhile True:\n    os.fork()\n"
    async with factory.open() as sandbox:
        bounded = await sandbox.run(["python3", "-c", flat])
        assert bounded.limit_hit == "processes" and bounded.exit_code == 1
        assert not bounded.timed_out, "the sleeping children must not hold the run open"
        bomb = await sandbox.run(["python3", "-c", recursive], timeout_s=60)
        # The first process to be refused a fork exits; its sandbox takes the rest along.
        assert bomb.limit_hit == "processes" and not bomb.timed_out
        assert (await sandbox.run(["true"])).ok, "the host must still start sandboxes"
    assert host_pids_with("987654") == []


async def test_memory_bomb_hits_memory_limit(factory: SandboxFactory) -> None:
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    async with factory.open() as sandbox:
        result = await sandbox.run(["python3", "-c", bomb])
    assert result.limit_hit == "memory" and not result.timed_out


async def test_infinite_loop_hits_cpu_limit_and_idle_command_hits_wall_limit() -> None:
    fast = build_sandbox_factory(SandboxConfig(limits=LIMITS.model_copy(update={"cpu_s": 1})))
    async with fast.open() as sandbox:
        spin = await sandbox.run(["python3", "-c", "while True: pass"])
        assert spin.limit_hit == "cpu" and spin.killed_by_signal is not None
        assert not spin.timed_out, "the CPU limit ends it, whatever the machine's load"
        idle = await sandbox.run(["sleep", "600"], timeout_s=0.5)
        assert idle.limit_hit == "wall" and idle.timed_out and idle.killed_by_signal is not None


async def test_huge_file_hits_file_size_limit(factory: SandboxFactory) -> None:
    python_write = "open('big', 'wb').write(b'x' * (8 << 20))"
    async with factory.open() as sandbox:
        from_python = await sandbox.run(["python3", "-c", python_write])
        assert from_python.limit_hit == "file_size"
        from_shell = await sandbox.run(["sh", "-c", "head -c 8M /dev/zero > big2"])
        assert from_shell.limit_hit == "file_size" and from_shell.killed_by_signal == 25
        in_tmp = await sandbox.run(["sh", "-c", "head -c 8M /dev/zero > /tmp/big"])
        assert in_tmp.limit_hit == "file_size"
        assert (sandbox.workdir / "big").stat().st_size <= LIMITS.file_size_bytes


async def test_concurrent_sandboxes_all_succeed(factory: SandboxFactory) -> None:
    async def one(i: int) -> bytes:
        async with factory.open() as sandbox:
            result = await sandbox.run(["python3", "-c", f"print({i} * 2)"])
            assert result.ok, result.stderr
            return result.stdout

    outputs = await asyncio.gather(*(one(i) for i in range(16)))
    assert outputs == [f"{i * 2}\n".encode() for i in range(16)]


@pytest.mark.skipif(os.geteuid() != 0, reason="only root drops to a uid that cannot read it")
async def test_sandbox_that_cannot_start_raises(tmp_path: Path) -> None:
    # pytest's tmp_path is private to root: the sandbox's host uid cannot reach folders in it.
    config = SandboxConfig(limits=LIMITS, root_dir=tmp_path / "sandboxes")
    with pytest.raises(SandboxError, match="could not start the sandbox"):
        async with build_sandbox_factory(config).open():
            pass
    assert list((tmp_path / "sandboxes").glob("sbx-*")) == [], "a failed open leaves nothing"


def test_mount_path_must_be_absolute_and_not_a_system_folder() -> None:
    for bad in ("workspace", "/usr", "/tmp/", "/a/../etc"):
        with pytest.raises(ValueError, match="mount_path"):
            SandboxConfig(mount_path=bad)


def test_cli_runs_one_command_and_reports_limits(seed: Path) -> None:
    (seed / "main.py").write_text("print(open('data.txt').read().strip()); raise SystemExit(7)")
    cli = [sys.executable, "-m", "apps.sandbox_cli", "sandbox", "run", "--workdir", str(seed)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([*cli, "--", "python3", "main.py"], capture_output=True, env=env)
    assert (done.returncode, done.stdout) == (7, b"21\n")
    spin = subprocess.run(
        [*cli, "--wall-s", "0.5", "--", "sleep", "30"], capture_output=True, env=env
    )
    assert spin.returncode == EXIT_LIMIT and b"limit hit: wall" in spin.stderr


def test_a_seed_folder_holding_the_sandboxes_own_folder_is_refused(tmp_path: Path) -> None:
    from libs.sandbox.bubblewrap import check_seed_dir

    root = tmp_path / "sandboxes"
    root.mkdir()
    with pytest.raises(ValueError, match="contains the sandboxes' own folder"):
        check_seed_dir(tmp_path, root)  # copying it would copy the copy, until the disk is full
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "big.bin").write_bytes(b"\0" * 2048)
    with pytest.raises(ValueError, match="holds more than"):
        check_seed_dir(tmp_path / "task", root, max_bytes=1024)
    check_seed_dir(tmp_path / "task", root)


async def test_a_new_factory_on_the_same_root_leaves_running_sandboxes_alone() -> None:
    # Test workers and services share <tmp>/rlpipe-sandboxes-<uid>: a factory built by one
    # (here with another mount path, so another passwd) must neither change what the other's
    # sandboxes see nor replace a file their bubblewrap is binding (it failed to start then).
    first = build_sandbox_factory(SandboxConfig(limits=LIMITS))
    building = asyncio.Event()

    def build_others() -> int:
        built = 0
        while not building.is_set():
            build_sandbox_factory(SandboxConfig(limits=LIMITS, mount_path=f"/work{built % 2}"))
            built += 1
        return built

    others = asyncio.create_task(asyncio.to_thread(build_others))
    try:
        for _ in range(30):
            async with first.open() as sandbox:
                result = await sandbox.run(
                    ["python3", "-c", "import os, pwd; print(pwd.getpwuid(os.getuid()).pw_dir)"]
                )
                assert result.stdout == b"/workspace\n", result.stderr
    finally:
        building.set()
    assert await others > 0
