"""Send messages to the groups and collect their replies, timing each exchange on its own.

``Grid.send_and_receive`` sleeps 3 s between pulls; a round of a small model is a few seconds,
so the strategy pushes and pulls itself, every ``poll-interval``. Each call measures its own
push and wait (:class:`Exchange`): a round's statistics take them from the training exchange,
and a later exchange of the same round (the groups' evaluation) cannot change them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from logging import INFO

from flwr.app import Message
from flwr.common.logger import log
from flwr.serverapp import Grid


@dataclass(frozen=True)
class Times:
    """Where one send-and-receive's time went."""

    push_s: float = 0.0
    """Pushing the messages to the SuperLink."""
    reply_wait_s: float = 0.0
    """From the end of the push to the last reply (or to the timeout)."""


@dataclass(frozen=True)
class Exchange:
    """One send-and-receive: the replies (those that came in time) and its own times."""

    replies: list[Message]
    times: Times = field(default_factory=Times)


@dataclass(frozen=True)
class Pushed:
    """Messages pushed to the SuperLink, whose replies are to come."""

    ids: list[str]
    push_s: float


@dataclass(frozen=True)
class Messenger:
    """The strategy's link to the groups: the Grid, a timeout and a poll interval."""

    grid: Grid
    timeout: float
    poll_interval: float

    def node_ids(self) -> list[int]:
        return sorted(self.grid.get_node_ids())

    @property
    def run_id(self) -> int:
        return self.grid.run.run_id

    def send_and_receive(
        self, messages: list[Message], take: Callable[[Message], Message] | None = None
    ) -> Exchange:
        """:meth:`push`, then :meth:`receive`."""
        return self.receive(self.push(messages), take)

    def push(self, messages: list[Message]) -> Pushed:
        """Push the messages (the Grid gives them their ids)."""
        start = time.perf_counter()
        ids = list(self.grid.push_messages(messages)) if messages else []
        # None: a message the Grid could not push (no reply will come)
        return Pushed([i for i in ids if i], time.perf_counter() - start)

    def receive(self, pushed: Pushed, take: Callable[[Message], Message] | None = None) -> Exchange:
        """Pull every ``poll_interval`` until all replied or ``timeout`` passed.

        Replies are pulled one message at a time (the Grid inflates every reply a pull asks for
        at once) and each goes through ``take`` as it arrives, which keeps what it needs of the
        reply and returns what the exchange keeps (the reply, its arrays dropped): so the
        ServerApp holds one reply's arrays at a time, whatever the number of groups.
        """
        start = time.perf_counter()
        pending = list(pushed.ids)
        replies: list[Message] = []
        deadline = time.monotonic() + self.timeout
        while pending and time.monotonic() < deadline:
            for mid in list(pending):
                for msg in self.grid.pull_messages([mid]):
                    replies.append(take(msg) if take else msg)
                    if msg.metadata.reply_to_message_id in pending:
                        pending.remove(msg.metadata.reply_to_message_id)
            if pending:
                time.sleep(self.poll_interval)
        return Exchange(replies, Times(pushed.push_s, time.perf_counter() - start))

    def wait_for_nodes(self, count: int, timeout: float) -> None:
        """Wait until at least ``count`` nodes are connected; TimeoutError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while len(self.node_ids()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"fewer than min-groups {count} nodes connected within {timeout:.0f} s: "
                    "start more nodes, or lower min-groups"
                )
            time.sleep(self.poll_interval * 4)
        log(INFO, "%d group(s) connected", len(self.node_ids()))
