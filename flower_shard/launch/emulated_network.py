"""A multi-tier network on one machine: sites as network namespaces, slow links between them.

Each site is a network namespace with its own loopback (the fast tier: ranks of one site talk
over it). The sites are joined by veth pairs to a bridge in the root namespace, and each site's
veth sends through a ``tc tbf`` rate limiter (the slow, inter-site tier; netem is not
available here, tbf is). Traffic stays inside namespaces this object made; it removes them on
exit, on Ctrl-C, on SIGTERM (entered from the main thread, where SIGTERM was not handled
yet: it then raises SystemExit, so the caller's context managers run too) and at interpreter
exit, also when the caller fails.

Counters: :meth:`site_bytes` reads, per site, the bytes it sent to other sites (its veth) and
the bytes its ranks sent each other (its loopback).

Needs root (``ip netns``); :func:`available` tells whether this machine can do it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# Tiny TCP peers for wait_connected (run inside the namespaces with this interpreter).
_ACCEPT = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:
    s.accept()[0].close()
"""
_CONNECT = """
import socket, sys
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()
"""


def available() -> bool:
    """True if network namespaces, veth, bridges and tbf can be used here."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    name = f"fsprobe{os.getpid() % 100000}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _sh(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")


class EmulatedNetwork:
    """``sites`` namespaces on one bridge; each site's uplink is limited to ``rate_mbit``."""

    def __init__(self, sites: int = 2, rate_mbit: float = 1000.0):
        if sites < 1 or rate_mbit <= 0:
            raise ValueError("need sites >= 1 and rate_mbit > 0")
        self.sites, self.rate_mbit = sites, rate_mbit
        tag = f"{os.getpid() % 10000:04d}{random.randint(0, 99):02d}"
        self.bridge = f"fsbr{tag}"
        self.namespaces = [f"fs{tag}s{i}" for i in range(sites)]
        self.host_ends = [f"fsh{tag}{i}" for i in range(sites)]
        self.site_ends = [f"fss{tag}{i}" for i in range(sites)]
        self.subnet = f"10.213.{random.randint(0, 255)}"
        self.addresses = [f"{self.subnet}.{i + 1}" for i in range(sites)]
        self.bridge_address = f"{self.subnet}.254"
        self._up = False

    def __enter__(self) -> EmulatedNetwork:
        atexit.register(self.close)
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _exit_on_sigterm)  # else a kill leaves the namespaces
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        self._up = True
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "link", "set", self.bridge, "up")
        # The root namespace reaches the sites through the bridge (health checks, `flwr`).
        _sh("ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        for ns, host, site, addr in zip(
            self.namespaces, self.host_ends, self.site_ends, self.addresses
        ):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", host, "type", "veth", "peer", "name", site)
            _sh("ip", "link", "set", site, "netns", ns)
            _sh("ip", "link", "set", host, "master", self.bridge)
            _sh("ip", "link", "set", host, "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", site)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", site, "up")
            self.set_rate(self.rate_mbit, ns, site, add=True)
        self.wait_connected()

    def wait_connected(self, timeout_s: float = 30.0) -> None:
        """Return once every site reaches site 0 over TCP; raise if it never does.

        Runs start only on a network that carries traffic: a distributed job whose first
        connections fail or stall retries them, and gloo can abort on a half-open one.
        """
        port = 29400 + random.randint(0, 500)
        server = subprocess.Popen(
            self.prefix(0) + [sys.executable, "-c", _ACCEPT, self.addresses[0], str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            if server.stdout.readline().strip() != "listening":
                raise RuntimeError("emulated network: site 0 could not listen")
            deadline = time.monotonic() + timeout_s
            for site in range(1, self.sites):
                while True:
                    probe = subprocess.run(
                        self.prefix(site)
                        + [sys.executable, "-c", _CONNECT, self.addresses[0], str(port)],
                        capture_output=True,
                    )
                    if probe.returncode == 0:
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"emulated network: site {site} cannot reach site 0 over the "
                            f"bridge {self.bridge} after {timeout_s:.0f} s; if bridged traffic "
                            "goes through iptables here, set net.bridge.bridge-nf-call-iptables=0"
                        )
                    time.sleep(0.2)
        finally:
            server.kill()
            server.wait()

    def set_rate(
        self, rate_mbit: float, ns: str | None = None, dev: str | None = None, add: bool = False
    ) -> None:
        """(Re)shape the uplink of one site, or of all sites, to ``rate_mbit`` Mbit/s."""
        targets = [(ns, dev)] if ns else list(zip(self.namespaces, self.site_ends))
        burst = max(32_000, int(rate_mbit * 1e6 / 8 / 250))  # ~4 ms of traffic
        for n, d in targets:
            _sh(
                "ip",
                "netns",
                "exec",
                n,
                "tc",
                "qdisc",
                "add" if add else "replace",
                "dev",
                d,
                "root",
                "tbf",
                "rate",
                f"{rate_mbit}mbit",
                "burst",
                str(burst),
                "latency",
                "100ms",
            )
        self.rate_mbit = rate_mbit

    def prefix(self, site: int) -> list[str]:
        """The command prefix that runs a command inside a site."""
        return ["ip", "netns", "exec", self.namespaces[site]]

    def site_bytes(self) -> list[dict[str, int]]:
        """Per site: bytes sent to other sites (``inter``) and among its own ranks (``intra``)."""
        out = []
        for ns, host in zip(self.namespaces, self.host_ends):
            inter = int(Path(f"/sys/class/net/{host}/statistics/rx_bytes").read_text())
            lo = subprocess.run(
                ["ip", "netns", "exec", ns, "cat", "/sys/class/net/lo/statistics/tx_bytes"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            out.append({"inter": inter, "intra": int(lo)})
        return out

    def close(self) -> None:
        if not self._up:
            return
        for ns in self.namespaces:
            # Processes still inside a namespace keep it alive: end them first.
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for host in self.host_ends:
            subprocess.run(["ip", "link", "del", host], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self._up = False
