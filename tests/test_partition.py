"""Partitioners (--partition iid | by-source | dirichlet): pure functions and small corpora."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flower_shard import protocol as P
from flower_shard.config import ConfigError, TrainConfig
from flower_shard.config.federation import FederationConfig
from flower_shard.data.batches import rank_batches
from flower_shard.data.corpus import load_blocks, load_documents, prepare_corpus
from flower_shard.data.partition import (
    DIRICHLET_ATTEMPTS,
    block_documents,
    by_source_groups,
    dirichlet_groups,
    partition,
    partition_data,
)
from flower_shard.data.sources import count_sources, source_of
from flower_shard.preflight import check, check_fits
from flower_shard.ux.cli import build_parser, config_from_args

SEQ = 31  # blocks of 32 tokens: a few hundred blocks from the small corpus below


@pytest.fixture
def text_corpus(tmp_path):
    """Five sources of very different sizes: three directories (one nested) and two top files."""
    root = tmp_path / "text"
    rng = np.random.default_rng(0)
    layout = {"big/a": 9, "big/deep/b": 3, "mid": 5, "small": 2, "top1.txt": 0, "top2.txt": 0}
    for where, n_files in layout.items():
        if n_files == 0:  # a file at the top level: a source of its own
            (root / where).parent.mkdir(parents=True, exist_ok=True)
            (root / where).write_text("x" * int(rng.integers(500, 1500)))
            continue
        (root / where).mkdir(parents=True, exist_ok=True)
        for i in range(n_files):
            letter = where[0]  # each source has its own text, so a block's origin is visible
            (root / where / f"f{i}.txt").write_text(letter * int(rng.integers(1500, 4000)))
    return root


def flat(parts):
    return np.concatenate([p for g in parts for p in g])


def assert_disjoint_and_covering(parts, n_blocks):
    assert np.array_equal(np.sort(flat(parts)), np.arange(n_blocks))


# -- iid: today's partition, unchanged ---------------------------------------------------------


def test_iid_is_unchanged():
    # Pinned values of the partition before the partitioners existed: runs and results hold.
    got = [[p.tolist() for p in g] for g in partition(12, 2, 2, seed=3)]
    assert got == [[[11, 7, 2], [10, 0, 1]], [[4, 6, 9], [5, 3, 8]]]
    got = [[p.tolist() for p in g] for g in partition(10, 3, 1, seed=0)]
    assert got == [[[4, 6, 2, 7]], [[3, 5, 9]], [[0, 8, 1]]]


def test_iid_through_partition_data_is_the_plain_permutation(text_corpus, tmp_path):
    prepare_corpus(tmp_path / "prep", text_corpus, eval_fraction=0.2)
    n = len(load_blocks(tmp_path / "prep", "train", SEQ))
    parts = partition_data(tmp_path / "prep", SEQ, 2, 3, seed=7)
    perm = np.random.default_rng(7).permutation(n)
    half = (n + 1) // 2  # np.array_split: the first parts take the remainder
    expected = [np.array_split(perm[:half], 3), np.array_split(perm[half:], 3)]
    assert all(np.array_equal(a, b) for ga, gb in zip(parts, expected) for a, b in zip(ga, gb))


# -- documents, sources, blocks ----------------------------------------------------------------


def test_sources_and_block_documents(text_corpus, tmp_path):
    assert source_of("big/deep/b/f0.txt") == "big" and source_of("top1.txt") == "top1.txt"
    assert source_of("data.jsonl") == "data.jsonl"
    assert count_sources(text_corpus) == 5
    # A block belongs to the document holding its first token: blocks of 4 over docs at 0, 5, 12.
    starts = np.array([0, 5, 12])
    assert block_documents(starts, 5, 3).tolist() == [0, 0, 1, 2, 2]

    prepare_corpus(tmp_path / "prep", text_corpus, eval_fraction=0.2)
    docs = load_documents(tmp_path / "prep")
    train = np.load(tmp_path / "prep" / "train.npy")
    assert docs.starts[0] == 0 and np.all(np.diff(docs.starts) > 0)
    # Every document starts right after an end-of-document token (256), with its source's letter.
    assert np.all(train[docs.starts[1:] - 1] == 256)
    letters = {
        chr(int(train[s])) for s in docs.starts[docs.source_ids == docs.sources.index("mid")]
    }
    assert letters == {"m"} and docs.label_ids is None


# -- by-source ----------------------------------------------------------------------------------


def test_by_source_is_longest_first_onto_the_lightest_group():
    # Blocks per source id: 0:50, 1:30, 2:20, 3:20, 4:10 (interleaved in the stream).
    sources = np.repeat(np.arange(5), [50, 30, 20, 20, 10])
    sources = sources[np.random.default_rng(0).permutation(len(sources))]
    parts = by_source_groups(sources, 2)
    # 50 -> g0; 30 -> g1; 20 (id 2) -> g1 (30 < 50); 20 (id 3) -> g0 (50 = 50: lower group);
    # 10 -> g1 (60 < 70).
    assert [sorted(set(sources[p].tolist())) for p in parts] == [[0, 3], [1, 2, 4]]
    assert [len(p) for p in parts] == [70, 60]
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(sources)))
    with pytest.raises(ConfigError, match="fewer than the 6 groups; use at most 5 groups"):
        by_source_groups(sources, 6)


@pytest.mark.parametrize("groups,k", [(2, 1), (3, 2), (5, 1)])
def test_by_source_gives_whole_sources_disjoint_and_covering(text_corpus, tmp_path, groups, k):
    prepare_corpus(tmp_path / "prep", text_corpus, eval_fraction=0.2)
    n = len(load_blocks(tmp_path / "prep", "train", SEQ))
    docs = load_documents(tmp_path / "prep")
    block_source = docs.source_ids[block_documents(docs.starts, n, SEQ)]
    parts = partition_data(tmp_path / "prep", SEQ, groups, k, seed=1, how="by-source")
    assert len(parts) == groups and all(len(g) == k for g in parts)
    assert_disjoint_and_covering(parts, n)
    owners = {}
    for g, ranks in enumerate(parts):
        for s in set(block_source[np.concatenate(ranks)].tolist()):
            assert owners.setdefault(s, g) == g, f"source {docs.sources[s]} split over groups"
    assert len(owners) == 5
    # The seed moves blocks between a group's ranks, never between groups.
    other = partition_data(tmp_path / "prep", SEQ, groups, k, seed=2, how="by-source")
    for ga, gb in zip(parts, other):
        assert np.array_equal(np.sort(np.concatenate(ga)), np.sort(np.concatenate(gb)))
    again = partition_data(tmp_path / "prep", SEQ, groups, k, seed=1, how="by-source")
    assert all(np.array_equal(a, b) for ga, gb in zip(parts, again) for a, b in zip(ga, gb))
    if k > 1:
        assert not all(np.array_equal(a, b) for a, b in zip(parts[0], other[0]))


def test_by_source_batches_come_from_the_groups_sources(text_corpus, tmp_path):
    prepare_corpus(tmp_path / "prep", text_corpus, eval_fraction=0.2)
    # 2 groups: "big" (12 files) alone is the heaviest; everything else goes to the other group.
    seen = []
    for group in (0, 1):
        it = rank_batches(tmp_path / "prep", SEQ, 2, 2, 1, group, 0, seed=0, how="by-source")
        letters = set()
        for _ in range(20):
            x, _ = next(it)
            letters |= {chr(int(t)) for t in x[:, 0] if int(t) < 256}
        seen.append(letters)
    assert seen[0] == {"b"} and "b" not in seen[1] and seen[1] <= {"m", "s", "x"}


# -- dirichlet ----------------------------------------------------------------------------------


def expected_dirichlet(labels, groups, alpha, seed):
    """The documented algorithm, written out again: per sorted label, Dirichlet proportions,
    cuts at floor(cumsum * n), pieces in stream order to groups 0..G-1."""
    rng = np.random.default_rng(seed)
    out = [[] for _ in range(groups)]
    for label in sorted(set(labels.tolist())):
        where = [i for i, v in enumerate(labels.tolist()) if v == label]
        p = rng.dirichlet([alpha] * groups)
        bounds = [0] + [int(c) for c in np.cumsum(p)[:-1] * len(where)] + [len(where)]
        for g in range(groups):
            out[g] += where[bounds[g] : bounds[g + 1]]
    return [sorted(x) for x in out]


def skew(labels, parts):
    """Mean over labels of the largest share of a label's blocks that one group holds."""
    shares = []
    for label in np.unique(labels):
        counts = [np.sum(labels[p] == label) for p in parts]
        shares.append(max(counts) / sum(counts))
    return float(np.mean(shares))


