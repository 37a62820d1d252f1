"""Fragmented and overlapped outer sync (runtime/streaming_sync.py) on real torchrun groups.

Exactness where it is defined: one group with overlap and fragments is bit for bit training with
no outer sync; with two groups every sync event follows the documented rule, checked against an
independent reference on full tensors (gathered with DTensor.full_tensor, not the sync's flat
buffers); a run with overlap resumes bit-exactly from its checkpoints.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import torchrun, train_cli
from test_checkpoint import assert_same_state

from flower_shard import protocol as P
from flower_shard.config import TrainConfig
from flower_shard.config.federation import FederationConfig
from flower_shard.errors import ConfigError
from flower_shard.runtime import checkpoint as C
from flower_shard.runtime import compression as Z
from flower_shard.runtime.pacing import piece_bounds
from flower_shard.runtime.streaming_sync import due_step, window_steps
from flower_shard.ux import metrics as M


def run_events(tmp_path, corpus_dir, fragments, mode, **overrides):
    cfg = TrainConfig(local_steps=4, rounds=3, seq_len=32, batch_size=2, eval_every=0, **overrides)
    cfg.to_json(tmp_path / "config.json")  # G = 1 with fragments is refused by validate()
    torchrun(
        "streaming_sync_check.py",
        cfg.world_size,
        tmp_path / "config.json",
        corpus_dir,
        fragments,
        mode,
        tmp_path,
    )
    return [torch.load(tmp_path / f"events_g{g}.pt") for g in range(cfg.groups)]


def test_one_group_with_overlap_and_fragments_is_training_without_outer_sync(tmp_path, corpus_dir):
    (run,) = run_events(tmp_path, corpus_dir, 2, "overlap", groups=1, nproc_per_group=2)
    final = run["events"][-1]["after"]
    assert len(run["events"]) == 2 * 3 + 1  # 2 fragments x 3 rounds, then the drain
    for name, t in run["plain"].items():
        assert torch.equal(final[name], t), name
    assert not torch.equal(final[name], run["events"][0]["before"][name])  # it trained


def reference_outer(kind):
    """The outer step on full tensors, one parameter at a time (plain torch SGD for nesterov)."""
    state = {}

    def step(name, x, mean):
        if kind == "fedavg":
            return mean
        if name not in state:
            w = torch.nn.Parameter(x.clone())
            state[name] = (w, torch.optim.SGD([w], lr=0.7, momentum=0.9, nesterov=True))
        w, sgd = state[name]
        w.grad = w.detach() - mean
        sgd.step()
        return w.detach().clone()

    return step


def check_rule(runs, overlap, kind):
    """Replay every group's sync events with the documented rule on full tensors."""
    groups = len(runs)
    compare = torch.equal if kind == "fedavg" else (lambda a, b: torch.allclose(a, b, atol=1e-6))
    outer = reference_outer(kind)
    globals_ = dict(runs[0]["init"])  # every group starts from the same weights
    sent = [{} for _ in runs]
    fragments = runs[0]["fragments"]
    trained_apart = False
    for e, event in enumerate(runs[0]["events"]):
        names = fragments[event["fragment"]] if event["fragment"] is not None else None
        per_group = [run["events"][e] for run in runs]
        for g, ev in enumerate(per_group):  # other fragments are untouched by this event
            for n in ev["before"]:
                if names is not None and n not in names:
                    assert torch.equal(ev["after"][n], ev["before"][n]), (e, g, n)
        for n in names or list(globals_):
            trained_apart |= not torch.equal(per_group[0]["before"][n], per_group[-1]["before"][n])
            if overlap:
                if n in sent[0]:  # the last sync's result is in: rebase every group on it
                    globals_[n] = outer(n, globals_[n], sum(s[n] for s in sent) / groups)
                    rebased = [
                        ev["before"][n] + (globals_[n] - sent[g][n])
                        for g, ev in enumerate(per_group)
                    ]
                else:
                    rebased = [ev["before"][n] for ev in per_group]
                if names is None:  # the drain: one synchronous sync after the rebase
                    globals_[n] = outer(n, globals_[n], sum(rebased) / groups)
                    expected = [globals_[n]] * groups
                else:
                    expected = rebased
                    for g in range(groups):
                        sent[g][n] = rebased[g]
            else:
                mean = sum(ev["before"][n] for ev in per_group) / groups
                globals_[n] = outer(n, globals_[n], mean)
                expected = [globals_[n]] * groups
            for g, ev in enumerate(per_group):
                assert compare(ev["after"][n], expected[g]), (e, g, n)
    assert trained_apart, "the groups never differed: the test would prove nothing"
    final = [run["events"][-1]["after"] for run in runs]
    for n in final[0]:
        assert torch.equal(final[0][n], final[-1][n]), n  # the drain leaves one global model


def reference_apply(kind):
    """The outer step from a mean pseudo-gradient on a fragment's flat full tensor."""
    state = {}

    def apply(f, x, mean):
        if kind == "fedavg":
            return x - mean
        if f not in state:
            w = torch.nn.Parameter(x.clone())
            state[f] = (w, torch.optim.SGD([w], lr=0.7, momentum=0.9, nesterov=True))
        w, sgd = state[f]
        w.grad = mean.clone()
        sgd.step()
        return w.detach().clone()

    return apply


