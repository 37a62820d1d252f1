"""The ServerApp's aggregators: started here (or reached on other hosts), configured, driven
round by round, and stopped.

Local aggregators are processes of this host, each listening on its own port of
``dataplane-host``; remote ones were started by the operator (``python -m
flower_shard.dataplane.aggregator``) with the same secret file, and are only reached. Either way
the ServerApp sends each its part of the model (``configure``), and per round ``begin``,
``status`` and ``commit``. A local aggregator that dies fails the round's calls with a clear
error; the processes are stopped with the ServerApp, whatever happens.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from flower_shard.dataplane import tickets
from flower_shard.dataplane.client import ControlClient, DataPlaneError
from flower_shard.dataplane.layout import Layout

log = logging.getLogger(__name__)


class AggregatorPool:
    """A of them: ``addresses[i]`` is aggregator i."""

    def __init__(
        self,
        addresses: list[str],
        secret: str,
        tls: tuple | None,
        root: bytes | None,
        call_timeout: float = 600.0,
    ):
        self.addresses, self.secret = list(addresses), secret
        self.tls, self.root = tls, root
        self.call_timeout = call_timeout
        """Seconds a control call may take (a commit folds every group's update)."""
        self.processes: list = []
        self.clients = [ControlClient(a, secret, root, tls is not None) for a in self.addresses]

    @classmethod
    def start_local(
        cls,
        count: int,
        host: str,
        work_dir: Path,
        tls: tuple[str, str] | None,
        root: bytes | None,
        ready_timeout: float = 120.0,
        call_timeout: float = 600.0,
    ) -> AggregatorPool:
        """Start ``count`` aggregator processes on ``host`` (free ports), with a fresh secret."""
        from flower_shard.launch.processes import ManagedProcess, free_port

        work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        secret = tickets.new_secret()
        secret_file = work_dir / "secret"
        secret_file.unlink(missing_ok=True)
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secret)
        addresses, processes = [], []
        for i in range(count):
            address = f"{host}:{free_port()}"
            cmd = [sys.executable, "-m", "flower_shard.dataplane.aggregator", "--listen", address]
            cmd += ["--secret-file", str(secret_file), "--work-dir", str(work_dir / f"agg{i}")]
            cmd += ["--tls-cert", tls[0], "--tls-key", tls[1]] if tls else ["--insecure"]
            processes.append(ManagedProcess(f"aggregator{i}", cmd, work_dir / f"agg{i}.log"))
            addresses.append(address)
        pool = cls(addresses, secret, tls, root, call_timeout)
        pool.processes = processes
        try:
            pool.wait_ready(ready_timeout)
        except BaseException:
            pool.stop()
            raise
        return pool

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for i, client in enumerate(self.clients):
            while True:
                if self.processes and not self.processes[i].alive():
                    raise DataPlaneError(f"aggregator {i} exited:\n{self.processes[i].tail()}")
                try:
                    client("ping", timeout=2)
                    break
                except DataPlaneError:
                    if time.monotonic() > deadline:
                        raise DataPlaneError(
                            f"aggregator {self.addresses[i]} did not answer in {timeout:.0f} s"
                        ) from None
                    time.sleep(0.2)

    def configure(self, run: str, layout: Layout, settings: dict, init: dict) -> None:
        for i, client in enumerate(self.clients):
            log.info("configuring aggregator %d at %s", i, self.addresses[i])
            client(
                "configure",
                timeout=self.call_timeout,
                run=run,
                layout=layout.to_json(),
                index=i,
                init=init,
                **settings,
            )

    def begin(self, rnd: int) -> None:
        for client in self.clients:
            client("begin", timeout=self.call_timeout, round=rnd)

    def expect(self, rnd: int, groups: list[int], max_weight: float | None = None) -> None:
        """Name the groups of round ``rnd`` whose uploads the pipelined commit waits for (and
        the largest weight the ServerApp will accept, None: no bound known)."""
        for client in self.clients:
            client(
                "expect",
                timeout=self.call_timeout,
                round=rnd,
                groups=sorted(groups),
                max_weight=max_weight,
            )

    def status(self) -> dict[int, list[dict]]:
        """Group -> its status on every aggregator (a group absent from one is not complete)."""
        out: dict[int, list[dict]] = {}
        for i, client in enumerate(self.clients):
            for g, s in client("status", timeout=self.call_timeout)["groups"].items():
                out.setdefault(int(g), [{} for _ in self.clients])[i] = s
        return out

    def commit(self, rnd: int, accepted: dict[int, float]) -> bool:
        """Commit round ``rnd`` everywhere; whether every aggregator kept its pipelined fold
        (the followers hold the model). Where only some did, they are told not to (a rank's
        pull needs one answer from all)."""
        accepted_json = {str(g): w for g, w in accepted.items()}
        kept = []
        for client in self.clients:
            reply = client("commit", timeout=self.call_timeout, round=rnd, accepted=accepted_json)
            kept.append(bool(reply.get("kept")))
        if any(kept) and not all(kept):
            log.warning("round %d: only some aggregators kept the pipelined fold", rnd)
            for client in self.clients:
                client("unkeep", timeout=self.call_timeout, round=rnd)
        return all(kept)

    def save(self, directory: Path) -> None:
        for i, client in enumerate(self.clients):
            client("save", timeout=self.call_timeout, dir=str(directory / f"aggregator_{i}"))

    def load(self, directory: Path) -> None:
        for i, client in enumerate(self.clients):
            client("load", timeout=self.call_timeout, dir=str(directory / f"aggregator_{i}"))

    def stop(self) -> None:
        for client in self.clients:
            try:
                if self.processes:
                    client("shutdown", timeout=5)
            except DataPlaneError:
                pass
            client.close()
        for proc in self.processes:
            proc.stop(grace_s=5)
