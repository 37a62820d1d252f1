"""Corpus preparation at scale: tokens/s with 1 and 2 workers, and every process's peak memory.

Generates a corpus of ``.jsonl`` files (``--size-gb``, Zipf-distributed words, records of 1-8 kB)
and a byte-level BPE tokenizer trained locally on a sample of it (nothing is downloaded), then
prepares the corpus with ``flower_shard.data.corpus.prepare_corpus`` in a fresh process per run
(the host cache off, so each run tokenises), sampling the VmHWM of that process and of its
workers. Side by side in one invocation:

- ``--workers 1`` and ``--workers 2`` on the whole corpus (speed-up; target >= 1.7x on 2 cores);
- ``--workers 2`` on half the corpus (peak memory must not grow with the corpus: target, every
  process under 1 GB, and the half corpus's peaks within 10% of the whole's);
- the ceiling: the tokenizer's own batch throughput on one core (``tok(list_of_texts)`` in
  memory, no I/O), and that x 2.

    .venv/bin/python bench/data_prep.py [--size-gb 1.0 --repeats 3]
    .venv/bin/python bench/data_prep.py --smoke        # 4 MB, one repeat (tests run this)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from memory import PeakSampler, wait_sampling  # noqa: E402

HERE = Path(__file__).parent
WORDS = 20000
FILE_BYTES = 64 << 20


def make_corpus(root: Path, size: int, seed: int = 0) -> list[Path]:
    """``.jsonl`` files of about FILE_BYTES holding ``size`` bytes of records in all."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(WORDS)]
    weights = 1.0 / np.arange(1, WORDS + 1)
    weights /= weights.sum()
    files, written, k = [], 0, 0
    while written < size:
        path = root / f"part-{k:04d}.jsonl"
        with open(path, "w", encoding="utf-8") as fh:
            n = 0
            while n < min(FILE_BYTES, size - written):
                words = rng.choice(WORDS, rng.integers(150, 1200), p=weights)
                line = json.dumps({"text": " ".join(vocab[w] for w in words)}) + "\n"
                fh.write(line)
                n += len(line)
        files.append(path)
        written += n
        k += 1
    return files


def make_tokenizer(sample: Path, out: Path, vocab: int = 8000) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    texts = (json.loads(line)["text"] for line in open(sample, encoding="utf-8"))
    bpe.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "</s>"])
    )
    PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(out)


def run_once(data: Path, tok: Path, workers: int, out: Path) -> dict:
    """One preparation in a fresh process; its seconds, tokens and every process's peak."""
    env = dict(os.environ, FLOWER_SHARD_CACHE="none", TOKENIZERS_PARALLELISM="false")
    code = (
        "import json, sys, time\n"
        "from flower_shard.data.corpus import prepare_corpus\n"
        "if __name__ == '__main__':\n"
        "    t = time.perf_counter()\n"
        f"    info = prepare_corpus({str(out)!r}, {str(data)!r}, {str(tok)!r}, workers={workers})\n"
        "    print(json.dumps({'seconds': time.perf_counter() - t,\n"
        "                      'tokens': info.train_tokens + info.eval_tokens}))\n"
    )
    script = out.with_suffix(".py")
    script.write_text(code)
    with PeakSampler(interval=0.05) as sampler:
        proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE)
        sampler.root = proc.pid
        rc = wait_sampling(proc, sampler)
    if rc != 0:
        raise SystemExit(f"preparation with {workers} worker(s) failed ({rc})")
    result = json.loads(proc.stdout.read())
    peaks = {pid: p for pid, (p, _) in sampler.peaks.items() if pid != os.getpid()}
    main = sampler.peaks.get(proc.pid, (0, ""))[0]
    workers_peak = max((p for pid, p in peaks.items() if pid != proc.pid), default=0)
    return result | {
        "main_peak": main,
        "worker_peak": workers_peak,
        "sum_peaks": sum(peaks.values()),
    }


