"""How an episode's agent and verifier processes are started: the sandbox that keeps them from the reward.

The agent is the adversary (docs/rollouts.md, Sandbox). Three modes:

- `bwrap` (local episodes): bubblewrap puts each command in its own user, PID, mount, network, IPC and UTS
  namespaces, as uid 65534 with no capability, no-new-privileges and the `seccomp.py` filter, whoever starts
  it (`privileges_left` checks that once per process). It sees only its own processes, and all of them die
  with it (`setsid` ones too). The file
  system is an empty root with the system directories, the Python prefixes, the `openforge` package, the
  tools directory and any absolute path the command names read-only; the workspace and HOME writable; a
  private /tmp; everything else (the run directory, specs, results, other episodes, the real home) is not
  there. The network namespace has only loopback: a forwarder started as the sandbox's first process
  listens on 127.0.0.1 at the proxy's port (the proxy knows requests to itself by their port) and relays
  to a Unix socket bound in from outside, where `ProxyRelay` relays to the proxy's host and port, and
  nowhere else.
- `uid` (a container whose episode process runs as root, one episode per container): the agent runs as an
  unprivileged uid and gid without supplementary groups and with no-new-privileges, owning only its
  workspace and HOME, so it can neither read root-only files (the spec, 0400) nor signal the episode
  process; every process of that uid is killed after each step.
- `none`: plain child processes of the same user (what `--no-sandbox` gives).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from openforge.choices import Sandbox
from openforge.rollout import seccomp

SOCKET_IN_SANDBOX = "/run/openforge/proxy.sock"
NOBODY = 65534  # the uid and gid the agent runs as in `uid` mode
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# A user namespace whose only user is NOBODY (as root too: bwrap started by root otherwise keeps every capability
# inside), every capability dropped, bounding set included; bwrap sets no-new-privileges itself.
UNPRIVILEGED = ("--unshare-user", "--uid", str(65534), "--gid", str(65534), "--cap-drop", "ALL")
# Kernel settings and triggers the sandbox's own /proc would leave writable to a uid that maps to root outside.
PROC_READONLY = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs")
INSTALL_HINT = "install bubblewrap (apt-get install bubblewrap), or run with --no-sandbox"
NOT_PROTECTED = (
    "warning: --no-sandbox: agents run as plain processes of your user; nothing keeps them from reading the "
    "run directory, specs (verify commands, expected answers) and other episodes, from reaching the engine "
    "and the network directly, from signalling or inspecting other processes of your user, or from leaving "
    "processes running after their episode")

def _pump(a: socket.socket, b: socket.socket) -> None:
    """Copy `a` to `b` until `a` ends, then half-close both."""
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    for s, how in ((b, socket.SHUT_WR), (a, socket.SHUT_RD)):
        try:
            s.shutdown(how)
        except OSError:
            pass


def _relay(server: socket.socket, connect: Callable[[], socket.socket]) -> None:
    """Join each connection `server` accepts to a new `connect()`, both ways, until `server` is closed; a
    connection whose upstream cannot be reached is closed."""
    while True:
        try:
            client, _ = server.accept()
        except OSError:
            return
        try:
            upstream = connect()
        except OSError:
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()


# The first process of a bwrap sandbox: serve 127.0.0.1:PORT by relaying each connection to the Unix socket,
# run the agent, exit with its status (the namespace and whatever the agent left in it die then). The relay
# is this module's own `_pump` and `_relay`, by their source.
FORWARDER = "\n".join(["from __future__ import annotations", "import socket, subprocess, sys, threading",
                        inspect.getsource(_pump), inspect.getsource(_relay), r'''
port, path, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
server = socket.create_server(("127.0.0.1", port))
def connect():
    upstream = socket.socket(socket.AF_UNIX)
    upstream.connect(path)
    return upstream
threading.Thread(target=_relay, args=(server, connect), daemon=True).start()
try:
    code = subprocess.call(argv)
except OSError as e:
    print(f"cannot start {argv[0]}: {e.strerror or e}", file=sys.stderr)
    code = 127
sys.exit(code if code >= 0 else 128 - code)
'''])


def unavailable(mode: str) -> str | None:
    """Why `mode` cannot run on this machine, or None when it can."""
    if mode == Sandbox.bwrap:
        if not shutil.which("bwrap"):
            return f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}"
        try:
            probe = subprocess.run(["bwrap", "--unshare-pid", "--unshare-net", "--die-with-parent",
                                    "--ro-bind", "/", "/", "--proc", "/proc", "true"],
                                   capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bubblewrap cannot run here ({e}): {INSTALL_HINT}"
        if probe.returncode != 0:
            why = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]
            return (f"bubblewrap cannot create namespaces here ({why}); allow unprivileged user namespaces "
                    f"(sysctl kernel.unprivileged_userns_clone=1), or run with --no-sandbox")
        return privileges_left()
    elif mode == Sandbox.uid and os.geteuid() != 0:
        return "sandbox 'uid' needs the episode process to run as root (it starts agents as another user)"
    return None


# What the probe reads inside the sandbox: its status, and whether a sysctl or a root-only file is open to it.
PROBE = ("cat /proc/self/status; test -w /proc/sys/vm/drop_caches && echo SYSCTL OPEN; "
         "test -s /etc/shadow && head -c1 /etc/shadow >/dev/null 2>&1 && echo SHADOW OPEN; true")


@functools.cache
def root_only_files() -> tuple[tuple[str, bool], ...]:
    """(path, is a directory) of what in /etc only root may read (`shadow`, `ssl/private`, ...), when this
    process is root: started by root, bwrap maps the sandbox's user to root outside, and though it holds no
    capability, file permissions see it as the owner of root's files. Masked in the sandbox: an empty file or
    directory. Nothing to mask for another user."""
    if os.geteuid() != 0:
        return ()
    found: list[tuple[str, bool]] = []
    for top, dirs, files in os.walk("/etc"):
        for name in [*dirs, *files]:
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode) or st.st_mode & stat.S_IROTH:
                continue
            found.append((path, stat.S_ISDIR(st.st_mode)))
        dirs[:] = [d for d in dirs if (os.path.join(top, d), True) not in found]
    return tuple(found)


@functools.cache
def seccomp_program() -> bytes:
    """The sandbox's seccomp filter (`seccomp.py`), built once per process."""
    return seccomp.program()


