"""Flower's simulation mode with real groups: ``flwr run . local-simulation``.

Virtual clients (Ray actors) have no node config, so the run config's ``group-addresses``
tells virtual client ``partition-id`` which group to drive. :func:`simulate` starts G groups,
runs the app on the ``:local:`` SuperLink that ``flwr run`` manages, waits for the ServerApp's
summary, and stops everything, including the local SuperLink that ``flwr run`` detaches.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from flower_shard import protocol as P
from flower_shard import runfiles as F
from flower_shard.flower.node.config import NodeConfig
from flower_shard.flower.node.launcher import Node, bin_path, env_with_bin
from flower_shard.launch.deployment import FLWR_CONFIG, FLWR_HOME, run_config_arg
from flower_shard.launch.fab import staged_app
from flower_shard.launch.processes import ManagedProcess, free_port

CONNECTION = "local-simulation"


SLOW_START = "Failed to start local SuperLink within"
START_ATTEMPTS = 3


def simulate(
    work_dir: str | os.PathLike,
    run_config: dict,
    groups: int = 2,
    nproc_per_group: int = 2,
    timeout: float = 900.0,
    dump_dir: str | None = None,
) -> dict:
    """Run ``run_config`` (must hold ``out-dir``) in simulation mode; return the summary."""
    work = Path(work_dir).resolve()
    env = _simulation_env(work, groups)
    out = Path(run_config[P.OUT_DIR])
    (out / F.SUMMARY_FILE).unlink(missing_ok=True)
    nodes = [
        Node(
            NodeConfig(
                nproc_per_group=nproc_per_group, work_dir=str(work / f"group{i}"), dump_dir=dump_dir
            )
        )
        for i in range(groups)
    ]
    flwr = None
    try:
        for node in nodes:
            node.launch_group()
        for node in nodes:
            node.wait_group()
        config = dict(run_config)
        config[P.GROUP_ADDRESSES] = ",".join(n.address for n in nodes)
        app = staged_app(work / "app")
        cmd = [bin_path("flwr"), "run", str(app), CONNECTION, "--run-config"]
        cmd.append(run_config_arg(config))
        flwr = ManagedProcess("flwr-run", cmd, work / "flwr-run-1.log", env, cwd=work)
        flwr = _wait_for_summary(out, flwr, nodes, time.monotonic() + timeout, timeout)
        return json.loads((out / F.SUMMARY_FILE).read_text())
    finally:
        if flwr is not None:
            flwr.stop()  # also the local SuperLink and its Ray workers (they carry the marker)
        for node in nodes:
            node.stop()


def _simulation_env(work: Path, groups: int) -> dict[str, str]:
    """The environment of ``flwr run``: a FLWR_HOME whose connection simulates ``groups``
    SuperNodes on free ports."""
    home = work / FLWR_HOME
    home.mkdir(parents=True, exist_ok=True)
    (home / FLWR_CONFIG).write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = ":local:"\n'
        f"options.num-supernodes = {groups}\n"
        "options.backend.client-resources.num-cpus = 1\n"
    )
    env = env_with_bin()
    env["FLWR_HOME"] = str(home)
    # The managed local SuperLink's ports: free ones, so runs and other tests do not collide.
    env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(free_port())
    env["FLWR_LOCAL_CONTROL_API_PORT"] = str(free_port())
    return env


def _wait_for_summary(
    out: Path, flwr: ManagedProcess, nodes: list[Node], deadline: float, timeout: float
) -> ManagedProcess:
    """Wait until the ServerApp wrote its summary; start ``flwr run`` again when its local
    SuperLink was too slow to start. Returns the ``flwr run`` process that is running now."""
    attempt = 1
    while not (out / F.SUMMARY_FILE).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the simulation did not finish in {timeout} s:\n{flwr.tail()}")
        if not flwr.alive() and flwr.proc.returncode != 0:
            # `flwr run` gives its local SuperLink a fixed 15 s to start; on a loaded
            # machine that can pass before it is up. Nothing ran yet: start it again.
            if SLOW_START in flwr.tail() and attempt < START_ATTEMPTS:
                flwr.stop()
                attempt += 1
                log = flwr.log_path.with_name(f"flwr-run-{attempt}.log")
                flwr = ManagedProcess("flwr-run", flwr.cmd, log, flwr.env, cwd=flwr.cwd)
                continue
            raise RuntimeError(f"flwr run failed:\n{flwr.tail()}")
        for node in nodes:
            if reason := node.dead():
                raise RuntimeError(f"a group died during the simulation: {reason}")
        time.sleep(0.2)
    return flwr