def ceiling(data: Path, tok_dir: Path, sample_bytes: int) -> dict:
    """The tokenizer's own batch throughput on one core: texts in memory, no I/O."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    texts, size = [], 0
    for path in sorted(data.glob("*.jsonl")):
        for line in open(path, encoding="utf-8"):
            texts.append(json.loads(line)["text"])
            size += len(texts[-1])
            if size >= sample_bytes:
                break
        if size >= sample_bytes:
            break
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), 256):
        tokens += sum(
            len(x) for x in tok(texts[i : i + 256], add_special_tokens=False)["input_ids"]
        )
    seconds = time.perf_counter() - start
    return {"tokens_per_s": tokens / seconds, "mb_per_s": size / 1e6 / seconds}


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default="/tmp/flower-shard-data-bench")
    p.add_argument("--out", default=str(HERE / "results" / "data_prep.json"))
    p.add_argument("--smoke", action="store_true", help="4 MB, one repeat (the tests run it)")
    args = p.parse_args()
    if args.smoke:
        args.size_gb, args.repeats = 0.004, 1
    work = Path(args.work)
    size = int(args.size_gb * 1e9)
    full, half = work / f"corpus-{size}", work / f"half-{size}"
    if not full.is_dir():
        make_corpus(full, size)
    if not half.is_dir():
        half.mkdir(parents=True)
        for f in sorted(full.glob("*.jsonl"))[: max(1, len(list(full.glob("*.jsonl"))) // 2)]:
            os.link(f, half / f.name)
    tok = work / "tokenizer"
    if not tok.is_dir():
        make_tokenizer(sorted(full.glob("*.jsonl"))[0], tok, 1000 if args.smoke else 8000)
    runs: dict[str, list[dict]] = {"1 worker": [], "2 workers": [], "2 workers, half": []}
    for r in range(args.repeats):  # interleaved: the configurations share the machine's noise
        for name, data, workers in (
            ("1 worker", full, 1),
            ("2 workers", full, 2),
            ("2 workers, half", half, 2),
        ):
            out = work / f"prep-{name.replace(' ', '_').replace(',', '')}-{r}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            runs[name].append(run_once(data, tok, workers, out))
            subprocess.run(["rm", "-rf", str(out)], check=True)
    top = ceiling(full, tok, min(size, 1 << 20 if args.smoke else 64 << 20))
    report(args, size, runs, top)


def report(args, size: int, runs: dict, top: dict) -> None:
    rows, summary = [], {}
    for name, rs in runs.items():
        tps = [r["tokens"] / r["seconds"] for r in rs]
        summary[name] = {
            "tokens_per_s": spread(tps),
            "seconds": spread([r["seconds"] for r in rs]),
            "main_peak_mb": spread([r["main_peak"] / 1e6 for r in rs]),
            "worker_peak_mb": spread([r["worker_peak"] / 1e6 for r in rs]),
            "tokens": rs[0]["tokens"],
        }
        s = summary[name]
        rows.append(
            f"| {name} | {s['tokens_per_s']['median']:,.0f} ({s['tokens_per_s']['min']:,.0f}-"
            f"{s['tokens_per_s']['max']:,.0f}) | {s['main_peak_mb']['max']:.0f} | "
            f"{s['worker_peak_mb']['max']:.0f} |"
        )
    one, two = (runs[k] for k in ("1 worker", "2 workers"))
    speedups = [
        (b["tokens"] / b["seconds"]) / (a["tokens"] / a["seconds"]) for a, b in zip(one, two)
    ]
    whole = max(
        summary["2 workers"]["worker_peak_mb"]["max"], summary["2 workers"]["main_peak_mb"]["max"]
    )
    halfp = max(
        summary["2 workers, half"]["worker_peak_mb"]["max"],
        summary["2 workers, half"]["main_peak_mb"]["max"],
    )
    print(f"corpus {size / 1e9:.2f} GB of .jsonl, {args.repeats} repeat(s)")
    print("| run | tokens/s median (min-max) | main peak MB | worker peak MB |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    print(f"speed-up 2 vs 1 worker: {spread(speedups)}")
    print(f"largest process peak: whole corpus {whole:.0f} MB, half {halfp:.0f} MB")
    print(
        f"ceiling (tokenizer batch calls, 1 core, in memory): {top['tokens_per_s']:,.0f} tokens/s "
        f"({top['mb_per_s']:.1f} MB/s); x 2 = {2 * top['tokens_per_s']:,.0f}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "size_bytes": size,
                "repeats": args.repeats,
                "runs": runs,
                "summary": summary,
                "speedup_2_vs_1": spread(speedups),
                "largest_peak_mb": {"whole": whole, "half": halfp},
                "ceiling": top,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
