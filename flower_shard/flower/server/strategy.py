"""ShardedFedAvg: FedAvg where a client is a whole FSDP/HSDP group and a round is T local steps."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from flower_shard import protocol as P
from flower_shard.config.federation import FederationConfig
from flower_shard.flower.server.aggregation import (
    check_arrays,
    check_weight,
    norm_outliers,
    trimmed_mean,
    update_norms,
    weighted_mean,
)
from flower_shard.flower.wire import describe, flatten, pack, unflatten, unflatten_flat, unpack
from flower_shard.planning.adaptive import AdaptiveT
from flower_shard.runtime import compression as Z
from flower_shard.runtime.evaluation import perplexity


class ShardedFedAvg(FedAvg):
    """FedAvg over FSDP/HSDP groups, one round = T local steps, with an outer optimizer.

    Each round, every connected node (one group each, indexed by sorted node id) gets the run
    config with ``local-steps`` = T and its ``group-index``; with ``transport=flower`` also the
    global weights. Replies are validated one by one (error replies, missing or extra arrays,
    shapes, dtypes, non-finite values, the ``num-tokens`` weight): a bad reply is rejected with
    its reason in the log and in the round's metrics, and the round goes on with the others.
    With at least ``min-groups`` valid replies, the token-weighted mean of the groups' weights
    goes through the outer optimizer (the group runtime's own
    :class:`~flower_shard.runtime.outer_sync.OuterOptimizer`: ``fedavg`` or DiLoCo's
    ``nesterov``) to give the next global weights; with fewer, the global weights stay as they were.

    With ``transport=collective`` the messages carry configuration only: the groups average
    their shards among themselves over a cross-group process group (rendezvous at
    ``collective-address`` under a fresh prefix per round) and reply with metrics; the strategy
    keeps rounds, membership, metrics and evaluation.

    The strategy pushes and pulls messages itself with a short poll (``poll-interval``)
    instead of ``Grid.send_and_receive``, which sleeps 3 s between pulls.
    """

    def __init__(self, fed: FederationConfig, *, on_round: Callable[[dict], None] | None = None):
        super().__init__(
            fraction_evaluate=0.0,
            min_train_nodes=fed.min_groups,
            min_available_nodes=fed.min_groups,
            weighted_by_key=P.NUM_TOKENS,
            arrayrecord_key=P.ARRAYS,
            configrecord_key=P.CONFIG,
        )
        self.fed = fed
        self.on_round = on_round
        self.outer = None
        self.expected: dict | None = None
        self.order: list[str] = []
        self.history: list[dict] = []
        self.dropped: set[int] = set()
        """Collective transport: nodes whose group died; later rounds leave them out."""
        self._round: dict = {}

    # -- one round ---------------------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self._messages(server_round, arrays, config, grid, MessageType.TRAIN)

    def _messages(self, server_round, arrays, config, grid, message_type) -> list[Message]:
        """One message per node: the run config, its group index, and the weights (flower)."""
        node_ids = sorted(grid.get_node_ids())
        # Collective: the groups that died are left out, and the live ones form this round's
        # cross-group process group (their data parts stay where they were).
        live = [n for n in node_ids if n not in self.dropped]
        if self.fed.transport == "flower":  # one flat Array on the wire (aggregation.pack)
            flat = pack({k: v.numpy() for k, v in arrays.items()})
            arrays = ArrayRecord({P.PACKED: Array(flat)})
        messages = []
        for index, node in enumerate(node_ids):
            if node not in live:
                continue
            cfg = ConfigRecord(dict(config))
            cfg[P.SERVER_ROUND] = server_round
            cfg[P.GROUP_INDEX] = index
            cfg[P.NUM_GROUPS] = len(node_ids)
            cfg[P.SYNC_RANK] = live.index(node)
            cfg[P.SYNC_SIZE] = len(live)
            cfg[P.COLLECTIVE_PREFIX] = f"run{grid.run.run_id}/round{server_round}"
            cfg[P.RUN_ID] = grid.run.run_id  # a new run gets a fresh trainer in the group
            content = RecordDict({P.CONFIG: cfg})
            if self.fed.transport == "flower":
                content[P.ARRAYS] = arrays
            messages.append(Message(content=content, message_type=message_type, dst_node_id=node))
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        start = time.perf_counter()
        ok, rejected = [], []
        for msg in replies:
            reason, parsed = self._check_reply(msg)
            node = msg.metadata.src_node_id
            if reason:
                rejected.append(f"node {node}: {reason}")
                log(
                    WARNING,
                    "round %s: rejected the reply of node %s: %s",
                    server_round,
                    node,
                    reason,
                )
            else:
                ok.append(parsed)
        self._round["rejected"] = self._round.get("rejected", []) + rejected
        if self.fed.transport == "flower" and len(ok) > 1:
            ok = self._reject_outliers(server_round, ok)
        self._round["ok"] = ok
        if len(ok) < self.fed.min_groups:
            log(
                WARNING,
                "round %s: %d valid replies, fewer than min-groups %d: the global model is kept",
                server_round,
                len(ok),
                self.fed.min_groups,
            )
            return None, None
        weights = [p["metrics"][P.NUM_TOKENS] for p in ok]
        metrics = MetricRecord(
            {
                P.NUM_TOKENS: int(sum(weights)),
                P.TRAIN_LOSS: float(
                    np.average([p["metrics"][P.TRAIN_LOSS] for p in ok], weights=weights)
                ),
            }
        )
        if self.fed.transport != "flower":
            return None, metrics
        if self._compression != "none":
            new = self._aggregate_deltas(ok, weights)
        elif self.fed.aggregation == "trimmed-mean":
            mean = trimmed_mean([p["arrays"] for p in ok], self.fed.trim_fraction)
            new = unflatten(self.outer.step(flatten(mean, self.order)), mean, self.order)
        else:
            mean = weighted_mean([p["arrays"] for p in ok], weights)
            new = unflatten(self.outer.step(flatten(mean, self.order)), mean, self.order)
        self._global = new
        self._round["server_s"] = time.perf_counter() - start
        return ArrayRecord({k: Array(v) for k, v in new.items()}), metrics

    def _reject_outliers(self, server_round: int, ok: list[dict]) -> list[dict]:
        """Drop updates far larger than the others' (see aggregation.norm_outliers)."""
        if self._compression != "none":
            norms = [float(np.linalg.norm(p["delta"].astype(np.float64))) for p in ok]
        else:
            norms = update_norms([p["arrays"] for p in ok], self._global)
        bad = norm_outliers(norms, self.fed.outlier_factor)
        for i, reason in bad.items():
            self._round["rejected"].append(f"node {ok[i]['node']}: {reason}")
            log(
                WARNING,
                "round %s: rejected the update of node %s: %s",
                server_round,
                ok[i]["node"],
                reason,
            )
        return [p for i, p in enumerate(ok) if i not in bad]

    def _check_reply(self, msg: Message) -> tuple[str | None, dict]:
        if msg.has_error():
            return f"error reply: {msg.error.reason}", {}
        content = msg.content
        if P.METRICS not in content:
            return f"no {P.METRICS!r} record", {}
        metrics = dict(content[P.METRICS])
        for key in (P.NUM_TOKENS, P.TRAIN_LOSS):
            if key not in metrics:
                return f"metric {key!r} missing", {}
        reason = check_weight(metrics[P.NUM_TOKENS])
        if reason is None and not np.isfinite(metrics[P.TRAIN_LOSS]):
            reason = f"train-loss is {metrics[P.TRAIN_LOSS]}"
        if reason:
            return reason, {}
        parsed = {"metrics": metrics, "node": msg.metadata.src_node_id}
        if self.fed.transport == "flower":
            if P.ARRAYS not in content:
                return f"no {P.ARRAYS!r} record (transport flower needs the weights)", {}
            try:
                arrays = {k: v.numpy() for k, v in content[P.ARRAYS].items()}
            except Exception as exc:  # a malformed Array fails to decode
                return f"undecodable arrays: {exc}", {}
            if self._compression == "none":
                reason, arrays = unpack(arrays, self.expected)
                reason = reason or check_arrays(arrays, self.expected)
                if reason:
                    return reason, {}
                parsed["arrays"] = arrays
            else:
                reason, parsed["delta"] = self._decode_delta(arrays)
                if reason:
                    return reason, {}
            parsed["bytes"] = content[P.ARRAYS].count_bytes()
        return None, parsed

    @property
    def _compression(self) -> str:
        return self.fed.train.compression

    def _decode_delta(self, arrays: dict) -> tuple[str | None, np.ndarray | None]:
        """A compressed reply: (why it is refused, None) or (None, the flat float32 delta in
        sorted-name order)."""
        import torch

        t = self.fed.train
        payload = {}
        for k, v in arrays.items():
            payload[k] = torch.from_numpy(np.ascontiguousarray(v))
        numel = sum(int(np.prod(shape)) for shape, _ in self.expected.values())
        reason = Z.check_payload(payload, t.compression, numel, t.compression_chunk)
        if reason:
            return reason, None
        return None, Z.decompress(payload, t.compression, t.compression_chunk).numpy()

    def _aggregate_deltas(self, ok: list[dict], weights: list[float]) -> dict[str, np.ndarray]:
        """The next global weights from compressed replies: the (token-weighted, or trimmed)
        mean of the decoded pseudo-gradients, stepped by the outer optimizer."""
        deltas = [{"delta": p["delta"]} for p in ok]
        if self.fed.aggregation == "trimmed-mean":
            mean = trimmed_mean(deltas, self.fed.trim_fraction)["delta"]
        else:
            mean = weighted_mean(deltas, weights)["delta"]
        # The wire order is sorted by name; the outer optimizer's flat order is self.order.
        pseudo_grad = flatten(unflatten_flat(mean, self.expected, sorted(self.order)), self.order)
        return unflatten(self.outer.apply(pseudo_grad), self._global, self.order)

    # -- the loop ----------------------------------------------------------------------------

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        *,
        resumed: dict | None = None,
    ) -> Result:
        """Run rounds up to ``num_rounds``; ``evaluate_fn`` (flower transport) returns
        ``eval-loss``.

        ``resumed`` continues a run from a server checkpoint: ``round`` (the last round done),
        ``outer`` (the outer optimizer's state) and ``history`` (the rounds so far);
        ``initial_arrays`` are then that checkpoint's global weights.
        """
        from flower_shard.runtime.outer_sync import OuterOptimizer

        t = self.fed.train
        config = ConfigRecord(self.fed.group_config()) if train_config is None else train_config
        initial = {k: v.numpy() for k, v in initial_arrays.items()}
        self.expected, self.order = describe(initial), list(initial)
        self._global = initial
        self.outer = OuterOptimizer(
            flatten(initial, self.order),
            t.outer,
            t.outer_lr,
            t.outer_momentum,
            track_weights=t.compression != "none",
        )
        first = 1
        if resumed:
            self.outer.load_state_dict(resumed["outer"])
            self.history = list(resumed["history"])
            first = resumed["round"] + 1
            config[P.RESUME_ROUND] = resumed["round"]
        self._wait_for_groups(grid, timeout)
        arrays, result = initial_arrays, Result()
        tokens = self.history[-1][P.TOKENS] if self.history else 0
        # The budget is in inner steps: with a fixed T that is exactly num_rounds rounds; with
        # adaptive-t the number of rounds follows from the T chosen each round. Time-budgeted
        # rounds (round-seconds): num_rounds rounds, each group as many steps as fit.
        timed = self.fed.round_seconds > 0
        steps = self.history[-1][P.STEP] if self.history else 0
        budget = num_rounds * t.local_steps
        local = self._next_local_steps(self.history[-1]) if self.history else t.local_steps
        rnd = first - 1
        while rnd < num_rounds if timed else steps < budget:
            rnd += 1
            n = t.max_local_steps if timed else min(local, budget - steps)
            start = time.perf_counter()
            self._round = {}
            round_config = ConfigRecord(dict(config) | {P.ROUND_STEPS: n})
            if timed:
                round_config[P.ROUND_SECONDS] = float(self.fed.round_seconds)
            messages = list(self.configure_train(rnd, arrays, round_config, grid))
            sent = arrays.count_bytes() * len(messages) if self.fed.transport == "flower" else 0
            replies = self.send_and_receive(grid, messages, self.fed.round_timeout)
            if self.fed.transport == "collective":
                self._drop_dead(rnd, messages, replies)
            new_arrays, train_metrics = self.aggregate_train(rnd, replies)
            if new_arrays is not None:
                arrays = result.arrays = new_arrays
            ok = self._round["ok"]
            if timed:  # the step count advances by the most steps a group trained
                n = max((int(p["metrics"].get(P.STEPS, 0)) for p in ok), default=0)
            steps += n
            last = rnd >= num_rounds if timed else steps >= budget
            round_tokens = int(sum(p["metrics"][P.NUM_TOKENS] for p in ok))
            tokens += round_tokens
            if train_metrics is not None:
                result.train_metrics_clientapp[rnd] = train_metrics
            eval_loss = None
            if t.eval_every and (rnd % t.eval_every == 0 or last):
                eval_loss = self._evaluate(rnd, arrays, config, grid, evaluate_fn)
            round_s = time.perf_counter() - start
            record = self._record(rnd, ok, round_tokens, tokens, round_s, eval_loss, sent)
            record |= {P.STEP: steps, P.ROUND_LOCAL_STEPS: n}
            self.history.append(record)
            if self.on_round:
                self.on_round(record)
            local = self._next_local_steps(record)
        result.arrays = arrays
        return result

    def _next_local_steps(self, record: dict) -> int:
        """The next round's T: the configured one, or with adaptive-t the rule of
        :class:`~flower_shard.planning.adaptive.AdaptiveT` applied to the round's record (so that a
        resumed run picks the same T). The exchange is everything in the round but the
        groups' compute and the evaluation: gathering, Flower's messaging, the aggregation
        (or the collective sync), loading the new weights."""
        t = self.fed.train
        if not t.adaptive_t:
            return t.local_steps
        n = record.get(P.ROUND_LOCAL_STEPS, t.local_steps)
        compute = record[P.COMPUTE_S]
        exchange = record["control_overhead_s"] + record["group_round_s"] - compute
        rule = AdaptiveT(t.exchange_share, t.min_local_steps, t.max_local_steps)
        return rule.next(n, compute / n, max(0.0, exchange))

    def _drop_dead(self, rnd: int, messages: list[Message], replies: list[Message]) -> None:
        """Leave out of later collective rounds every group that did not answer, or failed for
        another reason than an abandoned sync (a group that abandoned the sync is alive)."""
        alive = {
            r.metadata.src_node_id
            for r in replies
            if not r.has_error() or P.SYNC_ABANDONED in r.error.reason
        }
        dead = {m.metadata.dst_node_id for m in messages} - alive
        if dead:
            self.dropped |= dead
            log(
                WARNING,
                "round %s: group(s) of node(s) %s failed; the next rounds sync without them",
                rnd,
                sorted(dead),
            )

    @property
    def global_arrays(self) -> dict[str, np.ndarray]:
        """The current global weights (the server's copy; in the collective transport the
        groups hold the model and this stays the initial one)."""
        return self._global

    def _record(self, rnd, ok, round_tokens, tokens, round_s, eval_loss, sent) -> dict:
        groups = [p["metrics"] for p in ok]
        flower = self.fed.transport == "flower"
        received = sum(p.get("bytes", 0) for p in ok)
        group_s = max((g.get(P.GROUP_ROUND_S, 0.0) for g in groups), default=0.0)
        record = {
            P.ROUND: rnd,
            P.TOKENS: tokens,
            P.TOKENS_PER_S: round_tokens / round_s,
            P.TRAIN_LOSS: float(
                np.average(
                    [g[P.TRAIN_LOSS] for g in groups], weights=[g[P.NUM_TOKENS] for g in groups]
                )
            )
            if groups
            else float("nan"),
            P.LR: float(np.mean([g.get(P.LR, 0.0) for g in groups])) if groups else 0.0,
            P.ROUND_S: round_s,
            P.COMPUTE_S: max((g.get(P.COMPUTE_S, 0.0) for g in groups), default=0.0),
            P.INTRA_BYTES: max((g.get(P.INTRA_BYTES, 0.0) for g in groups), default=0.0),
            P.INTRA_COMM_S: max((g.get(P.INTRA_COMM_S, 0.0) for g in groups), default=0.0),
            P.OUTER_SYNC_S: self._round.get("server_s", 0.0)
            if flower
            else max((g.get(P.OUTER_SYNC_S, 0.0) for g in groups), default=0.0),
            P.OUTER_SYNC_BYTES: (received // len(ok) if ok else 0)
            if flower
            else max((int(g.get(P.OUTER_SYNC_BYTES, 0)) for g in groups), default=0),
            "groups_ok": len(ok),
            "groups_rejected": len(self._round["rejected"]),
            "groups_dropped": len(self.dropped),
            "rejected": self._round["rejected"],
            "exchange_bytes": sent + received,
            "push_s": self._round.get("push_s", 0.0),
            "reply_wait_s": self._round.get("reply_wait_s", 0.0),
            "group_round_s": group_s,
            "control_overhead_s": max(0.0, round_s - group_s - self._round.get("eval_s", 0.0)),
            # Each valid group's share of the round (they differ with round-seconds or K).
            "groups": sorted(
                (
                    {
                        P.GROUP: int(g.get(P.GROUP, -1)),
                        P.STEPS: int(g.get(P.STEPS, 0)),
                        "tokens": int(g[P.NUM_TOKENS]),
                        "compute_s": float(g.get(P.COMPUTE_S, 0.0)),
                        "clientapp_pid": int(g.get(P.CLIENTAPP_PID, 0)),
                    }
                    for g in groups
                ),
                key=lambda g: g["group"],
            ),
        }
        if eval_loss is not None:
            record[P.EVAL_LOSS] = eval_loss
            record[P.EVAL_PPL] = perplexity(eval_loss)
        return record

    def _evaluate(self, rnd, arrays, config, grid, evaluate_fn) -> float | None:
        start = time.perf_counter()
        loss = None
        if self.fed.transport == "flower" and evaluate_fn is not None:
            res = evaluate_fn(rnd, arrays)
            loss = None if res is None else float(res[P.EVAL_LOSS])
        elif self.fed.transport == "collective":  # the groups hold the (identical) model
            messages = self._messages(rnd, arrays, config, grid, MessageType.EVALUATE)
            losses = [
                dict(m.content[P.METRICS])[P.EVAL_LOSS]
                for m in self.send_and_receive(grid, messages, self.fed.round_timeout)
                if not m.has_error() and P.METRICS in m.content
            ]
            loss = float(np.mean(losses)) if losses else None
        self._round["eval_s"] = time.perf_counter() - start
        return loss

    def final_weights(self, grid: Grid) -> dict[str, np.ndarray] | None:
        """Collective transport: the model the groups hold after the last sync, fetched once
        from one live group (all hold the same average) with a QUERY message; checked like a
        training reply. None, with the reason logged, if no group delivers valid weights."""
        live = [n for n in sorted(grid.get_node_ids()) if n not in self.dropped]
        for node in live:
            msg = Message(
                content=RecordDict({P.CONFIG: ConfigRecord({P.RUN_ID: grid.run.run_id})}),
                message_type=MessageType.QUERY,
                dst_node_id=node,
            )
            replies = self.send_and_receive(grid, [msg], self.fed.round_timeout)
            if not replies or replies[0].has_error() or P.ARRAYS not in replies[0].content:
                why = replies[0].error.reason if replies and replies[0].has_error() else "none"
                log(WARNING, "final weights: node %s gave no weights (%s)", node, why)
                continue
            arrays = {k: v.numpy() for k, v in replies[0].content[P.ARRAYS].items()}
            reason = check_arrays(arrays, self.expected)
            if reason is None:
                return arrays
            log(WARNING, "final weights: node %s: %s", node, reason)
        return None

    # -- messaging ---------------------------------------------------------------------------

    def send_and_receive(self, grid: Grid, messages: list[Message], timeout: float):
        """Push, then pull every ``poll-interval`` until all replied or ``timeout`` passed."""
        start = time.perf_counter()
        pending = set(grid.push_messages(messages))
        self._round["push_s"] = self._round.get("push_s", 0.0) + time.perf_counter() - start
        replies: list[Message] = []
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            got = list(grid.pull_messages(pending))
            replies += got
            pending -= {m.metadata.reply_to_message_id for m in got}
            if pending:
                time.sleep(self.fed.poll_interval)
        self._round["reply_wait_s"] = time.perf_counter() - start - self._round["push_s"]
        if pending:
            self._round.setdefault("rejected", []).extend(
                f"no reply within round-timeout {timeout:.0f} s" for _ in pending
            )
            log(WARNING, "%d group(s) did not reply within %.0f s", len(pending), timeout)
        return replies

    def _wait_for_groups(self, grid: Grid, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(list(grid.get_node_ids())) < self.fed.min_groups:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than min-groups {self.fed.min_groups} nodes connected")
            time.sleep(self.fed.poll_interval * 4)
        log(INFO, "%d group(s) connected", len(list(grid.get_node_ids())))
