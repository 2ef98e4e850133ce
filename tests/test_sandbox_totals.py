"""Exhaustion attempts against a sandbox's totals, for real: memory, processes and CPU over
all its processes (its cgroup), and the size of its working folder (a tmpfs).

Per-process rlimits alone let a process tree through (eight children held 1.26 GB under a
256 MB address-space limit); these attacks spread the load over many processes, over
concurrent commands, and over ways of writing a file.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from libs.sandbox import SandboxConfig, SandboxError, SandboxLimits, build_sandbox_factory
from libs.sandbox.bubblewrap import BubblewrapSandbox, BubblewrapSandboxFactory
from libs.sandbox.cgroups import CgroupHost, cgroup_parents
from libs.sandbox.limits import MIB

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

REPO = Path(__file__).resolve().parents[1]
LIMITS = SandboxLimits(
    cpu_s=10,
    memory_bytes=256 * MIB,
    memory_total_bytes=256 * MIB,
    max_processes=32,
    file_size_bytes=64 * MIB,
    disk_bytes=4 * MIB,
    wall_s=120.0,  # a deadline against a hung command only
)

# Eight children each touch 64 MB and hold it; the parent reports, once each child has
# either said it holds its block or died, how many hold and how many were killed.
MEMORY_TREE = """
import os, select, signal, sys
children, block_bytes = int(sys.argv[1]), 64 << 20
ready_r, ready_w = os.pipe()
pids = []
for _ in range(children):
    pid = os.fork()
    if pid == 0:
        block = bytearray(block_bytes)
        for offset in range(0, block_bytes, 4096):
            block[offset] = 1  # make every page resident
        os.write(ready_w, os.getpid().to_bytes(4, "little"))
        signal.pause()
    pids.append(pid)
ready, dead = set(), {}
while len(ready | set(dead)) < children:
    if select.select([ready_r], [], [], 0.05)[0]:
        data = os.read(ready_r, 4096)
        ready |= {int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data), 4)}
    for pid in set(pids) - set(dead):
        if os.waitpid(pid, os.WNOHANG)[0]:
            dead[pid] = True
print(len(ready - set(dead)), len(dead))
"""

# Two commands of one sandbox at once, each starting up to 20 sleeping processes: alone,
# each would fit the limit of 32; together they cannot.
HOLD_PROCESSES = """
import os, sys, time
me, other = sys.argv[1], sys.argv[2]

def wait_for(name):
    while not os.path.exists(name):
        time.sleep(0.01)

open(f"started-{me}", "w").close()
wait_for(f"started-{other}")
started = 0
try:
    for _ in range(20):
        if os.fork() == 0:
            time.sleep(3600)
        started += 1
except BlockingIOError:
    pass
open(f"count-{me}", "w").write(str(started))
wait_for(f"count-{other}")
"""

SPIN = """
import os, time
os.fork()  # two processes spin, each until it has had 0.1 s of CPU
while time.process_time() < 0.1:
    pass
