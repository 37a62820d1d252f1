"""The launchers on real processes: nothing listens beyond loopback, nothing outlives them.

``flower-shard train`` (G=2, K=1) and ``flower-shard node`` (a group of 2 ranks, a SuperNode
on a real SuperLink) run as a user starts them. While they run, every listening TCP socket of
their process trees (read from ``/proc``) must be on 127.0.0.1 (torchrun's store included,
which listens on every interface when torchrun is left to itself), and the group's control
socket owner-only. Then the launcher is killed with SIGKILL, which runs no cleanup of its own:
within seconds no process of its tree may be left. A node stopped with SIGTERM also removes
its control socket and any checkpoint staging directory.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flower_shard import runfiles as F
from flower_shard.flower.node.launcher import bin_path, env_with_bin
from flower_shard.launch.processes import ManagedProcess, free_port

LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::ffff:127.0.0.1
GONE_WITHIN_S = 20.0


def start_time(pid: int) -> int | None:
    """The process's start time (tells a reused pid apart); None when gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """``root``'s process tree: pid -> start time."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if (start := start_time(pid)) is not None:
            tree[pid] = start
        todo += children.get(pid, [])
    return tree


def alive(tree: dict[int, int]) -> list[int]:
    return [pid for pid, start in tree.items() if start_time(pid) == start]


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
    except OSError:
        return "?"


def listening(pids) -> list[tuple[int, str, int]]:
    """(pid, hex address, port) of every TCP socket in LISTEN state that ``pids`` hold."""
    table = {}
    for family in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{family}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":  # TCP_LISTEN
                address, port = f[1].split(":")
                table[int(f[9])] = (address, int(port, 16))
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in table:
                found.append((pid, *table[int(target[8:-1])]))
    return found


def assert_loopback_only(tree: dict[int, int], expect: tuple[str, ...]) -> None:
    """Every listening socket of ``tree`` is on 127.0.0.1, and the processes whose command
    holds each of ``expect`` listen at all (the test sees what it means to see)."""
    sockets = listening(tree)
    wrong = [(pid, command(pid), addr, port) for pid, addr, port in sockets if addr not in LOOPBACK]
    assert not wrong, f"listening beyond loopback: {wrong}"
    for part in expect:
        assert any(part in command(pid) for pid, _, _ in sockets), (part, sockets)


