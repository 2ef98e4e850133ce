"""Escape attempts against the bubblewrap sandbox's seccomp filter, run for real inside it.

Each probe calls the kernel the way model-written code would (libc's wrappers, or the raw
syscall with numbers written here from the kernel headers, not taken from the filter's own
table), and reports the errno. Without the filter, in the same namespaces, many of these
calls succeed (ptrace, process_vm_readv, user-mode userfaultfd) or fail otherwise (bpf,
perf_event_open, keyctl, add_key, io_uring_setup: EINVAL or EFAULT; unshare and clone of a
user namespace: ENOSPC): EPERM from all of them is the filter's doing.
"""

from __future__ import annotations

import json
import platform
import shutil

import pytest

from libs.sandbox import SandboxConfig, SandboxFactory, SandboxLimits, build_sandbox_factory
from libs.sandbox.limits import MIB
from libs.sandbox.seccomp import build_filter

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

MACHINE = platform.machine()
LIMITS = SandboxLimits(cpu_s=5, memory_bytes=256 * MIB, max_processes=32, wall_s=120.0)
# From arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/unistd.h.
NUMBERS = {
    "x86_64": {
        "bpf": 321, "perf_event_open": 298, "keyctl": 250, "add_key": 248, "userfaultfd": 323,
        "io_uring_setup": 425, "process_vm_readv": 310, "kexec_load": 246, "init_module": 175,
        "clone": 56, "getpid": 39,
    },
    "aarch64": {
        "bpf": 280, "perf_event_open": 241, "keyctl": 219, "add_key": 217, "userfaultfd": 282,
        "io_uring_setup": 425, "process_vm_readv": 270, "kexec_load": 104, "init_module": 105,
        "clone": 220, "getpid": 172,
    },
}  # fmt: skip

PROBE = """
import ctypes, errno, json, os, shutil, subprocess, sys, threading
NR = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def outcome(result):
    return "succeeded" if result >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")

def raw(name, *args):
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(NR[name]), *(ctypes.c_long(a) for a in args))
    if result == 0 and name == "clone":
        os._exit(0)  # a clone that got through: its child leaves at once
    return outcome(result)

def wrapped(function, *args):
    ctypes.set_errno(0)
    return outcome(getattr(libc, function)(*args))

def in_child(function, *args):  # a traced process stops at its next signal: not this one
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write_end, wrapped(function, *args).encode())
        os._exit(0)
    os.close(write_end)
    verdict = os.read(read_end, 64).decode()
    os.waitpid(pid, 0)
    return verdict

CLONE_NEWNS, CLONE_NEWUSER, SIGCHLD = 0x20000, 0x10000000, 17
child = os.fork()
if child == 0:
    os.read(os.pipe()[0], 1)  # a sibling to attach to; blocks until killed
ns = os.open("/proc/self/ns/uts", os.O_RDONLY)
attempts = {
    "unshare(user)": wrapped("unshare", CLONE_NEWUSER),
    "unshare(mount)": wrapped("unshare", CLONE_NEWNS),
    "clone(user)": raw("clone", CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0),
    "setns": wrapped("setns", ns, 0),
    "mount": wrapped("mount", b"none", b"/tmp", b"tmpfs", 0, None),
    "umount2": wrapped("umount2", b"/proc", 2),
    "chroot": wrapped("chroot", b"/tmp"),
    "ptrace(traceme)": in_child("ptrace", 0, 0, None, None),
    "ptrace(attach)": wrapped("ptrace", 16, child, None, None),
    "process_vm_readv": raw("process_vm_readv", os.getpid(), 0, 0, 0, 0, 0),
    "bpf": raw("bpf", 0, 0, 0),
    "perf_event_open": raw("perf_event_open", 0, 0, -1, -1, 0),
    "keyctl": raw("keyctl", 0, 0),
    "add_key": raw("add_key", 0, 0, 0, 0, 0),
    "userfaultfd": raw("userfaultfd", 1),
    "io_uring_setup": raw("io_uring_setup", 1, 0),
    "kexec_load": raw("kexec_load", 0, 0, 0, 0),
    "init_module": raw("init_module", 0, 0, 0),
}
os.kill(child, 9)
tools = {}
for argv in (["unshare", "-U", "true"], ["unshare", "-m", "true"],
             ["mount", "-t", "tmpfs", "none", "/tmp"]):
    if shutil.which(argv[0]):
        tools[" ".join(argv)] = subprocess.run(argv, capture_output=True).returncode
thread = threading.Thread(target=lambda: None)
thread.start()
thread.join()
status = [l.split()[1] for l in open("/proc/self/status") if l.startswith("Seccomp:")]
print(json.dumps({"attempts": attempts, "tools": tools, "seccomp": status,
                  "getpid": raw("getpid"), "true": subprocess.run(["true"]).returncode}))
"""