def check_compressed_rule(runs, overlap, kind, compression, chunk):
    """Replay every sync event of a compressed run (K = 1, so a rank's flat buffer is the
    fragment's full tensors in order) with the documented rule: each group sends its
    fragment's pseudo-gradient against the last global weights plus its own residual, int8
    chunks starting at the fragment's first value; the mean of the decoded payloads steps the
    outer optimizer; an overlapped group rebases on the result one sync later."""
    groups, fragments = len(runs), runs[0]["fragments"]
    compare = torch.equal if kind == "fedavg" else (lambda a, b: torch.allclose(a, b, atol=1e-6))
    apply = reference_apply(kind)

    def flat(state, f):
        return torch.cat([state[n].reshape(-1).float() for n in fragments[f]])

    x = {f: flat(runs[0]["init"], f) for f in range(len(fragments))}
    residual = [{f: torch.zeros_like(x[f]) for f in x} for _ in runs]
    sent, pending = [{} for _ in runs], {}
    lost = 0.0

    def send(f, weights):
        """Each group's decoded payload for ``weights``; updates the residuals."""
        nonlocal lost
        decoded = []
        for g in range(groups):
            target = (x[f] - weights[g]) + residual[g][f]
            d = Z.decompress(Z.compress(target, compression, chunk), compression, chunk)
            residual[g][f] = target - d
            lost = max(lost, residual[g][f].abs().max().item())
            decoded.append(d)
        return decoded

    def rebase(f, before):
        if f not in pending:
            return before
        x[f] = apply(f, x[f], sum(pending.pop(f)) / groups)
        return [before[g] + (x[f] - sent[g][f]) for g in range(groups)]

    for e, event in enumerate(runs[0]["events"]):
        per_group = [run["events"][e] for run in runs]
        targets = [event["fragment"]] if event["fragment"] is not None else list(x)
        for f in targets:
            before = [flat(ev["before"], f) for ev in per_group]
            if overlap and event["fragment"] is not None:
                expected = rebase(f, before)
                pending[f] = send(f, expected)
                for g in range(groups):
                    sent[g][f] = expected[g]
            else:  # a blocking sync, or the drain: the pending result, then a blocking sync
                weights = rebase(f, before) if overlap else before
                x[f] = apply(f, x[f], sum(send(f, weights)) / groups)
                expected = [x[f]] * groups
            for g, ev in enumerate(per_group):
                assert compare(flat(ev["after"], f), expected[g]), (e, g, f)
    assert lost > 0, "compression lost nothing: the residual would prove nothing"
    final = [run["events"][-1]["after"] for run in runs]
    for n in final[0]:
        assert torch.equal(final[0][n], final[-1][n]), n  # the drain leaves one global model


@pytest.mark.parametrize(
    "mode,kind,compression",
    [
        ("overlap", "fedavg", "int8"),
        ("blocking", "fedavg", "int8"),
        ("overlap", "nesterov", "bf16"),
        ("paced", "fedavg", "int8"),
    ],
)
def test_compressed_sync_events_follow_the_rule_with_error_feedback(
    tmp_path, corpus_dir, mode, kind, compression
):
    chunk = 100  # several int8 chunks per fragment, and chunks that straddle parameters
    runs = run_events(
        tmp_path, corpus_dir, 2, mode, groups=2, nproc_per_group=1, outer=kind,
        compression=compression, compression_chunk=chunk,
    )  # fmt: skip
    check_compressed_rule(runs, mode != "blocking", kind, compression, chunk)


@pytest.mark.parametrize("mode", ["overlap", "paced"])
def test_hsdp_stripes_the_overlapped_sync_and_follows_the_rule(tmp_path, corpus_dir, mode):
    runs = run_events(
        tmp_path, corpus_dir, 2, mode, groups=2, nproc_per_group=4, sharding="hsdp",
        replicate=2,
    )  # fmt: skip
    check_rule(runs, True, "fedavg")
    for payload, sent, replicate in runs[0]["stats"]:  # rank 0's shard: half of the model
        # G = 2 sends 2 (G-1)/G x its stripe: half of the payload (a few values of padding
        # per fragment), and all-gathers the other half from its replica inside the group.
        assert payload // 2 <= sent <= payload // 2 + 2 * 4, (payload, sent)
        assert replicate == sent, (payload, sent, replicate)


@pytest.mark.parametrize(
    "fragments,mode,kind",
    [
        (2, "overlap", "fedavg"),
        (3, "blocking", "fedavg"),
        (2, "overlap", "nesterov"),
        (2, "paced", "fedavg"),
        (1, "paced", "nesterov"),
    ],
)
def test_every_sync_event_follows_the_rule_on_full_tensors(
    tmp_path, corpus_dir, fragments, mode, kind
):
    runs = run_events(
        tmp_path, corpus_dir, fragments, mode, groups=2, nproc_per_group=1, outer=kind
    )
    check_rule(runs, mode != "blocking", kind)
    check_pacing(runs, fragments, mode == "paced")


