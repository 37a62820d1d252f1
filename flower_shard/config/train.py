"""The run configuration: one typed dataclass, filled in one place, validated before launch.

Every check raises :class:`ConfigError` with one line that names the problem and the fix; the
CLI prints that line and exits with status 2, so a bad configuration never reaches torchrun.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from flower_shard.config import choices as C
from flower_shard.config.choices import check_choice, check_choices, choice
from flower_shard.config.ranges import bounded, check_fields
from flower_shard.errors import ConfigError

MAX_RANKS = 1 << 20
"""The most ranks (and groups, hosts) a world may have."""
MAX_LOCAL_RANKS = 128
"""The most ranks one host runs (a launcher's N / nnodes, a node's K): more would only
oversubscribe it."""
MAX_STEPS = 10**8
"""The most steps, rounds or checkpoint intervals a setting may name."""


@dataclass
class TrainConfig:
    """Everything a group runtime needs to train; the CLI and the Flower apps fill it in."""

    groups: int = bounded(2, 1, MAX_RANKS)
    """G: number of loosely coupled groups; G = 1 is plain FSDP/HSDP over all ranks (baseline)."""
    nproc_per_group: int = bounded(2, 1, MAX_RANKS)
    """K: ranks per group; the world size is N = G x K."""
    nnodes: int = bounded(1, 1, MAX_RANKS)
    """Hosts the world spans; each host runs N / nnodes ranks (torchrun's --nnodes)."""
    local_steps: int = bounded(4, 1, MAX_STEPS)
    """T: inner optimizer steps per round; the groups synchronise once per round."""
    adaptive_t: bool = False
    """Choose each round's T from the last round's timings, keeping the exchange at most
    --exchange-share of the round (flower_shard/planning/adaptive.py). T starts at --local-steps;
    the budget stays rounds x local-steps inner steps, so the number of rounds varies."""
    exchange_share: float = bounded(0.2, 0, 1, open_lo=True, open_hi=True)
    """--adaptive-t: the largest share of a round that the exchange between groups may take."""
    min_local_steps: int = bounded(1, 1, MAX_STEPS)
    """--adaptive-t: the smallest T."""
    max_local_steps: int = bounded(64, 1, MAX_STEPS)
    """--adaptive-t: the largest T; with Flower's `round-seconds`, the most steps a group
    trains in one round."""
    rounds: int = bounded(5, 1, MAX_STEPS)
    """Number of rounds (outer synchronisations)."""
    sharding: str = choice(C.FSDP, C.SHARDING_MODES)
    """Sharding inside a group: `fsdp` (1-D shard mesh) or `hsdp` (replicate x shard)."""
    replicate: int = bounded(1, 1, MAX_RANKS)
    """R: replicate degree for HSDP; the shard degree is S = K / R. Must be 1 for FSDP."""
    outer: str = choice(C.FEDAVG, C.OUTER_OPTIMIZERS)
    """Outer optimizer: `fedavg` (the mean replaces the weights) or `nesterov` (DiLoCo)."""
    outer_lr: float = bounded(0.7, 0, 100, open_lo=True)
    """Learning rate of the nesterov outer optimizer (DiLoCo uses 0.7)."""
    outer_momentum: float = bounded(0.9, 0, 1, open_hi=True)
    """Momentum of the nesterov outer optimizer."""
    sync_optimizer_state: bool = False
    """Also average AdamW's first and second moments in the outer sync."""
    compression: str = choice(C.NO_COMPRESSION, C.COMPRESSIONS)
    """How each group sends its pseudo-gradient (global - local) between groups: `none`
    (float32), `bf16`, or `int8` (per-chunk scales); both transports
    (flower_shard/runtime/compression.py).
    """
    compression_chunk: int = bounded(2048, 1, 1 << 24)
    """int8: values per scale (one float32 scale per chunk: 4 / chunk bytes of overhead)."""
    error_feedback: bool = True
    """Carry what compression lost in one round into the next (per group); no effect for `none`.
    """
    outer_fragments: int = bounded(1, 1, 1 << 16)
    """F: sync the parameters in F fragments of consecutive layers, staggered over the round
    (Streaming DiLoCo), so each sync moves 1/F of the model; 1 syncs them all at the round's end.
    At most T. One-job collective runs (`flower-shard train`), FSDP or HSDP (striped), any
    --compression (flower_shard/runtime/streaming_sync.py)."""
    outer_overlap: bool = False
    """Overlap each sync with the next round's steps: send and go on, apply the result one round
    later on top of the group's progress since (Streaming DiLoCo, one sync of delay). One-job
    runs as --outer-fragments; through Flower on the streaming transport (its update crosses
    while the group trains the next round: flower_shard/flower/group/overlap.py). Every
    checkpoint and the run's end wait for the syncs in flight."""
    outer_pace: bool = False
    """With --outer-overlap: send each sync in pieces spread evenly over the time until the next
    fragment's sync point (a background thread, from the measured step time), instead of all
    at once, so the slow link's peak rate falls from its full rate toward the round's average
    (the result is the same). One-job collective runs (flower_shard/runtime/pacing.py)."""
    model: str = "tiny"
    """Model preset (`tiny`, `small`, `base`, `llama3.1-8b`), or a local transformers causal-LM
    directory: config.json alone (built from it, initialised from the seed) or with safetensors
    weights (loaded)."""
    data: str | None = None
    """Directory of text files, or a .jsonl / .parquet file (or a directory with some) whose
    --text-column holds one document per record; None means the Python standard library's source.
    """
    text_column: str = "text"
    """The field (column) of .jsonl / .parquet records that holds the text."""
    partition: str = choice(C.IID, C.PARTITIONS)
    """How the training blocks are split between groups (ranks then split their group's part):
    `iid` (a seeded shuffle), `by-source` (whole top-level directories, or files at the top
    level, per group, balanced by blocks) or `dirichlet` (each label's blocks shared out over
    the groups in Dirichlet(--dirichlet-alpha) proportions)."""
    partition_label: str | None = None
    """For `dirichlet`: the field of .jsonl / .parquet records that holds a document's label, or
    `directory` (the document's top-level directory, or its file at the top level: the only
    label text files have)."""
    dirichlet_alpha: float = bounded(0.5, 0, 1e6, open_lo=True)
    """For `dirichlet`: the concentration; smaller is more skewed (0.1: most labels go to one
    group; 100: close to iid)."""
    tokenizer: str | None = None
    """Local Hugging Face tokenizer directory; None means the byte-level tokenizer."""
    data_workers: int = bounded(0, 0, 1024)
    """Processes that tokenise the corpus, each streaming its pieces to disk in bounded memory
    (0: one per core). A host tokenises a corpus once: runs and nodes share the result through
    the cache in $FLOWER_SHARD_CACHE (default ~/.cache/flower-shard; `none` turns it off)."""
    eval_fraction: float = bounded(0.05, 0, 1, open_lo=True, open_hi=True)
    """Fraction of documents held out for evaluation (text files, or records of .jsonl / .parquet
    files; chosen by a hash of the file's path and the record's index)."""
    seq_len: int = bounded(128, 1, 1 << 20)
    """Tokens per training sequence."""
    batch_size: int = bounded(4, 1, 1 << 20)
    """Sequences per rank per step (B_local); a group's batch is B_local x K."""
    lr: float = bounded(3e-3, 0, 10, open_lo=True)
    """Peak learning rate of the inner AdamW."""
    min_lr_ratio: float = bounded(0.1, 0, 1)
    """The cosine schedule decays to lr x min_lr_ratio at the last step."""
    warmup_frac: float = bounded(0.1, 0, 1, open_hi=True)
    """Fraction of all inner steps spent in linear warm-up."""
    weight_decay: float = bounded(0.1, 0, 100)
    """AdamW weight decay."""
    grad_clip: float = bounded(1.0, 0, 1e6)
    """Clip the gradient norm of each group to this value; 0 disables clipping."""
    bf16: bool = False
    """Compute in bfloat16 (FSDP2 MixedPrecisionPolicy); parameters and reductions stay float32."""
    seed: int = bounded(0, 0, 2**32 - 1)
    """Seed for model initialisation and data order; the same seed gives the same run."""
    eval_every: int = bounded(1, 0, MAX_STEPS)
    """Evaluate held-out perplexity every E rounds (and after the last round); 0 disables."""
    eval_sequences: int = bounded(64, 1, 1 << 24)
    """Held-out sequences per evaluation (the same set whatever the topology)."""
    checkpoint_every: int = bounded(0, 0, MAX_STEPS)
    """Save a checkpoint every C rounds (and after the last round) under OUT/checkpoints; 0 never.
    """
    keep_checkpoints: int = bounded(3, 0, MAX_STEPS)
    """Checkpoints kept per group (and on the server), newest first; 0 keeps all."""
    resume: str | None = None
    """Continue the run whose output directory this is, from its last good checkpoint (the run's
    settings must be the same; the number of ranks per group may differ)."""
    device: str = choice(C.AUTO, C.DEVICES)
    """`cuda` (NCCL), `cpu` (gloo), or `auto`: CUDA when it is available."""
    out: str = "runs/latest"
    """Output directory: metrics.jsonl, config.json and the prepared data."""
    quiet: bool = False
    """Do not show the rounds (a live progress bar on a terminal, else one line per round)."""
    tensorboard: bool = False
    """Also write each round's numeric metrics to OUT/tensorboard (scalars, step = round)."""

    @property
    def world_size(self) -> int:
        """N = G x K."""
        return self.groups * self.nproc_per_group

    @property
    def total_steps(self) -> int:
        """Inner steps over the whole run."""
        return self.rounds * self.local_steps

    def checkpoint_due(self, rnd: int) -> bool:
        """Whether a group saves a checkpoint after round ``rnd``: every C rounds and after
        the last one (never when C = 0)."""
        return bool(self.checkpoint_every) and (
            rnd % self.checkpoint_every == 0 or rnd == self.rounds
        )

    def validate(self) -> TrainConfig:
        """Raise :class:`ConfigError` on the first wrong value; return self when all is well.

        Field checks only: what needs the disk, ``transformers`` or CUDA (the data, the model
        directory, the tokenizer, a run to resume) is :func:`flower_shard.preflight.check`'s.
        """
        if self.adaptive_t:
            self._validate_adaptive()
        check_fields(self)  # every field's type and declared range (NaN and inf refused)
        check_choices(self)
        if self.world_size % self.nnodes:
            raise ConfigError(
                f"--nnodes {self.nnodes} does not divide the world size N = G x K = "
                f"{self.groups} x {self.nproc_per_group} = {self.world_size}: every host runs "
                "the same number of ranks"
            )
        if self.world_size > MAX_RANKS:
            raise ConfigError(
                f"N = G x K = {self.world_size} ranks: at most {MAX_RANKS}; use fewer groups or "
                "smaller ones"
            )
        check_degrees(self.world_size, self.groups, self.sharding, self.replicate)
        if self.compression != C.NO_COMPRESSION and self.sync_optimizer_state:
            raise ConfigError(
                "--compression covers the weights' pseudo-gradient, not AdamW's moments: drop "
                "--sync-optimizer-state or use --compression none"
            )
        self._validate_streaming_sync()
        if not self.text_column:
            raise ConfigError("--text-column must name a field of the records, got ''")
        self._validate_partition()
        return self

    def _validate_adaptive(self) -> None:
        """--adaptive-t's settings, together (their types and ranges are checked after)."""
        share, low, high = self.exchange_share, self.min_local_steps, self.max_local_steps
        numbers = all(isinstance(v, (int, float)) for v in (share, low, high))
        if numbers and not (0 < share < 1 and low <= high):  # `not (...)` also refuses NaN
            raise ConfigError(
                f"--adaptive-t needs --exchange-share in (0, 1) and --min-local-steps <= "
                f"--max-local-steps, got {share}, {low}, {high}"
            )

    def _validate_streaming_sync(self) -> None:
        """--outer-fragments and --outer-overlap with what they do not cover yet."""
        if self.outer_pace and not self.outer_overlap:
            raise ConfigError(
                "--outer-pace spreads an overlapped sync over the round: add --outer-overlap"
            )
        if self.outer_fragments == 1 and not self.outer_overlap:
            return
        options = "--outer-fragments/--outer-overlap"
        if self.outer_fragments > self.local_steps:
            raise ConfigError(
                f"--outer-fragments {self.outer_fragments} is above --local-steps "
                f"{self.local_steps}: each fragment syncs after its own step of the round; use "
                "at most T fragments"
            )
        refused = [
            (self.groups < 2, "need --groups >= 2 (G = 1 has no outer sync)"),
            (
                self.sync_optimizer_state,
                "move weights, not AdamW's moments: drop --sync-optimizer-state",
            ),
            (self.adaptive_t, "hide the exchange --adaptive-t sizes T by: drop --adaptive-t"),
        ]
        for wrong, why in refused:
            if wrong:
                raise ConfigError(f"{options} {why}")

    def _validate_partition(self) -> None:
        """The --partition settings that depend on each other (the choice and
        --dirichlet-alpha's range are checked with the other fields)."""
        if self.partition == C.DIRICHLET and not self.partition_label:
            raise ConfigError(
                "--partition dirichlet needs --partition-label: a field of the records, or "
                "`directory` (each document's top-level directory)"
            )
        if self.partition_label and self.partition != C.DIRICHLET:
            raise ConfigError(
                f"--partition-label applies to --partition dirichlet only, not {self.partition!r}; "
                "drop it or use --partition dirichlet"
            )

    def non_defaults(self) -> str:
        """``flag=value`` for each setting that differs from its default ("none" if none)."""
        default = TrainConfig()
        changed = [
            f"{f.name.replace('_', '-')}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        ]
        return " ".join(changed) or "none"

    def to_json(self, path: str | os.PathLike) -> None:
        """Write the configuration as JSON (what the ranks read)."""
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> TrainConfig:
        """Read a configuration written by :meth:`to_json`; unknown keys are an error."""
        raw = json.loads(Path(path).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"{path}: unknown configuration keys {unknown}")
        return cls(**raw)


def check_degrees(world_size: int, groups: int, sharding: str = C.FSDP, replicate: int = 1) -> None:
    """Raise :class:`ConfigError` unless N = G x K and K = R x S hold (the topology's degrees)."""
    n, g, r = world_size, groups, replicate
    if n < 1 or g < 1:
        raise ConfigError(f"world size {n} and groups {g} must both be >= 1")
    if n % g:
        raise ConfigError(
            f"world size N = {n} is not divisible by --groups {g}: N = G x K needs every "
            f"group to have the same K; use a G that divides {n} or change --nproc-per-group"
        )
    check_choice("--sharding", sharding, C.SHARDING_MODES)
    if sharding == C.FSDP and r != 1:
        raise ConfigError(f"--replicate {r} needs --sharding hsdp (FSDP has no replicate dim)")
    k = n // g
    if r < 1 or k % r:
        raise ConfigError(
            f"--replicate {r} does not divide the group size K = {k}: HSDP needs "
            f"K = R x S; pick R among {[d for d in range(1, k + 1) if k % d == 0]}"
        )