@functools.cache
def privileges_left() -> str | None:
    """Why the sandbox as `bwrap_command` makes it would leave its command a privilege, or None: the real
    command line, run once per process, must show no capability (effective, permitted, bounding, ambient),
    no-new-privileges and the seccomp filter in the command's own /proc/self/status."""
    try:
        fd = seccomp.program_fd(seccomp_program())
    except seccomp.SeccompUnavailable as e:
        return f"the sandbox's seccomp filter cannot be built: {e}; or run with --no-sandbox"
    try:
        probe = subprocess.run(bwrap_command(["sh", "-c", PROBE], cwd=Path("/"), writable=[], readonly=[],
                                             hidden=[], seccomp_fd=fd), pass_fds=(fd,), capture_output=True,
                               text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bubblewrap cannot run its sandbox here ({e}): {INSTALL_HINT}"
    finally:
        os.close(fd)
    status = dict(line.split(":", 1) for line in probe.stdout.splitlines() if ":" in line)
    if probe.returncode != 0 or "CapEff" not in status:
        why = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]
        return f"bubblewrap cannot start an unprivileged sandbox here ({why}); or run with --no-sandbox"
    held = [f"{name} {status[name].strip()}" for name in ("CapEff", "CapPrm", "CapBnd", "CapAmb")
            if int(status[name], 16)]
    if held:
        return (f"the bwrap sandbox would leave the agent capabilities ({', '.join(held)}): this bubblewrap "
                "ignores --cap-drop or --unshare-user; refusing to run agents with privileges")
    if " OPEN" in probe.stdout:
        return "the bwrap sandbox would leave /proc/sys or /etc/shadow to the agent; refusing to run agents with them"
    if status.get("NoNewPrivs", "").strip() != "1" or status.get("Seccomp", "").strip() != "2":
        return ("the bwrap sandbox would run the agent without no-new-privileges or its seccomp filter "
                f"(NoNewPrivs {status.get('NoNewPrivs', '?').strip()}, Seccomp {status.get('Seccomp', '?').strip()})")
    return None


