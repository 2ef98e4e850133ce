"""The seccomp filter of every sandboxed command: a deny list of syscalls model code never needs.

    program = build_filter()            # classic BPF for this machine, as bytes
    # bubblewrap loads it right before it execs the command: `bwrap --seccomp FD ...`

What it refuses, with EPERM: mounting and namespace syscalls (mount, umount2, pivot_root,
unshare, setns, the new mount API, and clone() with a CLONE_NEW* flag), tracing and reading
other processes (ptrace, process_vm_*, kcmp, pidfd_getfd), kernel surfaces that have held
privilege-escalation bugs and that ordinary programs do not call (bpf, perf_event_open,
userfaultfd, io_uring, keyctl and the key syscalls, open_by_handle_at), and administration
(kexec, modules, swap, reboot, clocks, quotas, accounting, hostname). Most of these already
fail for an unprivileged user in its own namespaces; the filter makes the kernel turn them
away before their code runs. clone3 answers ENOSYS, as in Docker's default profile: its
flags sit in memory a filter cannot read, and glibc then falls back to clone().

Every syscall of another ABI is refused too: the i386 entry (int 0x80) and x32 numbers on
x86_64, AArch32 on aarch64, whose syscall numbers differ and would slip past the list.
Only x86_64 and aarch64 are supported; any other machine is refused by name.
"""

from __future__ import annotations

import errno
import platform
import struct

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000

# Syscall numbers: x86_64 from asm/unistd_64.h, aarch64 from asm-generic/unistd.h (aarch64
# lacks the legacy ones: iopl, ioperm, uselib, _sysctl, create_module, ...).
# fmt: off
SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {
        "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272,
        "setns": 308, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
        "pidfd_getfd": 438,
        "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "keyctl": 250, "add_key": 248,
        "request_key": 249, "open_by_handle_at": 304, "name_to_handle_at": 303,
        "fanotify_init": 300, "lookup_dcookie": 212,
        "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "swapon": 167, "swapoff": 168, "reboot": 169, "acct": 163,
        "quotactl": 179, "quotactl_fd": 443, "syslog": 103, "settimeofday": 164,
        "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159, "sethostname": 170,
        "setdomainname": 171, "vhangup": 153, "nfsservctl": 180,
        "iopl": 172, "ioperm": 173, "uselib": 134, "_sysctl": 156, "create_module": 174,
        "get_kernel_syms": 177, "query_module": 178,
    },
    "aarch64": {
        "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "unshare": 97,
        "setns": 268, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
        "pidfd_getfd": 438,
        "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "keyctl": 219, "add_key": 217,
        "request_key": 218, "open_by_handle_at": 265, "name_to_handle_at": 264,
        "fanotify_init": 262, "lookup_dcookie": 18,
        "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "swapon": 224, "swapoff": 225, "reboot": 142, "acct": 89,
        "quotactl": 60, "quotactl_fd": 443, "syslog": 116, "settimeofday": 170,
        "clock_settime": 112, "clock_adjtime": 266, "adjtimex": 171, "sethostname": 161,
        "setdomainname": 162, "vhangup": 58, "nfsservctl": 42,
    },
}
# fmt: on
CLONE = {"x86_64": 56, "aarch64": 220}
CLONE3 = 435  # the same number on both
# clone() flags that make a namespace (CLONE_NEWTIME is left out: in clone() that bit is
# part of the exit signal, and a time namespace comes only from clone3 or unshare).
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
CLONE_NEW_FLAGS |= 0x20000000 | 0x40000000  # NS, CGROUP, UTS, IPC, USER | PID, NET

# Classic BPF (linux/filter.h, linux/seccomp.h); seccomp_data: nr @0, arch @4, args[0] @16.
LOAD_WORD, JUMP_EQ, JUMP_GE, JUMP_SET, RETURN = 0x20, 0x15, 0x35, 0x45, 0x06
NR_OFFSET, ARCH_OFFSET, ARG0_LOW_OFFSET = 0, 4, 16  # args[0]'s low half: both are little-endian
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
DENY, NO_SYSCALL = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.ENOSYS


def machine_name(machine: str | None = None) -> str:
    """The supported machine name for `machine` (default: this one), or a clear refusal."""
    name = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine or "", machine)
    name = name or platform.machine()
    if name not in AUDIT_ARCH:
        raise ValueError(
            f"the sandbox's seccomp filter supports x86_64 and aarch64, not {name!r}: "
            "run the env-gateway on one of those"
        )
    return name


def denied_syscalls(machine: str | None = None) -> tuple[str, ...]:
    """The syscalls the filter refuses on `machine` (clone with CLONE_NEW* flags besides)."""
    return tuple(sorted(SYSCALLS[machine_name(machine)]))


def build_filter(machine: str | None = None) -> bytes:
    """The filter for `machine` as struct sock_filter[] bytes (what `bwrap --seccomp` reads)."""
    name = machine_name(machine)
    # (code, true target, false target, k); targets are labels resolved below, None = next.
    program: list[tuple[int, str | None, str | None, int]] = [
        (LOAD_WORD, None, None, ARCH_OFFSET),
        (JUMP_EQ, None, "deny", AUDIT_ARCH[name]),
        (LOAD_WORD, None, None, NR_OFFSET),
    ]
    if name == "x86_64":
        program.append((JUMP_GE, "deny", None, X32_SYSCALL_BIT))
    program += [(JUMP_EQ, "deny", None, number) for number in sorted(SYSCALLS[name].values())]
    program += [
        (JUMP_EQ, "no_syscall", None, CLONE3),
        (JUMP_EQ, None, "allow", CLONE[name]),
        (LOAD_WORD, None, None, ARG0_LOW_OFFSET),
        (JUMP_SET, "deny", None, CLONE_NEW_FLAGS),
    ]
    labels = {"allow": len(program), "deny": len(program) + 1, "no_syscall": len(program) + 2}
    program += [(RETURN, None, None, RET_ALLOW), (RETURN, None, None, DENY)]
    program.append((RETURN, None, None, NO_SYSCALL))
    return b"".join(
        _instruction(index, code, labels, true, false, k)
        for index, (code, true, false, k) in enumerate(program)
    )


def _instruction(
    index: int, code: int, labels: dict[str, int], true: str | None, false: str | None, k: int
) -> bytes:
    """One struct sock_filter; jump targets become offsets from the next instruction."""
    offsets = [0 if label is None else labels[label] - index - 1 for label in (true, false)]
    assert all(0 <= offset <= 255 for offset in offsets), "a BPF jump reaches 255 at most"
    return struct.pack("=HBBI", code, offsets[0], offsets[1], k)