def synthetic_labels(n_labels=12, per_label=400, seed=0):
    labels = np.repeat(np.arange(n_labels), per_label)
    return labels[np.random.default_rng(seed).permutation(len(labels))]


@pytest.mark.parametrize("alpha", [0.05, 0.5, 5.0])
def test_dirichlet_histograms_are_exactly_the_documented_draws(alpha):
    labels = synthetic_labels()
    parts = dirichlet_groups(labels, 4, alpha, seed=11)
    expected = expected_dirichlet(labels, 4, alpha, seed=11)
    assert [p.tolist() for p in parts] == expected
    hist = np.array([[np.sum(labels[p] == c) for c in range(12)] for p in parts])
    assert hist.sum(axis=0).tolist() == [400] * 12  # every block of every label, once


def test_dirichlet_skew_grows_as_alpha_shrinks():
    labels = synthetic_labels()
    skews = [skew(labels, dirichlet_groups(labels, 4, a, seed=3)) for a in (100, 1, 0.1, 0.01)]
    assert skews == sorted(skews) and skews[0] < 0.4 and skews[-1] > 0.95, skews
    # iid for reference: every group holds about a quarter of every label.
    assert skew(labels, np.array_split(np.random.default_rng(3).permutation(len(labels)), 4)) < 0.3


