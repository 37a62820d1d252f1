"""A rank's side of the streaming transport across rounds: pull the global model into its
shards, push its pseudo-gradient from them.

Each rank holds, besides its FSDP2 shards, its **view**: the flat float32 values of the last
global model it loaded, for exactly the element ranges its shards hold (M / K per rank). At the
start of a round it pulls the global model: a full snapshot (first round, after a restart, or
after missing a round) replaces the view, a compressed delta is added to it, and nothing comes
when the view already is the last committed model (the group evaluated it); the shards then
take the view's values, in place. At the end of the round it pushes ``view - local``, chunk by
chunk (computed per chunk: no second copy of the shard), through the uplink encoder (error
feedback per rank when compressed).

Pipelined commit (:mod:`.pipeline`): while it pushes, the rank *follows* the round on a second
connection, in a thread: each parameter's new values come into the view as soon as every group
has sent that parameter (the push has read it by then, so the view it subtracts from is never
changed under it; the shards are not touched from the thread). The next pull waits for that
thread, then asks whether the round was committed as followed: if so the shards take the view
(``current``), else a full snapshot comes.

Overlapped rounds (:mod:`flower_shard.flower.group.overlap`): :meth:`RankExchange.snapshot`
keeps a copy of the shards (``sent``, M / K float32) that :meth:`RankExchange.push` streams
from while the shards train on; :meth:`RankExchange.confirm` brings the view (not the shards)
to the committed model and :meth:`RankExchange.rebase` adds ``view - sent`` to the shards.

HSDP: the R replicas of a shard hold it bit-identically, so only replica 0 pulls and pushes;
it broadcasts what it pulled to the other replicas over the replicate process group (the fast
tier), and the group sends its shard across the slow link once.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from flower_shard.dataplane.client import DataPlaneError, RankLink, UplinkEncoder
from flower_shard.dataplane.layout import Layout, local_range

log = logging.getLogger(__name__)


class _Delta:
    """``view - local`` of one piece, computed per slice (what the encoder reads); ``local``
    is the shard itself or, overlapped, its snapshot (a numpy array)."""

    def __init__(self, view: np.ndarray, local):
        self.view, self.local, self.size = view, local, view.size

    def __getitem__(self, s: slice) -> np.ndarray:
        local = self.local[s]
        if not isinstance(local, np.ndarray):
            local = local.detach().float().cpu().numpy()
        return self.view[s] - local


class RankExchange:
    """One rank's view, encoder and pieces; see the module docstring.

    Parameters
    ----------
    model
        The group's FSDP2 model (this rank's shards).
    layout
        The run's parameter layout (the names must be the model's parameters).
    kind, scale_chunk, feedback
        The uplink's compression and error feedback.
    replicate_pg
        HSDP: the process group of this rank's replicas (None for FSDP).
    """

    def __init__(
        self, model, layout: Layout, kind: str, scale_chunk: int, feedback: bool, replicate_pg=None
    ):
        from torch.distributed.tensor import DTensor

        index = layout.index()
        params = dict(model.named_parameters())
        unknown = sorted(set(params) ^ set(index))
        if unknown:
            raise ValueError(f"the model and the run's layout differ in {unknown[:3]}")
        self.pieces = []  # (layout index, flat local view of the shard, start, stop)
        for name in sorted(params):
            p = params[name]
            local = p.to_local() if isinstance(p, DTensor) else p
            start, stop = local_range(p)
            if stop > start:
                self.pieces.append((index[name].index, local.data.view(-1), start, stop))
        self.layout = layout
        self.encoder = UplinkEncoder(kind, scale_chunk, feedback)
        self.view = {i: np.zeros(stop - start, np.float32) for i, _, start, stop in self.pieces}
        self.starts = {i: start for i, _, start, _ in self.pieces}
        """Parameter -> the first element of this rank's piece of it."""
        self.have_round = -1
        self.provisional = False
        """Whether ``have_round`` was followed and not yet confirmed as committed."""
        self.replicate_pg = replicate_pg
        self._follower: threading.Thread | None = None
        self._follow_link: RankLink | None = None
        self._followed: tuple[int, bool] | None = None
        """What the view holds once the follower is done: (round, provisional), or None."""
        self.sent: dict[int, np.ndarray] = {}
        """Overlapped: the weights whose update is out (or goes out next), per piece."""

    @property
    def leader(self) -> bool:
        """Whether this rank talks to the aggregators (replica 0 of its shard)."""
        return self.replicate_pg is None or self.replicate_pg.rank() == 0

    def ranges(self) -> list[tuple[int, int, int]]:
        return [(i, start, stop) for i, _, start, stop in self.pieces]

    def _into_view(self, how: str, param: int, start: int, values: np.ndarray) -> np.ndarray:
        """Put a downloaded chunk into the view; the view's slice it changed."""
        at = start - self.starts[param]
        view = self.view[param][at : at + values.size]
        if how == "delta":
            view += values
        else:
            view[:] = values
        return view

    def follow(self, link: RankLink) -> None:
        """Start following the round on ``link`` (a link of its own, closed when done)."""
        if not self.leader:
            link.close()
            return

        have, provisional = self.have_round, self.provisional
        wrote = [False]

        def sink(how: str, param: int, start: int, values: np.ndarray) -> None:
            wrote[0] = True
            self._into_view(how, param, start, values)

        def run() -> None:
            try:
                _, rnd, _ = link.download(
                    self.ranges(),
                    self.layout,
                    have,
                    sink=sink,
                    follow=True,
                    provisional=provisional,
                )
                self._followed = (rnd, True)
            except (DataPlaneError, ValueError) as exc:  # ValueError: its link was closed
                log.info("following the round: %s", exc)
                # the view is as before when nothing came (refused, or void before a value)
                self._followed = None if wrote[0] else (have, provisional)
            finally:
                link.close()

        self._followed = None
        self.have_round = -1  # the view changes under the thread: until it is done, unknown
        self._follower = threading.Thread(target=run, name="follow", daemon=True)
        self._follow_link = link
        self._follower.start()

    def _join_follower(self) -> None:
        if self._follower is None:
            return
        self._follower.join()
        self._follower = None
        if self._followed is not None:
            self.have_round, self.provisional = self._followed

    def pull(self, link: RankLink | None) -> str:
        """Load the global model into the shards (and the view); the mode it came in."""
        import torch

        mode = "none"
        if self.leader:
            self._join_follower()
            locals_ = {i: local for i, local, _, _ in self.pieces}

            def sink(how: str, param: int, start: int, values: np.ndarray) -> None:
                view = self._into_view(how, param, start, values)
                at = start - self.starts[param]
                target = locals_[param][at : at + values.size]
                target.copy_(torch.from_numpy(view).to(target.device))

            mode, rnd, _ = link.download(
                self.ranges(), self.layout, self.have_round, sink=sink, provisional=self.provisional
            )
            if mode == "current":  # nothing new: back to the global model it already holds
                for i, local, _, _ in self.pieces:
                    local.copy_(torch.from_numpy(self.view[i]).to(local.device))
            self.have_round, self.provisional = rnd, False
        if self.replicate_pg is not None:
            self._share_with_replicas()
        return mode

    def _share_with_replicas(self, shards: bool = True) -> None:
        """HSDP: replica 0's shards (unless not ``shards``) and view to the other replicas
        (replicate group)."""
        import torch
        import torch.distributed as dist

        pg = self.replicate_pg
        device = self.pieces[0][1].device if self.pieces else torch.device("cpu")
        for i, local, _, _ in self.pieces:
            view = torch.from_numpy(self.view[i])
            for t in (local, view) if shards else (view,):
                buf = t if t.device == device else t.to(device)
                dist.broadcast(buf, group=pg, group_src=0)
                if buf is not t:
                    t.copy_(buf.cpu())
        rnd = torch.tensor([self.have_round], dtype=torch.int64, device=device)
        dist.broadcast(rnd, group=pg, group_src=0)
        self.have_round = int(rnd.item())

    def push(self, link: RankLink | None, weight: float, snapshot: bool = False) -> None:
        """Stream ``view - local`` of every piece (replica 0 only); ``snapshot``: from the
        weights :meth:`snapshot` took, while the shards train on."""
        if not self.leader:
            return
        pieces = [
            (i, start, _Delta(self.view[i], self.sent[i] if snapshot else local))
            for i, local, start, _ in self.pieces
        ]
        link.upload(pieces, self.layout, weight, self.encoder)

    # -- the overlapped sync (flower_shard.flower.group.overlap) ------------------------------

    def confirm(self, link: RankLink | None) -> str:
        """Bring the view (not the shards) to the last committed global model: nothing when
        the round it followed was committed as followed, else the delta or a full snapshot;
        the mode it came in. HSDP: the replicas get the view."""
        mode = "none"
        if self.leader:
            self._join_follower()
            mode, rnd, _ = link.download(
                self.ranges(),
                self.layout,
                self.have_round,
                sink=self._into_view,
                provisional=self.provisional,
            )
            self.have_round, self.provisional = rnd, False
        if self.replicate_pg is not None:
            self._share_with_replicas(shards=False)
        return mode

    def rebase(self) -> None:
        """``local += view - sent``: the group's progress since it sent ``sent`` goes on top
        of the global model that came back for it (every replica: each has its own copy)."""
        import torch

        for i, local, _, _ in self.pieces:
            moved = np.subtract(self.view[i], self.sent[i])
            local.add_(torch.from_numpy(moved).to(local.device))

    def snapshot(self) -> None:
        """Keep a copy of the shards' weights (M / K float32) to push while they train on."""
        self.sent = {i: p.detach().float().cpu().numpy().copy() for i, p, _, _ in self.pieces}

    def forget(self) -> None:
        """Drop the snapshot and what the view is known to hold (after a failure). A follower
        still waiting is cut off: its round may not commit before this group replies."""
        self.sent = {}
        if self._follower is not None:
            self._follow_link.close()  # cancels its streams: the thread ends at once
        self._join_follower()
        self.have_round, self.provisional = -1, False
