"""The outer sync on real torchrun process groups (gloo): exact averages, exact Nesterov steps."""

from __future__ import annotations

import pytest
import torch
from conftest import torchrun

from flower_shard.config import TrainConfig
from flower_shard.runtime.models import build_model

GROUPS = 2


def run_sync(tmp_path, corpus_dir, **overrides):
    cfg = TrainConfig(
        groups=GROUPS, local_steps=2, rounds=2, seq_len=32, batch_size=2, eval_every=0, **overrides
    )
    cfg.validate().to_json(tmp_path / "config.json")
    torchrun("outer_sync_check.py", cfg.world_size, tmp_path / "config.json", corpus_dir, tmp_path)

    def load(name):
        return [torch.load(tmp_path / f"{name}_g{g}.pt") for g in range(GROUPS)]

    return cfg, load


def assert_fedavg(cfg, load):
    for r in range(cfg.rounds):
        pre, post = load(f"pre_r{r}"), load(f"post_r{r}")
        names = [n for n in pre[0] if not n.startswith("_")]
        assert names, "nothing was gathered"
        # The groups really trained apart, or the test proves nothing.
        assert any(not torch.equal(pre[0][n], pre[1][n]) for n in names)
        for n in names:
            expected = (pre[0][n] + pre[1][n]) / 2
            for g in range(GROUPS):
                assert torch.equal(post[g][n], expected), (
                    f"round {r} group {g}: {n} is not the mean"
                )


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(dict(nproc_per_group=2, sync_optimizer_state=True), id="fsdp-with-moments"),
        pytest.param(dict(nproc_per_group=4, sharding="hsdp", replicate=2), id="hsdp-2x2"),
    ],
)
def test_fedavg_sync_is_the_exact_mean(tmp_path, corpus_dir, overrides):
    cfg, load = run_sync(tmp_path, corpus_dir, outer="fedavg", **overrides)
    assert_fedavg(cfg, load)
    if cfg.sync_optimizer_state:
        assert any(n.endswith("exp_avg_sq") for n in load("post_r0")[0])
    # One flat buffer of the rank's local shards: |model| / S values (+ 2 moments), never more.
    post = load("post_r0")[0]
    params = sum(t.numel() for n, t in post.items() if not n.startswith("_") and "exp_avg" not in n)
    copies = 3 if cfg.sync_optimizer_state else 1
    s = cfg.nproc_per_group // cfg.replicate
    payload = int(post["_payload_bytes"])
    assert payload <= 4 * copies * (params // s + 1024)
    # Each rank sends its share to the other group: all of it (FSDP), or, with R HSDP
    # replicas, one 1/R stripe, the replicas all-gathering the rest inside the group.
    stripe = 4 * -(-payload // 4 // cfg.replicate)
    assert int(post["_sent_bytes"]) == stripe  # 2 (G-1)/G = 1 for G = 2
    assert int(post["_replicate_bytes"]) == (cfg.replicate - 1) * stripe
    if cfg.replicate > 1:
        assert post["_replicas_agree"].item() == 1.0

    # A model built on the meta device and materialised after sharding starts equal in all groups.
    meta = load("meta")
    reference = build_model("tiny", 257, seed=0)
    for n, t in meta[0].items():
        if n != "_loss":  # each group's loss is on its own batch
            assert torch.equal(t, meta[1][n]), n
    assert torch.equal(meta[0]["_inv_freq"], reference.model.rotary_emb.inv_freq)
    assert torch.isfinite(meta[0]["_loss"]) and meta[0]["_loss"] < 7  # ~ln(257) at init
    std = meta[0]["model.layers.0.mlp.up_proj.weight"].std().item()
    assert abs(std - reference.config.initializer_range) < 0.002


def test_nesterov_matches_plain_torch_reference(tmp_path, corpus_dir):
    cfg, load = run_sync(tmp_path, corpus_dir, outer="nesterov", nproc_per_group=2)
    init = load("init")[0]
    names = [n for n in init if not n.startswith("_")]
    # Reference on full tensors, one SGD per tensor: w <- SGD_nesterov(w, grad = w - mean).
    weights = {n: torch.nn.Parameter(init[n].clone()) for n in names}
    sgd = torch.optim.SGD(
        weights.values(), lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True, foreach=False
    )
    for r in range(cfg.rounds):
        pre, post = load(f"pre_r{r}"), load(f"post_r{r}")
        for n in names:
            weights[n].grad = weights[n].detach() - (pre[0][n] + pre[1][n]) / 2
        sgd.step()
        for n in names:
            for g in range(GROUPS):
                assert torch.equal(post[g][n], weights[n].detach()), f"round {r} group {g}: {n}"
        # The outer step is not a plain average (else the test could not tell them apart).
        assert not torch.equal(post[0][names[0]], (pre[0][names[0]] + pre[1][names[0]]) / 2)


def shard_flat(state: dict, names: list[str], s: int, shards: int) -> torch.Tensor:
    """Rank s's flat local shards, rebuilt from full tensors: FSDP2 cuts dim 0 like torch.chunk."""
    parts = []
    for n in names:
        pieces = torch.chunk(state[n], shards, dim=0)
        parts.append(pieces[s].reshape(-1) if s < len(pieces) else torch.empty(0))
    return torch.cat(parts)


def unshard(flats: list[torch.Tensor], like: dict, names: list[str]) -> dict:
    offsets, out = [0] * len(flats), {}
    for n in names:
        pieces = []
        for s, flat in enumerate(flats):
            chunks = torch.chunk(like[n], len(flats), dim=0)
            size = chunks[s].numel() if s < len(chunks) else 0
            pieces.append(flat[offsets[s] : offsets[s] + size].view(-1, *like[n].shape[1:]))
            offsets[s] += size
        out[n] = torch.cat(pieces)
    return out


def test_int8_sync_is_the_exact_decoded_mean_with_error_feedback(tmp_path, corpus_dir):
    """Each rank compresses ITS shard of global - local (chunks of 64, residual carried over),
    all-gathers, and every group applies the same decoded mean: rebuilt here from full tensors."""
    from flower_shard.runtime import compression as Z

    chunk = 64
    cfg, load = run_sync(
        tmp_path, corpus_dir, outer="fedavg", compression="int8", compression_chunk=chunk
    )
    shards = cfg.nproc_per_group
    init = load("init")[0]
    names = [n for n in init if not n.startswith("_")]
    glob = {n: init[n] for n in names}
    residual = [[0.0] * shards for _ in range(GROUPS)]
    for r in range(cfg.rounds):
        pre, post = load(f"pre_r{r}"), load(f"post_r{r}")
        new_flats = []
        for s in range(shards):
            w = shard_flat(glob, names, s, shards)
            mean = torch.zeros_like(w)
            for g in range(GROUPS):
                target = (w - shard_flat(pre[g], names, s, shards)) + residual[g][s]
                decoded = Z.decompress(Z.compress(target, "int8", chunk), "int8", chunk)
                residual[g][s] = target - decoded
                mean.add_(decoded)
            new_flats.append(w - mean.div_(GROUPS))
        glob = unshard(new_flats, glob, names)
        exact_mean = {n: (pre[0][n] + pre[1][n]) / 2 for n in names}
        for n in names:
            for g in range(GROUPS):
                assert torch.equal(post[g][n], glob[n]), f"round {r} group {g}: {n}"
        # Compression really happened: close to the float32 mean, but not equal to it.
        assert any(not torch.equal(glob[n], exact_mean[n]) for n in names)
        err = max((glob[n] - exact_mean[n]).abs().max().item() for n in names)
        assert err < 1e-3
    # The payload is int8 plus one float32 scale per chunk of 64 values, per shard.
    numel = shard_flat(glob, names, 0, shards).numel()
    assert int(load("post_r0")[0]["_payload_bytes"]) == Z.payload_bytes("int8", numel, chunk)


def test_a_failed_stripe_raises_on_its_replica_and_hangs_no_one(tmp_path):
    """HSDP's striped exchange: when one replica's cross-group all-reduce fails, the other
    replica must not wait forever in the replicas' all-gather (gloo timeout here: 30 s)."""
    torchrun("striped_failure_check.py", 4, tmp_path, timeout=120)
    results = [(tmp_path / f"result_{r}.txt").read_text() for r in range(4)]
    # Ranks (group, replica): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1).
    assert results[0] == results[2] == "ok"
    assert results[1] == results[3] == "raised: injected: the peer group is gone"
