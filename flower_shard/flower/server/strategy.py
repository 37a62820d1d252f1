"""ShardedFedAvg: FedAvg where a client is a whole FSDP/HSDP group and a round is T local steps."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
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
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info

from flower_shard import protocol as P
from flower_shard.config.federation import FederationConfig
from flower_shard.flower.server import replies as R
from flower_shard.flower.server.exchange import Exchange, Messenger
from flower_shard.flower.server.membership import DataSlots
from flower_shard.flower.server.schedule import RoundPlan, RoundSchedule
from flower_shard.flower.server.stats import (
    Evaluation,
    RoundStats,
    Timing,
    TrainOutcome,
    evaluated,
)
from flower_shard.flower.server.transports import Transport, transport_class

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues: its server checkpoint's round, state and history."""

    round: int
    """The last round done."""
    transport_state: dict
    """The transport's :meth:`~.transports.base.Transport.state_dict` (the outer optimizer)."""
    history: list[dict]
    """The metrics records of the rounds so far."""
    run_name: str
    """The run's identity, which keys the groups' checkpoints."""
    directory: str | None = None
    """The server checkpoint it comes from (what the transport saved beside it)."""
    slots: dict | None = None
    """The nodes' data partitions (:meth:`DataSlots.state_dict`; None: before they existed)."""