def check_pacing(runs, fragments, paced, steps=4):
    """Paced, the pacer's thread held pieces of an exchange back after its sync point (they go
    out over the window: the time to the next fragment's sync point); unpaced, nothing."""
    for run in runs:
        assert len(run["unsent"]) == 3 * steps
        assert max(run["unsent"]) > 0 if paced else max(run["unsent"]) == 0, run["unsent"]


@pytest.mark.parametrize(
    "fragments,steps,windows", [(1, 4, [4]), (2, 4, [2, 2]), (3, 4, [1, 2, 1]), (3, 8, [3, 3, 2])]
)
def test_a_paced_exchange_gets_the_steps_to_the_next_sync_point(fragments, steps, windows):
    dues = [due_step(f, fragments, steps) for f in range(fragments)]
    assert [window_steps(f, fragments, steps) for f in range(fragments)] == windows
    assert sum(windows) == steps and dues[-1] == steps  # the windows tile the round


RUN = (
    "--groups", "2", "--nproc-per-group", "2", "--local-steps", "2", "--rounds", "4",
    "--seq-len", "32", "--batch-size", "2", "--outer", "nesterov", "--eval-every", "0",
    "--checkpoint-every", "2", "--outer-fragments", "2", "--outer-overlap", "--quiet",
)  # fmt: skip


def test_an_overlapped_run_resumes_bit_exactly(tmp_path):
    straight = tmp_path / "straight"
    train_cli(straight, *RUN)
    crashed = tmp_path / "crashed"
    shutil.copytree(straight, crashed)
    for g in (0, 1):  # the run died in round 3 or 4: round 2's checkpoint is the newest
        shutil.rmtree(C.round_dir(crashed / "checkpoints" / f"group_{g}", 4))
    resumed = tmp_path / "resumed"
    train_cli(resumed, *RUN, "--resume", str(crashed))
    rounds = M.read_metrics(resumed)
    assert [r[P.ROUND] for r in rounds] == [1, 2, 3, 4]
    assert rounds[:2] == M.read_metrics(straight)[:2]
    for g in (0, 1):
        assert_same_state(
            C.round_dir(straight / "checkpoints" / f"group_{g}", 4),
            C.round_dir(resumed / "checkpoints" / f"group_{g}", 4),
            tmp_path,
        )


@pytest.mark.parametrize(
    "overrides,words",
    [
        (dict(outer_fragments=5, local_steps=4), "--outer-fragments 5 is above --local-steps 4"),
        (dict(outer_overlap=True, groups=1), "need --groups >= 2"),
        (dict(outer_fragments=2, sync_optimizer_state=True), "drop --sync-optimizer-state"),
        (dict(outer_fragments=2, adaptive_t=True), "drop --adaptive-t"),
        (dict(outer_fragments=0), "--outer-fragments must be a positive integer"),
        (dict(outer_pace=True, outer_fragments=2), "--outer-pace spreads an overlapped sync"),
    ],
)
def test_settings_it_does_not_cover_fail_in_one_line(overrides, words):
    with pytest.raises(ConfigError) as err:
        TrainConfig(**overrides).validate()
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "config,words",
    [
        ({"outer-fragments": 2, "transport": "streaming"}, "not through Flower"),
        ({"outer-pace": True, "outer-overlap": True, "transport": "streaming"}, "outer-pace runs"),
        ({"outer-overlap": True}, "set transport = 'streaming'"),
        ({"outer-overlap": True, "transport": "collective"}, "not on 'collective'"),
        (
            {"outer-overlap": True, "transport": "streaming", "pipelined-commit": False},
            "keep pipelined-commit = true",
        ),
        (
            {"outer-overlap": True, "transport": "streaming", "adaptive-t": True},
            "drop adaptive-t",
        ),
    ],
)
def test_a_flower_run_config_they_do_not_cover_is_refused(config, words):
    """Through Flower, overlap runs on the streaming transport (tests/test_streaming.py), with
    the pipelined commit, and fixed or time-budgeted rounds; fragments not at all."""
    with pytest.raises(ConfigError) as err:
        FederationConfig.from_run_config(config)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_streaming_run_config_with_overlap_is_accepted():
    streaming = {"transport": "streaming", "dataplane-insecure": True}
    fed = FederationConfig.from_run_config({"outer-overlap": True} | streaming)
    assert fed.train.outer_overlap and fed.group_config()["outer-overlap"] is True


@pytest.mark.parametrize("total,pieces", [(10, 4), (3, 8), (1, 1), (4097, 7), (8, 8)])
def test_pieces_cover_the_buffer_once_in_order_and_about_equally(total, pieces):
    bounds = piece_bounds(total, pieces)
    assert len(bounds) == min(pieces, total)
    assert [a for a, _ in bounds] == [0] + [b for _, b in bounds[:-1]] and bounds[-1][1] == total
    sizes = [b - a for a, b in bounds]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
