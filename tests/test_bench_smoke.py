"""The benchmarks' smoke versions: each runs its real code path end to end on a tiny input and
writes its figures (the full runs are in bench/RESULTS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parent.parent / "bench"


def bench(script: str, *args: str, timeout: float = 600) -> str:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_exchange_bench_moves_the_model_and_samples_the_aggregators(tmp_path):
    out = tmp_path / "exchange.json"
    text = bench("exchange.py", "--smoke", "--out", str(out))
    results = json.loads(out.read_text())["results"]
    assert [r["groups"] for r in results] == [1, 2]
    for r in results:
        assert r["exchange_s"][0] > 0 and r["raw_tcp_s"][0] > 0 and r["bare_grpc_s"][0] > 0
        assert r["pipelined_s"][0] > 0  # every rank followed the round to its end (asserted)
        assert all(p > r["model_bytes"] for p in r["aggregator_peak_bytes"])
    assert "aggregator peak growth per added group" in text


def test_data_prep_bench_tokenises_alike_with_one_and_two_workers(tmp_path):
    out = tmp_path / "data_prep.json"
    text = bench("data_prep.py", "--smoke", "--work", str(tmp_path / "work"), "--out", str(out))
    report = json.loads(out.read_text())
    tokens = {name: runs[0]["tokens"] for name, runs in report["runs"].items()}
    assert tokens["1 worker"] == tokens["2 workers"] > 0
    assert report["ceiling"]["tokens_per_s"] > 0 and "speed-up 2 vs 1 worker" in text