class ShardedFedAvg(Strategy):
    """FedAvg over FSDP/HSDP groups, one round = T local steps, weights moved by a transport.

    A subclass of Flower's message-API ``Strategy`` (not of ``FedAvg``, whose hooks expect one
    plain weighted average of unpacked ArrayRecords): ``configure_train`` builds one message
    per group, ``aggregate_train`` checks and aggregates the replies, ``configure_evaluate`` and
    ``aggregate_evaluate`` ask the groups for their held-out loss where they hold the model,
    and ``start`` is Flower's loop with this project's rounds (below). What differs between
    transports (what a message carries, how a reply's arrays are checked, how replies are
    combined, where the model is evaluated, how it is fetched at the end) is the
    :class:`~flower_shard.flower.server.transports.base.Transport` named by ``transport``.

    Each round, every member node (one group each) gets the run config with ``round-steps`` =
    T, its data partition (``group-index``, kept for the run: :mod:`.membership`) and the
    transport's records. Every reply is checked before use (:mod:`.replies`: error replies,
    each metric's type, finiteness and range, the arrays): a bad reply, or one that does not
    come within ``round-timeout``, is rejected with its reason in the log and in the round's
    ``rejected`` list, and the round goes on with the others. With at least ``min-groups``
    valid replies the transport's aggregate becomes the next global model; with fewer, the
    model stays as it was. The run is a budget of inner steps (``num-server-rounds`` x
    ``local-steps``; see :mod:`~flower_shard.flower.server.schedule` for adaptive-t and
    round-seconds). After each round ``on_round`` gets the metrics record (the ServerApp
    checkpoints, then writes it). The strategy pushes and pulls messages itself with a short
    poll (``poll-interval``) instead of ``Grid.send_and_receive``, which sleeps 3 s between pulls.
    """

    def __init__(self, fed: FederationConfig, *, on_round: Callable[[dict], None] | None = None):
        self.fed = fed
        self.on_round = on_round
        self.transport: Transport | None = None
        """The run's transport (built by :meth:`start` from the initial weights)."""
        self.history: list[dict] = []
        """The rounds' metrics records, resumed ones included."""
        self.final_weights: dict[str, np.ndarray] = {}
        """The model after the run (empty if the transport could not get one)."""
        self._sent: list[Message] = []
        """The round's training messages in flight: what its replies answer and must match."""
        self.slots = DataSlots(fed.data_partitions)
        """Each node's data partition, kept for the run (saved in the server checkpoint)."""
        self._ranks: dict[int, int] = {}
        """Node -> its group's K in its valid reply of the last round (a new K is refused once)."""

    # -- Flower's Strategy hooks -----------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per member: the config, its place, and the transport's records."""
        records = self.transport.train_records()
        self._sent = self._messages(server_round, config, grid, MessageType.TRAIN, records)
        return self._sent

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        outcome = self._aggregate(server_round, list(replies))
        return outcome.arrays, outcome.metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Where the groups hold the model, one message per member; else none (the ServerApp
        evaluates the global model itself)."""
        if not self.transport.groups_hold_model:
            return []
        return self._messages(server_round, config, grid, MessageType.EVALUATE, {})

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The mean held-out loss of the valid evaluation replies."""
        return evaluated(server_round, replies)[0]

    def summary(self) -> None:
        t, fed = self.fed.train, self.fed
        log(INFO, "\t├──> Transport: %s, at least %d group(s)", fed.transport, fed.min_groups)
        log(INFO, "\t├──> Outer optimizer: %s (lr %g)", t.outer, t.outer_lr)
        log(INFO, "\t└──> Aggregation: %s, round-timeout %g s", fed.aggregation, fed.round_timeout)

    # -- the loop ------------------------------------------------------------------------------

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
        *,
        resumed: ResumePoint | None = None,
        initial_weights: dict[str, np.ndarray] | None = None,
    ) -> Result:
        """Run the rounds; ``timeout``: how long to wait for ``min-groups`` nodes to connect.

        ``evaluate_fn`` evaluates the global model where the ServerApp holds it. ``resumed``
        continues a run from a server checkpoint, whose global weights are then
        ``initial_arrays``. ``initial_weights``, if given, replaces ``initial_arrays`` without
        a copy: the transport takes its arrays and the dict is left empty, so that the caller
        does not keep the first model for the whole run; the final model is then only
        :attr:`final_weights`, not also ``Result.arrays`` (a copy). ``Result.arrays`` is the
        final model (empty if the transport could not get one).
        """
        began = time.perf_counter()
        config = ConfigRecord(self.fed.group_config()) if train_config is None else train_config
        if initial_weights is None:
            initial = {k: v.numpy() for k, v in initial_arrays.items()}
        else:
            initial = dict(initial_weights)
            initial_weights.clear()
        log(INFO, "Starting %s strategy:", type(self).__name__)
        log_strategy_start_info(num_rounds, ArrayRecord(), config, evaluate_config)
        log(INFO, "\t├── Initial model: %.2f MB", sum(a.nbytes for a in initial.values()) / 2**20)
        self.summary()
        self.transport = transport_class(self.fed.transport)(self.fed, initial)
        del initial, initial_arrays  # the transport holds the first model from here
        if resumed:
            self._resume(resumed, config)
        messenger = Messenger(grid, self.fed.round_timeout, self.fed.poll_interval)
        schedule = RoundSchedule(self.fed.train, num_rounds, self.fed.round_seconds, self.history)
        # Flower's hooks take the global model as an ArrayRecord; the transports read their own
        # (an ArrayRecord is a copy of the model's bytes: none is kept between rounds).
        result, arrays = Result(), ArrayRecord()
        with self.transport:
            if resumed and resumed.directory:
                self.transport.load_files(resumed.directory)
            messenger.wait_for_nodes(self.fed.min_groups, timeout)
            while (plan := schedule.next()) is not None:
                log(INFO, "")
                log(INFO, "[ROUND %s%s]", plan.round, schedule.total)
                self._round(messenger, plan, schedule, arrays, config, evaluate_fn, result)
            final = self.transport.final_weights(messenger)
        self.final_weights = final or {}
        if initial_weights is None:  # Flower's way: the model as an ArrayRecord (a copy)
            result.arrays = ArrayRecord({k: Array(v) for k, v in self.final_weights.items()})
        log(INFO, "")
        log(INFO, "Strategy execution finished in %.2fs", time.perf_counter() - began)
        return result

    def _resume(self, resumed: ResumePoint, config: ConfigRecord) -> None:
        """Continue after ``resumed``: the transport's state, the history, the data slots."""
        self.transport.load_state_dict(resumed.transport_state)
        self.history = list(resumed.history)
        self.slots = DataSlots.from_state(resumed.slots, self.fed.data_partitions)
        config[P.RESUME_ROUND] = resumed.round

    def _round(
        self,
        messenger: Messenger,
        plan: RoundPlan,
        schedule: RoundSchedule,
        arrays: ArrayRecord,
        config: ConfigRecord,
        evaluate_fn: EvaluateFn | None,
        result: Result,
    ) -> None:
        """One round: train, aggregate, evaluate, record (``arrays``: what Flower's hooks are
        given; the transport holds the model)."""
        start = time.perf_counter()
        sent, exchange, outcome = self._train(messenger, plan, arrays, config)
        metrics = outcome.metrics
        if metrics is not None:
            log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)
            result.train_metrics_clientapp[plan.round] = metrics
        evaluated = time.perf_counter()
        evaluation = Evaluation()
        if plan.evaluate:
            evaluation = self._evaluate(messenger, plan.round, arrays, config, evaluate_fn, result)
        timing = Timing(
            round_s=time.perf_counter() - start,
            train=exchange.times,  # the training exchange's own, whatever came after it
            eval_s=time.perf_counter() - evaluated if plan.evaluate else 0.0,
        )
        local_steps = schedule.trained(plan, max((r.steps for r in outcome.ok), default=0))
        dropped = len(self.transport.dropped)
        stats = RoundStats.collect(plan, local_steps, outcome, sent, dropped, timing, evaluation)
        record = stats.record()
        self.history.append(record)
        schedule.done(record)
        if self.on_round:
            self.on_round(record)

    def _train(
        self, messenger: Messenger, plan: RoundPlan, arrays: ArrayRecord, config: ConfigRecord
    ) -> tuple[int, Exchange, TrainOutcome]:
        """The training phase: configure, send, check each reply as it comes, aggregate.

        Returns the bytes of arrays sent (to every member), the exchange and its outcome."""
        per_round = {P.ROUND_STEPS: plan.steps}
        if plan.seconds:
            per_round[P.ROUND_SECONDS] = plan.seconds
        if self.fed.train.outer_overlap:  # nothing in flight after the last round, a checkpoint
            per_round[P.OUTER_DRAIN] = plan.last or self.fed.train.checkpoint_due(plan.round)
        round_config = ConfigRecord(dict(config) | per_round)
        self.transport.admit(messenger)
        self.transport.begin_round(plan.round)
        messages = list(self.configure_train(plan.round, arrays, round_config, messenger.grid))
        self.transport.sending(plan.round, messages)
        budget = f"as many as fit in {plan.seconds:g} s, at most" if plan.seconds else "each"
        log(INFO, "configure_train: %d group(s), %s %d steps", len(messages), budget, plan.steps)
        sent = sum(m.content[P.ARRAYS].count_bytes() for m in messages if P.ARRAYS in m.content)
        pushed = messenger.push(messages)
        intake = R.Intake(
            plan.round,
            self._reply_rules(),
            R.TRAIN_FIELDS + self.transport.reply_fields,
            self.transport.check_payload,
            self.transport.keep,
        )
        self._sent, messages = [], []  # the rules have what they need: drop the sent model
        exchange = messenger.receive(pushed, intake.take)
        outcome = self._aggregate(plan.round, exchange.replies, intake)
        ok, failed = len(outcome.ok), len(outcome.rejected)
        log(INFO, "aggregate_train: received %d results and %d failures", ok, failed)
        return sent, exchange, outcome

    def _evaluate(
        self,
        messenger: Messenger,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        evaluate_fn: EvaluateFn | None,
        result: Result,
    ) -> Evaluation:
        """The held-out loss of the round's model: the groups' where they hold it, else the
        ServerApp's ``evaluate_fn`` on the global arrays."""
        rejected: list[str] = []
        if self.transport.groups_hold_model:
            messages = list(self.configure_evaluate(server_round, arrays, config, messenger.grid))
            log(INFO, "configure_evaluate: %d group(s)", len(messages))
            exchange = messenger.send_and_receive(messages)
            metrics, rejected = evaluated(server_round, exchange.replies, messages)
            store = result.evaluate_metrics_clientapp
        elif evaluate_fn is not None:
            log(INFO, "Global evaluation")
            if not len(arrays):  # the model as Flower's hook takes it, for this call only
                arrays = ArrayRecord({k: Array(v) for k, v in self.transport.global_arrays.items()})
            metrics = evaluate_fn(server_round, arrays)
            store = result.evaluate_metrics_serverapp
        else:
            return Evaluation()
        if metrics is None:
            return Evaluation(None, rejected)
        log(INFO, "\t└──> MetricRecord: %s", metrics)
        store[server_round] = metrics
        pull = float(metrics[P.EVAL_PULL_S]) if P.EVAL_PULL_S in metrics else 0.0
        return Evaluation(float(metrics[P.EVAL_LOSS]), rejected, pull)

    # -- the round's parts -----------------------------------------------------------------------

    def _messages(
        self,
        server_round: int,
        config: ConfigRecord,
        grid: Grid,
        message_type: str,
        records: dict[str, ArrayRecord | ConfigRecord],
    ) -> list[Message]:
        """One message per member node: ``config``, the node's place, the transport's keys."""
        slots = self.slots.assign(self.transport.members(sorted(grid.get_node_ids())), server_round)
        members = list(slots)
        self.transport.seat(members)
        run_id = grid.run.run_id
        messages = []
        for rank, node in enumerate(members):
            cfg = ConfigRecord(dict(config))
            cfg[P.SERVER_ROUND] = server_round
            cfg[P.GROUP_INDEX] = slots[node]
            cfg[P.NUM_GROUPS] = self.slots.partitions
            cfg[P.RUN_ID] = run_id  # a new run gets a fresh trainer in the group
            extra = self.transport.node_config(
                server_round, run_id, rank, len(members), group=slots[node]
            )
            own, keys = (
                self.transport.node_records(node) if message_type == MessageType.TRAIN else ({}, {})
            )
            for key, value in (extra | keys).items():
                cfg[key] = value
            content = RecordDict({P.CONFIG: cfg, **records, **own})
            messages.append(Message(content, dst_node_id=node, message_type=message_type))
        return messages

    def _reply_rules(self) -> R.ReplyRules:
        """What the round's training replies must match, from its messages as pushed."""
        t = self.fed.train
        configs = [m.content[P.CONFIG] for m in self._sent]
        steps = [int(c.get(P.ROUND_STEPS, t.local_steps)) for c in configs]
        return R.ReplyRules(
            asked=R.asked_nodes(self._sent),
            groups={m.metadata.dst_node_id: c[P.GROUP_INDEX] for m, c in zip(self._sent, configs)},
            max_steps=self.transport.update_steps(max(steps, default=0)),
            tokens_per_step=t.batch_size * t.seq_len,
            max_lr=t.lr * (1 + 1e-6),
            # A group that replied in time worked less than round-timeout after the push
            # began; twice that leaves room for the push and for the clocks' resolution.
            max_seconds=2 * self.fed.round_timeout,
            ranks=self._ranks,
        )

    def _aggregate(
        self, server_round: int, replies: list[Message], intake: R.Intake | None = None
    ) -> TrainOutcome:
        """Check every reply (unless ``intake`` did as they came), leave out the transport's
        outliers, aggregate the rest in group order (the same bits whatever order the replies
        came in)."""
        rules = intake.rules if intake else self._reply_rules()
        answered = {r.metadata.reply_to_message_id: r for r in replies}
        timeout = f"no reply within round-timeout {self.fed.round_timeout:.0f} s"
        rejected = [
            R.reject(server_round, MessageType.TRAIN, node, timeout)
            for mid, node in rules.asked.items()
            if mid not in answered
        ]
        if intake is None:
            fields = R.TRAIN_FIELDS + self.transport.reply_fields
            intake = R.Intake(server_round, rules, fields, self.transport.check_payload)
            for msg in replies:
                intake.take(msg)
        ok = sorted(intake.ok, key=lambda r: r.group)
        rejected += intake.rejected
        self._ranks = {r.node: r.ranks for r in ok}
        outliers = self.transport.screen(ok)
        for i, reason in outliers.items():
            rejected.append(R.reject(server_round, MessageType.TRAIN, ok[i].node, reason))
        ok = [r for i, r in enumerate(ok) if i not in outliers]
        by_node = {node: answered[mid] for mid, node in rules.asked.items() if mid in answered}
        self.transport.observe(server_round, rules.groups, by_node)
        folded = sum(not r.held_back for r in ok)  # overlapped: updates held back fold later
        committed = folded >= self.fed.min_groups or bool(ok and not folded)
        if not committed:
            n, least = folded, self.fed.min_groups
            why = f"{n} valid updates, fewer than min-groups {least}: the global model is kept"
            log(WARNING, "round %s: %s", server_round, why)
        aggregate = self.transport.aggregate(server_round, ok, committed)
        return TrainOutcome(ok, rejected, aggregate, committed)