def test_dirichlet_draws_again_until_every_group_is_big_enough():
    labels = synthetic_labels(n_labels=3, per_label=100)
    first = dirichlet_groups(labels, 3, 0.05, seed=3)
    assert min(len(p) for p in first) < 50  # with alpha 0.05 the first draw is very skewed
    parts = dirichlet_groups(labels, 3, 0.05, seed=3, min_blocks=50)
    # Each draw takes one Dirichlet sample per label from the same generator: find the first
    # draw that satisfies the minimum, independently.
    rng = np.random.default_rng(3)
    draws = []
    for _attempt in range(DIRICHLET_ATTEMPTS):
        sizes = np.zeros(3, dtype=int)
        for _label in range(3):
            cuts = [0, *(np.cumsum(rng.dirichlet([0.05] * 3))[:-1] * 100).astype(int), 100]
            sizes += np.diff(cuts)
        draws.append(sizes.tolist())
    first_good = next(d for d in draws if min(d) >= 50)
    assert draws.index(first_good) == 2 and [len(p) for p in parts] == first_good
    with pytest.raises(ConfigError, match="raise --dirichlet-alpha, use fewer groups"):
        dirichlet_groups(labels, 3, 0.05, seed=3, min_blocks=101)


def test_dirichlet_over_directories_is_disjoint_covering_and_seeded(text_corpus, tmp_path):
    prepare_corpus(tmp_path / "prep", text_corpus, eval_fraction=0.2)
    n = len(load_blocks(tmp_path / "prep", "train", SEQ))

    def parts(seed, k=2):
        return partition_data(tmp_path / "prep", SEQ, 2, k, seed, "dirichlet", "directory", 1.0)

    a = parts(4)
    assert_disjoint_and_covering(a, n)
    assert all(np.array_equal(x, y) for gx, gy in zip(a, parts(4)) for x, y in zip(gx, gy))
    assert not np.array_equal(np.sort(np.concatenate(a[0])), np.sort(np.concatenate(parts(5)[0])))
    docs = load_documents(tmp_path / "prep")
    labels = docs.source_ids[block_documents(docs.starts, n, SEQ)]
    expected = expected_dirichlet(labels, 2, 1.0, seed=4)
    assert [sorted(np.concatenate(g).tolist()) for g in a] == expected


