"""The server side's settings, read from Flower's run config in one place.

Run-config keys are the kebab-case names of :class:`~flower_shard.config.TrainConfig` fields
(``seq-len``, ``batch-size``, ...) plus Flower-specific ones: ``num-server-rounds``,
``local-steps``, ``transport``, ``outer-optimizer``, ``min-groups``, ``round-seconds``,
``round-timeout``, ``collective-address``, ``poll-interval``, ``out-dir``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from flower_shard import protocol as P
from flower_shard.config import choices as C
from flower_shard.config.choices import check_choices, choice
from flower_shard.config.ranges import bounded, check_address, check_fields, check_host
from flower_shard.config.train import MAX_RANKS, TrainConfig
from flower_shard.errors import ConfigError

MAX_SECONDS = 1e7
"""The longest timeout or round budget a setting may name (about 115 days)."""

# run-config key -> TrainConfig field, where the names differ
RENAMED = {
    P.NUM_SERVER_ROUNDS: "rounds",
    P.OUTER_OPTIMIZER: "outer",
    P.OUT_DIR: "out",
}


@dataclass
class FederationConfig:
    """What the ServerApp and ShardedFedAvg need."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """The run as a group sees it (model, data, T, rounds, outer optimizer, ...)."""
    transport: str = choice(P.FLOWER, P.TRANSPORTS)
    """`flower`: weights travel in Flower Messages (small and medium models, any Flower
    deployment); `collective`: groups all-reduce shards (inside one cluster); `streaming`: every
    rank streams its shard to aggregator processes over gRPC, Flower carries only a ticket
    (large models across sites)."""
    min_groups: int = bounded(1, 1, MAX_RANKS)
    """A round updates the global model only if at least this many groups replied validly."""
    data_partitions: int = bounded(0, 0, MAX_RANKS)
    """P: the parts the training data is cut into for the run, one per group. A group keeps
    its part (and its data position and checkpoints) whoever joins or leaves; a new group takes
    a part no group has held, else the part of the group away longest. 0: the number of groups
    at the first round. Set it to the most groups the run will have, so that late groups get
    data of their own (with every part held by a connected group, a new one waits)."""
    round_seconds: float = bounded(0.0, 0, MAX_SECONDS, open_hi=True)
    """Time-budgeted rounds: each group trains as many inner steps as fit in this many seconds
    (at least one, at most `max-local-steps`), reports its steps and tokens, and the
    aggregation weights by tokens, so fast and slow groups (different K or hardware) finish a
    round together; the run is `num-server-rounds` rounds and the inner LR schedule follows
    its time. 0: every group trains `local-steps` steps."""
    round_timeout: float = bounded(600.0, 0, MAX_SECONDS, open_lo=True)
    """Seconds to wait for the groups' replies in one round; late groups are left out."""
    sync_timeout: float = bounded(120.0, 0, MAX_SECONDS, open_lo=True)
    """Collective transport: seconds a group waits for its peers in the cross-group
    rendezvous and all-reduce; past it the group abandons that sync and keeps its weights."""
    collective_address: str = "127.0.0.1:29600"
    """HOST:PORT where the ServerApp hosts the cross-group rendezvous (collective transport)."""
    poll_interval: float = bounded(0.05, 0, 60, open_lo=True)
    """Seconds between the strategy's pulls of replies (Flower's default sleeps 3 s)."""
    outlier_factor: float = bounded(10.0, 0, 1e6)
    """The robust rules' bound f (0: off; else >= 1). Per inner step, against a reference (the
    median of the other groups' values this round pooled with those accepted in the last 5
    rounds): a group's token weight is capped at f x the reference; an update whose norm is
    below 1/f of it (a free rider) is rejected; an update whose token-weighted norm or largest
    coordinate exceeds f x its reference is rejected (or clipped: `clip-outliers`). See
    SECURITY.md for what each rule withstands."""
    clip_outliers: bool = False
    """Transport flower: clip an update beyond a bound of `outlier-factor` (scaled to the norm
    bound, coordinates clamped to the coordinate bound) instead of rejecting it."""
    aggregation: str = choice(C.MEAN, C.AGGREGATIONS)
    """`mean` (token-weighted) or, transport flower, `trimmed-mean`: per coordinate, the
    max(1, floor(trim-fraction x G)) lowest and highest values are dropped whatever their
    weights, the rest averaged with their groups' token weights (needs min-groups >= 3)."""
    trim_fraction: float = bounded(0.2, 0, 0.5, open_hi=True)
    """For `trimmed-mean`: the fraction of groups dropped at each end, per coordinate (at least
    one group)."""
    group_addresses: str = ""
    """Simulation only: the groups' addresses, comma-separated, one per virtual client."""
    aggregators: int = bounded(1, 1, 256)
    """Streaming transport: aggregator processes the ServerApp starts on its host, each owning
    about 1/A of the parameters (and their outer state), each on its own port of
    `dataplane-host`."""
    aggregator_addresses: str = ""
    """Streaming transport: HOST:PORT of aggregators started on other hosts (`python -m
    flower_shard.dataplane.aggregator`), comma-separated; instead of starting `aggregators`."""
    aggregator_secret_file: str = ""
    """With `aggregator-addresses`: the run-secret file those aggregators were started with
    (owner-only)."""
    dataplane_host: str = "127.0.0.1"
    """Streaming transport: the address the ServerApp's aggregators listen on, and only there;
    the groups dial it (give the server's address that the sites can reach)."""
    dataplane_certfile: str = ""
    """Streaming transport: the aggregators' TLS certificate (PEM; the SuperLink's will do)."""
    dataplane_keyfile: str = ""
    """Streaming transport: its private key."""
    dataplane_ca_certfile: str = ""
    """Streaming transport: the CA that signed it (the ServerApp verifies its aggregators with
    it; each node verifies them with its own `--root-certificates`)."""
    dataplane_insecure: bool = False
    """Streaming transport without TLS: on purpose only (loopback tests and demos)."""
    pipelined_commit: bool = True
    """Streaming transport: an aggregator folds each parameter as soon as every group of the
    round has sent it whole, and the groups download the new values while they still upload
    (both directions of a site link at once). Provisional until the round commits: a group
    left out (died, rejected) makes the others pull the committed model again."""
    downlink_compression: str = choice(C.NO_COMPRESSION, C.COMPRESSIONS)
    """Transports streaming and flower: how the global model reaches the groups each round:
    `none` (float32 snapshots) or, `bf16` / `int8`, the delta since the model they hold,
    compressed, with server-side error feedback; a new, restarted or rejoining group gets a
    float32 snapshot of that model (flower: a group that lost it answers one round with an
    error and gets the snapshot the next)."""

    @classmethod
    def from_run_config(cls, run_config: dict) -> FederationConfig:
        """Fill and validate from a Flower run config; unknown keys are an error."""
        own = {f.name for f in dataclasses.fields(cls) if f.name != "train"}
        train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
        train_kwargs, kwargs, unknown = {}, {}, []
        for key, value in run_config.items():
            name = RENAMED.get(key, key.replace("-", "_"))
            if name in own:
                kwargs[name] = value
            elif name in train_fields and name not in ("groups", "nproc_per_group", "nnodes"):
                train_kwargs[name] = value
            else:
                unknown.append(key)
        if unknown:
            raise ConfigError(
                f"unknown run-config keys {sorted(unknown)}; see flower_shard/config/federation.py"
            )
        # TOML has no None: "" means unset.
        for name in ("data", "tokenizer", "resume", "partition_label"):
            if train_kwargs.get(name) == "":
                train_kwargs[name] = None
        cfg = cls(train=TrainConfig(**train_kwargs), **kwargs)
        return cfg.validate()

    def validate(self) -> FederationConfig:
        """Raise :class:`ConfigError` on the first wrong value, the group's fields included;
        return self."""
        check_fields(self, prefix="", skip=("train",))  # types, ranges, NaN and inf
        check_choices(self, prefix="")
        if self.round_seconds and self.train.adaptive_t:
            raise ConfigError(
                "round-seconds and adaptive-t both choose the steps of a round: set one of them"
            )
        if self.round_seconds and self.round_seconds >= self.round_timeout:
            raise ConfigError(
                f"round-seconds {self.round_seconds} must be below round-timeout "
                f"{self.round_timeout}, or every round would time out"
            )
        self._validate_overlap()
        check_address("collective-address", self.collective_address)
        self._validate_robust()
        if self.transport == P.STREAMING:
            self._validate_dataplane()
        elif self.downlink_compression != C.NO_COMPRESSION and self.transport != P.FLOWER:
            raise ConfigError(
                f"downlink-compression applies to transports {P.FLOWER!r} and {P.STREAMING!r} "
                f"(the {self.transport!r} transport sends no global model); drop it"
            )
        # The group-level field checks (T, rounds, ...) with a stand-in topology; the ones that
        # need I/O are flower_shard.preflight.check_federation's.
        self.stand_in().validate()
        return self

    def stand_in(self) -> TrainConfig:
        """The group fields with a stand-in topology of one group of one rank, for the checks
        that do not need the groups' own (the overlap of several groups: above)."""
        return dataclasses.replace(
            self.train, groups=1, nproc_per_group=1, nnodes=1, outer_overlap=False
        )

    def _validate_overlap(self) -> None:
        """outer-fragments, outer-pace and outer-overlap through Flower: overlap on the
        streaming transport only (:mod:`flower_shard.flower.group.overlap`)."""
        t = self.train
        for key, used in (("outer-fragments", t.outer_fragments > 1), ("outer-pace", t.outer_pace)):
            if used:
                raise ConfigError(
                    f"{key} runs in the one-job driver (`flower-shard train`), not through "
                    "Flower: drop it from the run config"
                )
        if not t.outer_overlap:
            return
        refused = [
            (
                self.transport != P.STREAMING,
                f"runs on the {P.STREAMING!r} transport (or in the one-job driver, `flower-shard "
                f"train`), not on {self.transport!r}: set transport = {P.STREAMING!r}",
            ),
            (
                not self.pipelined_commit,
                "takes the new global model while it is folded: keep pipelined-commit = true",
            ),
            (t.adaptive_t, "hides the exchange adaptive-t sizes T by: drop adaptive-t"),
            (t.sync_optimizer_state, "moves weights, not AdamW's moments: drop it"),
        ]
        for wrong, why in refused:
            if wrong:
                raise ConfigError(f"outer-overlap {why}")

    def _validate_robust(self) -> None:
        """The robust rules' settings (:mod:`flower_shard.flower.server.robust`)."""
        if 0 < self.outlier_factor < 1:
            raise ConfigError(
                f"outlier-factor must be 0 (off) or >= 1 (a bound of f x the others'), got "
                f"{self.outlier_factor}"
            )
        if self.aggregation == C.TRIMMED_MEAN and self.transport != P.FLOWER:
            raise ConfigError(
                f"aggregation {C.TRIMMED_MEAN!r} needs transport {P.FLOWER!r} (the others only "
                "average); set aggregation = 'mean'"
            )
        if 0 < self.data_partitions < self.min_groups:
            raise ConfigError(
                f"data-partitions {self.data_partitions} < min-groups {self.min_groups}: a "
                "round could never have enough groups (each holds its own partition); set "
                "data-partitions >= min-groups, or 0 (the groups at the first round)"
            )
        if self.aggregation == C.TRIMMED_MEAN and self.min_groups < 3:
            raise ConfigError(
                f"aggregation {C.TRIMMED_MEAN!r} drops at least one group at each end of every "
                f"coordinate: set min-groups >= 3 (got {self.min_groups}), or aggregation = 'mean'"
            )
        if self.clip_outliers and self.transport != P.FLOWER:
            raise ConfigError(
                f"clip-outliers needs transport {P.FLOWER!r} (the {self.transport} transport "
                "cannot change one group's update); set clip-outliers = false"
            )

    def _validate_dataplane(self) -> None:
        for address in self.remote_aggregators():
            check_address("aggregator-addresses:", address)
        if self.aggregator_addresses and not self.aggregator_secret_file:
            raise ConfigError(
                "aggregator-addresses needs aggregator-secret-file: the secret those "
                "aggregators were started with"
            )
        check_host("dataplane-host", self.dataplane_host)
        tls = (self.dataplane_certfile, self.dataplane_keyfile, self.dataplane_ca_certfile)
        if not self.dataplane_insecure and not all(tls):
            raise ConfigError(
                "transport streaming needs TLS: set dataplane-certfile, dataplane-keyfile and "
                "dataplane-ca-certfile (the SuperLink's will do), or dataplane-insecure = true "
                "on purpose (loopback only)"
            )

    def remote_aggregators(self) -> list[str]:
        """The addresses of aggregators on other hosts (empty: the ServerApp starts its own)."""
        return [a.strip() for a in self.aggregator_addresses.split(",") if a.strip()]

    def group_config(self) -> dict:
        """The run config that every train/evaluate message carries to the groups."""
        t = self.train
        cfg = {P.kebab(f): getattr(t, f) for f in P.GROUP_FIELDS if getattr(t, f) is not None}
        cfg |= {
            P.NUM_SERVER_ROUNDS: t.rounds,
            P.LOCAL_STEPS: t.local_steps,
            P.TRANSPORT: self.transport,
            P.OUTER_OPTIMIZER: t.outer,
            P.OUTER_LR: t.outer_lr,
            P.OUTER_MOMENTUM: t.outer_momentum,
            P.OUTER_OVERLAP: t.outer_overlap,
            P.ROUND_TIMEOUT: self.round_timeout,
            P.SYNC_TIMEOUT: self.sync_timeout,
            P.COLLECTIVE_ADDRESS: self.collective_address,
        }
        return cfg


