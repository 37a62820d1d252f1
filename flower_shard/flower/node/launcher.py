"""``flower-shard node``: one Flower client = a torchrun group + a ``flower-supernode``.

Starts the group (K ranks under torchrun with its rendezvous on 127.0.0.1 and gloo / NCCL on
loopback; the control service on an owner-only Unix socket in a work directory that only this
user can write), waits until it answers, then starts ``flower-supernode`` with the node config
that points the ClientApp at the group, and waits until the SuperNode is up. From then on it
watches both: on SIGINT/SIGTERM, or when either one dies, it stops both process trees
(including the SuperExec and ClientApp processes that Flower detaches), removes the socket and
any interrupted checkpoint save, and exits. Killed outright (SIGKILL), it leaves nothing
running either: the group's torchrun and the SuperNode get a parent-death signal, the ranks
die with torchrun, the SuperExec with the SuperNode (:mod:`flower_shard.launch.guard`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import stat
import sys
import time
from pathlib import Path

from flower_shard import protocol as P
from flower_shard import runfiles as F
from flower_shard.flower.compat import check_flwr
from flower_shard.flower.node import fast_supernode
from flower_shard.flower.node.config import NodeConfig, own_work_dir
from flower_shard.launch.agent import (
    AGENT_MODULE,
    LOOPBACK,
    LOOPBACK_INTERFACE,
    SOCKET_IFNAME_ENVS,
)
from flower_shard.launch.processes import (
    ManagedProcess,
    free_port,
    marked_pids,
    unreachable_reason,
)
from flower_shard.preflight import check_device
from flower_shard.threads import with_threads

logger = logging.getLogger(__name__)
WAIT_REPORT_S = 15.0  # how often a node waiting for its SuperLink says so
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Flower's log colours


def bin_path(name: str) -> str:
    """An entry point of the running environment (flower-supernode, flwr, ...)."""
    return str(Path(sys.executable).with_name(name))


def env_with_bin() -> dict[str, str]:
    """Our environment with the running venv's bin first on PATH (Flower spawns its tools)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # Never let Flower install the app's dependencies into a fresh environment per run: that
    # would pull a second torch (a CUDA build) instead of using the one installed here.
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    # SuperExec (which starts ServerApp / ClientApp processes) polls for work every 1 s.
    env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.05")
    return env


GROUP_MODULE = "flower_shard.flower.group.service"  # what torchrun runs on every rank


class _PortTaken(RuntimeError):
    """The SuperNode could not bind its local API port."""


class SuperNodeRefused(RuntimeError):
    """``flower-supernode`` exited before it joined: refused by the SuperLink, or TLS failed.

    The first line of the message says why; the SuperNode's log tail follows.
    """


# Flower 1.42's API error codes (flwr.supercore.error.ApiErrorCode), which the SuperNode prints
# as "[code: N]" when the SuperLink refuses it: steadier than the messages' wording.
_REFUSALS = {
    "[code: 2001]": (
        "the SuperLink requires SuperNode authentication: start this node with "
        "--auth-supernode-private-key KEY whose public key is registered "
        "(flwr supernode register KEY.pub CONNECTION)"
    ),
    "[code: 2004]": (
        "the SuperLink refused this SuperNode's key: register its public key first "
        "(flwr supernode register KEY.pub CONNECTION)"
    ),
}


def _refusal(tail: str, cfg: NodeConfig) -> str:
    for code, reason in _REFUSALS.items():
        if code in tail:
            return f"flower-supernode was refused by {cfg.superlink}: {reason}"
    if "SSL/TLS handshake error" in tail or "CERTIFICATE_VERIFY_FAILED" in tail:
        return (
            f"flower-supernode could not verify {cfg.superlink}'s TLS certificate with "
            f"--root-certificates {cfg.root_certificates}: pass the CA that signed it"
        )
    return "flower-supernode exited"


