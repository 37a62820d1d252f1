"""Training data: text files, tokenised once, packed into blocks, partitioned by group and rank.

The built-in corpus is the source of the running Python's standard library (every machine has
it, nothing is downloaded); ``--data`` takes a directory of text files instead, a ``.jsonl`` /
``.parquet`` file of records (or a directory holding such files), a local ``datasets`` dataset
directory (``save_to_disk``), one document per record in the ``--text-column`` field, or a
directory of already-tokenised shards (``tokens.json`` + ``.npy`` / ``.bin``).

Pipeline (done once per corpus and host, see :func:`~flower_shard.data.corpus.prepare_corpus`):

1. list the files in a fixed order (sorted relative paths); a text file is one document, a
   record file one document per record (``PATH#INDEX``), a token file one document per run of
   ids ended by the end-of-document id (``PATH#K``) (:mod:`~flower_shard.data.sources`);
2. hold out whole documents for evaluation, chosen by a hash of the document's name
   (deterministic, independent of the seed, so every run of a corpus evaluates on the same text);
3. tokenise (bytes by default, or a local Hugging Face tokenizer) on several worker processes,
   each streaming its pieces of the corpus into shard files in bounded memory, then join the
   shards in document order into one training and one evaluation stream with an
   end-of-document token after each document, saved as ``.npy``
   (:mod:`~flower_shard.data.prepare`); the result is cached per host and shared by its runs
   and nodes (:mod:`~flower_shard.data.cache`).

``.jsonl`` is read with the standard library's ``json``, one line at a time; ``.parquet`` and
dataset directories need ``datasets`` (or ``pyarrow``).

The ranks then memory-map the streams. The training stream is cut into blocks of
``seq_len + 1`` tokens, and the blocks are split into G disjoint parts, one per group, that
together hold every block (``--partition``):

- ``iid``: a seeded permutation of the blocks cut into G contiguous parts;
- ``by-source``: every source (a top-level directory, or a file at the top level) goes whole to
  one group; largest source first, each onto the group with the fewest blocks so far;
- ``dirichlet``: for each label in sorted order, proportions p ~ Dirichlet(alpha, ..., alpha)
  over the G groups; the label's blocks, in stream order, are cut at
  ``floor(cumsum(p) * n_label)`` (flwr-datasets' DirichletPartitioner without self-balancing);
  if a group ends with fewer than K x batch-size blocks, all labels are drawn again from the
  same generator (10 attempts at most).

A block belongs to the document that holds its first token (blocks run across document ends);
``train_docs.npz`` records where each training document starts, its source and its label. Each
group's part is then cut into K parts (one per rank): for ``iid`` as before, a contiguous split
of the permuted part; otherwise after a permutation seeded with ``[seed, group]``. The held-out
split does not depend on the partition.
"""
