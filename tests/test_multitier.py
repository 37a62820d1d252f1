"""The multi-tier benchmark's smoke run: real namespaces, real tbf links, real torchrun sites,
and a real Flower deployment across them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flower_shard.launch.emulated_network import available

BENCH = Path(__file__).parent.parent / "bench" / "multitier.py"

pytestmark = pytest.mark.skipif(not available(), reason="needs root and ip netns")


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_multitier_smoke_measures_bytes_the_cost_model_predicts(tmp_path):
    before = namespaces()
    out = tmp_path / "multitier.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--streaming", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-8000:]
    assert namespaces() == before, "the benchmark left network namespaces behind"
    (entries,) = json.loads(out.read_text())["rates"].values()
    fsdp, fl = entries["fsdp"], entries["fl-fsdp T=4"]
    # Interface counters: FSDP's collectives cross the site link every step, FL's only at the
    # outer sync, and what crosses is the outer sync the cost model predicts (plus TCP/IP
    # framing, the store and the small metric all-reduces).
    assert fsdp["inter_byte_share"]["median"] > 5 * fl["inter_byte_share"]["median"]
    ratio = fl["inter_bytes"]["median"] / fl["predicted_inter_bytes"]
    assert 1.0 <= ratio <= 1.6, ratio
    assert fl["predicted_speedup"] > 0 and fl["fraction_of_isolated"] > 0
    assert fl["ppl_equal_tokens"]["median"] > 1
    # The link meter: never faster than the shaper (tbf's burst aside).
    assert 0 < fl["peak_link_MBps"]["median"] <= 1.2 * 100 / 8
    assert 0 <= fl["link_busy_share"]["median"] <= 1
    # (The flower transport's leg, `--flower`, is left out of the smoke to keep CI short: the
    # streaming leg below covers a real Flower deployment across the sites.)
    # The streaming transport across the same sites: every rank of site 1 streams its shard to
    # the aggregator in site 0 over the slow link; the aggregator's float32 fold is the same
    # mean to float32 rounding, so the same perplexity to well under 0.1%.
    streaming = entries["fl-fsdp-streaming T=4"]
    ppl = streaming["ppl_equal_tokens"]["median"] / fl["ppl_equal_tokens"]["median"]
    assert abs(ppl - 1) < 1e-3, ppl
    assert 0 < streaming["inter_byte_share"]["median"] < fsdp["inter_byte_share"]["median"]
    # The link while site 1's streams were open (the aggregators' stream logs): each direction
    # carried something, and never more than the shaper lets through (tbf's 4 ms burst aside).
    # (The tiny model's exchange is too short to fill the link: bench/RESULTS.md has the figures.)
    assert 0 <= streaming["exchange_busy_share"]["median"] <= 1
    for direction in ("exchange_use_up", "exchange_use_down"):
        assert 0 < streaming[direction]["median"] <= 1.05, direction
    # The cost model prices the streaming row too (the aggregators as a hub, plus Flower's
    # control plane a round) from the row's own compute per step, which the file keeps, so
    # --repredict recomputes the same figure from it.
    predicted = streaming["predicted_speedup"]
    assert predicted > 0 and streaming["compute_s_per_step"] > 0
    subprocess.run(
        [sys.executable, str(BENCH), "--repredict", str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (again,) = json.loads(out.read_text())["rates"].values()
    repredicted = again["fl-fsdp-streaming T=4"]["predicted_speedup"]
    assert repredicted == pytest.approx(predicted, rel=1e-12)
    # (The int8 leg, `--compression int8`, is left out for CI time: its bytes against the cost
    # model are in tests/test_costmodel.py, its exchange in tests/test_compression.py and
    # tests/test_streaming.py, its figures in bench/RESULTS.md.)
    # (The overlapped sync's leg, `--overlap`, is left out for CI time: its rule, resume and
    # HSDP stripes are tested in tests/test_streaming_sync.py, its pricing in
    # tests/test_costmodel.py, its figures are in bench/RESULTS.md.)