class Node:
    """A running node: the group and the SuperNode, started and stopped together."""

    def __init__(self, cfg: NodeConfig, prefix: list[str] | None = None):
        """``prefix`` runs the group and the SuperNode through a wrapper command (the
        multi-tier benchmark puts a node in a network namespace: ``ip netns exec SITE``)."""
        check_flwr()  # the SuperNode and ClientApp patch Flower internals of these releases
        self.cfg = cfg.validate()  # an existing work dir must be ours, writable by us alone
        check_device(cfg.device, cfg.nproc_per_group)  # this host's: CUDA and enough GPUs
        self.prefix = list(prefix or [])
        self.work_dir = own_work_dir(cfg.work_dir)
        self.address = f"unix:{self.work_dir / F.GROUP_SOCKET}"
        self.port = cfg.port or free_port()
        self.group: ManagedProcess | None = None
        self.supernode: ManagedProcess | None = None
        self.restarts = 0
        """How many times :meth:`supervise` restarted the group."""

    def start(self, supernode: bool = True) -> None:
        """Start the group, wait until it answers, then (optionally) the SuperNode."""
        try:
            self.launch_group()
            self.wait_group()
            if supernode:
                self.start_supernode()
        except BaseException:
            self.stop()
            raise

    def launch_group(self) -> None:
        """Spawn the group's torchrun job (returns at once; see :meth:`wait_group`)."""
        k = self.cfg.nproc_per_group
        self._clean()  # what a dead group left: its socket (it would block the new one's bind)
        cmd = [
            *self.prefix,
            sys.executable,
            "-m",
            AGENT_MODULE,  # torchrun with its store on 127.0.0.1; the ranks die with it
            f"--nproc-per-node={k}",
            "--nnodes=1",
            "--node-rank=0",
            f"--master-addr={LOOPBACK}",
            "--master-port=0",
            "-m",
            GROUP_MODULE,
            "--address",
            self.address,
            "--work-dir",
            str(self.work_dir),
            "--device",
            self.cfg.device,
        ]
        if self.cfg.data:
            cmd += ["--data", self.cfg.data]
        if self.cfg.dump_dir:
            cmd += ["--dump-dir", self.cfg.dump_dir]
        if self.cfg.fault_file:
            cmd += ["--fault-file", self.cfg.fault_file]
        if self.cfg.root_certificates:  # the streaming transport's aggregators use it too
            cmd += ["--root-certificates", self.cfg.root_certificates]
        env = with_threads(env_with_bin(), k)
        for name in SOCKET_IFNAME_ENVS:  # gloo / NCCL on loopback unless told otherwise
            env.setdefault(name, LOOPBACK_INTERFACE)
        self.group = ManagedProcess("group", cmd, self.work_dir / F.GROUP_LOG, env)

    def wait_group(self) -> None:
        """Wait until the group's control service answers ``Health`` with ready."""
        from flower_shard.flower.client.group_client import GroupClient, GroupUnavailable

        client = GroupClient(self.address, connect_timeout=1.0)
        deadline = time.monotonic() + self.cfg.ready_timeout
        try:
            while True:
                if not self.group.alive():
                    raise RuntimeError(f"the group exited while starting:\n{self.group.tail()}")
                try:
                    if client.health().get(P.H_READY):
                        return
                except GroupUnavailable:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the group did not answer in {self.cfg.ready_timeout} s")
                time.sleep(0.2)
        finally:
            client.close()

    def start_supernode(self, attempts: int = 3) -> None:
        """Start the SuperNode; if its auto-chosen API port was taken meanwhile, use another."""
        for attempt in range(attempts):
            try:
                return self._start_supernode_once()
            except _PortTaken:
                if self.cfg.port is not None or attempt == attempts - 1:
                    raise
                self.supernode.stop()
                self.port = free_port()

    def _start_supernode_once(self) -> None:
        cfg = self.cfg
        cmd = [
            *self.prefix,
            sys.executable,
            "-m",
            "flower_shard.flower.node.fast_supernode",
            "--superlink",
            cfg.superlink,
            "--port",
            str(self.port),
            "--node-config",
            f"{P.GROUP_ADDRESS}='{self.address}'",
        ]
        cmd += (
            ["--root-certificates", cfg.root_certificates]
            if cfg.root_certificates
            else ["--insecure"]
        )
        if cfg.auth_private_key:
            # Not --auth-supernode-public-key: deprecated in Flower 1.42 (only a warning), the
            # public key is derived from the private one.
            cmd += ["--auth-supernode-private-key", cfg.auth_private_key]
        env = env_with_bin()
        env[fast_supernode.POLL_ENV] = str(cfg.poll_interval)
        env[fast_supernode.WARM_ENV] = "1" if cfg.warm_clientapp else "0"
        self.supernode = ManagedProcess(
            "supernode", cmd, self.work_dir / F.SUPERNODE_LOG, env, cwd=self.work_dir
        )
        self._wait_registered()

    def _wait_registered(self) -> None:
        """Until the SuperNode says it registered; saying so while the SuperLink is away."""
        cfg = self.cfg
        start = time.monotonic()
        deadline, report = start + cfg.ready_timeout, start + WAIT_REPORT_S
        unreachable = unreachable_reason(cfg.superlink)
        if unreachable:
            logger.warning(
                "the SuperLink at %s does not answer (%s); waiting up to %.0f s "
                "(--ready-timeout) for it",
                cfg.superlink,
                unreachable,
                cfg.ready_timeout,
            )
        while "SuperNode ID" not in self.supernode.tail(200):
            if not self.supernode.alive():
                tail = self.supernode.tail()
                if "Runtime HTTP API failed to start" in tail or "address already in use" in tail:
                    raise _PortTaken(f"port {self.port} is taken")
                raise SuperNodeRefused(f"{_refusal(tail, cfg)}\n{tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"flower-supernode did not register with {cfg.superlink} in "
                    f"{cfg.ready_timeout} s (is the SuperLink up, and does it use TLS "
                    "(--root-certificates) or not (no flag)?):\n"
                    f"{self.supernode.tail()}"
                )
            if time.monotonic() > report:
                report += WAIT_REPORT_S
                last = ANSI.sub("", self.supernode.tail(1)).strip()
                logger.warning(
                    "still waiting for the SuperLink at %s (%.0f of %.0f s): %s",
                    cfg.superlink,
                    time.monotonic() - start,
                    cfg.ready_timeout,
                    last or "no word from flower-supernode yet",
                )
            time.sleep(0.2)

    def supervise(self, log=logger.warning) -> str | None:
        """Restart a dead group (up to ``max_restarts`` times); say why the node cannot go on.

        Returns None while the node can serve. The restart does not wait for the new group:
        until it answers, the ClientApp replies with an error and the server leaves this group
        out of the round; once up, the group rejoins from the global weights and its own last
        checkpoint (inner optimizer, LR schedule, data position).
        """
        if self.supernode is not None and not self.supernode.alive():
            return self.dead()
        if self.group is None or self.group.alive():
            return None
        if self.restarts >= self.cfg.max_restarts:
            return f"{self.dead()}\n(restarted {self.restarts} times already: giving up)"
        self.restarts += 1
        log(
            f"the group exited with {self.group.proc.returncode}; restart "
            f"{self.restarts}/{self.cfg.max_restarts}:\n{self.group.tail(5)}"
        )
        self.group.stop()
        self.launch_group()
        return None

    def rank_pids(self) -> list[int]:
        """The group's rank processes (not its torchrun agent): targets for fault drills."""
        pids = []
        for pid in marked_pids(self.group.marker) if self.group else []:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if GROUP_MODULE.encode() in cmd and AGENT_MODULE.encode() not in cmd:
                pids.append(pid)
        return pids

    def dead(self) -> str | None:
        """Which part has died, if any."""
        for part in (self.group, self.supernode):
            if part is not None and not part.alive():
                return f"{part.name} exited with {part.proc.returncode}:\n{part.tail()}"
        return None

    def stop(self) -> None:
        """Stop both process trees, then remove the socket and interrupted checkpoint saves."""
        for part in (self.supernode, self.group):
            if part is not None:
                part.stop()
        self._clean()

    def _remove_socket(self) -> None:
        path = Path(self.address.removeprefix("unix:"))
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()

    def _clean(self) -> None:
        """What a stopped group leaves: its socket and checkpoint staging directories."""
        from flower_shard.runtime import checkpoint as C

        self._remove_socket()
        for removed in C.clean_staging(self.work_dir / F.CHECKPOINTS_DIR):
            logger.warning("removed %s, left by an interrupted checkpoint save", removed)


