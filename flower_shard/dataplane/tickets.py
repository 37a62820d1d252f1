"""Per-round tickets: what a Flower message carries instead of weights.

The ServerApp holds a run secret (random, never sent). For each round and group it derives
the group's token ``HMAC(secret, "run|round|group")`` and sends it in that group's train message
(over Flower's own channel, TLS when the deployment has it) together with the aggregators'
addresses. A rank proves its stream's identity with ``HMAC(group token, "rank")``: bound to
(run, round, group, rank), useless for another round (replay) or another group. Aggregators,
given the secret by the ServerApp that started them, recompute and compare in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass


def new_secret() -> str:
    """A fresh run secret (256 bits, hex)."""
    return secrets.token_hex(32)


def group_token(secret: str, run: str, rnd: int, group: int) -> str:
    """The token of ``group`` for round ``rnd`` of run ``run``."""
    msg = f"{run}|{rnd}|{group}".encode()
    return hmac.new(bytes.fromhex(secret), msg, hashlib.sha256).hexdigest()


def rank_token(token: str, rank: int) -> str:
    """What rank ``rank`` of a group presents, derived from its group's token."""
    return hmac.new(bytes.fromhex(token), str(rank).encode(), hashlib.sha256).hexdigest()


def control_token(secret: str) -> str:
    """What the ServerApp presents on an aggregator's control calls."""
    return hmac.new(bytes.fromhex(secret), b"control", hashlib.sha256).hexdigest()


def valid(secret: str, run: str, rnd: int, group: int, rank: int, presented: str) -> bool:
    """Whether ``presented`` is rank ``rank`` of ``group``'s token for round ``rnd``."""
    want = rank_token(group_token(secret, run, rnd, group), rank)
    return hmac.compare_digest(want, str(presented))


@dataclass(frozen=True)
class Ticket:
    """What a group needs to use the data plane for one round (sent in its Flower message)."""

    run: str
    round: int
    group: int
    token: str
    addresses: tuple[str, ...]
    """Aggregator i listens at addresses[i]."""
    tls: bool
    """Whether to dial with TLS (the root certificate comes from the node's own settings)."""
    layout: str = ""
    """The digest of the server's layout (:meth:`~.layout.Layout.digest`): a group whose model
    is cut otherwise (another vocabulary) refuses to stream instead of sending garbage."""
    follow: bool = False
    """Whether the ranks download the round's new values while they upload (the pipelined
    commit, :mod:`.pipeline`)."""

    def to_config(self) -> dict:
        return {
            "run": self.run,
            "round": self.round,
            "group": self.group,
            "token": self.token,
            "addresses": ",".join(self.addresses),
            "tls": self.tls,
            "layout": self.layout,
            "follow": self.follow,
        }

    @classmethod
    def from_config(cls, config: dict) -> Ticket:
        return cls(
            run=str(config["run"]),
            round=int(config["round"]),
            group=int(config["group"]),
            token=str(config["token"]),
            addresses=tuple(a for a in str(config["addresses"]).split(",") if a),
            tls=bool(config["tls"]),
            layout=str(config.get("layout", "")),
            follow=bool(config.get("follow", False)),
        )
