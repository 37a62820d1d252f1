"""The ServerApp's commands to an aggregator (JSON over the ``Control`` call).

Every command carries the control token (:func:`~.tickets.control_token` of the run secret);
anything else is refused. ``configure`` gives the aggregator its part of the model (layout,
index, compression, outer optimizer, and how to build the first global weights); ``begin``
opens a round for uploads; ``expect`` names the groups the round was sent to (the pipelined
commit, :mod:`.pipeline`); ``status`` says which groups completed their upload, with what
weight and squared norm (the ServerApp checks them against the groups' Flower replies);
``commit`` folds the accepted groups and takes the outer step (and says whether it kept the
pipelined fold; ``unkeep`` makes an aggregator that kept it answer like one that did not);
``save`` / ``load`` checkpoint
the aggregator's state; ``shutdown`` stops it.
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path

from flower_shard.dataplane import tickets
from flower_shard.dataplane.layout import Layout

log = logging.getLogger(__name__)


class Refused(Exception):
    """A control call without the right token."""


def handle(service, cmd: dict) -> dict:
    """Run one command on ``service`` (a :class:`~.aggregator.DataPlaneService`)."""
    if not hmac.compare_digest(str(cmd.get("token", "")), tickets.control_token(service.secret)):
        raise Refused("a control call without the run's control token")
    op = cmd.get("op")
    if op == "ping":
        return {"ok": True, "configured": service.state is not None}
    if op == "configure":
        return _configure(service, cmd)
    if service.state is None:
        return {"ok": False, "reason": f"{op!r} before configure"}
    state = service.state
    if op == "begin":
        state.begin(int(cmd["round"]))
        return {"ok": True}
    if op == "expect":
        cap = cmd.get("max_weight")
        groups = [int(g) for g in cmd["groups"]]
        state.expect(int(cmd["round"]), groups, None if cap is None else float(cap))
        return {"ok": True}
    if op == "status":
        return {"ok": True, "groups": {str(g): s for g, s in state.status().items()}}
    if op == "commit":
        accepted = {int(g): float(w) for g, w in cmd["accepted"].items()}
        return {"ok": True, **state.commit(int(cmd["round"]), accepted)}
    if op == "unkeep":
        with state._lock:
            state.pipe.unkeep(int(cmd["round"]))
        return {"ok": True}
    if op == "save":
        from flower_shard.dataplane.persist import save

        save(state, Path(cmd["dir"]))
        return {"ok": True}
    if op == "load":
        from flower_shard.dataplane.persist import load

        load(state, Path(cmd["dir"]))
        return {"ok": True, "round": state.round}
    if op == "shutdown":
        service.stopped.set()
        return {"ok": True}
    return {"ok": False, "reason": f"unknown command {op!r}"}


def _configure(service, cmd: dict) -> dict:
    from flower_shard.dataplane.init import initial_weights
    from flower_shard.dataplane.state import AggregatorState

    layout = Layout.from_json(cmd["layout"])
    index = int(cmd["index"])
    owned = layout.owned(index)
    initial = initial_weights(cmd["init"], owned)
    service.state = AggregatorState(
        layout,
        index,
        initial,
        service.work_dir / "spool",
        uplink=str(cmd["uplink"]),
        downlink=str(cmd["downlink"]),
        scale_chunk=int(cmd["scale_chunk"]),
        outer=str(cmd["outer"]),
        outer_lr=float(cmd["outer_lr"]),
        outer_momentum=float(cmd["outer_momentum"]),
        follow_timeout=float(cmd.get("follow_timeout", 600.0)),
    )
    service.run = str(cmd["run"])
    log.info("aggregator %d of %d: %d parameters", index, layout.aggregators, len(owned))
    return {"ok": True, "numel": service.state.numel}
