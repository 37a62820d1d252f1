"""Children that die with their parent, even when the parent is killed with SIGKILL.

A launcher that is killed outright runs no cleanup, so its children must not depend on it:
each child asks the kernel for a parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG)``), which
arrives when the thread that started it ends, however it ends. Two ways to get it:

- :func:`guarded` prefixes any command with ``python -m flower_shard.launch.guard PARENT_PID
  --``, which sets the signal and then ``exec``\\ s the command (same process; the setting
  survives ``exec``): every process that :mod:`flower_shard.launch.processes` starts;
- a Python process that is not started that way calls :func:`die_with_parent` itself: the
  ranks that torchrun starts (the parent is the torchrun agent, whose pid
  :mod:`flower_shard.launch.agent` exports as ``FLOWER_SHARD_AGENT_PID``).

Either way the child then checks that its parent is still the one it was started by: a parent
that died between the fork and the ``prctl`` would otherwise leave it orphaned for good.

A pure module (standard library only): it runs before every child, so it must start fast.
Elsewhere than Linux it does nothing (the launchers' own process-tree stop still applies).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
AGENT_ENV = "FLOWER_SHARD_AGENT_PID"
"""The torchrun agent's pid, which the ranks it starts pass to :func:`die_with_parent`."""


def die_with_parent(parent: int | None = None, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when its parent (thread) ends; if the
    parent is already gone (``os.getppid() != parent``), end now with ``sig``."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return  # not permitted here: the launchers' tree stop still applies
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def die_with_agent(sig: int = signal.SIGKILL) -> None:
    """For a rank started by :mod:`flower_shard.launch.agent`: die when that agent dies (a rank
    without its agent can only hang in its next collective). Nothing without the agent."""
    agent = os.environ.get(AGENT_ENV, "")
    if agent.isdigit():
        die_with_parent(int(agent), sig)


def guarded(cmd: list[str], parent: int | None = None) -> list[str]:
    """``cmd`` run so that it gets SIGTERM when ``parent`` (default: this process) dies."""
    pid = os.getpid() if parent is None else parent
    return [sys.executable, "-m", __name__, str(pid), "--", *cmd]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or not argv[0].isdigit() or argv[1] != "--":
        print("usage: python -m flower_shard.launch.guard PARENT_PID -- CMD...", file=sys.stderr)
        return 2
    die_with_parent(int(argv[0]))
    cmd = argv[2:]
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        print(f"flower-shard: error: cannot run {cmd[0]}: {exc}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
