"""FL+FSDP vs FSDP on an emulated two-site network, side by side, with the cost model's prediction.

Two sites, each a network namespace holding K ranks (one torchrun node); inside a site the
ranks talk over the namespace's loopback, between sites through a tbf-limited link. Same model,
data, seed, per-rank batch and number of steps for every configuration:

- FSDP: one group of all 2K ranks spanning both sites (every all-gather crosses the slow link);
- FL+FSDP (collective transport): 2 groups = the 2 sites, outer sync every T steps.

FL runs get twice FSDP's steps, so that they are still training at FSDP's wall-clock budget.
Figures per configuration (median over repeats, with min and max): tokens/s, the fraction of
time in the inter-group exchange, the inter-site share of all bytes (interface counters), eval
perplexity at FSDP's token count and at FSDP's wall-clock budget (evaluations every 4 steps),
the isolated-groups limit (the FL groups' own step throughput, no exchange), and the cost
model's predicted speed-up next to the measured one.

    sudo .venv/bin/python bench/multitier.py                       # the sweep in bench/RESULTS.md
    .venv/bin/python bench/multitier.py --smoke                   # seconds: what the tests run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from flower_shard import protocol as P
from flower_shard.config import TrainConfig
from flower_shard.data.corpus import prepare_corpus
from flower_shard.dataplane import streamlog
from flower_shard.flower.node.launcher import env_with_bin
from flower_shard.launch.deployment import LocalDeployment
from flower_shard.launch.emulated_network import EmulatedNetwork, available
from flower_shard.launch.processes import ManagedProcess, free_port
from flower_shard.planning.costmodel import (
    Layout,
    Network,
    Workload,
    default_round_overhead_s,
    outer_sync_bytes,
    predict,
)
from flower_shard.runtime.models import build_model, count_parameters
from flower_shard.ux.metrics import read_metrics

HERE = Path(__file__).parent


class SiteKilled(RuntimeError):
    """A site's rank died by a signal (gloo aborts a process on some transport errors)."""


def run_config(
    net: EmulatedNetwork,
    cfg: TrainConfig,
    data_dir: Path,
    work: Path,
    watch: Callable[[Path], None] | None = None,
) -> dict:
    """:func:`run_once`, again once if a rank died by a signal; the result counts retries.

    gloo's transport thread can abort a process (SIGABRT) on a connection error instead of
    raising; on an emulated link that is an accident of the harness, not a result. The retry
    is printed and kept in the JSON (``retries``); a second failure fails the benchmark.
    """
    try:
        return run_once(net, cfg, data_dir, work, watch) | {"retries": 0}
    except SiteKilled as exc:
        print(f"multitier: a rank died by a signal; running the configuration again\n{exc}")
        return run_once(net, cfg, data_dir, work, watch) | {"retries": 1}


def run_once(
    net: EmulatedNetwork,
    cfg: TrainConfig,
    data_dir: Path,
    work: Path,
    watch: Callable[[Path], None] | None = None,
) -> dict:
    """Run one configuration across the sites; return its metrics and the bytes per tier.

    ``watch`` is called with the run's directory about every 0.2 s while it runs (e.g. to
    re-shape the link once the run reaches a step)."""
    out = work / f"g{cfg.groups}_t{cfg.local_steps}{'_adaptive' if cfg.adaptive_t else ''}"
    out.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, out=str(out), nnodes=net.sites, quiet=True)
    (out / "data").unlink(missing_ok=True)
    (out / "data").symlink_to(data_dir)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    cfg.to_json(out / "config.json")
    port = free_port()
    env = env_with_bin()
    env["OMP_NUM_THREADS"] = "1"
    before = net.site_bytes()
    start = time.perf_counter()
    meter = LinkMeter(net)
    rounds = RoundClock(out / "metrics.jsonl")

    def poll() -> None:
        rounds.poll()
        if watch:
            watch(out)

    procs = []
    for site in range(net.sites):
        cmd = net.prefix(site) + [
            "env",
            f"GLOO_SOCKET_IFNAME={net.site_ends[site]}",
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={net.sites}",
            f"--node-rank={site}",
            f"--nproc-per-node={cfg.world_size // net.sites}",
            f"--master-addr={net.addresses[0]}",
            f"--master-port={port}",
            "-m",
            "flower_shard.launch.job",
            str(out / "config.json"),
        ]
        procs.append(ManagedProcess(f"site{site}", cmd, out / f"site{site}.log", env))
    try:
        with meter:
            wait_all(procs, timeout_s=3600, watch=poll)
    finally:
        for p in procs:
            p.stop()
    wall = time.perf_counter() - start
    after = net.site_bytes()
    inter = sum(a["inter"] - b["inter"] for a, b in zip(after, before))
    intra = sum(a["intra"] - b["intra"] for a, b in zip(after, before))
    return {
        "metrics": read_metrics(out),
        "inter_bytes": inter,
        "intra_bytes": intra,
        "wall_s": wall,
    } | meter.figures(rounds.steady())