def write_records(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dirichlet_over_a_record_field(tmp_path):
    langs = ["en", "de", "fr"]
    rows = [{"text": langs[i % 3] * 200 + str(i), "lang": langs[i % 3]} for i in range(90)]
    data = write_records(tmp_path / "docs.jsonl", rows)
    prep = tmp_path / "prep"
    info = prepare_corpus(prep, str(data), eval_fraction=0.1, partition_label="lang")
    docs = load_documents(prep)
    assert docs.label_field == "lang" and docs.labels == ["de", "en", "fr"]
    assert len(docs.label_ids) == info.train_files
    train = np.load(prep / "train.npy")
    # Each training document's label is its record's field (its text begins with it).
    for start, label in zip(docs.starts, docs.label_ids):
        assert bytes(train[start : start + 2].astype(np.uint8)).decode() == docs.labels[label]
    parts = partition_data(prep, 15, 3, 1, 0, "dirichlet", "lang", 0.3)
    assert_disjoint_and_covering(parts, len(load_blocks(prep, "train", 15)))
    # Asking for another field than the one prepared is refused, not silently wrong.
    with pytest.raises(ConfigError, match="prepare it again with this --partition-label"):
        partition_data(prep, 15, 3, 1, 0, "dirichlet", "topic", 0.3)
    # The held-out split and the streams do not depend on the label.
    plain = prepare_corpus(tmp_path / "plain", str(data), eval_fraction=0.1)
    assert plain == info.__class__(**{**info.__dict__, "directory": str(tmp_path / "plain")})
    for name in ("train.npy", "eval.npy"):
        assert np.array_equal(np.load(prep / name), np.load(tmp_path / "plain" / name))


def test_bad_labels_fail_with_one_line(tmp_path, text_corpus):
    data = write_records(tmp_path / "d.jsonl", [{"text": "abc" * 50, "lang": "en"}] * 20)
    with pytest.raises(ConfigError, match="--partition-label 'topic': record 0 of .* no such"):
        prepare_corpus(tmp_path / "p1", str(data), partition_label="topic")
    with pytest.raises(ConfigError, match="is a text file, which has no fields; use --partition"):
        prepare_corpus(tmp_path / "p2", text_corpus, partition_label="lang")


# -- validation, CLI, Flower ----------------------------------------------------------------


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"partition": "shards"}, "--partition 'shards' is unknown; choose one of iid, by-source"),
        ({"dirichlet_alpha": 0.0}, "--dirichlet-alpha must be > 0"),
        ({"dirichlet_alpha": -1.0}, "--dirichlet-alpha must be > 0"),
        ({"dirichlet_alpha": float("nan")}, "--dirichlet-alpha must be > 0"),
        ({"partition": "dirichlet"}, "--partition dirichlet needs --partition-label"),
        ({"partition_label": "lang"}, "applies to --partition dirichlet only, not 'iid'"),
        (
            {"partition": "by-source", "groups": 6, "nproc_per_group": 1},
            "the data has 5 source.* for 6 groups; use at most 5 groups",
        ),
    ],
)
def test_bad_partition_settings_fail_with_one_line(text_corpus, changes, message):
    cfg = TrainConfig(data=str(text_corpus), **changes)
    with pytest.raises(ConfigError, match=message) as info:
        check(cfg)
    assert "\n" not in str(info.value)


def test_good_partition_settings_validate(text_corpus):
    check(TrainConfig(data=str(text_corpus), partition="by-source", groups=5, nproc_per_group=1))
    TrainConfig(partition="dirichlet", partition_label="directory", dirichlet_alpha=0.1).validate()


def test_a_group_too_small_for_the_batch_fails_before_launch(text_corpus, tmp_path):
    info = prepare_corpus(tmp_path / "prep", text_corpus, eval_fraction=0.2)
    # 5 groups for 5 sources: a top-level file of ~1000 bytes is a group of ~30 blocks.
    cfg = TrainConfig(
        data=str(text_corpus), partition="by-source", groups=5, nproc_per_group=1, seq_len=SEQ
    )
    check_fits(info, TrainConfig(**{**cfg.__dict__, "batch_size": 4}))
    with pytest.raises(ConfigError, match="leaves a rank of group 4 .* fewer than --batch-size 40"):
        check_fits(info, TrainConfig(**{**cfg.__dict__, "batch_size": 40}))


def test_cli_flags_and_flower_run_config_carry_the_partition():
    args = build_parser().parse_args(
        ["train", "--partition", "dirichlet", "--partition-label", "lang"]
        + ["--dirichlet-alpha", "0.05"]
    )
    cfg = config_from_args(args)
    assert (cfg.partition, cfg.partition_label, cfg.dirichlet_alpha) == ("dirichlet", "lang", 0.05)

    # Flower: the run config reaches every group in its messages; "" (TOML's None) means unset.
    assert FederationConfig.from_run_config({"partition-label": ""}).train.partition_label is None
    fed = FederationConfig.from_run_config(
        {"partition": "dirichlet", "partition-label": "directory", "dirichlet-alpha": 0.1}
    )
    message = fed.group_config() | {
        P.NUM_GROUPS: 4,
        P.GROUP_INDEX: 2,
        P.NUM_SERVER_ROUNDS: 3,
    }
    from flower_shard.config.federation import train_config_from_message

    group = train_config_from_message(message, nproc_per_group=2, data=None, device="cpu")
    assert (group.partition, group.partition_label, group.dirichlet_alpha) == (
        "dirichlet",
        "directory",
        0.1,
    )
    assert (group.groups, group.nproc_per_group) == (4, 2)
