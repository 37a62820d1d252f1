"""The caller's side of a group's control service (used by the ClientApp and the launcher)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from flower_shard import protocol as P
from flower_shard.errors import GroupError, GroupUnavailable
from flower_shard.flower import wire


class GroupClient:
    """Calls a group at ``address`` (``unix:/path/group.sock`` or ``127.0.0.1:PORT``).

    Every call has a deadline, so a missing or hung group gives a clear error, never a hang.
    """

    def __init__(self, address: str, connect_timeout: float = 10.0):
        import grpc

        self.address = address
        self.connect_timeout = connect_timeout
        self._channel = grpc.insecure_channel(address, options=wire.GRPC_OPTIONS)

    def call(
        self,
        method: str,
        header: dict | None = None,
        arrays: dict[str, np.ndarray] | None = None,
        timeout: float = 3600.0,
    ):
        import grpc

        missing = _missing_directory(self.address)
        if missing:  # no node made it: nothing will ever listen there, so do not wait for it
            raise GroupUnavailable(
                f"no flower-shard group answers at {self.address} (the directory {missing} "
                f"does not exist): start it with `flower-shard node`, or fix the node config "
                f"key {P.GROUP_ADDRESS!r}"
            )
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=self.connect_timeout)
        except grpc.FutureTimeoutError:
            ready.cancel()
            raise GroupUnavailable(
                f"no flower-shard group answers at {self.address} (waited "
                f"{self.connect_timeout:.0f} s): start it with `flower-shard node`, or fix the "
                f"node config key {P.GROUP_ADDRESS!r}"
            ) from None
        try:
            if method == P.HEALTH:
                stub = self._channel.unary_unary(f"/{P.SERVICE}/{method}")
                head, out = wire.decode(stub(wire.encode(header or {}), timeout=timeout))
            else:  # weights both ways as streams of frames (wire.frames)
                stub = self._channel.stream_stream(f"/{P.SERVICE}/{method}")
                head, out = wire.assemble(stub(wire.frames(header or {}, arrays), timeout=timeout))
        except grpc.RpcError as exc:
            raise GroupUnavailable(
                f"the group at {self.address} failed during {method}: {exc.code().name} "
                f"{exc.details()}"
            ) from None
        except ValueError as exc:  # a broken stream of frames
            raise GroupError(f"the group at {self.address} sent a bad reply: {exc}") from None
        if P.H_ERROR in head:
            raise GroupError(head[P.H_ERROR])
        return head, out

    def health(self) -> dict:
        return self.call(P.HEALTH, timeout=self.connect_timeout)[0]

    def close(self) -> None:
        self._channel.close()


def _missing_directory(address: str) -> Path | None:
    """The directory of a ``unix:`` address with an absolute path, if it does not exist. (A
    group that restarts keeps its node's work directory: only its socket comes and goes.)"""
    if not address.startswith("unix:"):
        return None
    path = address[len("unix:") :]
    path = path[2:] if path.startswith("//") else path  # unix:///abs is unix:/abs
    parent = Path(path).parent
    return parent if Path(path).is_absolute() and not parent.is_dir() else None
