"""The settings of ``flower-shard node`` (one Flower client: a torchrun group plus a
``flower-supernode``), their checks and their flags.

Light to import (no ``cryptography``, no torch): the CLI builds the ``node`` parser from here
for every command, and the generated reference reads the field docstrings.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from flower_shard.config import choices as C
from flower_shard.config.choices import check_choices, choice, choices_of
from flower_shard.config.federation import MAX_SECONDS
from flower_shard.config.ranges import MAX_PORT, bounded, check_address, check_fields
from flower_shard.config.train import MAX_LOCAL_RANKS
from flower_shard.errors import ConfigError
from flower_shard.preflight import check_data


@dataclass
class NodeConfig:
    """Settings of one node (a group plus its SuperNode).

    :meth:`validate` checks them before anything starts, files and keys included (a CA that is
    not PEM, a key that is not an EC key on a NIST curve, a public key that is not the private
    key's pair): what Flower would report only once the SuperNode runs fails here as a
    :class:`~flower_shard.errors.ConfigError` of one line that names the flag.
    """

    superlink: str = "127.0.0.1:8000"
    """SuperLink address (HOST:PORT) the SuperNode connects to."""
    nproc_per_group: int = bounded(2, 1, MAX_LOCAL_RANKS)
    """K: ranks in this node's group."""
    port: int | None = bounded(None, 1, MAX_PORT)
    """The SuperNode's local API port (distinct per node on one host); None picks a free one."""
    work_dir: str | None = None
    """Where the group keeps its socket, data, checkpoints and logs: a new path (created
    owner-only), or a directory of this user that no one else can write, kept when the node
    stops (its data cache and checkpoints serve the next start); None makes a private temporary
    dir, removed when the node stops."""
    data: str | None = None
    """This node's directory of text files, or a .jsonl / .parquet file whose run-config
    `text-column` holds the text (default: the standard library's source)."""
    device: str = choice(C.AUTO, C.DEVICES)
    """`cuda` (NCCL), `cpu` (gloo) or `auto`."""
    root_certificates: str | None = None
    """CA certificate (PEM) that signed a TLS SuperLink's certificate; None connects with
    --insecure (no TLS)."""
    auth_private_key: str | None = None
    """SuperNode authentication: this node's private key (EC on a NIST curve, unencrypted OpenSSH
    format, see flower_shard.flower.certificates.make_supernode_keys). Its public key must be
    registered first (`flwr supernode register KEY.pub CONNECTION`). Needs root_certificates."""
    auth_public_key: str | None = None
    """Optional: the public key registered for this node. Flower 1.42 derives it from the
    private key and no longer takes it; when given, it is checked to be the private key's pair
    before anything starts."""
    dump_dir: str | None = None
    """Debug: the group writes its weights at each stage of each round here."""
    poll_interval: float = bounded(0.1, 0, 3, open_lo=True)
    """The SuperNode's idle poll in seconds (Flower's own is 3 s; see fast_supernode)."""
    warm_clientapp: bool = True
    """Serve every message from one long-lived ClientApp process
    (flower_shard.flower.node.warm_superexec) instead of Flower's fresh process per message, which
    costs seconds of start-up per round. False: Flower's own process isolation between messages."""
    fault_file: str | None = None
    """Fault injection: the group spoils its replies as this file says (tests, drills)."""
    ready_timeout: float = bounded(180.0, 0, MAX_SECONDS, open_lo=True)
    """Seconds to wait for the group and the SuperNode to come up."""
    max_restarts: int = bounded(3, 0, 1000)
    """Restart the group up to this many times when it dies (a rank killed, out of memory);
    the SuperNode stays connected, so the group keeps its place and rejoins at the next round.
    0: the node exits when its group dies."""

    def validate(self) -> NodeConfig:
        """Raise :class:`ConfigError` (one line naming the flag) on the first wrong value, before
        anything starts; return self."""
        check_fields(self)  # types and declared ranges (NaN, inf, out-of-range ports refused)
        check_choices(self)
        check_address("--superlink", self.superlink)
        if self.data is not None:
            check_data(self.data)
        if self.work_dir is not None:
            check_work_dir(self.work_dir)
        for flag, path in (
            ("--root-certificates", self.root_certificates),
            ("--auth-supernode-private-key", self.auth_private_key),
            ("--auth-supernode-public-key", self.auth_public_key),
        ):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{flag} {path}: no such file")
        self._validate_security()
        return self

    def _validate_security(self) -> None:
        # Flower only reports these once the SuperNode runs (or as a traceback); checked here
        # they fail in one line that names the flag, before the group starts.
        from cryptography import x509

        from flower_shard.flower.certificates import (
            load_supernode_private_key,
            load_supernode_public_key,
        )

        if self.root_certificates is not None:
            try:
                x509.load_pem_x509_certificates(Path(self.root_certificates).read_bytes())
            except ValueError:
                raise ConfigError(
                    f"--root-certificates {self.root_certificates}: not a PEM certificate "
                    "(pass the CA file that signed the SuperLink's certificate)"
                ) from None
        if self.auth_public_key is not None and self.auth_private_key is None:
            raise ConfigError(
                "--auth-supernode-public-key needs --auth-supernode-private-key (the node "
                "signs with the private key; the public key alone authenticates nothing)"
            )
        if self.auth_private_key is None:
            return
        if self.root_certificates is None:
            raise ConfigError(
                "SuperNode authentication needs both --auth-supernode-private-key and "
                "--root-certificates CA: Flower authenticates SuperNodes only over TLS"
            )
        try:
            key = load_supernode_private_key(self.auth_private_key)
        except ValueError as exc:
            raise ConfigError(
                f"--auth-supernode-private-key {self.auth_private_key}: {exc}; make one with "
                "flower_shard.flower.certificates.make_supernode_keys or ssh-keygen -t ecdsa -b 384"
            ) from None
        if self.auth_public_key is not None:
            try:
                public = load_supernode_public_key(self.auth_public_key)
            except ValueError as exc:
                raise ConfigError(
                    f"--auth-supernode-public-key {self.auth_public_key}: {exc}"
                ) from None
            if public.public_numbers() != key.public_key().public_numbers():
                raise ConfigError(
                    f"--auth-supernode-public-key {self.auth_public_key} is not the public key "
                    f"of --auth-supernode-private-key {self.auth_private_key}: pass the pair "
                    "(or leave the public key out; Flower derives it)"
                )


def check_work_dir(path: str) -> None:
    """Raise :class:`ConfigError` unless ``--work-dir`` is a new path below a directory, or an
    existing directory that this user owns and that no one else can write: the node keeps its
    control socket, data and checkpoints there, and never changes the mode of a directory it
    did not create."""
    work = Path(path)
    if not work.exists():
        parent = next((p for p in work.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise ConfigError(f"--work-dir {path}: {parent} is not a directory")
        return
    info = work.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"--work-dir {path} is not a directory; give a directory or a new path")
    if info.st_uid != os.getuid():
        raise ConfigError(
            f"--work-dir {path} belongs to user {info.st_uid}, not to you ({os.getuid()}): give a "
            "directory of your own, or a new path (created owner-only)"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"--work-dir {path} can be written by others (mode {stat.S_IMODE(info.st_mode):o}): "
            "give a directory only you can write (chmod go-w), or a new path (created "
            "owner-only)"
        )


def add_node_flags(parser: argparse.ArgumentParser) -> None:
    d = NodeConfig()
    parser.add_argument("--superlink", default=d.superlink, help="SuperLink HOST:PORT")
    parser.add_argument(
        "--nproc-per-group",
        type=int,
        default=d.nproc_per_group,
        help="K: ranks in this node's group",
    )
    parser.add_argument("--port", type=int, default=None, help="the SuperNode's local API port")
    parser.add_argument(
        "--work-dir",
        default=None,
        help="socket, tokenised data, checkpoints and logs of the group, kept for the next start "
        "(default: a temporary directory, removed when the node stops)",
    )
    parser.add_argument(
        "--data",
        default=None,
        help="this node's directory of text files, or a .jsonl / .parquet file (the run "
        "config's text-column names the records' text field)",
    )
    parser.add_argument("--device", default=d.device, choices=_choices("device"))
    _add_security_flags(parser)
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=d.poll_interval,
        help="the SuperNode's idle poll in seconds (Flower's own: 3)",
    )
    parser.add_argument(
        "--no-warm-clientapp",
        dest="warm_clientapp",
        action="store_false",
        help="start a fresh ClientApp process per message (Flower's own; seconds per round)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=d.max_restarts,
        help="restart the group up to this many times when it dies (0: the node exits)",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=d.ready_timeout,
        help="seconds to wait for the group and for the SuperLink to accept the SuperNode "
        f"(default: {d.ready_timeout:g}); the node says every 15 s that it is still waiting",
    )
    parser.add_argument("--dump-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fault-file", default=None, help=argparse.SUPPRESS)


def _add_security_flags(parser: argparse.ArgumentParser) -> None:
    """TLS to the SuperLink and SuperNode authentication."""
    parser.add_argument(
        "--root-certificates",
        default=None,
        help="CA file (PEM) that signed a TLS SuperLink's certificate; without it: no TLS",
    )
    parser.add_argument(
        "--auth-supernode-private-key",
        dest="auth_private_key",
        default=None,
        help="this node's EC private key (OpenSSH format) for SuperNode authentication; its "
        "public key must be registered (flwr supernode register KEY.pub CONNECTION); needs "
        "--root-certificates",
    )
    parser.add_argument(
        "--auth-supernode-public-key",
        dest="auth_public_key",
        default=None,
        help="optional: the registered public key, checked to match the private key",
    )


def _choices(name: str) -> tuple[str, ...] | None:
    return choices_of(next(f for f in dataclasses.fields(NodeConfig) if f.name == name))


def node_config_from_args(args: argparse.Namespace) -> NodeConfig:
    """The one place where ``flower-shard node``'s flags become a NodeConfig (the flags are
    named after its fields)."""
    return NodeConfig(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(NodeConfig) if f.name in args}
    )


def own_work_dir(path: str | None) -> Path:
    """The node's work directory: a new private temporary one (None), a new one created
    owner-only (mode 0700), or an existing one, which :meth:`NodeConfig.validate` checked to be
    ours and writable by us alone. The mode of a directory the node did not create is never
    changed."""
    if path is None:
        return Path(tempfile.mkdtemp(prefix="flower-shard-node-"))
    work = Path(path)
    if not work.exists():
        work.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # made meanwhile: checked below
            work.mkdir(mode=0o700)
    check_work_dir(str(work))
    return work