"""


@pytest.fixture(scope="module")
def factory() -> BubblewrapSandboxFactory:
    built = build_sandbox_factory(SandboxConfig(limits=LIMITS))
    assert isinstance(built, BubblewrapSandboxFactory)
    return built


def needs(factory: BubblewrapSandboxFactory, controller: str) -> None:
    if controller not in factory.cgroups.parents:
        pytest.skip(f"no {controller} cgroup here: {factory.cgroups.describe()}")


async def test_a_process_tree_cannot_exceed_the_memory_total(
    factory: BubblewrapSandboxFactory,
) -> None:
    needs(factory, "memory")
    async with factory.open() as sandbox:
        within = await sandbox.run(["python3", "-c", MEMORY_TREE, "2"])
        tree = await sandbox.run(["python3", "-c", MEMORY_TREE, "8"])
    assert within.ok and within.stdout.split() == [b"2", b"0"], within
    holding, killed = map(int, tree.stdout.split())
    # 4 x 64 MB is 256 MB before any interpreter: at most 3 hold at once, the rest are killed.
    assert holding <= 3 and killed >= 5, tree.stdout
    assert tree.limit_hit == "memory", tree


async def test_a_fork_bomb_stops_at_the_sandbox_process_limit(
    factory: BubblewrapSandboxFactory,
) -> None:
    needs(factory, "pids")
    bomb = "import os\nwhile True:\n    os.fork()\n"
    async with factory.open() as sandbox:
        assert isinstance(sandbox, BubblewrapSandbox) and sandbox.cgroup is not None
        result = await sandbox.run(["python3", "-c", bomb], timeout_s=60)
        assert result.limit_hit == "processes" and not result.timed_out, result
        assert sandbox.cgroup.counters().forks_refused > 0, "the cgroup refused the forks"
        assert (await sandbox.run(["true"])).ok, "the sandbox still runs commands"


async def test_concurrent_commands_share_one_process_total(
    factory: BubblewrapSandboxFactory,
) -> None:
    needs(factory, "pids")
    async with factory.open() as sandbox:
        results = await asyncio.gather(
            sandbox.run(["python3", "-c", HOLD_PROCESSES, "a", "b"]),
            sandbox.run(["python3", "-c", HOLD_PROCESSES, "b", "a"]),
        )
        counts = [int((sandbox.workdir / f"count-{me}").read_text()) for me in "ab"]
    assert all(result.exit_code == 0 for result in results), results
    # Each command is 2 processes itself (bubblewrap's pid 1 and python): 4 of the 32.
    assert sum(counts) <= LIMITS.max_processes - 4 < 40, counts
    assert all(result.limit_hit == "processes" for result in results), results


async def test_the_cpu_share_throttles_all_processes_together(
    factory: BubblewrapSandboxFactory,
) -> None:
    needs(factory, "cpu")
    slow = build_sandbox_factory(
        SandboxConfig(limits=LIMITS.model_copy(update={"cpu_cores": 0.05}))
    )
    async with slow.open() as sandbox:
        assert isinstance(sandbox, BubblewrapSandbox) and sandbox.cgroup is not None
        result = await sandbox.run(["python3", "-c", SPIN])
        assert result.ok, result
        # 0.2 CPU seconds at 0.05 cores (5 ms per 100 ms period): the kernel held them back.
        assert sandbox.cgroup.counters().cpu_throttled_periods > 0


async def test_writes_past_the_disk_quota_fail_however_they_are_made(
    factory: BubblewrapSandboxFactory,
) -> None:
    fill = (
        "import errno, os\n"
        "written = 0\n"
        "try:\n"
        "    for n in range(100):\n"
        "        with open(f'part{n}', 'wb') as file:\n"
        "            file.write(b'x' * (512 << 10))\n"
        "        written += 512 << 10\n"
        "except OSError as exc:\n"
        "    print(written, errno.errorcode[exc.errno])\n"
    )
    allocate = "import os\nos.posix_fallocate(os.open('big', os.O_CREAT | os.O_WRONLY), 0, 8 << 20)"
    mapped = (
        "import mmap, os\n"
        "fd = os.open('mapped', os.O_CREAT | os.O_RDWR)\n"
        "os.ftruncate(fd, 8 << 20)\n"  # a sparse file: no blocks yet
        "view = mmap.mmap(fd, 8 << 20)\n"
        "for offset in range(0, 8 << 20, 4096):\n"
        "    view[offset] = 1\n"
    )
    async with factory.open() as sandbox:
        files = await sandbox.run(["python3", "-c", fill])
        written, error = files.stdout.split()
        assert error == b"ENOSPC" and int(written) <= LIMITS.disk_bytes, files
        on_host = sum(path.stat().st_size for path in sandbox.workdir.iterdir())
        assert on_host <= LIMITS.disk_bytes
        await sandbox.run(["sh", "-c", "rm part*"])
        fallocated = await sandbox.run(["python3", "-c", allocate])
        assert fallocated.exit_code == 1 and b"No space left" in fallocated.stderr, fallocated
        assert fallocated.limit_hit == "disk"
        touched = await sandbox.run(["python3", "-c", mapped])
        assert touched.killed_by_signal == signal.SIGBUS, touched  # a page the tmpfs refused
        assert (sandbox.workdir / "mapped").stat().st_blocks * 512 <= LIMITS.disk_bytes
        again = await sandbox.run(["sh", "-c", "rm -f mapped big; head -c 1M /dev/zero > ok"])
        assert again.ok, "space freed inside the sandbox can be used again"


async def test_a_seed_larger_than_the_disk_quota_is_refused(
    factory: BubblewrapSandboxFactory, tmp_path: Path
) -> None:
    (tmp_path / "big.bin").write_bytes(b"\0" * (LIMITS.disk_bytes + MIB))
    with pytest.raises(SandboxError, match="does not fit the sandbox's disk quota"):
        async with factory.open(tmp_path):
            pass


@pytest.mark.skipif(os.geteuid() != 0, reason="remounting the cgroup folders read-only: root")
def test_without_writable_cgroups_the_factory_says_so_and_required_refuses() -> None:
    # As in a container whose /sys/fs/cgroup is read-only: a private mount namespace where
    # every cgroup hierarchy is remounted read-only.
    script = (
        "import asyncio, json\n"
        "from libs.sandbox import SandboxConfig, SandboxError, build_sandbox_factory\n"
        "factory = build_sandbox_factory(SandboxConfig())\n"
        "async def one():\n"
        "    async with factory.open() as sandbox:\n"
        "        return (await sandbox.run(['echo', 'ran'])).stdout.decode()\n"
        "try:\n"
        "    build_sandbox_factory(SandboxConfig(cgroups='required'))\n"
        "    refused = ''\n"
        "except SandboxError as exc:\n"
        "    refused = str(exc)\n"
        "print(json.dumps([factory.enforcement['cgroup'], asyncio.run(one()), refused]))\n"
    )
    remount = (
        'for m in $(findmnt -rn -t cgroup,cgroup2 -o TARGET); do mount -o remount,bind,ro "$m"; '
        'done; exec "$@"'
    )
    private_mounts = ["unshare", "--mount", "--propagation", "private"]
    done = subprocess.run(
        [*private_mounts, "sh", "-c", remount, "sh", sys.executable, "-c", script],
        capture_output=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    *logs, last = done.stdout.decode().splitlines()
    cgroup, ran, refused = json.loads(last)
    assert cgroup.startswith("none: ") and "Read-only file system" in cgroup
    assert any("sandbox totals not enforced by cgroups" in line for line in logs), logs
    assert ran == "ran\n", "sandboxes still run, bounded by their per-process limits"
    assert "cgroups='required'" in refused


# The service as the image runs it: an ordinary user, who may make no cgroups.
AS_A_USER = """
import asyncio, json
from libs.sandbox import SandboxConfig, SandboxLimits, build_sandbox_factory
limits = SandboxLimits(disk_bytes=1 << 20, file_size_bytes=8 << 20)
factory = build_sandbox_factory(SandboxConfig(limits=limits))
async def main():
    async with factory.open() as sandbox:
        fill = await sandbox.run(["sh", "-c", "head -c 2M /dev/zero > big"])
        status = await sandbox.run(["grep", "Seccomp:", "/proc/self/status"])
        size = (sandbox.workdir / "big").stat().st_size
        return [fill.limit_hit, status.stdout.decode().split(), size]
