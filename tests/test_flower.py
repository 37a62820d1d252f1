"""Flower integration on a real deployment: flower-superlink, flower-supernode, torchrun groups.

One deployment (SuperLink + 2 nodes of 2 ranks) serves several runs. The groups write their
weights at each stage of each round (--dump-dir), so every claim is checked against the
weights that really moved, with references computed here with numpy / plain torch.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_tensorboard_is_metrics
from safetensors.numpy import load_file

from flower_shard import protocol as P
from flower_shard.launch.deployment import LocalDeployment
from flower_shard.launch.processes import free_port
from flower_shard.runtime.models import build_model
from flower_shard.ux.metrics import read_metrics

ROUNDS, T, SEQ, BATCH, SEED = 2, 2, 32, 2, 3


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    work = tmp_path_factory.mktemp("deployment")
    dump = work / "dump"
    dump.mkdir()
    fault = work / "fault"  # node 1's group reads its faults from here (absent: none)
    with LocalDeployment(
        work, num_nodes=2, nproc_per_group=2, dump_dir=str(dump), fault_files=[None, str(fault)]
    ) as dep:
        dep.dump, dep.fault = dump, fault
        yield dep


def run(dep, out, **extra):
    for f in dep.dump.iterdir():
        f.unlink()
    config = {
        P.NUM_SERVER_ROUNDS: ROUNDS,
        P.LOCAL_STEPS: T,
        P.OUT_DIR: str(out),
        P.MIN_GROUPS: 1,
        "model": "tiny",
        "seq-len": SEQ,
        "batch-size": BATCH,
        "seed": SEED,
        "lr": 3e-3,
        "eval-sequences": 8,
        P.COLLECTIVE_ADDRESS: f"127.0.0.1:{free_port()}",
    } | extra
    summary = dep.run(config, timeout=600)
    assert summary["status"] == "ok", summary
    return read_metrics(out)


def wait_until_online(dep, count: int, timeout: float = 120) -> None:
    """Wait until the SuperLink counts ``count`` SuperNodes online (a stopped one goes offline
    when it says goodbye, or when its heartbeats stop)."""
    deadline = time.monotonic() + timeout
    online = []
    while time.monotonic() < deadline:
        online = [n for n in dep.list_supernodes() if n["status"] == "online"]
        if len(online) == count:
            return
        time.sleep(1)
    raise AssertionError(f"{len(online)} SuperNodes online after {timeout:.0f} s, not {count}")


def dumped(dep, group, rnd, stage):
    return load_file(dep.dump / f"g{group}_r{rnd}_{stage}.safetensors")


def initial_global():
    model = build_model("tiny", 257, SEED, SEQ)
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def test_flower_transport_groups_hold_the_exact_global_model(deployment, tmp_path):
    rounds = run(
        deployment,
        tmp_path,
        transport="flower",
        **{"outer-optimizer": "nesterov", P.TENSORBOARD: True},
    )
    assert [r["groups_ok"] for r in rounds] == [2, 2]
    # Each node served every message from one warm ClientApp process, and it is still up.
    pids = [[g["clientapp_pid"] for g in r["groups"]] for r in rounds]
    assert pids[0] == pids[1] and len(set(pids[0])) == 2, pids
    for pid in pids[0]:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert b"flower_shard.flower.node.warm_superexec" in cmdline
    assert_tensorboard_is_metrics(tmp_path)  # the ServerApp's rounds, as TensorBoard scalars
    assert all(r["exchange_bytes"] > 0 and r["eval_ppl"] > 0 for r in rounds)

    # Reference: token-weighted mean in float64, then DiLoCo's Nesterov step in plain torch.
    expected = initial_global()
    names = list(expected)
    weights = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in expected.items()}
    sgd = torch.optim.SGD(weights.values(), lr=0.7, momentum=0.9, nesterov=True, foreach=False)
    tokens = T * BATCH * SEQ * 2  # each group: T steps x batch x seq_len x K ranks
    for rnd in range(1, ROUNDS + 1):
        for g in (0, 1):  # every group started the round from exactly the global model
            loaded = dumped(deployment, g, rnd, "loaded")
            for k in names:
                assert np.array_equal(loaded[k], expected[k]), f"round {rnd} group {g}: {k}"
        trained = [dumped(deployment, g, rnd, "trained") for g in (0, 1)]
        assert not np.array_equal(trained[0][names[0]], trained[1][names[0]])
        for k in names:
            mean = (
                (
                    tokens * trained[0][k].astype(np.float64)
                    + tokens * trained[1][k].astype(np.float64)
                )
                / (2 * tokens)
            ).astype(np.float32)
            weights[k].grad = weights[k].detach() - torch.from_numpy(mean)
        sgd.step()
        expected = {k: w.detach().numpy().copy() for k, w in weights.items()}
    final = load_file(tmp_path / "final_model.safetensors")
    for k in names:
        assert np.array_equal(final[k], expected[k]), k
    assert rounds[-1]["tokens"] == ROUNDS * 2 * tokens


def test_flower_transport_int8_deltas_with_error_feedback(deployment, tmp_path):
    """Groups send int8 pseudo-gradients (global - trained) with error feedback; the server
    applies the token-weighted mean of the decoded deltas. Rebuilt here from the dumps. Round 3
    spoils one group's weights (NaN): its payload is refused and the round goes on."""
    from flower_shard.flower.wire import flatten, unflatten
    from flower_shard.runtime import compression as Z

    chunk, rounds_n = 256, 3
    deployment.fault.write_text(f"{rounds_n}:nan")
    try:
        rounds = run(
            deployment,
            tmp_path,
            transport="flower",
            compression="int8",
            **{"compression-chunk": chunk, P.NUM_SERVER_ROUNDS: rounds_n},
        )
    finally:
        deployment.fault.unlink()
    assert [r["groups_ok"] for r in rounds] == [2, 2, 1]
    assert "non-finite" in " ".join(rounds[-1]["rejected"])
    glob = initial_global()
    order = sorted(glob)
    numel = sum(v.size for v in glob.values())
    # What one group sends: numel int8 values and one float32 scale per chunk, plus Flower's
    # framing (each array is an .npy blob with its header), against 4 bytes per value.
    payload = Z.payload_bytes("int8", numel, chunk)
    assert payload <= rounds[0]["outer_sync_bytes"] < payload + 512
    tokens = T * BATCH * SEQ * 2
    residual = [torch.zeros(numel), torch.zeros(numel)]
    candidates = None
    for rnd in range(1, rounds_n + 1):
        for g in (0, 1):
            loaded = dumped(deployment, g, rnd, "loaded")
            assert all(np.array_equal(loaded[k], glob[k]) for k in order), f"round {rnd} g{g}"
        w = flatten(glob, order)
        decoded = []
        for g in (0, 1):
            target = (w - flatten(dumped(deployment, g, rnd, "trained"), order)) + residual[g]
            decoded.append(Z.decompress(Z.compress(target, "int8", chunk), "int8", chunk))
            residual[g] = target - decoded[g]
        if rnd == rounds_n:  # one group was refused: the mean is the other group's delta
            candidates = [unflatten(w - d, glob, order) for d in decoded]
            break
        d64 = [d.numpy().astype(np.float64) for d in decoded]
        mean = ((tokens * d64[0] + tokens * d64[1]) / (2 * tokens)).astype(np.float32)
        glob = unflatten(w - torch.from_numpy(mean), glob, order)
    final = load_file(tmp_path / "final_model.safetensors")
    assert any(all(np.array_equal(final[k], c[k]) for k in order) for c in candidates)