def train_config_from_message(
    config: Mapping, *, nproc_per_group: int, data: str | None, device: str
) -> TrainConfig:
    """A group's TrainConfig from a train/evaluate message's config: the inverse of
    :meth:`FederationConfig.group_config` (which always sends every key read here), with this
    node's own ``nproc_per_group`` (K), ``data`` and ``device``. The groups do not evaluate on
    their own (the server asks) and do not print rounds.

    Raises
    ------
    KeyError
        A key that ``group_config`` always sends is missing (not a message of this server).
    ConfigError
        A value is wrong (see :meth:`TrainConfig.validate`).
    """
    fields = {f: config[P.kebab(f)] for f in P.GROUP_FIELDS if P.kebab(f) in config}
    cfg = TrainConfig(
        groups=int(config[P.NUM_GROUPS]),
        nproc_per_group=nproc_per_group,
        local_steps=int(config[P.LOCAL_STEPS]),
        rounds=int(config[P.NUM_SERVER_ROUNDS]),
        outer=str(config[P.OUTER_OPTIMIZER]),
        outer_lr=float(config[P.OUTER_LR]),
        outer_momentum=float(config[P.OUTER_MOMENTUM]),
        data=data,
        device=device,
        eval_every=0,
        quiet=True,
        **fields,
    )
    return cfg.validate()