def _uplink_rate(a, b) -> float:
    """The fullest site's uplink between two samples, in bytes per second."""
    return max(y - x for x, y in zip(a[1], b[1])) / (b[0] - a[0])


class RoundClock:
    """When each round of a one-job run ended (wall clock, to the polling interval): the
    time its line appeared in ``metrics.jsonl``."""

    def __init__(self, metrics: Path):
        self.metrics, self.ends = metrics, []

    def poll(self) -> None:
        try:
            lines = self.metrics.read_text().count("\n")
        except FileNotFoundError:
            return
        self.ends += [time.time()] * (lines - len(self.ends))

    def steady(self) -> tuple[float, float] | None:
        """From the end of round 1 to the end of the round before the last (None: too few)."""
        return (self.ends[0], self.ends[-2]) if len(self.ends) >= 3 else None


class LinkMeter:
    """Samples the bytes each site sends over the slow link (its host end's interface counter)
    every ``interval`` seconds in a thread: the peak rate of one site's uplink over any
    ``window`` seconds, and the share of the samples in which some site's uplink ran at half
    its shaped rate or more ("busy")."""

    def __init__(self, net: EmulatedNetwork, interval: float = 0.1, window: float = 1.0):
        self.paths = [Path(f"/sys/class/net/{h}/statistics/rx_bytes") for h in net.host_ends]
        self.rate = net.rate_mbit * 1e6 / 8
        self.interval, self.window = interval, window
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():  # wall-clock stamps: the stream logs' clock
            self.samples.append((time.time(), [int(p.read_text()) for p in self.paths]))
            self._stop.wait(self.interval)

    def __enter__(self) -> LinkMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def figures(self, steady: tuple[float, float] | None = None) -> dict:
        """The peak over the run and the busy share; with ``steady`` (wall-clock start and
        end), also the peak within it (``steady_peak_link_MBps``: without start-up and the
        last round, whose drain sends a whole synchronous sync)."""
        s = self.samples
        if len(s) < 2:
            return {}
        steps = [_uplink_rate(a, b) for a, b in zip(s, s[1:])]
        busy = sum(r >= 0.5 * self.rate for r in steps) / len(steps)
        out = {"peak_link_MBps": self._peak(s) / 1e6, "link_busy_share": busy}
        inside = [x for x in s if steady and steady[0] <= x[0] <= steady[1]]
        if len(inside) >= 2:
            out["steady_peak_link_MBps"] = self._peak(inside) / 1e6
        return out

    def _peak(self, s: list) -> float:
        """The fullest window of at least ``window`` seconds among the samples ``s``."""
        peak, j = 0.0, 0
        for i in range(len(s)):
            while j < len(s) and s[j][0] - s[i][0] < self.window:
                j += 1
            if j == len(s):
                break
            peak = max(peak, _uplink_rate(s[i], s[j]))
        return peak

    def during(self, windows: list[tuple[float, float]]) -> dict:
        """The link while ``windows`` (disjoint wall-clock intervals) were open: the share of
        that time in which some direction ran at half its shaped rate or more ("busy"), and
        each direction's bytes over what its rate could carry in that time ("use"). Each
        sampling interval counts by its overlap with the windows."""
        s, sites = self.samples, len(self.paths)
        open_s, busy_s, sent = 0.0, 0.0, [0.0] * sites
        for a, b in zip(s, s[1:]):
            span = b[0] - a[0]
            overlap = sum(max(0.0, min(b[0], w1) - max(a[0], w0)) for w0, w1 in windows)
            if span <= 0 or overlap <= 0:
                continue
            moved = [y - x for x, y in zip(a[1], b[1])]
            open_s += overlap
            busy_s += overlap * (max(moved) / span >= 0.5 * self.rate)
            sent = [t + m * overlap / span for t, m in zip(sent, moved)]
        if open_s == 0:
            return {}
        use = [t / (self.rate * open_s) for t in sent]
        return {
            "exchange_open_s": open_s,
            "exchange_busy_share": busy_s / open_s,
            "exchange_link_use": use,
        }


