"""A real Flower deployment on loopback: ``flower-superlink``, G nodes, ``flwr run``.

Used by ``flower-shard demo``, the tests and the benchmarks. Everything lives under one work
directory (its own ``FLWR_HOME`` with the connection config), and everything started is
stopped on exit, also on failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from flower_shard.metrics import METRICS_FILE
from flower_shard.node import Node, NodeConfig, bin_path, env_with_bin
from flower_shard.processes import ManagedProcess, free_port

CONNECTION = "local-deployment"
APP_DIR = Path(__file__).resolve().parent.parent  # the Flower App: this project's pyproject


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
    """SuperLink + ``num_nodes`` nodes (each a torchrun group of ``nproc_per_group``) on loopback.

    Use as a context manager; :meth:`run` starts a run with ``flwr run`` and waits for the
    ServerApp's ``summary.json``.
    """

    def __init__(
        self,
        work_dir: str | os.PathLike,
        num_nodes: int = 2,
        nproc_per_group: int = 2,
        dump_dir: str | None = None,
        log: Callable[[str], None] | None = None,
        fault_files: list[str | None] | None = None,
        poll_interval: float = 0.1,
    ):
        self.work_dir = Path(work_dir).resolve()
        self.num_nodes, self.nproc_per_group, self.dump_dir = num_nodes, nproc_per_group, dump_dir
        self.log = log or (lambda _msg: None)
        self.fault_files = fault_files or [None] * num_nodes
        self.poll_interval = poll_interval
        self.port = free_port()
        self.superlink: ManagedProcess | None = None
        self.nodes: list[Node] = []
        self.flwr_home = self.work_dir / "flwr-home"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

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

    def start(self) -> None:
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        (self.flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "{self.address}"\ninsecure = true\n'
        )
        self.log(f"starting flower-superlink on {self.address}")
        self.superlink = ManagedProcess(
            "superlink",
            [
                bin_path("flower-superlink"),
                "--insecure",
                "--disable-runtime-dependency-installation",
                "--port",
                str(self.port),
            ],
            self.work_dir / "superlink.log",
            self.env(),
            cwd=self.work_dir,
        )
        self._wait_healthy()
        for i in range(self.num_nodes):
            self.log(
                f"starting node {i + 1}/{self.num_nodes}: a group of {self.nproc_per_group} "
                "ranks, then flower-supernode"
            )
            node = Node(
                NodeConfig(
                    superlink=self.address,
                    nproc_per_group=self.nproc_per_group,
                    work_dir=str(self.work_dir / f"node{i}"),
                    dump_dir=self.dump_dir,
                    fault_file=self.fault_files[i],
                    poll_interval=self.poll_interval,
                )
            )
            self.nodes.append(node)
            node.launch_group()  # the groups start side by side
        for node in self.nodes:
            node.wait_group()
            node.start_supernode()

    def _wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.superlink.alive():
                raise RuntimeError(f"flower-superlink exited:\n{self.superlink.tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.address}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"flower-superlink did not become healthy in {timeout} s")

    def run(
        self,
        run_config: dict,
        timeout: float = 900.0,
        on_round: Callable[[dict], None] | None = None,
    ) -> dict:
        """``flwr run`` with ``run_config`` (must hold ``out-dir``); return the summary.

        ``on_round`` is called with each metrics line as the ServerApp writes it.
        """
        out = Path(run_config["out-dir"])
        for name in ("summary.json", METRICS_FILE):
            (out / name).unlink(missing_ok=True)
        cmd = [
            bin_path("flwr"),
            "run",
            str(APP_DIR),
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
            summary = out / "summary.json"
            if summary.exists():
                self._follow(out, seen, on_round)
                return json.loads(summary.read_text())
            for node in self.nodes:
                if reason := node.dead():
                    raise RuntimeError(f"a node died during the run: {reason}")
            time.sleep(0.2)
        raise TimeoutError(f"the run did not finish in {timeout} s; see {self.work_dir}")

    @staticmethod
    def _follow(out: Path, seen: int, on_round) -> int:
        path = out / METRICS_FILE
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