# x86_64 only: getpid through the i386 entry (int 0x80) and with the x32 bit set. Their
# numbers are another ABI's, which a deny list by number would let through.
OTHER_ABIS = """
import ctypes, errno, json, mmap
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
ctypes.set_errno(0)
x32 = libc.syscall(ctypes.c_long(0x40000000 | 39))
x32 = errno.errorcode.get(ctypes.get_errno()) if x32 < 0 else "succeeded"
# push rbx; mov eax, 20 (getpid on i386); int 0x80; pop rbx; movsxd rax, eax; ret
code = bytes.fromhex("53 b8 14 00 00 00 cd 80 5b 48 63 c0 c3")
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
i386 = ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
print(json.dumps({"x32": x32, "i386": "succeeded" if i386 >= 0 else errno.errorcode[-i386]}))
"""


@pytest.fixture(scope="module")
def factory() -> SandboxFactory:
    return build_sandbox_factory(SandboxConfig(limits=LIMITS))


@pytest.mark.skipif(MACHINE not in NUMBERS, reason=f"no syscall numbers for {MACHINE}")
async def test_namespace_mount_trace_and_kernel_syscalls_are_refused(
    factory: SandboxFactory,
) -> None:
    async with factory.open() as sandbox:
        result = await sandbox.run(["python3", "-c", PROBE, json.dumps(NUMBERS[MACHINE])])
    assert result.ok, result.stderr
    report = json.loads(result.stdout)
    assert report["seccomp"] == ["2"], "the command runs under a seccomp filter"
    attempts = report["attempts"]
    assert attempts == dict.fromkeys(attempts, "EPERM"), attempts
    assert report["tools"] and all(code != 0 for code in report["tools"].values()), report
    # What ordinary programs do still works: threads (glibc falls back from clone3), fork,
    # subprocesses, plain syscalls.
    assert report["getpid"] == "succeeded" and report["true"] == 0


@pytest.mark.skipif(MACHINE != "x86_64", reason="the i386 and x32 ABIs exist on x86_64 only")
async def test_syscalls_of_other_abis_are_refused(factory: SandboxFactory) -> None:
    async with factory.open() as sandbox:
        result = await sandbox.run(["python3", "-c", OTHER_ABIS])
    # A kernel without i386 emulation kills the probe (SIGSEGV): refused all the same.
    if result.killed_by_signal is None:
        assert result.ok, result.stderr
        assert json.loads(result.stdout) == {"x32": "EPERM", "i386": "EPERM"}
    assert b"succeeded" not in result.stdout


def test_the_filter_is_built_for_x86_64_and_aarch64_and_refuses_other_machines() -> None:
    x86, arm = build_filter("x86_64"), build_filter("aarch64")
    assert x86 != arm and len(x86) % 8 == 0 and len(arm) % 8 == 0  # struct sock_filter[]
    assert build_filter("amd64") == x86 and build_filter("arm64") == arm
    with pytest.raises(ValueError, match="supports x86_64 and aarch64, not 'riscv64'"):
        build_filter("riscv64")
