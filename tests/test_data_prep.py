"""Streaming, parallel corpus preparation: the same tokens as one process, bounded pieces,
every input kind, and a host cache that tokenises a corpus once."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat

import numpy as np
import pytest

from flower_shard.config import ConfigError
from flower_shard.data import cache, prepare
from flower_shard.data.corpus import CorpusInfo, prepare_corpus
from flower_shard.data.sources import is_held_out, list_documents
from flower_shard.data.tokenizers import ByteTokenizer


@pytest.fixture
def no_cache(monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, cache.OFF)


def reference(docs: list[tuple[str, bytes]], eval_fraction: float, encode, eos: int):
    """The pipeline's definition, in one process: every document in order, its ids and then
    the end-of-document id, into the held-out stream if its name hashes there."""
    streams = {False: [], True: []}
    for name, text in docs:
        streams[is_held_out(name, eval_fraction)] += [*encode(text).tolist(), eos]
    return [np.asarray(streams[s], dtype=np.uint16) for s in (False, True)]


def load(out):
    return [np.load(out / f) for f in ("train.npy", "eval.npy")]


def test_builtin_corpus_gives_todays_tokens_with_many_tasks_and_two_workers(
    tmp_path, monkeypatch, no_cache
):
    # Pieces of 1 MB: the standard library (~30 MB) becomes ~30 tasks on two spawned workers.
    monkeypatch.setattr(prepare, "TASK_BYTES", 1 << 20)
    info = prepare_corpus(tmp_path / "two", workers=2)
    root, files = list_documents(None)
    tok = ByteTokenizer()
    docs = [(rel, (root / rel).read_bytes()) for rel in files]
    train, held = reference(docs, 0.05, tok.encode, tok.eos_id)
    got = load(tmp_path / "two")
    assert np.array_equal(got[0], train) and np.array_equal(got[1], held)
    assert (info.train_tokens, info.eval_tokens) == (train.size, held.size)
    # The documents' starts are where each training document begins in the stream.
    starts = np.load(tmp_path / "two" / "train_docs.npz")["starts"]
    assert len(starts) == info.train_files and np.all(train[starts[1:] - 1] == tok.eos_id)
    one = prepare_corpus(tmp_path / "one", workers=1)
    assert one.train_tokens == info.train_tokens
    with (
        np.load(tmp_path / "one" / "train_docs.npz") as a,
        np.load(tmp_path / "two" / "train_docs.npz") as b,
    ):
        assert sorted(a.files) == sorted(b.files)
        assert all(np.array_equal(a[k], b[k]) for k in a.files)


def write_jsonl(path, n):
    """Records with blank lines between some, a null text, and labels."""
    rng = np.random.default_rng(1)
    lines = []
    for i in range(n):
        text = None if i == 7 else "".join(rng.choice(list("abcdé \n"), 40 + i % 90))
        lines.append(json.dumps({"text": text, "lang": ["en", "it", "fr"][i % 3]}))
        if i % 11 == 0:
            lines.append("   ")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_jsonl_file_cut_into_pieces_keeps_every_records_name(tmp_path, monkeypatch, no_cache):
    data = write_jsonl(tmp_path / "d.jsonl", 600)
    monkeypatch.setattr(prepare, "PIECE_BYTES", 2000)
    monkeypatch.setattr(prepare, "TASK_BYTES", 3000)
    units = prepare.plan_units(tmp_path, ["d.jsonl"])
    assert len(units) > 10 and [u.start for u in units[1:]] == [u.stop for u in units[:-1]]
    info = prepare_corpus(tmp_path / "p", str(data), partition_label="lang", workers=1)
    records = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    docs = [(f"d.jsonl#{i}", r["text"].encode()) for i, r in enumerate(records) if r["text"]]
    train, held = reference(docs, 0.05, ByteTokenizer().encode, 256)
    got = load(tmp_path / "p")
    assert np.array_equal(got[0], train) and np.array_equal(got[1], held)
    assert info.train_files + info.eval_files == len(records) - 1  # the null text is skipped
    with np.load(tmp_path / "p" / "train_docs.npz") as z:
        kept = [
            r["lang"]
            for i, r in enumerate(records)
            if r["text"] and not is_held_out(f"d.jsonl#{i}", 0.05)
        ]
        assert [z["labels"][i] for i in z["label_ids"]] == kept


def test_bad_records_fail_with_one_line_naming_the_record(tmp_path, no_cache):
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(ConfigError, match="at byte 15 is not UTF-8"):
        prepare_corpus(tmp_path / "p", str(tmp_path / "bad.jsonl"))
    (tmp_path / "num.jsonl").write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(ConfigError, match="record 1 of .* holds int, not text"):
        prepare_corpus(tmp_path / "p", str(tmp_path / "num.jsonl"))


def test_an_entry_that_is_not_a_regular_file_fails_before_reading(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("x" * 100)
    os.mkfifo(tmp_path / "d" / "pipe")  # reading it would block forever
    with pytest.raises(ConfigError, match="pipe is not a regular file"):
        list_documents(tmp_path / "d")


def test_pretokenized_shards_are_copied_split_into_documents_and_checked(tmp_path, no_cache):
    src = tmp_path / "tokens"
    src.mkdir()
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 999, rng.integers(1, 300)) for _ in range(400)]
    flat = np.concatenate([np.append(d, 999) for d in docs]).astype(np.uint16)
    np.save(src / "a.npy", flat[: flat.size // 2 + 5])  # documents run across the two files
    flat[flat.size // 2 + 5 :].tofile(src / "b.bin")
    (src / "tokens.json").write_text(json.dumps({"vocab_size": 1000, "eos_id": 999}))
    info = prepare_corpus(tmp_path / "p", str(src))
    assert info.vocab_size == 1000 and info.eos_id == 999 and info.tokenizer == "tokens:1000:999"
    # Documents are the runs ended by eos in each file (a file's last run without one too).
    named = []
    for rel, part in (("a.npy", flat[: flat.size // 2 + 5]), ("b.bin", flat[flat.size // 2 + 5 :])):
        ends = [*np.flatnonzero(part == 999).tolist()]
        if ends[-1] != part.size - 1:
            ends.append(part.size)
        begin = 0
        for k, end in enumerate(ends):
            named.append((f"{rel}#{k}", part[begin:end]))
            begin = end + 1
    train, held = reference(named, 0.05, lambda ids: ids, 999)
    got = load(tmp_path / "p")
    assert np.array_equal(got[0], train) and np.array_equal(got[1], held)
    flat[3] = 1000  # an id the vocabulary does not have
    np.save(src / "a.npy", flat[: flat.size // 2 + 5])
    with pytest.raises(ConfigError, match=r"token ids must lie in \[0, vocab_size 1000\)"):
        prepare_corpus(tmp_path / "q", str(src))
    with pytest.raises(ConfigError, match="already tokenised"):
        prepare_corpus(tmp_path / "r", str(src), tokenizer=str(tmp_path))


def test_a_saved_dataset_directory_is_a_corpus_of_records(tmp_path, no_cache):
    datasets = pytest.importorskip("datasets")
    texts = [f"document {i} " * (1 + i % 7) for i in range(300)]
    datasets.Dataset.from_dict({"body": texts, "n": list(range(300))}).save_to_disk(tmp_path / "ds")
    info = prepare_corpus(tmp_path / "p", str(tmp_path / "ds"), text_column="body")
    docs = [(f"ds#{i}", t.encode()) for i, t in enumerate(texts)]
    train, held = reference(docs, 0.05, ByteTokenizer().encode, 256)
    got = load(tmp_path / "p")
    assert np.array_equal(got[0], train) and np.array_equal(got[1], held)
    assert info.train_files + info.eval_files == 300
    with pytest.raises(ConfigError, match="--text-column 'text': .* no such column"):
        prepare_corpus(tmp_path / "q", str(tmp_path / "ds"))


def _prepare_with_cache(args):
    out, source, cache_dir = args
    os.environ[cache.CACHE_ENV] = cache_dir
    return prepare_corpus(out, source, workers=1).train_tokens


def test_the_host_cache_tokenises_once_for_concurrent_nodes(tmp_path):
    src = tmp_path / "text"
    src.mkdir()
    for i in range(30):
        (src / f"f{i}.txt").write_text(f"file {i} " * 500)
    shared = str(tmp_path / "cache")
    outs = [str(tmp_path / f"node{i}") for i in range(3)]
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        tokens = pool.map(_prepare_with_cache, [(o, str(src), shared) for o in outs])
    assert len(set(tokens)) == 1
    entries = [p for p in (tmp_path / "cache" / "corpora").iterdir() if p.is_dir()]
    assert len(entries) == 1  # one preparation, shared
    inode = (entries[0] / "train.npy").stat().st_ino
    assert all(os.stat(f"{o}/train.npy").st_ino == inode for o in outs)  # hard links
    assert all(CorpusInfo.load(o).directory == o for o in outs)
    assert stat.S_IMODE((tmp_path / "cache" / "corpora").stat().st_mode) == 0o700


def test_a_cache_others_can_write_is_not_used(tmp_path, monkeypatch):
    src = tmp_path / "text"
    src.mkdir()
    for i in range(30):
        (src / f"f{i}.txt").write_text(f"file {i} " * 50)
    (tmp_path / "cache" / "corpora").mkdir(parents=True)
    os.chmod(tmp_path / "cache" / "corpora", 0o777)
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    prepare_corpus(tmp_path / "p", str(src))
    assert not any((tmp_path / "cache" / "corpora").iterdir())  # tokenised in place instead
    assert (tmp_path / "p" / "train.npy").stat().st_nlink == 1