def test_flower_transport_int8_downlink_groups_hold_exactly_what_the_server_sent(
    deployment, tmp_path
):
    """downlink-compression int8: round 1 sends a float32 snapshot, later rounds the int8
    change of the model the groups hold. Rebuilt here from the dumps: each round both groups
    load exactly the server's held model (the previous one plus the decoded change of
    ``global - held``), fedavg's new global model is ``global - (held - mean)``, and rounds
    after the first move a quarter of the bytes to the groups."""
    from flower_shard.flower.wire import pack, unflatten_flat
    from flower_shard.runtime import compression as Z

    chunk, rounds_n = 256, 3
    rounds = run(
        deployment,
        tmp_path,
        transport="flower",
        **{"downlink-compression": "int8", "compression-chunk": chunk},
        **{P.NUM_SERVER_ROUNDS: rounds_n},
    )
    assert [r["groups_ok"] for r in rounds] == [2] * rounds_n
    glob = initial_global()
    spec = {k: (v.shape, "") for k, v in glob.items()}
    names = sorted(glob)
    held = torch.from_numpy(pack(glob))
    world = torch.from_numpy(pack(glob))  # the server's global model, flat, sorted names
    for rnd in range(1, rounds_n + 1):
        payload = Z.compress(world - held, "int8", chunk)
        held = held + Z.decompress(payload, "int8", chunk)
        want = unflatten_flat(held.numpy(), spec, names)
        for g in (0, 1):
            loaded = dumped(deployment, g, rnd, "loaded")
            assert all(np.array_equal(loaded[k], want[k]) for k in names), f"round {rnd} g{g}"
        trained = [pack(dumped(deployment, g, rnd, "trained")).astype(np.float64) for g in (0, 1)]
        mean = torch.from_numpy(((trained[0] + trained[1]) / 2).astype(np.float32))
        world = world - (held - mean)
    numel = held.numel()
    saved = 2 * (4 * numel - Z.payload_bytes("int8", numel, chunk))  # two groups' downlinks
    assert abs((rounds[0]["exchange_bytes"] - rounds[1]["exchange_bytes"]) - saved) < 4096


