"""The seccomp filter a bwrap sandbox runs under: the system calls an agent never needs and an escape would.

Built with libseccomp (`libseccomp.so.2`, which bubblewrap's own distributions ship) through ctypes, exported as
the BPF program bwrap loads (`--seccomp FD`) for the native architecture (and x32 on x86-64, refused whole).
Denied with EPERM: mounting (`mount`, `umount2`, `pivot_root`, the new mount API), namespaces (`setns`, and
`unshare` / `clone` asking for a new user namespace; `clone3`, whose flags a filter cannot read, answers ENOSYS
so libc falls back to `clone`), `ptrace` and reading other processes' memory, kernel code (`kexec_*`,
`*_module`, `bpf`), keyrings, `perf_event_open`, `open_by_handle_at`, `userfaultfd`, io_uring (which
bypasses the filter's view), swap, reboot, clocks, accounting and quotas. Standard library only: the episode
entrypoint imports it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

DENIED = ("mount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
          "mount_setattr", "setns", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "kexec_load",
          "kexec_file_load", "init_module", "finit_module", "delete_module", "bpf", "keyctl", "add_key",
          "request_key", "perf_event_open", "open_by_handle_at", "name_to_handle_at", "userfaultfd", "swapon",
          "swapoff", "reboot", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "acct", "quotactl",
          "lookup_dcookie", "iopl", "ioperm", "syslog", "io_uring_setup", "io_uring_enter", "io_uring_register")

# unshare and clone are denied only when their flags (argument 0) ask for a new user namespace
CLONE_NEWUSER = 0x10000000
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_MASKED_EQ = 7
_X32 = 0x4000003E  # SCMP_ARCH_X32


def _errno(code: int) -> int:
    return 0x00050000 | code  # SCMP_ACT_ERRNO


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


class SeccompUnavailable(Exception):
    """Why no filter can be built here (a sentence)."""


def _library() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        raise SeccompUnavailable("libseccomp is not installed (apt-get install libseccomp2)") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_arch_native.restype = ctypes.c_uint32
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def program() -> bytes:
    """The filter's BPF program, as bwrap's `--seccomp` reads it; SeccompUnavailable when it cannot be built."""
    lib = _library()
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise SeccompUnavailable("libseccomp could not start a filter")
    read, write = os.pipe()
    try:
        if lib.seccomp_arch_native() == 0xC000003E:  # x86-64: x32 calls are denied like the native ones
            lib.seccomp_arch_add(ctx, _X32)
        rules: list[tuple[str, int, list[_ArgCmp]]] = [(name, _errno(errno.EPERM), []) for name in DENIED]
        rules.append(("clone3", _errno(errno.ENOSYS), []))
        new_user = _ArgCmp(0, _SCMP_CMP_MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER)
        rules += [("unshare", _errno(errno.EPERM), [new_user]), ("clone", _errno(errno.EPERM), [new_user])]
        for name, action, args in rules:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                continue
            array = (_ArgCmp * len(args))(*args) if args else None
            if lib.seccomp_rule_add_array(ctx, action, nr, len(args), array) != 0:
                raise SeccompUnavailable(f"libseccomp refused the rule for {name}")
        if lib.seccomp_export_bpf(ctx, write) != 0:
            raise SeccompUnavailable("libseccomp could not export the filter")
        os.close(write)
        write = -1
        chunks = []
        while chunk := os.read(read, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        lib.seccomp_release(ctx)
        os.close(read)
        if write >= 0:
            os.close(write)


def program_fd(bpf: bytes) -> int:
    """An inheritable file descriptor holding `bpf` from its start, for bwrap's `--seccomp FD`."""
    fd = os.memfd_create("openforge-seccomp", 0)
    os.write(fd, bpf)
    os.lseek(fd, 0, os.SEEK_SET)
    os.set_inheritable(fd, True)
    return fd
