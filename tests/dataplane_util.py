"""Shared by the data plane's tests: a pool of real aggregator processes on loopback, and
groups of K ranks that stream to it (FSDP2's row shards, computed here)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from flower_shard.dataplane import tickets
from flower_shard.dataplane.client import RankLink, UplinkEncoder
from flower_shard.dataplane.layout import Layout, rows_to_elements
from flower_shard.dataplane.pool import AggregatorPool

SHAPES = {"a.weight": (96, 40), "b.weight": (33, 7), "c.bias": (50,), "d.weight": (70, 64)}
INIT = {"kind": "random", "seed": 7, "std": 1.0}


@pytest.fixture
def pool(tmp_path):
    pools = []

    def make(count=2, uplink="none", downlink="none", outer="fedavg", tls=None, root=None):
        p = AggregatorPool.start_local(count, "127.0.0.1", tmp_path / f"agg{len(pools)}", tls, root)
        pools.append(p)
        layout = Layout.build(SHAPES, count)
        settings = {
            "uplink": uplink,
            "downlink": downlink,
            "scale_chunk": 64,
            "outer": outer,
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
        }
        p.configure("run-1", layout, settings, INIT)
        return p, layout

    yield make
    for p in pools:
        p.stop()


def shard_pieces(layout, arrays, k: int, s: int):
    """Rank s of k's pieces: the rows of every parameter FSDP2 gives it (torch.chunk)."""
    pieces = []
    for p in layout.params:
        rows = p.shape[0]
        c = -(-rows // k)
        start = min(s * c, rows)
        n = max(0, min(rows, start + c) - start)
        a, b = rows_to_elements(p.shape, start, n)
        if b > a:
            pieces.append((p.index, a, arrays[p.name].reshape(-1)[a:b]))
    return pieces


def ticket(p, rnd, group):
    token = tickets.group_token(p.secret, "run-1", rnd, group)
    return tickets.Ticket("run-1", rnd, group, token, tuple(p.addresses), tls=False)


def upload_group(p, layout, rnd, group, deltas, k, weight, kind="none"):
    for s in range(k):
        link = RankLink(ticket(p, rnd, group), s)
        try:
            link.upload(shard_pieces(layout, deltas, k, s), layout, weight, UplinkEncoder(kind, 64))
        finally:
            link.close()


def download_all(p, layout, rnd, group, have=-1, shapes=None):
    link = RankLink(ticket(p, rnd, group), 0)
    try:
        ranges = [(q.index, 0, q.numel) for q in layout.params]
        mode, _, values = link.download(ranges, layout, have)
    finally:
        link.close()
    out = {}
    for q in layout.params:
        parts = sorted((start, v) for (i, start), v in values.items() if i == q.index)
        out[q.name] = np.concatenate([v for _, v in parts]).reshape(q.shape)
    return mode, out


class HeldValues:
    """A piece whose values come once ``ready()`` (its stream stays open until then)."""

    def __init__(self, values: np.ndarray, ready):
        self.values, self.ready, self.size = values, ready, values.size

    def __getitem__(self, key):
        deadline = time.monotonic() + 60
        while not self.ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.values[key]