def test_adaptive_t_sends_each_round_its_t_within_the_step_budget(deployment, tmp_path):
    """A target no exchange meets (0.1 % of the round): T doubles every round; the groups run
    exactly the steps they are sent, and the budget (7 rounds x 1 step) ends the run."""
    rounds = run(
        deployment,
        tmp_path,
        transport="flower",
        **{
            P.LOCAL_STEPS: 1,
            P.NUM_SERVER_ROUNDS: 7,
            "adaptive-t": True,
            "exchange-share": 0.001,
            "eval-every": 0,
        },
    )
    assert [r["local_steps"] for r in rounds] == [1, 2, 4]
    assert [r["step"] for r in rounds] == [1, 3, 7]
    per_step = BATCH * SEQ * 2 * 2  # batch x seq_len x K ranks x 2 groups
    assert [r["tokens"] for r in rounds] == [per_step * s for s in (1, 3, 7)]


def test_time_budgeted_rounds_with_groups_of_different_sizes(tmp_path):
    """Groups of K = 2 and K = 1 in one federation, each round 1.5 s of training per group:
    every group reports the steps that fit and the tokens they made (steps x batch x seq x K),
    and the global model is exactly their token-weighted mean (rebuilt from the dumps)."""
    dump = tmp_path / "dump"
    dump.mkdir()
    budget, cap = 1.5, 500
    with LocalDeployment(
        tmp_path / "dep", num_nodes=2, nproc_per_group=[2, 1], dump_dir=str(dump)
    ) as dep:
        dep.dump = dump
        rounds = run(
            dep,
            tmp_path / "out",
            transport="flower",
            **{P.ROUND_SECONDS: budget, "max-local-steps": cap, "eval-every": 0},
        )
    assert [r["round"] for r in rounds] == [1, 2]  # num-server-rounds rounds, not a step budget
    # The LR follows the run's time: after round 1 of 2 the groups are about half-way through
    # the cosine (x0.78 at the start of their last step), not at its floor (x0.1), where
    # their own step counts (far past the nominal 2 x 2 steps) would put them.
    assert rounds[0]["lr"] > 0.5 * 3e-3
    expected = initial_global()
    for rnd, record in zip((1, 2), rounds):
        groups = record["groups"]
        assert [g["group"] for g in groups] == [0, 1]
        sizes = sorted(g["tokens"] // (g["steps"] * BATCH * SEQ) for g in groups)
        assert sizes == [1, 2]  # one group of each size took part
        for g in groups:
            assert g["tokens"] % (g["steps"] * BATCH * SEQ) == 0
            assert 1 <= g["steps"] < cap and g["compute_s"] >= budget  # stopped by the clock
        assert record["tokens"] == sum(g["tokens"] for r in rounds[:rnd] for g in r["groups"])
        assert record["step"] == sum(max(g["steps"] for g in r["groups"]) for r in rounds[:rnd])
        for g in (0, 1):
            loaded = dumped(dep, g, rnd, "loaded")
            assert all(np.array_equal(loaded[k], expected[k]) for k in expected), (rnd, g)
        trained = [dumped(dep, g, rnd, "trained") for g in (0, 1)]
        tokens = [g["tokens"] for g in groups]
        expected = {
            k: (
                (
                    tokens[0] * trained[0][k].astype(np.float64)
                    + tokens[1] * trained[1][k].astype(np.float64)
                )
                / sum(tokens)
            ).astype(np.float32)
            for k in expected
        }
    final = load_file(tmp_path / "out" / "final_model.safetensors")
    assert all(np.array_equal(final[k], expected[k]) for k in expected)


def test_collective_transport_averages_shards_without_flower(deployment, tmp_path):
    rounds = run(deployment, tmp_path, transport="collective")
    assert [r["exchange_bytes"] for r in rounds] == [0, 0]  # no weights through Flower
    assert [r["groups_ok"] for r in rounds] == [2, 2]
    assert all(r["outer_sync_bytes"] > 0 and r["eval_ppl"] > 0 for r in rounds)
    for rnd in range(1, ROUNDS + 1):
        trained = [dumped(deployment, g, rnd, "trained") for g in (0, 1)]
        synced = [dumped(deployment, g, rnd, "synced") for g in (0, 1)]
        assert not np.array_equal(*(t[next(iter(t))] for t in trained))
        for k in trained[0]:
            mean = (trained[0][k] + trained[1][k]) / np.float32(2)
            assert np.array_equal(synced[0][k], mean) and np.array_equal(synced[1][k], mean), k
    # The final model, fetched from a group at the end (one QUERY message), is the last sync.
    final = load_file(tmp_path / "final_model.safetensors")
    assert sorted(final) == sorted(synced[0])
    assert all(np.array_equal(final[k], synced[0][k]) for k in final)


def test_malformed_weights_from_a_group_are_rejected_by_name(deployment, tmp_path):
    """The group's own fault injection, through the whole path: round 1 its reply has no
    weights at all, round 2 an array the model does not have. Each round goes on with the
    other group, whose weights become the global model."""
    wait_until_online(deployment, 2)  # this deployment's two nodes, and no other
    deployment.fault.write_text("1:missing,2:extra")
    try:
        rounds = run(deployment, tmp_path, transport="flower", **{"eval-every": 0})
    finally:
        deployment.fault.unlink()
    assert [r["groups_ok"] for r in rounds] == [1, 1]
    assert [r["groups_rejected"] for r in rounds] == [1, 1]
    assert "no 'arrays' record" in rounds[0]["rejected"][0], rounds[0]["rejected"]
    assert "unexpected arrays ['injected.extra']" in rounds[1]["rejected"][0]
    # The good group (its index follows the node ids' order) made the global model.
    (good,) = {g["group"] for r in rounds for g in r["groups"]}
    trained = dumped(deployment, good, ROUNDS, "trained")
    final = load_file(tmp_path / "final_model.safetensors")
    assert all(np.array_equal(final[k], trained[k]) for k in trained)  # fedavg of one group


def test_reply_wait_is_the_wait_for_the_training_replies(deployment, tmp_path):
    """Collective transport, evaluated by the groups every round: the round's push and reply
    wait are its training exchange's, which holds each group's whole round (at least its
    1.5 s of training); the evaluation's exchange, later in the round, is timed apart."""
    budget = 1.5
    rounds = run(
        deployment,
        tmp_path,
        transport="collective",
        **{P.ROUND_SECONDS: budget, "max-local-steps": 500, "eval-every": 1},
    )
    for r in rounds:
        assert r["compute_s"] >= budget and r["group_round_s"] >= r["compute_s"]
        assert r["push_s"] + r["reply_wait_s"] >= r["group_round_s"], r
        assert r["push_s"] + r["reply_wait_s"] + r["eval_s"] <= r["round_s"], r
        assert r["eval_loss"] > 0


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_node_stopped_with_sigterm_leaves_no_process(deployment, tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flower_shard.ux.cli",
            "node",
            "--superlink",
            deployment.address,
            "--nproc-per-group",
            "2",
            "--work-dir",
            str(tmp_path / "node"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=deployment.env(),
    )
    try:
        lines = [proc.stdout.readline() for _ in range(2)]  # where its work dir is, then up
        assert "flower-shard node: work dir" in lines[0], lines
        assert "flower-shard node: group of 2" in lines[1], lines
        # A round through this node first: what serves its messages must go too.
        rounds = run(deployment, tmp_path / "out", **{P.NUM_SERVER_ROUNDS: 1, P.MIN_GROUPS: 3})
        assert rounds[0]["groups_ok"] == 3
        tree = descendants(proc.pid)
        assert len(tree) >= 5  # torchrun, 2 ranks, flower-supernode, its warm SuperExec
        served = {g["clientapp_pid"] for g in rounds[0]["groups"]}
        assert served & set(tree), (served, tree)  # this node's ClientApp process is in it
        # The group's control socket is private to this user.
        assert (tmp_path / "node").stat().st_mode & 0o077 == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while any(running(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in tree if running(p)], "processes left behind"


REFUSED_TASK = """
import sys
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor.types import ExecutionSpec
from flower_shard.flower.node.warm_superexec import WarmClientAppExecutor

spec = ExecutionSpec(
    task_type=TaskType.CLIENT_APP, runtime_api_address=sys.argv[1], token="not-a-task-token",
    insecure=True, root_certificates_path=None, runtime_dependency_install=False,
    parent_pid=None, suppress_output=False, task_id=1,
)
WarmClientAppExecutor()._run_task(spec)
print("still serving")
"""


def test_warm_clientapp_outlives_a_refused_task_and_is_restarted_if_it_dies(deployment, tmp_path):
    # A task whose token the SuperNode refuses (expired, or its run stopped): Flower's own
    # client would SIGINT the process, taking every later task of the node down with it.
    node = deployment.nodes[0]
    refused = subprocess.run(
        [sys.executable, "-c", REFUSED_TASK, f"127.0.0.1:{node.port}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 0 and "still serving" in refused.stdout, refused.stderr[-2000:]
    assert "ClientApp task 1 failed" in refused.stderr

    # The warm process itself killed: the node starts another and serves the next run.
    # Both groups in the round (a node that an earlier test restarted may still be joining).
    before = run(deployment, tmp_path / "a", **{P.NUM_SERVER_ROUNDS: 1, P.MIN_GROUPS: 2})
    pids = [g["clientapp_pid"] for g in before[0]["groups"]]  # group indices may shift
    assert len(set(pids)) == 2, before[0]
    os.kill(pids[0], signal.SIGKILL)
    after = run(deployment, tmp_path / "b", **{P.NUM_SERVER_ROUNDS: 1, P.MIN_GROUPS: 2})
    assert after[0]["groups_ok"] == 2
    new = {g["clientapp_pid"] for g in after[0]["groups"]}
    assert pids[0] not in new and pids[1] in new, (pids, new)
    (started,) = new - {pids[1]}
    cmdline = Path(f"/proc/{started}/cmdline").read_bytes()
    assert b"flower_shard.flower.node.warm_superexec" in cmdline


def test_client_app_without_a_group_fails_fast_with_a_clear_error(tmp_path):
    from flower_shard.flower.client.group_client import GroupClient, GroupUnavailable

    start = time.monotonic()
    with pytest.raises(GroupUnavailable, match="no flower-shard group answers.*waited 2 s"):
        GroupClient(f"unix:{tmp_path}/missing.sock", connect_timeout=2).call(P.TRAIN, {})
    assert time.monotonic() - start < 10
    # In a directory no node made, nothing will ever listen: it says so without waiting.
    for address in (f"unix:{tmp_path}/nowhere/group.sock", f"unix://{tmp_path}/nowhere/g.sock"):
        with pytest.raises(GroupUnavailable, match=f"the directory {tmp_path}/nowhere does not"):
            GroupClient(address, connect_timeout=600).call(P.TRAIN, {})


def test_client_app_stays_torch_free():
    """Stock Flower starts a ClientApp per message: it must load in a moment, without torch."""
    probe = (
        "import sys, flower_shard.flower.client.client_app\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "[]", proc.stdout


def test_bad_run_config_fails_with_one_line():
    from flower_shard.config import ConfigError
    from flower_shard.config.federation import FederationConfig
    from flower_shard.preflight import check_federation

    for bad, message in (
        ({"transport": "carrier-pigeon"}, "transport"),
        ({"local-steps": 0}, "--local-steps"),
        ({"lcoal-steps": 3}, "unknown run-config keys"),
        ({"collective-address": "nowhere"}, "HOST:PORT"),
        ({"sync-timeout": 0}, "sync-timeout"),
        ({"checkpoint-every": -1}, "--checkpoint-every"),
        ({"resume": "/nonexistent/run"}, "no checkpoints/ there"),
        ({"outlier-factor": -1}, "outlier-factor"),
        ({"aggregation": "median"}, "aggregation"),
        ({"round-seconds": -1.0}, "round-seconds must be >= 0"),
        ({"round-seconds": float("nan")}, "round-seconds must be >= 0"),
        ({"round-seconds": 5.0, "adaptive-t": True}, "set one of them"),
        ({"round-seconds": 700.0}, "below round-timeout"),
        ({"transport": "collective", "downlink-compression": "int8"}, "sends no global model"),
    ):
        with pytest.raises(ConfigError, match=message):
            check_federation(FederationConfig.from_run_config(bad))
    assert json.dumps(FederationConfig.from_run_config({}).group_config())


# (The streaming transport only: the simulation launcher is the same for every transport, and
# the flower transport's exact mean is checked through a real deployment above. CI time.)
@pytest.mark.parametrize("transport", [P.STREAMING])
def test_simulation_mode_drives_real_groups(tmp_path, transport):
    """Simulation (virtual clients, one real group each): round 2 starts from the FedAvg of
    round 1's groups; exactly the float64 mean rounded (flower), or within 3e-6 of it
    (streaming: the aggregators fold into a float32 accumulator). Streaming runs here without
    the pipelined commit: upload, commit, download (tests/test_streaming.py: pipelined)."""
    from flower_shard.launch.simulation import simulate

    dump = tmp_path / "dump"
    dump.mkdir()
    config = {
        P.NUM_SERVER_ROUNDS: ROUNDS,
        P.LOCAL_STEPS: T,
        P.OUT_DIR: str(tmp_path / "out"),
        P.MIN_GROUPS: 2,
        "model": "tiny",
        "seq-len": SEQ,
        "batch-size": BATCH,
        "seed": SEED,
        "eval-sequences": 8,
        P.TRANSPORT: transport,
        "dataplane-insecure": transport == P.STREAMING,  # loopback, on purpose
        "pipelined-commit": False,
    }
    summary = simulate(
        tmp_path / "work", config, groups=2, nproc_per_group=2, dump_dir=str(dump), timeout=600
    )
    assert summary["status"] == "ok"
    rounds = read_metrics(tmp_path / "out")
    assert [r["groups_ok"] for r in rounds] == [2, 2]
    # Round 2 starts from the exact FedAvg of round 1's two groups.
    trained = [load_file(dump / f"g{g}_r1_trained.safetensors") for g in (0, 1)]
    for g in (0, 1):
        loaded = load_file(dump / f"g{g}_r2_loaded.safetensors")
        for k, v in loaded.items():
            mean = (trained[0][k].astype(np.float64) + trained[1][k].astype(np.float64)) / 2
            if transport == P.FLOWER:
                assert np.array_equal(v, mean.astype(np.float32)), k
            else:  # as tests/test_streaming.py bounds the float32 fold
                np.testing.assert_allclose(v, mean, rtol=0, atol=3e-6, err_msg=k)
    if transport == P.STREAMING:  # every commit folded the spools: nothing was pipelined
        logs = [f.read_text() for f in (tmp_path / "out" / "aggregators").glob("agg*.log")]
        assert logs and all(
            re.findall(r"round \d+: committed .*", text)
            == [f"round {r}: committed groups [0, 1], folded from the spools" for r in (1, 2)]
            for text in logs
        ), logs


def test_poisoned_and_missing_groups_are_rejected_and_the_round_goes_on(deployment, tmp_path):
    """Round 1: NaN; round 2: a wrong shape; round 3: weights x 1e6 (a norm outlier).

    The module's last run on its deployment: the stopped ghost can stay online at the
    SuperLink until its heartbeats are missed (up to about a minute here, seen after its
    "terminated gracefully"), and a run started before that would wait for it. (The next
    test starts and stops a node, and runs nothing; the one it stops lingers the same way.)"""
    wait_until_online(deployment, 2)  # no node an earlier test stopped is still counted
    deployment.fault.write_text("1:nan,2:shape,3:huge")
    # A third SuperNode whose group does not exist: its ClientApp must answer with an error.
    # (The node's own SuperNode, warm ClientApp and all: Flower's cold ClientApp process per
    # message costs seconds each round on a small machine, and answers the same.)
    ghost_dir = tmp_path / "ghost"
    ghost_dir.mkdir()
    from flower_shard.launch.processes import ManagedProcess

    ghost = ManagedProcess(
        "ghost",
        [
            sys.executable,
            "-m",
            "flower_shard.flower.node.fast_supernode",
            "--insecure",
            "--superlink",
            deployment.address,
            "--port",
            str(free_port()),
            "--node-config",
            f"{P.GROUP_ADDRESS}='unix:{ghost_dir}/no-node-here/nobody.sock'",  # fails at once
        ],
        ghost_dir / "supernode.log",
        deployment.env(),
        cwd=ghost_dir,
    )
    try:
        deadline = time.monotonic() + 60
        while "SuperNode ID" not in ghost.tail(100) and time.monotonic() < deadline:
            time.sleep(0.2)
        rounds = run(
            deployment,
            tmp_path,
            transport="flower",
            **{P.ROUND_TIMEOUT: 120.0, P.NUM_SERVER_ROUNDS: 3},
        )
    finally:
        ghost.stop()
        deployment.fault.unlink()
    assert len(rounds) == 3
    for r, bad in zip(rounds, ("non-finite", "shape", "update norm")):
        assert r["groups_ok"] == 1 and r["groups_rejected"] == 2, r
        reasons = " | ".join(r["rejected"])
        assert bad in reasons, reasons
        assert "no flower-shard group answers" in reasons, reasons
        assert np.isfinite(r["train_loss"]) and np.isfinite(r["eval_ppl"])
    final = load_file(tmp_path / "final_model.safetensors")
    assert all(np.isfinite(v).all() for v in final.values())


def test_node_moves_to_another_port_when_its_supernode_port_is_taken(deployment, tmp_path):
    from flower_shard.flower.node.launcher import Node, NodeConfig

    node = Node(
        NodeConfig(superlink=deployment.address, nproc_per_group=1, work_dir=str(tmp_path / "node"))
    )
    taken = node.port
    blocker = socket.create_server(("127.0.0.1", taken))
    try:
        node.start()
        assert node.port != taken and node.dead() is None
    finally:
        node.stop()
        blocker.close()
