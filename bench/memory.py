"""Peak memory of every process of a run: VmHWM sampled from /proc while it runs.

``VmHWM`` is the kernel's own high-water mark of a process's resident set, so a sample taken
at any time before the process exits holds its true peak; sampling every ``interval`` seconds
only risks missing a process that lives shorter than that. :class:`PeakSampler` follows a
process tree (a root pid and all its descendants, found through ``/proc/*/stat``) and keeps the
largest VmHWM seen per process, labelled with the process's command line.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def vm_hwm(pid: int) -> int:
    """The peak resident set of ``pid`` in bytes (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    tree, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += tree.get(pid, [])
    return out


def command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    return " ".join(a.decode(errors="replace") for a in raw if a)[:200]


class PeakSampler:
    """Samples the VmHWM of ``root`` (default: this process) and all its descendants.

    Use as a context manager; :attr:`peaks` maps pid -> (peak bytes, command line).
    """

    def __init__(self, root: int | None = None, interval: float = 0.1):
        self.root = os.getpid() if root is None else root
        self.interval = interval
        self.peaks: dict[int, tuple[int, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        for pid in descendants(self.root):
            peak = vm_hwm(pid)
            if peak > self.peaks.get(pid, (0, ""))[0]:
                self.peaks[pid] = (peak, self.peaks.get(pid, (0, ""))[1] or command(pid))

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def largest(self, where=lambda cmd: True) -> int:
        """The largest peak among the processes whose command line ``where`` accepts."""
        return max((p for p, cmd in self.peaks.values() if where(cmd)), default=0)


def wait_sampling(proc, sampler: PeakSampler, timeout: float | None = None) -> int:
    """Wait for a ``subprocess.Popen`` while ``sampler`` samples its tree; its exit status."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while proc.poll() is None:
        if deadline is not None and time.monotonic() > deadline:
            proc.kill()
        time.sleep(0.05)
    return proc.returncode
