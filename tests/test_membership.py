"""Data partitions that stay put when groups join and leave (server side, pure), and a real
deployment where a group dies and comes back and a new node joins mid-run."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from safetensors.numpy import load_file

from flower_shard import protocol as P
from flower_shard import runfiles as F
from flower_shard.config import ConfigError
from flower_shard.config.federation import FederationConfig
from flower_shard.errors import CheckpointError
from flower_shard.flower.server.membership import DataSlots
from flower_shard.launch.deployment import LocalDeployment
from flower_shard.ux.metrics import read_metrics


def test_the_first_round_numbers_the_nodes_in_order_and_fixes_p():
    slots = DataSlots()
    assert slots.assign([30, 10, 20], 1) == {30: 2, 10: 0, 20: 1}
    assert slots.partitions == 3


def test_a_slot_is_kept_while_others_leave_and_join():
    slots = DataSlots(4)
    assert slots.assign([10, 20], 1) == {10: 0, 20: 1}
    assert slots.assign([20], 2) == {20: 1}  # 10 away: 20 keeps its part
    assert slots.assign([5, 20], 3) == {5: 2, 20: 1}  # a new node, lower id: a free part
    assert slots.assign([5, 10, 20], 4) == {5: 2, 10: 0, 20: 1}  # 10 is back on its own part
    assert slots.assign([5, 10, 20], 4) == {5: 2, 10: 0, 20: 1}  # the same answer twice


def test_with_every_part_given_out_a_new_node_takes_that_of_the_node_away_longest():
    slots = DataSlots(3)
    slots.assign([1, 2, 3], 1)
    slots.assign([2, 3], 2)  # 1 last seen in round 1
    slots.assign([3], 3)  # 2 last seen in round 2
    assert slots.assign([3, 9], 4) == {3: 2, 9: 0}  # 1 was away longest
    assert slots.assign([1, 3, 9], 5) == {1: 1, 3: 2, 9: 0}  # 1 back: takes 2's (away)


def test_with_every_part_held_by_a_connected_node_a_new_one_waits():
    slots = DataSlots(2)
    slots.assign([1, 2], 1)
    assert slots.assign([1, 2, 3], 2) == {1: 0, 2: 1}
    assert slots.assign([1, 3], 3) == {1: 0, 3: 1}  # 2 left: 3 gets its part


def test_the_state_round_trips_and_an_edited_one_is_refused():
    slots = DataSlots(3)
    slots.assign([7, 8], 1)
    again = DataSlots.from_state(slots.state_dict())
    assert again == slots
    assert again.assign([7, 8, 9], 2) == {7: 0, 8: 1, 9: 2}
    assert DataSlots.from_state(None, 5) == DataSlots(5)
    bad = [
        {"partitions": 2, "slots": {"7": 0, "8": 0}, "seen": {}},  # one part, two nodes
        {"partitions": 2, "slots": {"7": 5}, "seen": {}},  # out of range
        {"partitions": 0, "slots": {}, "seen": {}},
        {"partitions": 2, "slots": ["7"], "seen": {}},
        {"partitions": "x", "slots": {}, "seen": {}},
        {"slots": {}},
    ]
    for state in bad:
        with pytest.raises(CheckpointError, match="data slots"):
            DataSlots.from_state(state)


def test_data_partitions_below_min_groups_is_refused():
    with pytest.raises(ConfigError, match="data-partitions 2 < min-groups 3"):
        FederationConfig(data_partitions=2, min_groups=3).validate()
    FederationConfig(data_partitions=3, min_groups=3).validate()
    FederationConfig(data_partitions=0, min_groups=3).validate()


def test_groups_that_die_come_back_and_join_keep_their_data_and_the_mean_is_exact(tmp_path):
    """Two nodes of one rank; after round 1 the second node's group is killed (SIGKILL) and its
    node restarts it; after round 3 a third node joins. Every round's global model is exactly
    the token-weighted mean of that round's valid groups; every group that trains a round
    (the restarted one, the new one) starts it from exactly the global model; the groups keep
    their partitions: the new node gets the third, the first group never rebuilds its runtime
    and keeps one checkpoint folder (its key names the partition), the restarted group finds
    its own checkpoints. The rounds are time-budgeted (1 s) so that the run outlasts the
    restart and the join on a slow machine."""
    dump = tmp_path / "dump"
    dump.mkdir()
    rounds_total = 10
    with LocalDeployment(
        tmp_path / "dep", num_nodes=2, nproc_per_group=1, dump_dir=str(dump)
    ) as dep:
        joiner = dep.add_node(1, connect=False)  # its group ready; its SuperNode joins later
        victim = dep.nodes[1]
        events = []

        def on_round(record: dict) -> None:
            if record["round"] == 1:
                for pid in victim.rank_pids():
                    os.kill(pid, signal.SIGKILL)
                events.append("killed")
            elif record["round"] == 3:
                joiner.start_supernode()
                events.append("joined")

        config = {
            P.NUM_SERVER_ROUNDS: rounds_total,
            P.ROUND_SECONDS: 1.0,
            P.OUT_DIR: str(tmp_path / "out"),
            P.MIN_GROUPS: 1,
            P.DATA_PARTITIONS: 3,
            "model": "tiny",
            "seq-len": 32,
            "batch-size": 2,
            "checkpoint-every": 1,
            "eval-every": 0,
        }
        summary = dep.run(config, timeout=600, on_round=on_round)
        logs = [(n.work_dir / F.GROUP_LOG).read_text() for n in dep.nodes]
        checkpoint_roots = [list((n.work_dir / F.CHECKPOINTS_DIR).iterdir()) for n in dep.nodes]
    assert summary["status"] == "ok" and events == ["killed", "joined"]
    records = read_metrics(tmp_path / "out")
    assert [r["round"] for r in records] == list(range(1, rounds_total + 1))
    groups = [[g["group"] for g in r["groups"]] for r in records]
    assert groups[0] == [0, 1]
    assert victim.restarts == 1, (victim.restarts, groups)
    assert all(2 not in g for g in groups[:3]), groups  # the joiner came after round 3
    assert groups[-1] == [0, 1, 2], groups  # both back by the end, the joiner on partition 2

    def dumped(g, rnd, stage):
        return load_file(dump / f"g{g}_r{rnd}_{stage}.safetensors")

    final = load_file(tmp_path / "out" / "final_model.safetensors")
    made = {r: dumped(0, r + 1, "loaded") for r in range(1, rounds_total)} | {rounds_total: final}
    for rnd, record in enumerate(records, start=1):
        shares = record["groups"]
        trained = [dumped(s["group"], rnd, "trained") for s in shares]
        tokens = [s["tokens"] for s in shares]
        for k in final:
            mean = sum(t * m[k].astype(np.float64) for t, m in zip(tokens, trained)) / sum(tokens)
            assert np.array_equal(made[rnd][k], mean.astype(np.float32)), (rnd, k)
        for g in groups[rnd - 1] if rnd > 1 else ():  # each started from the last round's model
            loaded = dumped(g, rnd, "loaded")
            assert all(np.array_equal(loaded[k], made[rnd - 1][k]) for k in final), (rnd, g)
    # The partitions stayed put: no group rebuilt its runtime for another partition count.
    assert "no checkpoint to load" not in logs[0]
    assert "rejoined round" in logs[1] and "checkpoint of round" in logs[1]
    assert [len(roots) for roots in checkpoint_roots] == [1, 1, 1]
