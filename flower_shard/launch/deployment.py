"""A real Flower deployment on loopback: ``flower-superlink``, G nodes, ``flwr run``.

Used by ``flower-shard demo``, the tests and the benchmarks. Everything lives under one work
directory (its own ``FLWR_HOME`` with the connection config), and everything started is
stopped on exit, also on failure.

With ``tls=True`` the SuperLink serves HTTPS with a CA and server certificate made on the fly
(:mod:`flower_shard.flower.certificates`); nodes and ``flwr`` trust that CA. With
``supernode_auth=True`` (needs TLS) the SuperLink admits only SuperNodes whose public key was
registered through its Control API (``flwr supernode register``); each node gets its own key.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from flower_shard import protocol as P
from flower_shard import runfiles as F
from flower_shard.config import ConfigError
from flower_shard.flower.certificates import (
    SuperNodeKeys,
    TlsFiles,
    make_supernode_keys,
    make_tls_certificates,
)
from flower_shard.flower.node.config import NodeConfig
from flower_shard.flower.node.launcher import Node, bin_path, env_with_bin
from flower_shard.launch.fab import staged_app
from flower_shard.launch.processes import ManagedProcess, free_port, start_marked, stop_tree

logger = logging.getLogger(__name__)

CONNECTION = "local-deployment"
FLWR_HOME = "flwr-home"  # under the work directory: Flower's config.toml with the connection
FLWR_CONFIG = "config.toml"
SUPERLINK_LOG = "superlink.log"


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return "'" + str(value).replace("'", "") + "'"


def run_config_arg(run_config: dict) -> str:
    """``flwr run --run-config`` syntax: space-separated ``key=value`` TOML pairs."""
    return " ".join(f"{k}={toml_value(v)}" for k, v in run_config.items())


class LocalDeployment:
    """SuperLink + ``num_nodes`` nodes (each a torchrun group of ``nproc_per_group`` ranks, or
    of ``nproc_per_group[i]`` for node i: groups of different sizes) on loopback.

    Use as a context manager; :meth:`run` starts a run with ``flwr run`` and waits for the
    ServerApp's ``summary.json``.

    ``tls``: the SuperLink serves TLS with certificates made into ``work_dir/certs``; nodes
    connect with ``--root-certificates`` and the ``flwr`` connection uses ``root-certificates``.
    ``supernode_auth`` (needs ``tls``): ``flower-superlink --enable-supernode-auth``; each node
    gets an EC key pair in ``work_dir/keys``, registered with ``flwr supernode register`` before
    the node starts, and connects with ``--auth-supernode-private-key``.
    """

    def __init__(
        self,
        work_dir: str | os.PathLike,
        num_nodes: int = 2,
        nproc_per_group: int | Sequence[int] = 2,
        dump_dir: str | None = None,
        log: Callable[[str], None] | None = None,
        fault_files: list[str | None] | None = None,
        poll_interval: float = 0.1,
        warm_clientapp: bool = True,
        tls: bool = False,
        supernode_auth: bool = False,
    ):
        if supernode_auth and not tls:
            # Flower 1.42's SuperLink exits at start in that case; fail before starting anything.
            raise ConfigError(
                "supernode_auth needs tls=True: Flower authenticates SuperNodes only over TLS"
            )
        self.work_dir = Path(work_dir).resolve()
        self.num_nodes, self.dump_dir = num_nodes, dump_dir
        if isinstance(nproc_per_group, int):
            nproc_per_group = [nproc_per_group] * num_nodes
        if len(nproc_per_group) != num_nodes:
            raise ConfigError(
                f"nproc_per_group has {len(nproc_per_group)} sizes for {num_nodes} nodes: give "
                "one size, or one per node"
            )
        self.nproc_per_group = list(nproc_per_group)
        """Each node's group size."""
        self.log = log or logger.info
        self.fault_files = fault_files or [None] * num_nodes
        self.poll_interval, self.warm_clientapp = poll_interval, warm_clientapp
        self.port = free_port()
        self.superlink: ManagedProcess | None = None
        self.nodes: list[Node] = []
        self.flwr_home = self.work_dir / FLWR_HOME
        self.app = self.work_dir / "app"
        """The app's files alone, staged by :meth:`start` for ``flwr run`` (:mod:`.fab`)."""
        self.tls, self.supernode_auth = tls, supernode_auth
        self.tls_files: TlsFiles | None = None
        """The CA and server certificate (``tls``), made by :meth:`start`."""
        self.node_keys: list[SuperNodeKeys] = []
        """Each node's registered key pair (``supernode_auth``), in node order."""
        self.node_ids: list[int] = []
        """The SuperNode IDs that registering the keys returned (``supernode_auth``)."""

    host = "127.0.0.1"
    """Where the SuperLink listens (a subclass may bind it elsewhere)."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def command_prefix(self, node: int | None) -> list[str]:
        """What runs a process of the SuperLink (``node`` None) or of a node, e.g.
        ``ip netns exec SITE`` in the emulated multi-tier network; nothing by default."""
        return []

    def env(self) -> dict[str, str]:
        env = env_with_bin()
        env["FLWR_HOME"] = str(self.flwr_home)
        return env

    def __enter__(self) -> LocalDeployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def ca_cert(self) -> str | None:
        """The CA that nodes and ``flwr`` trust (``tls``), else None (insecure)."""
        return str(self.tls_files.ca_cert) if self.tls_files else None

    def _write_connection(self) -> None:
        # `flwr` reads `root-certificates` with a plain Path(...).read_bytes(), relative to its
        # working directory: write the absolute path.
        security = (
            f'root-certificates = "{self.tls_files.ca_cert}"\n'
            if self.tls_files
            else "insecure = true\n"
        )
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        (self.flwr_home / FLWR_CONFIG).write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "{self.address}"\n{security}'
        )

    def start(self) -> None:
        """Start the SuperLink, register the nodes' keys (``supernode_auth``), then the nodes:
        their groups side by side, then each SuperNode once its group answers."""
        if self.tls:
            # The SuperLink's own SuperExec dials 127.0.0.1:PORT with the same CA, so the
            # certificate must name 127.0.0.1 as well as what nodes and `flwr` dial.
            self.tls_files = make_tls_certificates(self.work_dir / "certs")
        self._write_connection()
        staged_app(self.app)
        self.log(
            f"starting flower-superlink on {self.address}"
            + (" (TLS)" if self.tls else "")
            + (" (SuperNode authentication)" if self.supernode_auth else "")
        )
        self.superlink = ManagedProcess(
            "superlink",
            self._superlink_command(),
            self.work_dir / SUPERLINK_LOG,
            self.env(),
            cwd=self.work_dir,
        )
        self._wait_healthy()
        for i in range(self.num_nodes):
            self._register_key(i)
        for i in range(self.num_nodes):
            self.log(
                f"starting node {i + 1}/{self.num_nodes}: a group of {self.nproc_per_group[i]} "
                "ranks, then flower-supernode"
            )
            self.nodes.append(Node(self._node_config(i), prefix=self.command_prefix(i)))
            self.nodes[-1].launch_group()  # the groups start side by side
        for node in self.nodes:
            node.wait_group()
            node.start_supernode()

    def _register_key(self, i: int) -> None:
        """``supernode_auth``: make node ``i``'s key pair and register it with the SuperLink."""
        if self.supernode_auth:
            keys = make_supernode_keys(self.work_dir / "keys", f"node{i}")
            self.node_ids.append(self.register_supernode(keys.public_key, name=f"node{i}"))
            self.node_keys.append(keys)

    def add_node(self, nproc_per_group: int, connect: bool = True) -> Node:
        """One more node, its group started and ready (a node joining a running federation).
        ``connect`` False leaves its SuperNode to ``node.start_supernode()``, so that it can
        join mid-run without waiting for its group; :meth:`stop` stops it with the others."""
        i = self.num_nodes
        self.num_nodes += 1
        self.nproc_per_group.append(nproc_per_group)
        self.fault_files.append(None)
        self._register_key(i)
        node = Node(self._node_config(i), prefix=self.command_prefix(i))
        self.nodes.append(node)
        node.launch_group()
        node.wait_group()
        if connect:
            node.start_supernode()
        return node

    def _superlink_command(self) -> list[str]:
        cmd = [
            *self.command_prefix(None),
            bin_path("flower-superlink"),
            "--disable-runtime-dependency-installation",
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        if self.tls_files:
            cmd += [
                "--ssl-ca-certfile",
                str(self.tls_files.ca_cert),
                "--ssl-certfile",
                str(self.tls_files.server_cert),
                "--ssl-keyfile",
                str(self.tls_files.server_key),
            ]
        else:
            cmd.append("--insecure")
        if self.supernode_auth:
            cmd.append("--enable-supernode-auth")
        return cmd

    def _node_config(self, i: int) -> NodeConfig:
        """Node ``i``'s settings: its group size, work dir, fault file and key."""
        return self.node_config(
            nproc_per_group=self.nproc_per_group[i],
            work_dir=str(self.work_dir / f"node{i}"),
            dump_dir=self.dump_dir,
            fault_file=self.fault_files[i],
            auth_private_key=str(self.node_keys[i].private_key) if self.supernode_auth else None,
        )

    def node_config(self, **overrides) -> NodeConfig:
        """A NodeConfig that connects to this SuperLink (TLS if on), with ``overrides``."""
        settings = {
            "superlink": self.address,
            "nproc_per_group": self.nproc_per_group[0],
            "poll_interval": self.poll_interval,
            "warm_clientapp": self.warm_clientapp,
            "root_certificates": self.ca_cert,
        } | overrides
        return NodeConfig(**settings)

    def _wait_healthy(self, timeout: float = 120.0) -> None:
        scheme = "https" if self.tls_files else "http"
        context = (
            ssl.create_default_context(cafile=str(self.tls_files.ca_cert))
            if self.tls_files
            else None
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.superlink.alive():
                raise RuntimeError(f"flower-superlink exited:\n{self.superlink.tail()}")
            try:
                with urllib.request.urlopen(
                    f"{scheme}://{self.address}/health", timeout=1, context=context
                ) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"flower-superlink did not become healthy in {timeout} s")

    def flwr(self, *args: str, timeout: float = 120.0) -> str:
        """Run ``flwr ARGS...`` against this deployment's connection; return its stdout.

        Raises RuntimeError with the output when it fails (non-zero exit).
        """
        proc, marker = start_marked(
            [bin_path("flwr"), *args],
            self.env(),
            cwd=self.work_dir,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            stop_tree(proc, marker, grace_s=5)  # at once if it has finished
        if proc.returncode != 0:
            raise RuntimeError(f"flwr {' '.join(args)} failed:\n{out}\n{err}")
        return out

    def register_supernode(self, public_key: str | os.PathLike, name: str | None = None) -> int:
        """Admit a SuperNode key: ``flwr supernode register KEY CONNECTION``; return its ID.

        Flower 1.42 registers keys through the SuperLink's Control API; a SuperNode that starts
        with the matching ``--auth-supernode-private-key`` then takes that ID.
        """
        args = ["supernode", "register", str(public_key), CONNECTION, "--format", "json"]
        if name:
            args += ["--name", name]
        out = self.flwr(*args)
        return int(json.loads(out[out.index("{") :])["node-id"])

    def list_supernodes(self) -> list[dict]:
        """``flwr supernode list --format json``: the SuperNodes the SuperLink knows.

        Each entry has ``node-id`` (a string) and ``status`` (``registered``, ``online``,
        ``offline``, ...).
        """
        out = self.flwr("supernode", "list", CONNECTION, "--format", "json")
        return json.loads(out[out.index("{") :])["nodes"]

    def run(
        self,
        run_config: dict,
        timeout: float = 900.0,
        on_round: Callable[[dict], None] | None = None,
    ) -> dict:
        """``flwr run`` with ``run_config`` (must hold ``out-dir``); return the summary.

        ``on_round`` is called with each metrics line as the ServerApp writes it.
        """
        out = Path(run_config[P.OUT_DIR])
        for name in (F.SUMMARY_FILE, F.METRICS_FILE):
            (out / name).unlink(missing_ok=True)
        cmd = [
            bin_path("flwr"),
            "run",
            str(self.app),
            CONNECTION,
            "--run-config",
            run_config_arg(run_config),
        ]
        proc = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"flwr run failed:\n{proc.stdout}\n{proc.stderr}")
        seen = 0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = self._follow(out, seen, on_round)
            summary = out / F.SUMMARY_FILE
            if summary.exists():
                self._follow(out, seen, on_round)
                return json.loads(summary.read_text())
            for node in self.nodes:
                if reason := node.supervise(self.log):
                    raise RuntimeError(f"a node died during the run: {reason}")
            time.sleep(0.2)
        raise TimeoutError(f"the run did not finish in {timeout} s; see {self.work_dir}")

    @staticmethod
    def _follow(out: Path, seen: int, on_round) -> int:
        path = out / F.METRICS_FILE
        if not path.exists():
            return seen
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        for i in range(seen, len(lines)):
            try:
                record = json.loads(lines[i])
            except json.JSONDecodeError:  # a line being written: read it next time
                return i
            if on_round:
                on_round(record)
        return len(lines)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        if self.superlink is not None:
            self.superlink.stop()