def stream_windows(out: Path, site_addresses: list[str]) -> list[tuple[float, float]]:
    """The wall-clock intervals in which some data-plane stream of a group in another site than
    the aggregators' (``site_addresses``, site 0 excluded) was open: the union of those
    streams' intervals from every aggregator's stream log."""
    spans = sorted(
        (x["start"], x["end"])
        for log in sorted(Path(out, "aggregators").glob(f"agg*/{streamlog.FILE_NAME}"))
        for x in streamlog.read(log)
        if any(f":{a}:" in f"{x['peer']}" for a in site_addresses)
    )
    merged: list[tuple[float, float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


class SiteDeployment(LocalDeployment):
    """A real Flower deployment across the emulated sites: the SuperLink (and the ServerApp)
    in site 0, node i (its group and SuperNode) in site i. Site 1's weights cross the slow link
    to the server and back every round; the ranks of a group talk over their site's loopback."""

    def __init__(self, net: EmulatedNetwork, work: Path, nproc_per_group: int):
        super().__init__(work, num_nodes=net.sites, nproc_per_group=nproc_per_group)
        self.net = net
        self.host = net.addresses[0]

    def command_prefix(self, node: int | None) -> list[str]:
        if node is None:
            return self.net.prefix(0)
        return self.net.prefix(node) + ["env", "GLOO_SOCKET_IFNAME=lo"]


def run_flower(
    dep: SiteDeployment, cfg: TrainConfig, work: Path, transport: str, pipelined: bool = True
) -> dict:
    """One FL+FSDP run through Flower on the sites (``transport`` flower: the weights in Flower
    Messages; streaming: every rank streams its shard to an aggregator beside the ServerApp in
    site 0, over the same slow link, and with ``pipelined`` downloads the new values while it
    uploads); metrics as for torchrun."""
    sync = ("" if pipelined else "_sync") + ("_ovl" if cfg.outer_overlap else "")
    out = work / f"{transport}{sync}_t{cfg.local_steps}_{cfg.compression}"
    streaming = {}
    if transport == P.STREAMING:
        streaming = {"dataplane-host": dep.host, "dataplane-insecure": True}
        streaming["pipelined-commit"] = pipelined
        streaming[P.OUTER_OVERLAP] = cfg.outer_overlap
    before = dep.net.site_bytes()
    start = time.perf_counter()
    with LinkMeter(dep.net) as meter:
        summary = dep.run(
            {
                P.NUM_SERVER_ROUNDS: cfg.rounds,
                P.LOCAL_STEPS: cfg.local_steps,
                P.OUT_DIR: str(out),
                P.TRANSPORT: transport,
                P.MIN_GROUPS: dep.num_nodes,
                P.EVAL_EVERY: cfg.eval_every,
                P.COLLECTIVE_ADDRESS: f"127.0.0.1:{free_port()}",
                "model": cfg.model,
                "seq-len": cfg.seq_len,
                "batch-size": cfg.batch_size,
                "lr": cfg.lr,
                "seed": cfg.seed,
                "eval-sequences": cfg.eval_sequences,
                "compression": cfg.compression,
                "compression-chunk": cfg.compression_chunk,
                # both ways, as the collective transport's compressed all-gather
                "downlink-compression": cfg.compression,
            }
            | streaming,
            timeout=3600,
        )
    if summary[P.S_STATUS] != P.STATUS_OK:
        raise RuntimeError(f"{transport} run failed: {summary.get('error')}")
    wall = time.perf_counter() - start
    after = dep.net.site_bytes()
    windows = stream_windows(out, dep.net.addresses[1:]) if transport == P.STREAMING else []
    return (
        {
            "metrics": flower_rounds(read_metrics(out)),
            "inter_bytes": sum(a["inter"] - b["inter"] for a, b in zip(after, before)),
            "intra_bytes": sum(a["intra"] - b["intra"] for a, b in zip(after, before)),
            "wall_s": wall,
        }
        | meter.figures()
        | meter.during(windows)
    )


def flower_rounds(records: list[dict]) -> list[dict]:
    """The ServerApp's rounds in the torchrun runs' terms: time without the server-side
    evaluation; the exchange is everything in the round but the groups' compute (weights
    gathered, sent, aggregated, sent back, loaded, and Flower's own messaging), and the
    streaming transport's download where the groups pulled the model to evaluate it."""
    out, previous = [], 0
    for r in records:
        train_s = r["group_round_s"] + r["control_overhead_s"] + r.get(P.EVAL_PULL_S, 0.0)
        out.append(
            r
            | {
                "round_s": train_s,
                "tokens_per_s": (r["tokens"] - previous) / train_s,
                "outer_sync_s": train_s - r["compute_s"],
            }
        )
        previous = r["tokens"]
    return out


def wait_all(
    procs: list[ManagedProcess], timeout_s: float, watch: Callable[[], None] | None = None
) -> None:
    """Wait for every site; on a failure, name the one that failed first and show every log.

    The site that failed first is the cause; the others usually fail because a peer vanished.
    """
    deadline = time.monotonic() + timeout_s
    failed: list[ManagedProcess] = []
    while any(p.alive() for p in procs) and not failed:
        failed = [p for p in procs if not p.alive() and p.proc.returncode != 0]
        if time.monotonic() > deadline:
            raise RuntimeError(f"sites still running after {timeout_s:.0f} s")
        if watch:
            watch()
        time.sleep(0.2)
    failed = failed or [p for p in procs if p.proc.returncode != 0]
    if failed:
        time.sleep(2)  # let the other sites write what they saw
        logs = "\n".join(f"--- {p.name} (exit {p.proc.poll()}):\n{error_lines(p)}" for p in procs)
        first = error_lines(failed[0])
        killed = "Signal 6" in first or "SIGABRT" in first or "SIGSEGV" in first
        raise (SiteKilled if killed else RuntimeError)(f"{failed[0].name} failed first\n{logs}")


def error_lines(p: ManagedProcess, limit: int = 40) -> str:
    """What a site's ranks said before dying: error lines first, then the log's tail."""
    text = p.tail(10_000).splitlines()
    keys = ("Error", "error", "terminate", "what()", "Exception", "Fatal", "Signal")
    errors = [line for line in text if any(k in line for k in keys)]
    return "\n".join(errors[:limit] + ["..."] + text[-15:])


def make_configs(
    base: TrainConfig,
    k: int,
    ts: list[int],
    steps: int,
    hsdp: bool,
    deployed: tuple[str, ...] = (),
    compressions: tuple[str, ...] = (),
    compress_flower: bool = True,
    fsdp: bool = True,
    overlaps: tuple[int, ...] = (),
    pace: bool = False,
) -> list:
    """(name, config) pairs: the baseline over both sites, then one group per site per T.

    HSDP: the baseline shards inside a site and replicates across the two sites (R = 2);
    FL+HSDP groups are sites with R = 2, S = k / 2 inside.
    FL runs get twice the steps: they are still training at the baseline's wall-clock budget.
    Each of ``compressions`` (bf16, int8) adds a copy of every FL configuration that
    compresses its exchange, named ``fl-fsdp+int8 T=4`` (``fl-fsdp-flower+int8 T=4``, unless
    ``compress_flower`` is False; ``fl-fsdp-streaming+ovl+int8 T=4`` overlapped). Each
    transport of ``deployed`` (flower, streaming) adds every FL+FSDP configuration run
    through a real Flower deployment with that transport,
    named ``fl-fsdp-<transport> T=4``. Each F of ``overlaps`` adds every collective FL+FSDP
    configuration with the overlapped outer sync in F fragments (F <= T), named
    ``fl-fsdp+ovl T=4`` (F = 1) or ``fl-fsdp+ovl+F4 T=4``; F = 1 also every pipelined
    streaming one, overlapped (``fl-fsdp-streaming+ovl T=4``). ``pace`` adds a paced copy of
    each collective overlapped one (``fl-fsdp+ovl+F2+pace T=4``).
    """
    kinds = ([("fsdp", 1, 1)] if fsdp else []) + ([("hsdp", 2, 2)] if hsdp else [])
    out = []
    for kind, r_base, r_fl in kinds:
        out.append(
            (
                kind,
                dataclasses.replace(
                    base,
                    groups=1,
                    nproc_per_group=2 * k,
                    sharding=kind,
                    replicate=r_base,
                    local_steps=4,
                    rounds=steps // 4,
                    eval_every=1,
                ),
            )
        )
        out += [
            (
                f"fl-{kind} T={t}",
                dataclasses.replace(
                    base,
                    groups=2,
                    nproc_per_group=k,
                    sharding=kind,
                    replicate=r_fl,
                    local_steps=t,
                    rounds=max(1, 2 * steps // t),
                    eval_every=max(1, 4 // t),
                ),
            )
            for t in ts
        ]
        if kind == "fsdp":
            out += [
                (f"fl-fsdp-{transport} T={cfg.local_steps}", cfg)
                for transport in deployed
                for name, cfg in list(out)
                if name.startswith("fl-fsdp T=")
            ]
    out += [
        (
            f"fl-fsdp+ovl{'' if f == 1 else f'+F{f}'} T={cfg.local_steps}",
            dataclasses.replace(cfg, outer_overlap=True, outer_fragments=f),
        )
        for f in overlaps
        for name, cfg in list(out)
        if name.startswith("fl-fsdp T=") and f <= cfg.local_steps
    ]
    out += [
        (name.replace(" T=", "+pace T="), dataclasses.replace(cfg, outer_pace=True))
        for name, cfg in list(out)
        if pace and name.startswith("fl-fsdp+ovl")
    ]
    out += [  # the streaming transport overlaps whole rounds (no fragments)
        (name.replace(" T=", "+ovl T="), dataclasses.replace(cfg, outer_overlap=True))
        for name, cfg in list(out)
        if 1 in overlaps and name.startswith(f"fl-fsdp-{P.STREAMING} T=")
    ]
    for c in compressions:
        out += [
            (name.replace(" T=", f"+{c} T="), dataclasses.replace(cfg, compression=c))
            for name, cfg in list(out)
            if name.startswith("fl-")
            and variant(name)["compression"] == "none"  # overlapped ones too
            and (compress_flower or not deployed_transport(name))
        ]
    return out


STREAMING_SYNC = f"{P.STREAMING}-sync"  # the streaming transport without the pipelined commit


def variant(name: str) -> dict:
    """What a configuration's name says about its exchange: compression, overlap, fragments,
    the transport (one torchrun job: collective) and whether its commit is pipelined."""
    tags = name.split()[0].split("+")[1:]
    fragments = next((int(t[1:]) for t in tags if t.startswith("F") and t[1:].isdigit()), 1)
    compression = next((t for t in tags if t in ("bf16", "int8")), "none")
    return {
        "compression": compression,
        "overlap": "ovl" in tags,
        "paced": "pace" in tags,
        "fragments": fragments,
        "transport": deployed_transport(name) or P.COLLECTIVE,
        "pipelined": STREAMING_SYNC not in name,
    }


def deployed_transport(name: str) -> str | None:
    """The transport of a configuration run through a Flower deployment, from its name."""
    return next((t for t in (P.FLOWER, P.STREAMING) if f"-{t}" in name), None)


def trained_tokens(recs: list[dict]) -> list[float]:
    """Each round's cumulative tokens *trained*. The one-job driver records those; a Flower
    run records the tokens *folded*, which with the overlapped streaming sync lag one round
    behind: round 1 folds nothing (its update is held back) and the last round (the drain)
    folds two rounds' steps. Every group trains the same steps each round in these runs, so
    there each round trained an equal share of the total."""
    if len(recs) < 2 or recs[0]["tokens"] > 0:
        return [r["tokens"] for r in recs]
    total = recs[-1]["tokens"]
    return [total * (i + 1) / len(recs) for i in range(len(recs))]


def summarise(run: dict, tokens_per_step: int) -> dict:
    recs = run["metrics"]
    steady = recs[1:] if len(recs) > 1 else recs  # the first round pays start-up
    train_s = sum(r["round_s"] for r in steady)
    trained = trained_tokens(recs)
    # the steady rounds' own steps (not the tokens they fold: overlapped, round 1's too)
    tokens = trained[-1] - trained[0] if len(recs) > 1 else trained[0]
    compute = sum(r["compute_s"] for r in steady)
    evals = [  # the groups' models as evaluated: at the tokens they trained
        (sum(x["round_s"] for x in recs[: i + 1]), trained[i], r["eval_ppl"])
        for i, r in enumerate(recs)
        if r.get("eval_ppl") is not None
    ]
    return {
        "tokens_per_s": tokens / train_s,
        "isolated_tokens_per_s": tokens / compute,
        "exchange_share": sum(r["outer_sync_s"] for r in steady) / train_s,
        "inter_byte_share": run["inter_bytes"] / max(1, run["inter_bytes"] + run["intra_bytes"]),
        "inter_bytes": run["inter_bytes"],
        "intra_bytes": run["intra_bytes"],
        "sync_bytes_per_round": statistics.median(r["outer_sync_bytes"] for r in recs),
        "compute_s_per_step": compute / max(1, recs[-1]["step"] - recs[0]["step"])
        if len(recs) > 1
        else compute / recs[0]["step"],
        "final_ppl": recs[-1].get("eval_ppl"),
        "evals": evals,
        "rounds": len(recs),
        "retries": run.get("retries", 0),
        "peak_link_MBps": run.get("peak_link_MBps"),
        "steady_peak_link_MBps": run.get("steady_peak_link_MBps"),
        "link_busy_share": run.get("link_busy_share"),
        # while the streams across the link were open (streaming transport only); use per
        # direction: [site 0 -> site 1 (download), site 1 -> site 0 (upload)]
        "exchange_busy_share": run.get("exchange_busy_share"),
        "exchange_link_use": run.get("exchange_link_use"),
        "wall_s": run["wall_s"],  # start-up, evaluations and the final save included
    }


def ppl_at(evals: list, *, seconds: float | None = None, tokens: int | None = None):
    """Eval perplexity of the last evaluation within a training-time or a token budget."""
    done = [
        ppl
        for t, tok, ppl in evals
        if (seconds is None or t <= seconds * 1.0001) and (tokens is None or tok <= tokens)
    ]
    return done[-1] if done else None


def predicted(
    params: int,
    compute_s: float,
    tokens: int,
    rate_mbit: float,
    k: int,
    t: int,
    hsdp: bool = False,
    compression: str = "none",
    overlap: bool = False,
    fragments: int = 1,
    transport: str = P.COLLECTIVE,
    pipelined: bool = True,
    paced: bool = False,
) -> dict:
    """The cost model's speed-up over FSDP for one configuration (:func:`variant`'s terms)
    and the site link's steady peak rate in MB/s (``peak_MBps``: the link's rate unless the
    exchange is paced). A streaming run also pays Flower's control plane each round
    (measured apart by bench/control_plane.py); the collective rows are one torchrun job,
    without it. Pacing is priced as the overlap it paces: the same bytes in the same window."""
    streaming = transport == P.STREAMING
    net = Network(
        ranks_per_node=k,
        nodes_per_site=1,
        intra_node_bw=2e9,
        inter_node_bw=rate_mbit * 1e6 / 8,
        inter_site_bw=rate_mbit * 1e6 / 8,
        intra_node_lat=0,
        inter_node_lat=0,
        inter_site_lat=0,
        backend="gloo",  # the benchmark runs on CPU
        round_overhead_s=default_round_overhead_s(transport),
    )
    w = Workload(
        params=params,
        compute_s=compute_s,
        tokens_per_step=tokens,
        compression=compression,
        downlink_compression=compression if streaming else "none",  # as run_flower sets it
    )
    sharding, r = ("hsdp", 2) if hsdp else ("fsdp", 1)
    fl = Layout(
        2 * k,
        2,
        sharding,
        r,
        local_steps=t,
        outer_overlap=overlap,
        outer_fragments=fragments,
        outer_pace=paced,
        transport=transport,
        pipelined=pipelined,
    )
    base = predict(w, Layout(2 * k, 1, sharding, r), net)
    got = predict(w, fl, net)
    return {
        "speedup": got.tokens_per_s / base.tokens_per_s,
        "peak_MBps": got.extra["peak_link_share"] * rate_mbit / 8,
    }


def med(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"min": None, "median": None, "max": None}
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--ranks-per-site", type=int, default=2)
    p.add_argument("--rates-mbit", default="200,1000")
    p.add_argument("--local-steps", default="1,2,4,8,16")
    p.add_argument("--steps", type=int, default=32, help="inner steps per run (equal tokens)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--hsdp",
        action="store_true",
        help="also HSDP vs FL+HSDP (use --ranks-per-site 4 for S >= 2)",
    )
    p.add_argument(
        "--hsdp-only",
        action="store_true",
        help="only HSDP vs FL+HSDP (leave out the FSDP configurations)",
    )
    p.add_argument(
        "--flower",
        action="store_true",
        help="also FL+FSDP through a real Flower deployment (flower transport) across the sites",
    )
    p.add_argument(
        "--streaming",
        action="store_true",
        help="also FL+FSDP through a real Flower deployment with the streaming transport (its "
        "aggregator in site 0, beside the ServerApp)",
    )
    p.add_argument(
        "--streaming-sync",
        action="store_true",
        help="also the streaming transport without the pipelined commit (upload, commit, then "
        "download), named fl-fsdp-streaming-sync",
    )
    p.add_argument(
        "--compression",
        default="",
        help="comma-separated bf16,int8: also run every FL configuration with its exchange "
        "compressed that way (side by side with the float32 one)",
    )
    p.add_argument(
        "--no-flower-compression",
        action="store_true",
        help="compress only the collective configurations (the smoke test: tests/test_flower.py "
        "checks compression through Flower)",
    )
    p.add_argument(
        "--overlap",
        default="",
        help="comma-separated fragment counts, e.g. 1,4: also run every collective FL+FSDP "
        "configuration with the overlapped outer sync in that many fragments (F <= T)",
    )
    p.add_argument(
        "--pace",
        action="store_true",
        help="with --overlap: also run each collective overlapped configuration paced "
        "(--outer-pace: its exchange sent in T pieces, one per inner step)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny model, one rate, T=4, seconds")
    p.add_argument(
        "--repredict",
        metavar="JSON",
        help="run nothing: price the configurations of an earlier result file again with the "
        "current cost model (from their measured compute per step) and print its table",
    )
    p.add_argument("--out", default=str(HERE / "results" / "multitier.json"))
    args = p.parse_args()
    if args.repredict:
        repredict(Path(args.repredict))
        return
    if args.smoke:
        args.model, args.rates_mbit, args.local_steps = "tiny", "100", "4"
        args.steps, args.repeats, args.seq_len = 4, 1, 32
    if not available():
        raise SystemExit("multitier: needs root and `ip netns` (network namespaces) on Linux")
    args.hsdp = args.hsdp or args.hsdp_only
    deployed = tuple(
        t
        for t, on in (
            (P.FLOWER, args.flower),
            (P.STREAMING, args.streaming),
            (STREAMING_SYNC, args.streaming_sync),
        )
        if on
    )
    rates = [float(r) for r in args.rates_mbit.split(",")]
    ts = [int(t) for t in args.local_steps.split(",")]
    k = args.ranks_per_site
    compressions = tuple(c for c in args.compression.split(",") if c)
    for c in compressions:
        if c not in ("bf16", "int8"):
            raise SystemExit(f"multitier: --compression {c!r} is unknown; use bf16 and/or int8")
    tokens_per_step = args.batch_size * args.seq_len
    params = count_parameters(build_model(args.model))
    base_cfg = TrainConfig(
        model=args.model,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        eval_sequences=16,
        seed=0,
        lr=1e-3,
    )
    results = {"config": vars(args), "params": params, "rates": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "corpus"
        prepare_corpus(data)
        for rate in rates:
            samples: dict[str, list[dict]] = {}
            with EmulatedNetwork(2, rate) as net, contextlib.ExitStack() as stack:
                dep = None
                if deployed:
                    dep = stack.enter_context(SiteDeployment(net, work / f"flower{rate:g}", k))
                for rep in range(args.repeats):
                    configs = make_configs(
                        base_cfg,
                        k,
                        ts,
                        args.steps,
                        args.hsdp,
                        deployed,
                        compressions,
                        not args.no_flower_compression,
                        fsdp=not args.hsdp_only,
                        overlaps=tuple(int(f) for f in args.overlap.split(",") if f),
                        pace=args.pace,
                    )
                    if rep % 2:
                        configs.reverse()
                    for name, cfg in configs:
                        if transport := deployed_transport(name):
                            pipelined = STREAMING_SYNC not in name
                            run = run_flower(dep, cfg, work, transport, pipelined)
                        else:
                            run = run_config(net, cfg, data, work)
                        s = summarise(run, tokens_per_step)
                        samples.setdefault(name, []).append(s)
                        print(
                            f"{rate:g} Mbit/s repeat {rep + 1} {name:24s} "
                            f"{s['tokens_per_s']:8.0f} tok/s  exchange "
                            f"{100 * s['exchange_share']:5.1f}%  inter bytes "
                            f"{100 * s['inter_byte_share']:5.1f}%  ppl {s['final_ppl']:.2f}  "
                            f"wall {s['wall_s']:.0f} s",
                            flush=True,
                        )
            results["rates"][str(rate)] = aggregate(samples, params, tokens_per_step, rate, k)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    plot(results, Path(args.out).with_suffix(".png"))


def plot(results: dict, path: Path) -> None:
    """Speed-up (measured and predicted) against T, one line per inter-site rate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("multitier: matplotlib is not installed (pip install '.[bench]'): no plot")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    first = next(iter(results["rates"].values()))
    kind = "fsdp" if "fsdp" in first else "hsdp"  # --hsdp-only runs have no FSDP baseline
    base, fl_name = kind.upper(), f"FL+{kind.upper()}"
    for rate, entries in results["rates"].items():
        fl = sorted(
            (int(n.split("=")[1]), e) for n, e in entries.items() if n.startswith(f"fl-{kind} T=")
        )
        ts = [t for t, _ in fl]
        line = ax1.plot(
            ts,
            [e["speedup_vs_baseline"]["median"] for _, e in fl],
            "o-",
            label=f"measured, {float(rate):g} Mbit/s",
        )[0]
        ax1.plot(
            ts,
            [e["predicted_speedup"] for _, e in fl],
            "x--",
            color=line.get_color(),
            label=f"cost model, {float(rate):g} Mbit/s",
        )
        ax2.plot(
            ts,
            [100 * e["inter_byte_share"]["median"] for _, e in fl],
            "o-",
            color=line.get_color(),
            label=f"{fl_name}, {float(rate):g} Mbit/s",
        )
        ax2.axhline(
            100 * entries[kind]["inter_byte_share"]["median"],
            ls=":",
            color=line.get_color(),
            label=f"{base}, {float(rate):g} Mbit/s",
        )
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T (local steps per round)")
        ax.legend(fontsize=7)
    ax1.set_ylabel(f"tokens/s, {fl_name} / {base}")
    ax2.set_ylabel("inter-site share of bytes (%)")
    fig.suptitle(f"{fl_name} vs {base}, 2 emulated sites")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"multitier: plot in {path}")


def priced(name: str) -> bool:
    """Whether the cost model prices a configuration: FL over the collective or streaming
    transport (the flower transport sends whole models through Flower's messages)."""
    return name.startswith("fl-") and deployed_transport(name) != P.FLOWER


def collective_twin(name: str, entries: dict) -> float | None:
    """The compute per step of the one-job run with the same exchange schedule, for deployed
    rows of files written before those rows recorded their own."""
    twin = name.replace(f"-{STREAMING_SYNC}", "").replace(f"-{P.STREAMING}", "")
    return entries.get(twin, {}).get("compute_s_per_step")


def repredict(path: Path) -> None:
    """Rewrite ``predicted_speedup`` in a result file with the current cost model."""
    results = json.loads(path.read_text())
    c = results["config"]
    for rate, entries in results["rates"].items():
        for name, e in entries.items():
            compute = e.get("compute_s_per_step") or collective_twin(name, entries)
            if not priced(name) or compute is None:
                continue
            model = predicted(
                results["params"],
                compute,
                c["batch_size"] * c["seq_len"],
                float(rate),
                c["ranks_per_site"],
                int(name.split("=")[1]),
                name.startswith("fl-hsdp"),
                **variant(name),
            )
            e["predicted_speedup"] = model["speedup"]
            e["predicted_steady_peak_MBps"] = model["peak_MBps"]
    path.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    if path.with_suffix(".png").exists():
        plot(results, path.with_suffix(".png"))


def aggregate(samples: dict, params: int, tokens_per_step: int, rate: float, k: int) -> dict:
    out = {}
    for name, runs in samples.items():
        kind = "hsdp" if "hsdp" in name else "fsdp"
        fsdp = samples[kind]  # the baseline of the same sharding
        speed = [r["tokens_per_s"] / f["tokens_per_s"] for r, f in zip(runs, fsdp)]
        budget = [f["evals"][-1][0] if f["evals"] else None for f in fsdp]
        entry = {
            "tokens_per_s": med([r["tokens_per_s"] for r in runs]),
            "speedup_vs_baseline": med(speed),
            "exchange_share": med([r["exchange_share"] for r in runs]),
            "inter_byte_share": med([r["inter_byte_share"] for r in runs]),
            "ppl_equal_tokens": med(
                [
                    ppl_at(r["evals"], tokens=f["evals"][-1][1])
                    for r, f in zip(runs, fsdp)
                    if f["evals"]
                ]
            ),
            "ppl_at_baseline_time": med(
                [ppl_at(r["evals"], seconds=b) for r, b in zip(runs, budget) if b is not None]
            ),
            "isolated_tokens_per_s": med([r["isolated_tokens_per_s"] for r in runs]),
            "inter_bytes": med([r["inter_bytes"] for r in runs]),
            "sync_bytes_per_round": med([r["sync_bytes_per_round"] for r in runs]),
            "retries": sum(r["retries"] for r in runs),
            "peak_link_MBps": med([r.get("peak_link_MBps") for r in runs]),
            "steady_peak_link_MBps": med([r.get("steady_peak_link_MBps") for r in runs]),
            "link_busy_share": med([r.get("link_busy_share") for r in runs]),
            "exchange_busy_share": med([r.get("exchange_busy_share") for r in runs]),
            "exchange_use_down": med([(r.get("exchange_link_use") or [None])[0] for r in runs]),
            "exchange_use_up": med([(r.get("exchange_link_use") or [None, None])[1] for r in runs]),
        }
        if name.startswith("fl-"):
            iso = statistics.median(r["isolated_tokens_per_s"] for r in runs)
            entry["fraction_of_isolated"] = entry["tokens_per_s"]["median"] / iso
        if priced(name):
            t = int(name.split("=")[1])
            v = variant(name)
            compression = v["compression"]
            compute = statistics.median(r["compute_s_per_step"] for r in runs)
            entry["compute_s_per_step"] = compute  # the model's input: --repredict reuses it
            model = predicted(params, compute, tokens_per_step, rate, k, t, kind == "hsdp", **v)
            entry["predicted_speedup"] = model["speedup"]
            entry["predicted_steady_peak_MBps"] = model["peak_MBps"]
            if not deployed_transport(name):
                # Every rank's outer-sync bytes cross the site link (one group per site).
                w = Workload(
                    params=params,
                    compute_s=compute,
                    tokens_per_step=tokens_per_step,
                    compression=compression,
                )
                lay = Layout(2 * k, 2, kind, 2 if kind == "hsdp" else 1, local_steps=t)
                entry["predicted_inter_bytes"] = (
                    runs[0]["rounds"] * 2 * k * outer_sync_bytes(w, lay)
                )
        out[name] = entry
    return out


def _cell(value, fmt: str, unit: str = "") -> str:
    """``value`` formatted, or a dash as wide where a figure is missing (no eval in time)."""
    width = int(fmt.split(".")[0]) + len(unit)
    return f"{value:{fmt}}{unit}" if value is not None else f"{'-':>{width}s}"


def _pct(entry: dict | None) -> float | None:
    """An aggregated share's median in percent, None where it was not measured."""
    median = (entry or {}).get("median")
    return None if median is None else 100 * median


def print_table(results: dict) -> None:
    print(
        f"\n{'rate':>9s} {'config':24s} {'tok/s':>8s} {'speed-up':>9s} {'predicted':>9s} "
        f"{'exchange':>8s} {'inter B':>8s} {'of limit':>8s} {'ppl=tok':>8s} {'ppl=time':>8s} "
        f"{'link MB/s':>9s} {'steady':>6s} {'busy':>6s} {'xbusy':>6s} {'up':>5s} {'down':>5s}"
    )
    for rate, entries in results["rates"].items():
        for name, e in entries.items():
            pred = e.get("predicted_speedup")
            frac = e.get("fraction_of_isolated")
            cells = [
                _cell(e["tokens_per_s"]["median"], "8.0f"),
                _cell(e["speedup_vs_baseline"]["median"], "8.2f", "x"),
                _cell(pred, "8.2f", "x"),
                _cell(100 * e["exchange_share"]["median"], "7.1f", "%"),
                _cell(100 * e["inter_byte_share"]["median"], "7.1f", "%"),
                _cell(None if frac is None else 100 * frac, "7.0f", "%"),
                _cell(e["ppl_equal_tokens"]["median"], "8.2f"),
                _cell(e["ppl_at_baseline_time"]["median"], "8.2f"),
                _cell(e.get("peak_link_MBps", {}).get("median"), "9.1f"),
                _cell((e.get("steady_peak_link_MBps") or {}).get("median"), "6.1f"),
                *(
                    _cell(_pct(e.get(key)), "5.0f", "%")
                    for key in ("link_busy_share", "exchange_busy_share")
                ),
                *(
                    _cell(_pct(e.get(key)), "4.0f", "%")
                    for key in ("exchange_use_up", "exchange_use_down")
                ),
            ]
            print(f"{float(rate):7g}Mb {name:24s} " + " ".join(cells))


if __name__ == "__main__":
    main()
