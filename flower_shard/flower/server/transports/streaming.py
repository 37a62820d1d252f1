"""The streaming transport: ranks stream their shards to aggregators; Flower carries tickets.

For large models across sites. The ServerApp starts A aggregator processes on its host (or
reaches ones started on other hosts), each owning about 1/A of the parameters with their outer
optimizer state (:mod:`flower_shard.dataplane`). Every round:

1. :meth:`begin_round` opens the round on every aggregator;
2. each group's message carries its ticket (:meth:`node_config`): the aggregators' addresses and
   the group's token for this round (bound to run, round and group; each rank derives its own);
3. every rank of every group pulls its shard of the global model, trains, and pushes its
   pseudo-gradient, chunk by chunk, straight to the aggregators (nothing through SuperLink,
   SuperNode or ClientApp), then the group replies over Flower with its metrics, its token
   count among them. With ``pipelined-commit`` the aggregators know the round's groups
   (:meth:`sending`; not those left out of the last round, nor any that declares a weight
   beyond what the robust rules' history allows) and fold each parameter once all of them
   sent it, and the ranks download the new values while they push
   (:mod:`flower_shard.dataplane.pipeline`);
4. :meth:`screen` checks each valid reply against what the aggregators received: every
   aggregator has the group's complete upload, declared with the same token count; then the
   robust rules on those weights and the norms the aggregators measured;
5. :meth:`aggregate` has the aggregators fold the accepted groups, in group order, and take the
   outer step (a round with fewer than min-groups valid groups commits none: the model stays).

With ``outer-overlap`` the groups push the update of the round before while they train
(:mod:`flower_shard.flower.group.overlap`): :meth:`sending` names only the groups that have
one, a ``held_back`` reply is neither folded nor judged, and the replies' steps and tokens
are those of the update streamed (:meth:`update_steps`).

The groups hold (and evaluate) the global model they pulled; the ServerApp never holds it but
at the end, when it fetches the final model from the aggregators. Server checkpoints include
every local aggregator's state.

On failure: a group whose upload is incomplete (it died mid-stream), refused (a bad chunk, a
wrong token) or inconsistent with its reply is left out of the round; its spool is dropped, not
folded. It pulls a full snapshot when it next takes part, so groups join and rejoin at any round.
"""

from __future__ import annotations

import json
import math
import time
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.common.logger import log

from flower_shard import protocol as P
from flower_shard.dataplane import tickets
from flower_shard.dataplane.client import DataPlaneError, RankLink
from flower_shard.dataplane.init import parameter_shapes
from flower_shard.dataplane.layout import Layout
from flower_shard.dataplane.pool import AggregatorPool
from flower_shard.flower.server import replies as R
from flower_shard.flower.server.exchange import Messenger
from flower_shard.flower.server.robust import RobustRules, Update
from flower_shard.flower.server.transports.base import Aggregate, Transport

SERVER_RANK = -1  # the ServerApp's identity when it downloads the final model