class _Stopped(Exception):
    """SIGINT or SIGTERM while the node starts: stop waiting, stop what started."""


def run_node(cfg: NodeConfig) -> int:
    """Start a node and keep it until a signal arrives or a part dies. A work directory the
    node made itself (no ``--work-dir``) is removed when it stops: nothing else could find it."""
    node = Node(cfg)
    stopping = []

    def on_signal(signum, _frame):
        stopping.append(signum)
        if not started:  # the start-up waits (group, SuperLink) end here
            raise _Stopped(signum)

    started = False
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    kept = "kept" if cfg.work_dir else "temporary: removed when the node stops"
    logger.info("work dir %s (%s)", node.work_dir, kept)
    try:
        try:
            node.start()
        except (SuperNodeRefused, TimeoutError) as exc:
            logger.error("error: %s", exc)
            return 1
        except _Stopped:
            logger.warning("stopped while starting")
            return 0
        started = True
        print(
            f"flower-shard node: group of {cfg.nproc_per_group} at {node.address}, "
            f"supernode on port {node.port}, connected to {cfg.superlink}",
            flush=True,
        )
        while not stopping:
            reason = node.supervise()
            if reason:
                logger.error("%s", reason)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        node.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        if cfg.work_dir is None:
            shutil.rmtree(node.work_dir, ignore_errors=True)