def readonly_paths() -> list[Path]:
    """What every sandboxed command needs to read: the Python prefixes, the `openforge` package (with the
    directories of the checkout its links point to: examples, reconstruct, trainer, addons), the tools. Not
    the rest of the checkout, where run directories often are."""
    from openforge.rollout.adapters import tools_dir

    package = Path(__file__).resolve().parents[1]
    linked = [str(p.resolve()) for p in package.iterdir() if p.is_symlink()]
    return [Path(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, str(package), *linked, tools_dir()}
            if os.path.isdir(p)]


def named_files(argv: Iterable[str]) -> list[Path]:
    """Files a command names by absolute path (a custom CLI's script): bound read-only, nothing around them."""
    return [Path(a) for a in argv if a.startswith("/") and "\0" not in a and os.path.isfile(a)]


def install_roots(files: Iterable[Path]) -> list[Path]:
    """The installations the named files belong to, bound read-only with them: the top-most `node_modules`
    their real path lies in (an npm `.bin` link points into its package, whose dependencies sit beside it), and
    the virtual environment of a script whose `#!` names an interpreter in one (with the Python it was made
    from, `home` in its `pyvenv.cfg`)."""
    roots: set[Path] = set()
    for named in files:
        for path in {named.resolve(), Path(os.path.abspath(named))}:
            tops = [p for p in path.parents if p.name == "node_modules"]
            if tops:
                roots.add(tops[-1])
        roots.update(_venv_of(named))
    return sorted(roots)


def _venv_of(script: Path) -> list[Path]:
    """The venv (and its base Python's prefix) a script's `#!` interpreter lives in; [] for anything else."""
    try:
        with open(script, "rb") as f:
            first = f.readline(4096)
    except OSError:
        return []
    if not first.startswith(b"#!"):
        return []
    interpreter = Path(first[2:].split()[0].decode(errors="replace")) if first[2:].split() else None
    if interpreter is None or not interpreter.is_absolute():
        return []
    venv = next((p for p in interpreter.parents if (p / "pyvenv.cfg").is_file()), None)
    if venv is None:
        return []
    found = [venv]
    for line in (venv / "pyvenv.cfg").read_text(errors="replace").splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "home" and os.path.isdir(value.strip()):
            found.append(Path(value.strip()).resolve().parent)
    return found


MISSING = re.compile(r"Cannot find (?:module|package) '([^']+)'(?: imported from (\S+))?|"
                     r"ModuleNotFoundError: No module named '([^']+)'|(/\S+): (?:No such file or directory|not found)")


def missing_path_hint(stderr: str) -> str | None:
    """For a CLI that could not start in the sandbox: what it looked for, and how to bind it; None when its
    stderr says nothing of the kind."""
    found = list(MISSING.finditer(stderr[-8192:]))
    if not found:
        return None
    match = found[-1]
    module, where, python_module, path = match.groups()
    what = (f"{module!r}" + (f" (from {where})" if where else "")) if module else (
        f"Python module {python_module!r}" if python_module else path)
    return (f"the CLI could not find {what} in the sandbox, which binds only the system, Python, the tools "
            "directory and the installation of a command named by absolute path: add the directory it is in to "
            'the adapter\'s readonly = ["/path/to/it"] (docs/rollouts.md, Toolchains: adapters)')


def _depth(path: str) -> int:
    return len(Path(path).parts)


def _inside(path: str, root: str) -> bool:
    """`path` strictly below `root`."""
    return path != root and Path(path).is_relative_to(root)


