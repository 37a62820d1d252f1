"""Processes we start, and stop for sure: their whole tree, including what they detached.

Flower's SuperLink and SuperNode start helpers (SuperExec, ServerApp and ClientApp processes)
in new sessions, which outlive a plain kill of the parent's process group. So every process
started here carries a marker in its environment, inherited by everything it spawns; stopping
kills the process group and then every process on the host that still carries the marker.

A launcher killed outright (SIGKILL) stops nothing, so every process started here also gets a
parent-death signal (:mod:`flower_shard.launch.guard`: SIGTERM when the thread that started it
ends). Start them from a thread that lives as long as they should (the main thread does).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

from flower_shard.launch.guard import guarded

MARKER = "FLOWER_SHARD_TREE"


_ISSUED: set[int] = set()


def unreachable_reason(address: str, timeout: float = 3.0) -> str | None:
    """Why nothing accepts a TCP connection at ``address`` (HOST:PORT), or None if something
    does (whether it is the right service, its client finds out)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


def free_port() -> int:
    """A TCP port on loopback that is free now and was not handed out before by this process.

    The kernel may return the same ephemeral port to two binds in a row once the first socket
    is closed; two nodes started back to back must not get the same one.
    """
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ISSUED:
            _ISSUED.add(port)
            return port
    raise RuntimeError("no free TCP port on loopback")


def marked_pids(marker: str) -> list[int]:
    """Processes whose environment holds ``FLOWER_SHARD_TREE=marker``."""
    needle = f"{MARKER}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


class ManagedProcess:
    """A child process in its own session, with a log file and a marked environment."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        log: str | os.PathLike,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
    ):
        self.name = name
        self.cmd, self.env, self.cwd = cmd, env, cwd
        """What it runs, as given (to start it again)."""
        self.log_path = Path(log)
        self._log = open(self.log_path, "ab")
        self.proc, self.marker = start_marked(
            cmd, env, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the whole tree (see :func:`stop_tree`) and close the log."""
        stop_tree(self.proc, self.marker, grace_s)
        self._log.close()


def start_marked(
    cmd: list[str], env: dict[str, str] | None = None, **popen
) -> tuple[subprocess.Popen, str]:
    """Start ``cmd`` in its own session with a fresh marker in its environment; it gets SIGTERM
    when this process dies (:func:`~flower_shard.launch.guard.guarded`)."""
    marker = uuid.uuid4().hex
    env = dict(os.environ if env is None else env)
    env[MARKER] = marker
    return subprocess.Popen(guarded(cmd), env=env, start_new_session=True, **popen), marker


def stop_tree(proc: subprocess.Popen, marker: str, grace_s: float = 10.0) -> None:
    """SIGTERM the session, wait up to ``grace_s``, then SIGKILL whatever carries the marker."""
    for pid in [proc.pid, *marked_pids(marker)]:
        _signal(pid, signal.SIGTERM, group=pid == proc.pid)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (proc.poll() is None or marked_pids(marker)):
        time.sleep(0.1)
    for pid in [proc.pid, *marked_pids(marker)]:
        _signal(pid, signal.SIGKILL, group=pid == proc.pid)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _signal(pid: int, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
