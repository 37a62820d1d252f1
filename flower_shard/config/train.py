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
from flower_shard.errors import ConfigError


@dataclass
class TrainConfig:
    """Everything a group runtime needs to train; the CLI and the Flower apps fill it in."""

    groups: int = 2
    """G: number of loosely coupled groups; G = 1 is plain FSDP/HSDP over all ranks (baseline)."""
    nproc_per_group: int = 2
    """K: ranks per group; the world size is N = G x K."""
    nnodes: int = 1
    """Hosts the world spans; each host runs N / nnodes ranks (torchrun's --nnodes)."""
    local_steps: int = 4
    """T: inner optimizer steps per round; the groups synchronise once per round."""
    adaptive_t: bool = False
    """Choose each round's T from the last round's timings, keeping the exchange at most
    --exchange-share of the round (flower_shard/planning/adaptive.py). T starts at --local-steps;
    the budget stays rounds x local-steps inner steps, so the number of rounds varies."""
    exchange_share: float = 0.2
    """--adaptive-t: the largest share of a round that the exchange between groups may take."""
    min_local_steps: int = 1
    """--adaptive-t: the smallest T."""
    max_local_steps: int = 64
    """--adaptive-t: the largest T; with Flower's `round-seconds`, the most steps a group
    trains in one round."""
    rounds: int = 5
    """Number of rounds (outer synchronisations)."""
    sharding: str = choice(C.FSDP, C.SHARDING_MODES)
    """Sharding inside a group: `fsdp` (1-D shard mesh) or `hsdp` (replicate x shard)."""
    replicate: int = 1
    """R: replicate degree for HSDP; the shard degree is S = K / R. Must be 1 for FSDP."""
    outer: str = choice(C.FEDAVG, C.OUTER_OPTIMIZERS)
    """Outer optimizer: `fedavg` (the mean replaces the weights) or `nesterov` (DiLoCo)."""
    outer_lr: float = 0.7
    """Learning rate of the nesterov outer optimizer (DiLoCo uses 0.7)."""
    outer_momentum: float = 0.9
    """Momentum of the nesterov outer optimizer."""
    sync_optimizer_state: bool = False
    """Also average AdamW's first and second moments in the outer sync."""
    compression: str = choice(C.NO_COMPRESSION, C.COMPRESSIONS)
    """How each group sends its pseudo-gradient (global - local) between groups: `none`
    (float32), `bf16`, or `int8` (per-chunk scales); both transports
    (flower_shard/runtime/compression.py).
    """
    compression_chunk: int = 2048
    """int8: values per scale (one float32 scale per chunk: 4 / chunk bytes of overhead)."""
    error_feedback: bool = True
    """Carry what compression lost in one round into the next (per group); no effect for `none`.
    """
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
    dirichlet_alpha: float = 0.5
    """For `dirichlet`: the concentration; smaller is more skewed (0.1: most labels go to one
    group; 100: close to iid)."""
    tokenizer: str | None = None
    """Local Hugging Face tokenizer directory; None means the byte-level tokenizer."""
    data_workers: int = 0
    """Processes that tokenise the corpus, each streaming its pieces to disk in bounded memory
    (0: one per core). A host tokenises a corpus once: runs and nodes share the result through
    the cache in $FLOWER_SHARD_CACHE (default ~/.cache/flower-shard; `none` turns it off)."""
    eval_fraction: float = 0.05
    """Fraction of documents held out for evaluation (text files, or records of .jsonl / .parquet
    files; chosen by a hash of the file's path and the record's index)."""
    seq_len: int = 128
    """Tokens per training sequence."""
    batch_size: int = 4
    """Sequences per rank per step (B_local); a group's batch is B_local x K."""
    lr: float = 1e-3
    """Peak learning rate of the inner AdamW."""
    min_lr_ratio: float = 0.1
    """The cosine schedule decays to lr x min_lr_ratio at the last step."""
    warmup_frac: float = 0.1
    """Fraction of all inner steps spent in linear warm-up."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the gradient norm of each group to this value; 0 disables clipping."""
    bf16: bool = False
    """Compute in bfloat16 (FSDP2 MixedPrecisionPolicy); parameters and reductions stay float32."""
    seed: int = 0
    """Seed for model initialisation and data order; the same seed gives the same run."""
    eval_every: int = 1
    """Evaluate held-out perplexity every E rounds (and after the last round); 0 disables."""
    eval_sequences: int = 64
    """Held-out sequences per evaluation (the same set whatever the topology)."""
    checkpoint_every: int = 0
    """Save a checkpoint every C rounds (and after the last round) under OUT/checkpoints; 0 never.
    """
    keep_checkpoints: int = 3
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
        for flag, value in (
            ("--groups", self.groups),
            ("--nproc-per-group", self.nproc_per_group),
            ("--nnodes", self.nnodes),
            ("--local-steps", self.local_steps),
            ("--rounds", self.rounds),
            ("--seq-len", self.seq_len),
            ("--batch-size", self.batch_size),
            ("--eval-sequences", self.eval_sequences),
            ("--min-local-steps", self.min_local_steps),
            ("--max-local-steps", self.max_local_steps),
            ("--compression-chunk", self.compression_chunk),
        ):
            _positive(flag, value)
        check_choices(self)
        if not isinstance(self.data_workers, int) or not 0 <= self.data_workers <= 1024:
            raise ConfigError(
                f"--data-workers must be an integer in [0, 1024] (0: one per core), got "
                f"{self.data_workers!r}"
            )
        if self.world_size % self.nnodes:
            raise ConfigError(
                f"--nnodes {self.nnodes} does not divide the world size N = G x K = "
                f"{self.groups} x {self.nproc_per_group} = {self.world_size}: every host runs "
                "the same number of ranks"
            )
        check_degrees(self.world_size, self.groups, self.sharding, self.replicate)
        self._validate_rounds()
        self._validate_optimizers()
        if not 0 < self.eval_fraction < 1:
            raise ConfigError(f"--eval-fraction must be in (0, 1), got {self.eval_fraction}")
        if not self.text_column:
            raise ConfigError("--text-column must name a field of the records, got ''")
        self._validate_partition()
        return self

    def _validate_rounds(self) -> None:
        """T (fixed or adaptive), evaluation and checkpoints."""
        if self.adaptive_t and not (
            0 < self.exchange_share < 1 and self.min_local_steps <= self.max_local_steps
        ):
            raise ConfigError(
                f"--adaptive-t needs --exchange-share in (0, 1) and --min-local-steps <= "
                f"--max-local-steps, got {self.exchange_share}, {self.min_local_steps}, "
                f"{self.max_local_steps}"
            )
        if self.checkpoint_every < 0 or self.keep_checkpoints < 0:
            raise ConfigError(
                "--checkpoint-every and --keep-checkpoints must be >= 0 (0: never / keep all)"
            )
        if self.eval_every < 0:
            raise ConfigError(f"--eval-every must be >= 0 (0 disables), got {self.eval_every}")

    def _validate_optimizers(self) -> None:
        """The inner AdamW and its schedule, the outer optimizer and the exchange's compression."""
        if self.compression != C.NO_COMPRESSION and self.sync_optimizer_state:
            raise ConfigError(
                "--compression covers the weights' pseudo-gradient, not AdamW's moments: drop "
                "--sync-optimizer-state or use --compression none"
            )
        if self.lr <= 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 <= self.warmup_frac < 1:
            raise ConfigError(f"--warmup-frac must be in [0, 1), got {self.warmup_frac}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("--weight-decay and --grad-clip must be >= 0")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ConfigError(
                f"--outer-lr must be > 0 and --outer-momentum in [0, 1), got "
                f"{self.outer_lr} and {self.outer_momentum}"
            )

    def _validate_partition(self) -> None:
        """The --partition settings (the choice itself is checked with the others)."""
        if not self.dirichlet_alpha > 0:  # `not >` also refuses NaN
            raise ConfigError(
                "--dirichlet-alpha must be > 0 (smaller is more skewed), got "
                f"{self.dirichlet_alpha}"
            )
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


def _positive(flag: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{flag} must be a positive integer, got {value!r}")


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