def bwrap_command(argv: Sequence[str], *, cwd: Path, writable: Sequence[Path], readonly: Sequence[Path],
                  hidden: Sequence[Path], relay: ProxyRelay | None = None, seccomp_fd: int | None = None) -> list[str]:
    """`argv` inside a new bwrap sandbox, with no privileges (`UNPRIVILEGED`, `/proc/sys` read-only, the
    `seccomp.py` filter read from `seccomp_fd`). Mounts are made shallow first, so a deeper one wins: a hidden
    directory inside a read-only one is an empty tmpfs, a workspace inside a hidden one is there again.
    With `relay`, the sandbox's first process is the forwarder to it (the proxy on 127.0.0.1 at its port);
    without, the command has no network at all."""
    mounts: list[tuple[int, int, list[str]]] = []  # (depth, order at equal depth, bwrap arguments)
    for d in SYSTEM_DIRS:
        mounts.append((_depth(d), 0, ["--ro-bind-try", d, d]))
    mounts += [(1, 1, ["--dev", "/dev"]), (1, 1, ["--proc", "/proc"]), (1, 1, ["--tmpfs", "/tmp"])]
    mounts += [(_depth(p), 0, ["--ro-bind-try", p, p]) for p in PROC_READONLY]
    for path, is_dir in root_only_files():  # the agent's uid is root outside: it would read them as their owner
        mounts.append((_depth(path), 1, ["--tmpfs", path, "--remount-ro", path] if is_dir
                       else ["--ro-bind", "/dev/null", path]))
    ro = {dest: p for p in readonly for dest in (str(p.resolve()), os.path.abspath(p))}
    hide = {h for h in {str(p.resolve()) for p in hidden} if any(_inside(h, r) for r in ro)}
    for dest, src in ro.items():  # not again inside a read-only one (no mount point can be made there)
        if not any(_inside(dest, r) and not any(_inside(dest, h) and _inside(h, r) for h in hide)
                   for r in (*ro, *SYSTEM_DIRS)):
            mounts.append((_depth(dest), 0, ["--ro-bind", str(src.resolve()), dest]))
    mounts += [(_depth(h), 1, ["--tmpfs", h]) for h in hide]
    for w in {str(p.resolve()) for p in writable}:
        mounts.append((_depth(w), 2, ["--bind", w, w]))
    command = ["bwrap", *UNPRIVILEGED, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
               "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--hostname", "openforge"]
    if seccomp_fd is not None:
        command += ["--seccomp", str(seccomp_fd)]
    for _, _, args in sorted(mounts, key=lambda m: (m[0], m[1])):
        command += args
    command += ["--chdir", str(cwd.resolve())]
    if relay is None:
        return [*command, "--", *argv]
    command += ["--bind", str(relay.path), SOCKET_IN_SANDBOX]
    return [*command, "--", sys.executable, "-I", "-c", FORWARDER, str(relay.target[1]), SOCKET_IN_SANDBOX, *argv]


def _target(proxy_url: str) -> tuple[str, int]:
    parts = urlsplit(proxy_url)
    return parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)


def sandbox_url(proxy_url: str) -> str:
    """The proxy's URL as a bwrap sandbox reaches it: 127.0.0.1, the proxy's port and path."""
    return f"http://127.0.0.1:{_target(proxy_url)[1]}{urlsplit(proxy_url).path.rstrip('/')}"


class ProxyRelay:
    """A Unix socket (in a private 0700 directory) whose every connection is relayed to the proxy's host and
    port: the only way out of a bwrap sandbox. Use as a context manager; `path` is the socket."""

    def __init__(self, proxy_url: str) -> None:
        self.target = _target(proxy_url)
        self.dir = Path(tempfile.mkdtemp(prefix="openforge-relay-"))
        self.path = self.dir / "proxy.sock"
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(str(self.path))
        self.server.listen(64)
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> ProxyRelay:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.server.close()
        self.thread.join(5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _serve(self) -> None:
        _relay(self.server, self._connect)

    def _connect(self) -> socket.socket:
        upstream = socket.create_connection(self.target, timeout=30)
        upstream.settimeout(None)
        return upstream


def as_user(uid: int) -> dict[str, Any]:
    """Popen arguments for `uid` mode: that uid and gid, no supplementary groups, no new privileges."""
    return {"user": uid, "group": uid, "extra_groups": [], "preexec_fn": _no_new_privs}


def _no_new_privs() -> None:
    import ctypes

    PR_SET_NO_NEW_PRIVS = 38
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def give_to(root: Path, uid: int) -> None:
    """`root` and everything under it owned by `uid` (links themselves, never what they point to)."""
    os.lchown(root, uid, uid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)


def kill_user(uid: int) -> None:
    """SIGKILL every process of `uid` (what an agent left running, `setsid` or not), from a shell of that
    uid, so nothing else can be hit; repeated while some were found (one may have forked meanwhile)."""
    subprocess.run(["sh", "-c", "i=0; while [ $i -lt 20 ] && kill -9 -1 2>/dev/null; do i=$((i+1)); done"],
                   check=False, timeout=60, user=uid, group=uid, extra_groups=[], cwd="/")
