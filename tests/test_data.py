"""Corpus preparation, held-out split, partitioning and batch determinism."""

from __future__ import annotations

import numpy as np
import pytest

from flower_shard.config import ConfigError
from flower_shard.data.batches import BatchIterator, rank_batches
from flower_shard.data.corpus import CorpusInfo, load_blocks, prepare_corpus
from flower_shard.data.partition import partition
from flower_shard.data.sources import is_held_out, list_documents
from flower_shard.data.tokenizers import ByteTokenizer


def write_corpus(root, n_files=40, size=3000):
    rng = np.random.default_rng(0)
    for i in range(n_files):
        sub = root / f"d{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        words = rng.choice(["alpha", "beta", "gamma", "delta", "\n"], size=size // 5)
        (sub / f"f{i}.txt").write_text(" ".join(words))
    (root / ".hidden").write_text("never read")
    return root


def test_default_corpus_is_the_standard_library(corpus_dir):
    info = CorpusInfo.load(corpus_dir)
    _, files = list_documents(None)
    assert info.train_files + info.eval_files == len(files) > 500
    assert all(f.endswith(".py") and "site-packages" not in f for f in files)
    assert info.vocab_size == 257 and info.tokenizer == "bytes"
    # About eval_fraction of the files are held out.
    assert 0.02 < info.eval_files / len(files) < 0.08


def test_held_out_split_is_by_file_and_stable(tmp_path):
    root = write_corpus(tmp_path / "text")
    info = prepare_corpus(tmp_path / "prep", root, eval_fraction=0.25)
    _, files = list_documents(root)
    held = [f for f in files if is_held_out(f, 0.25)]
    assert ".hidden" not in files
    assert info.eval_files == len(held) and info.train_files == len(files) - len(held)
    # The streams are exactly the files' bytes, each followed by end-of-document.
    tok = ByteTokenizer()
    expected = np.concatenate(
        [np.append(tok.encode((root / f).read_bytes()), tok.eos_id) for f in files if f not in held]
    )
    assert np.array_equal(np.load(tmp_path / "prep" / "train.npy"), expected)
    # A second preparation of the same files is reused, not redone.
    before = (tmp_path / "prep" / "train.npy").stat().st_mtime_ns
    prepare_corpus(tmp_path / "prep", root, eval_fraction=0.25)
    assert (tmp_path / "prep" / "train.npy").stat().st_mtime_ns == before


@pytest.mark.parametrize("groups,k", [(1, 4), (2, 2), (3, 2), (2, 3)])
def test_partitions_are_disjoint_and_cover(groups, k):
    n = 1001
    parts = partition(n, groups, k, seed=5)
    flat = np.concatenate([p for g in parts for p in g])
    assert len(parts) == groups and all(len(g) == k for g in parts)
    assert len(flat) == n and np.array_equal(np.sort(flat), np.arange(n))
    sizes = [len(p) for g in parts for p in g]
    assert max(sizes) - min(sizes) <= 1
    # Seeded: same seed same parts, another seed other parts.
    again = partition(n, groups, k, seed=5)
    assert all(np.array_equal(a, b) for ga, gb in zip(parts, again) for a, b in zip(ga, gb))
    assert not np.array_equal(partition(n, groups, k, seed=6)[0][0], parts[0][0])


def test_same_seed_same_batches_and_ranks_see_disjoint_data(corpus_dir):
    def take(seed, group, rank, n=5):
        it = rank_batches(corpus_dir, 32, 4, 2, 2, group, rank, seed)
        return [next(it)[0] for _ in range(n)]

    a, b = take(0, 0, 0), take(0, 0, 0)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(take(1, 0, 0)[0], a[0])
    rows = {tuple(row.tolist()) for g in (0, 1) for r in (0, 1) for x in take(0, g, r) for row in x}
    assert len(rows) == 4 * 5 * 4  # 4 ranks x 5 batches x 4 rows, no block seen twice


def test_batches_shift_by_one_and_cycle_epochs(tmp_path):
    blocks = np.arange(6 * 9).reshape(6, 9)
    it = BatchIterator(blocks, np.arange(6), batch_size=2, seed=[0])
    seen = []
    for _ in range(6):  # two epochs of 3 batches
        x, y = next(it)
        assert np.array_equal(x[:, 1:], y[:, :-1])
        seen += [tuple(r.tolist()) for r in x]
    assert sorted(seen[:6]) == sorted(seen[6:]) and len(set(seen[:6])) == 6
    state = it.state_dict()
    resumed = BatchIterator(blocks, np.arange(6), batch_size=2, seed=[0])
    resumed.load_state_dict(state)
    assert np.array_equal(next(resumed)[0], next(it)[0])


def test_load_blocks_shape(corpus_dir):
    blocks = load_blocks(corpus_dir, "train", 64)
    assert (
        blocks.shape[1] == 65 and blocks.shape[0] == CorpusInfo.load(corpus_dir).train_tokens // 65
    )


def test_hugging_face_tokenizer_from_a_local_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = write_corpus(tmp_path / "text")
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train(
        [str(p) for p in root.rglob("*.txt")],
        trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "</s>"]),
    )
    PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(tmp_path / "tok")
    info = prepare_corpus(
        tmp_path / "prep", root, tokenizer=str(tmp_path / "tok"), eval_fraction=0.25
    )
    assert info.tokenizer.startswith("hf:") and info.vocab_size == len(bpe.get_vocab())
    train = np.load(tmp_path / "prep" / "train.npy")
    assert train.max() < info.vocab_size and (train == info.eos_id).sum() == info.train_files


def test_bad_data_fails_with_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no such directory"):
        list_documents(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no files"):
        list_documents(tmp_path / "empty")
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text("x")
    with pytest.raises(ConfigError, match="cannot be split"):
        prepare_corpus(tmp_path / "prep", tmp_path / "one")
    with pytest.raises(ConfigError, match="not a loadable tokenizer"):
        prepare_corpus(tmp_path / "prep2", write_corpus(tmp_path / "t"), tokenizer=str(tmp_path))