class StreamingTransport(Transport):
    """See the module docstring."""

    name = P.STREAMING
    groups_hold_model = True
    needs_initial_arrays = False
    reply_fields = R.SYNC_FIELDS

    def __init__(self, fed, initial):
        super().__init__(fed, initial)
        t = fed.train
        self.vocab_size = _vocab_size(fed)
        shapes = parameter_shapes(t.model, self.vocab_size, t.seq_len)
        self.spec = {name: (shape, "float32") for name, shape in shapes.items()}
        self.order = sorted(shapes)
        aggregators = len(fed.remote_aggregators()) or fed.aggregators
        self.layout = Layout.build(shapes, aggregators)
        self.run = tickets.new_secret()[:16]  # this ServerApp's run: tokens die with it
        self.pool: AggregatorPool | None = None
        self.round = 0
        self._status: dict[int, list[dict]] = {}
        self.rules = RobustRules(fed.outlier_factor, cap_weights=False)
        """The robust rules, for the whole run: they keep the accepted history."""
        self._sent: set[int] = set()
        self._left_out: set[int] = set()
        """The groups of the last round that were not accepted (not waited for next round)."""
        self.overlap = fed.train.outer_overlap
        if self.overlap:
            self.reply_fields = R.SYNC_FIELDS + (R.HELD_BACK_FIELD,)
        self._carried = 0
        """Overlapped: the steps of the round before, whose updates go out in this one (0: it
        drained, or this is the run's first or resumed round: nothing is pending)."""
        self._update_steps = 0

    # -- lifetime ------------------------------------------------------------------------------

    def open(self) -> None:
        fed, t = self.fed, self.fed.train
        root = Path(fed.dataplane_ca_certfile).read_bytes() if fed.dataplane_ca_certfile else None
        tls = None if fed.dataplane_insecure else (fed.dataplane_certfile, fed.dataplane_keyfile)
        remote = fed.remote_aggregators()
        if remote:
            secret = Path(fed.aggregator_secret_file).read_text().strip()
            self.pool = AggregatorPool(remote, secret, tls, root, fed.round_timeout)
            self.pool.wait_ready(fed.round_timeout)
        else:
            work = Path(t.out, "aggregators")
            self.pool = AggregatorPool.start_local(
                fed.aggregators, fed.dataplane_host, work, tls, root
            )
        settings = {
            "uplink": t.compression,
            "downlink": fed.downlink_compression,
            "scale_chunk": t.compression_chunk,
            "outer": t.outer,
            "outer_lr": t.outer_lr,
            "outer_momentum": t.outer_momentum,
            "follow_timeout": fed.round_timeout,
        }
        init = {"kind": "model", "model": t.model, "vocab_size": self.vocab_size, "seed": t.seed}
        self.pool.configure(self.run, self.layout, settings, init | {"seq_len": t.seq_len})
        log(
            INFO,
            "streaming data plane: %d aggregator(s) at %s",
            len(self.pool.addresses),
            ", ".join(self.pool.addresses),
        )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.stop()
            self.pool = None

    # -- a round -------------------------------------------------------------------------------

    def begin_round(self, server_round: int) -> None:
        self.round = server_round
        self._status = {}
        self.pool.begin(server_round)

    def sending(self, server_round: int, messages: list) -> None:
        """Name the round's groups to the aggregators (the pipelined commit waits for them)."""
        last_round = self._sent - self._left_out  # accepted (or held back) last round
        self._sent = {int(m.content[P.CONFIG][P.GROUP_INDEX]) for m in messages}
        steps = max((int(m.content[P.CONFIG][P.ROUND_STEPS]) for m in messages), default=0)
        groups = self._sent - self._left_out
        if self.overlap:
            steps, groups = self._overlapped(messages, steps, groups, last_round)
        self._update_steps = max(steps, self._carried)
        if self.fed.pipelined_commit and messages:
            # a group left out last round (dead, refused, outlier) is likely left out again:
            # waiting for it would void the pipelined fold; if it is accepted, the commit
            # folds again from the spools, as without pipelining
            self.pool.expect(server_round, sorted(groups), self.rules.weight_cap(steps))

    def _overlapped(
        self, messages: list, steps: int, groups: set[int], last_round: set[int]
    ) -> tuple[int, set[int]]:
        """Overlapped (:mod:`flower_shard.flower.group.overlap`): the most steps an update
        streamed this round covers, and the groups that stream one. A drain streams every
        group's pending update with this round's steps; another round the updates of the
        last round's steps, from the groups that trained it (the others hold theirs back)."""
        carried = self._carried
        if any(m.content[P.CONFIG].get(P.OUTER_DRAIN) for m in messages):
            self._carried = 0
            return carried + steps, groups
        self._carried = steps
        return carried, (groups & last_round) if carried else set()

    def update_steps(self, steps: int) -> int:
        return self._update_steps

    def node_config(
        self, server_round: int, run_id: int, rank: int, size: int, group: int = 0
    ) -> dict:
        token = tickets.group_token(self.pool.secret, self.run, server_round, group)
        ticket = tickets.Ticket(
            self.run,
            server_round,
            group,
            token,
            tuple(self.pool.addresses),
            tls=not self.fed.dataplane_insecure,
            layout=self.layout.digest(),
            follow=self.fed.pipelined_commit,
        )
        return {P.TICKET: json.dumps(ticket.to_config())}

    def screen(self, ok: list[R.TrainReply]) -> dict[int, str]:
        """Leave out a valid reply whose upload the aggregators do not hold whole, or declared
        another token count; then the robust rules (:mod:`~flower_shard.flower.server.robust`)
        on the declared weights and the norms the aggregators measured. The aggregators fold
        each update whole with its declared weight, so here a weight beyond its cap is
        rejected, not capped, and nothing is clipped; they report no update's largest
        coordinate, so that rule does not apply."""
        self._status = self.pool.status()
        out, index, updates = {}, [], []
        for i, reply in enumerate(ok):
            if reply.held_back:  # overlapped: nothing streamed, nothing to fold or judge
                continue
            reason = self._upload_problem(reply)
            if reason:
                out[i] = reason
                continue
            sq = sum(s["sq_norm"] for s in self._status[reply.group])
            index.append(i)
            updates.append(Update(float(reply.num_tokens), reply.steps, math.sqrt(sq)))
        decision = self.rules.judge(updates)
        return out | {index[j]: reason for j, reason in decision.rejected.items()}

    def _upload_problem(self, reply: R.TrainReply) -> str | None:
        parts = self._status.get(reply.group)
        if not parts:
            return "no upload reached the aggregators"
        for i, s in enumerate(parts):
            if not s:
                return f"no upload reached aggregator {i}"
            if s["rejected"]:
                return f"aggregator {i} refused the upload: {s['rejected']}"
            if not s["complete"]:
                have, want = s["received"], s["expected"]
                return f"incomplete upload: aggregator {i} has {have} of {want} values"
            if s["weight"] != float(reply.num_tokens):
                return f"the upload declared {s['weight']} tokens, the reply {reply.num_tokens}"
        return None

    def aggregate(self, server_round: int, ok: list[R.TrainReply], commit: bool) -> Aggregate:
        start = time.perf_counter()
        accepted = {r.group: float(r.num_tokens) for r in ok if not r.held_back} if commit else {}
        self.pool.commit(server_round, accepted)
        self._left_out = self._sent - {r.group for r in ok}
        sent = [sum(s["bytes"] for s in self._status.get(r.group, [])) for r in ok]
        return Aggregate(None, time.perf_counter() - start, int(max(sent, default=0)))

    # -- the end, checkpoints ------------------------------------------------------------------

    def final_weights(self, messenger: Messenger) -> dict[str, np.ndarray] | None:
        """The global model, downloaded from the aggregators parameter by parameter."""
        ticket = tickets.Ticket(
            self.run,
            self.round,
            SERVER_RANK,
            tickets.control_token(self.pool.secret),
            tuple(self.pool.addresses),
            tls=not self.fed.dataplane_insecure,
        )
        root = None
        if self.fed.dataplane_ca_certfile:
            root = Path(self.fed.dataplane_ca_certfile).read_bytes()
        link = RankLink(ticket, SERVER_RANK, root)
        link.token = ticket.token  # the control token itself, not a rank's
        out = {p.name: np.empty(p.shape, np.float32) for p in self.layout.params}
        flat = {p.index: out[p.name].reshape(-1) for p in self.layout.params}

        def sink(mode, param, start, values):
            flat[param][start : start + values.size] = values

        try:
            ranges = [(p.index, 0, p.numel) for p in self.layout.params]
            link.download(ranges, self.layout, -1, sink=sink)
        except DataPlaneError as exc:
            log(WARNING, "final weights: %s", exc)
            return None
        finally:
            link.close()
        return out

    def save_files(self, directory) -> None:
        if self.fed.remote_aggregators():
            log(WARNING, "aggregators on other hosts keep no checkpoint here")
            return
        self.pool.save(Path(directory))

    def load_files(self, directory) -> None:
        self.pool.load(Path(directory))


def _vocab_size(fed) -> int:
    """The run's vocabulary: the tokenizer's (or the byte tokenizer's), grown as the groups
    grow a preset's."""
    from flower_shard.data.tokenizers import load_tokenizer

    t = fed.train
    if t.data is not None:
        from flower_shard.data import pretokenized

        if pretokenized.is_pretokenized(t.data):
            return pretokenized.read_spec(Path(t.data)).vocab_size
    return load_tokenizer(t.tokenizer).vocab_size