print(json.dumps([factory.enforcement["cgroup"], *asyncio.run(main())]))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming an unprivileged user: root")
def test_a_service_run_as_an_ordinary_user_keeps_every_guard_but_the_totals() -> None:
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": f"{REPO}:{sysconfig.get_paths()['purelib']}"}
    pythons = [os.path.realpath(sys.executable), "/usr/bin/python3"]
    probe = ["-c", "import pydantic, structlog"]
    usable = [p for p in pythons if subprocess.run([*nobody, p, *probe], env=env).returncode == 0]
    if not usable:
        pytest.skip(f"none of {pythons} runs this checkout's packages as an unprivileged user")
    done = subprocess.run(
        [*nobody, usable[0], "-c", AS_A_USER], capture_output=True, cwd=REPO, env=env
    )
    assert done.returncode == 0, done.stderr
    cgroup, disk_limit, seccomp, size = json.loads(done.stdout.splitlines()[-1])
    assert cgroup.startswith("none: ") and "Permission denied" in cgroup
    assert disk_limit == "disk" and size <= 1 << 20
    assert seccomp == ["Seccomp:", "2"]


def test_cgroup_hierarchies_are_found_for_v1_v2_and_none() -> None:
    v1 = cgroup_parents(
        "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
        "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "39 31 0:36 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
        "8:pids:/a\n4:memory:/a/b\n1:cpu,cpuacct:/\n0::/\n",
    )
    assert v1 == CgroupHost(
        1,
        {
            "cpu": Path("/sys/fs/cgroup/cpu,cpuacct"),
            "memory": Path("/sys/fs/cgroup/memory/a/b"),
            "pids": Path("/sys/fs/cgroup/pids/a"),
        },
    )
    # A container with its own cgroup namespace: the mount's root is the container's cgroup.
    v2 = cgroup_parents(
        "600 500 0:30 /kubepods/pod1 /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n",
        "0::/kubepods/pod1/app\n",
    )
    assert v2.version == 2 and set(v2.parents.values()) == {Path("/sys/fs/cgroup/app")}
    none = cgroup_parents("22 1 0:21 / /proc rw - proc proc rw\n", "0::/\n")
    assert none.version is None and none.describe().startswith("none: no cgroup hierarchy")