def kill_and_assert_gone(proc: subprocess.Popen, tree: dict[int, int]) -> None:
    """SIGKILL the launcher: its whole tree must be gone within GONE_WITHIN_S (what is left
    is killed here, so that a failure leaks nothing)."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + GONE_WITHIN_S
    while alive(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [(pid, command(pid)) for pid in alive(tree)]
    for pid, _ in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"outlived the SIGKILLed launcher by {GONE_WITHIN_S} s: {left}"


def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{what}: not reached (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def launch(args: list, log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "flower_shard.ux.cli", *map(str, args)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def test_train_listens_on_loopback_only_and_dies_with_its_launcher(tmp_path):
    out, log = tmp_path / "run", tmp_path / "train.log"
    proc = launch(
        ["train", "--out", out, "--groups", "2", "--nproc-per-group", "1", "--rounds", "500"]
        + ["--local-steps", "1", "--seq-len", "16", "--batch-size", "1", "--eval-every", "0"]
        + ["--quiet"],
        log,
    )
    tree: dict[int, int] = {}
    try:
        # A round done: the store, both ranks and their gloo groups are all up.
        wait_for(lambda: (out / F.METRICS_FILE).exists(), 240, "a first round", proc, log)
        tree = descendants(proc.pid)
        ranks = [pid for pid in tree if "flower_shard.launch.job" in command(pid)]
        assert len(ranks) == 2, [command(p) for p in tree]
        assert_loopback_only(tree, expect=("flower_shard.launch.agent", "launch.job"))
    finally:
        kill_and_assert_gone(proc, tree | descendants(proc.pid))


@pytest.fixture(scope="module")
def superlink(tmp_path_factory):
    """A plain SuperLink on loopback for the nodes under test."""
    work = tmp_path_factory.mktemp("superlink")
    port = free_port()
    link = ManagedProcess(
        "superlink",
        [bin_path("flower-superlink"), "--insecure", "--disable-runtime-dependency-installation"]
        + ["--host", "127.0.0.1", "--port", str(port)],
        work / "superlink.log",
        env_with_bin() | {"FLWR_HOME": str(work)},
        cwd=work,
    )
    yield f"127.0.0.1:{port}"
    link.stop()


def start_node(superlink: str, work: Path, log: Path, k: int) -> subprocess.Popen:
    proc = launch(
        ["node", "--superlink", superlink, "--nproc-per-group", k, "--work-dir", work], log
    )
    wait_for(lambda: "flower-shard node: group of" in log.read_text(), 240, "node up", proc, log)
    return proc


def test_node_listens_on_loopback_only_and_dies_with_its_launcher(superlink, tmp_path):
    work, log = tmp_path / "work", tmp_path / "node.log"
    proc = start_node(superlink, work, log, k=2)
    tree: dict[int, int] = {}
    try:
        tree = descendants(proc.pid)
        for part in ("launch.agent", "group.service", "fast_supernode", "warm_superexec"):
            assert any(part in command(pid) for pid in tree), (part, [command(p) for p in tree])
        assert_loopback_only(tree, expect=("launch.agent", "group.service", "fast_supernode"))
        socket = work / F.GROUP_SOCKET
        assert stat.S_ISSOCK(socket.stat().st_mode)
        assert stat.S_IMODE(socket.stat().st_mode) == 0o600  # only this user drives the group
        assert stat.S_IMODE(work.stat().st_mode) == 0o700  # created by the node, owner-only
    finally:
        kill_and_assert_gone(proc, tree | descendants(proc.pid))


def test_node_stopped_with_sigterm_cleans_its_socket_and_staging(superlink, tmp_path):
    work, log = tmp_path / "work", tmp_path / "node.log"
    work.mkdir(mode=0o700)  # an existing directory of ours: accepted, its mode left alone
    proc = start_node(superlink, work, log, k=1)
    tree = descendants(proc.pid)
    staging = work / F.CHECKPOINTS_DIR / "somerun" / ".round_000003.tmp"
    staging.mkdir(parents=True)  # as a group killed mid-save leaves it
    (staging / "__0_0.distcp").write_bytes(b"half")
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        kill_and_assert_gone(proc, tree)
    assert not (work / F.GROUP_SOCKET).exists()
    assert not staging.exists() and (work / F.CHECKPOINTS_DIR / "somerun").is_dir()


def test_ctrl_c_stops_a_node_cleanly_and_leaves_no_traceback(superlink, tmp_path):
    """Ctrl-C (SIGINT to the launcher) on a running node: exit 0, every process gone, and
    neither the group's log nor the console shows a traceback (torchrun's agent used to log
    one for the SIGTERM it gets)."""
    work, log = tmp_path / "work", tmp_path / "node.log"
    proc = start_node(superlink, work, log, k=1)
    tree = descendants(proc.pid)
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        kill_and_assert_gone(proc, tree)
    for text in (log.read_text(), (work / F.GROUP_LOG).read_text()):
        assert "Traceback" not in text, text[-3000:]


def test_a_node_waiting_for_an_unreachable_superlink_says_so_and_stops_on_ctrl_c(tmp_path):
    """Nothing listens at --superlink: the node says so at once (with the reason), again while
    it waits, and Ctrl-C ends the wait at once (not after --ready-timeout); the temporary work
    directory it made (no --work-dir) is removed."""
    log = tmp_path / "node.log"
    nobody = f"127.0.0.1:{free_port()}"
    proc = launch(["node", "--superlink", nobody, "--nproc-per-group", 1], log)
    tree: dict[int, int] = {}
    try:
        wait_for(lambda: "does not answer" in log.read_text(), 240, "the warning", proc, log)
        tree = descendants(proc.pid)
        text = log.read_text()
        assert f"the SuperLink at {nobody} does not answer (Connection refused)" in text, text
        work = Path(text.split("work dir ", 1)[1].split(" (temporary", 1)[0])
        assert work.is_dir() and work.name.startswith("flower-shard-node-")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        kill_and_assert_gone(proc, tree | descendants(proc.pid))
    assert "stopped while starting" in log.read_text()
    assert not work.exists()
