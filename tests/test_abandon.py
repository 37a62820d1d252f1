"""A dead run's cross-group sync is given up as soon as a newer run's command arrives.

Real gloo process groups under torchrun, a real rendezvous store: group A waits for a peer group
that never comes (at the rendezvous) with a 120 s timeout; the
abandon flag ends the wait in about the flag's 2 s, and the group rolls back bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from conftest import torchrun

from flower_shard import protocol as P
from flower_shard.flower.group.service import supersedes


@pytest.mark.parametrize("mode,ranks", [("rendezvous", 2)])  # allreduce: see the issue note
def test_a_waiting_sync_is_abandoned_and_rolled_back(tmp_path, mode, ranks):
    torchrun("abandon_check.py", ranks, mode, tmp_path, timeout=100)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"a{rank}.pt")
        assert r["failure"] is not None and "SyncAbandoned" in r["failure"], r["failure"]
        assert 1.5 < r["seconds"] < 30, r["seconds"]  # the flag came at 2 s; the timeout is 120
        for k, v in r["before"].items():
            assert torch.equal(r["after"][k], v), k


def run(run_id, resume_round=0):
    return {P.RUN_ID: run_id, P.RESUME_ROUND: resume_round}


@pytest.mark.parametrize(
    "new,running,expected",
    [
        (run(2, 2), run(1, 0), True),  # the resumed run supersedes the run it resumed
        (run(3, 4), run(2, 2), True),  # and a resumed run resumed again
        (run(1, 0), run(2, 2), False),  # a late message of the dead run never does
        (run(1, 0), run(1, 0), False),  # nor does the same run
        (run(2, 0), run(1, 0), False),  # nor another run that resumes nothing
        (run(2, "x"), run(1, 0), False),  # nor a malformed one
        (run(2, [3]), run(1, 0), False),
    ],
)
def test_only_a_run_that_resumes_later_supersedes(new, running, expected):
    assert supersedes(new, running) is expected
