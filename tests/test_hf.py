"""Hugging Face models, tokenizers, datasets and export, all offline and made by the test.

A tiny Llama config (no weights: random init) with a tiny word-level tokenizer, and a tiny GPT-2
checkpoint (weights loaded; another class, tied embeddings, `transformer.h` blocks) with bytes,
both trained on a .jsonl dataset by `flower-shard train`, exported, and loaded back with
`AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from importlib.util import find_spec
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import flat_state, train_cli

from flower_shard import protocol as P
from flower_shard.config import ConfigError
from flower_shard.data.batches import eval_shard
from flower_shard.data.corpus import CorpusInfo, prepare_corpus
from flower_shard.data.sources import list_documents
from flower_shard.runtime import checkpoint as C
from flower_shard.ux import metrics as M

WORDS = [f"{w}{i}" for w in ("red", "blue", "green", "shard", "round", "node") for i in range(5)]
# Small enough for seconds of CPU, large enough for 2 ranks x 2 sequences of 32 tokens.
RUN = (
    *("--local-steps", "2", "--rounds", "2", "--seq-len", "32", "--batch-size", "2"),
    *("--eval-sequences", "8", "--quiet"),
)


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> SimpleNamespace:
    """A .jsonl dataset, a trained word-level tokenizer and three model directories."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("hf")
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS, size=rng.integers(8, 20))) for _ in range(400)]
    data = root / "corpus.jsonl"
    with open(data, "w") as fh:
        for i, line in enumerate(lines):
            fh.write(json.dumps({"id": i, "text": line, "upper": line.upper()}) + "\n")

    words = Tokenizer(models.WordLevel(unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    PreTrainedTokenizerFast(
        tokenizer_object=words, eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(root / "tok")
    vocab = words.get_vocab_size()

    def llama(name, vocab_size):
        LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ).save_pretrained(root / name)
        return root / name

    torch.manual_seed(123)  # not the runs' seed: a run that re-initialised would show it
    config = GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    GPT2LMHeadModel(config).save_pretrained(root / "gpt2")
    return SimpleNamespace(
        root=root,
        data=data,
        lines=lines,
        tok=root / "tok",
        llama=llama("llama", vocab + 6),
        small_vocab=llama("small-vocab", vocab - 5),
        gpt2=root / "gpt2",
    )


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flower_shard.ux.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_llama_config_with_tokenizer_and_jsonl_trains_and_exports(hf, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flower_shard.runtime.evaluation import lm_loss
    from flower_shard.runtime.models import build_model

    out, exported = tmp_path / "run", tmp_path / "export"
    train_cli(
        out,
        *("--model", hf.llama, "--tokenizer", hf.tok, "--data", hf.data),
        *("--groups", "2", "--nproc-per-group", "1", "--checkpoint-every", "2", *RUN),
    )
    proc = cli("export", out, "--out", exported)
    assert proc.returncode == 0, proc.stderr
    final = load_file(out / "final_model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
    assert type(model).__name__ == "LlamaForCausalLM"

    # The export holds exactly the run's final weights, and those are the global model after
    # the last outer sync (group 0's checkpoint of round 2), moved away from the seeded init.
    state = model.state_dict()
    assert state.keys() == final.keys()
    assert all(torch.equal(state[k], final[k]) for k in final)
    ckpt = flat_state(C.round_dir(out / "checkpoints" / "group_0", 2), tmp_path / "ck.pt")
    assert all(torch.equal(ckpt[f"model.{k}"], final[k]) for k in final)
    init = build_model(str(hf.llama), seed=0).state_dict()
    assert not all(torch.equal(init[k], final[k]) for k in final)

    # Same logits as the trainer's model class with those weights, and the run's held-out loss.
    ours = build_model(str(hf.llama), seed=1)
    ours.load_state_dict(final)
    rows = torch.from_numpy(eval_shard(out / "data", 32, 8, 0, 1).astype(np.int64))
    with torch.no_grad():
        torch.testing.assert_close(model(rows).logits, ours.eval()(rows).logits)
        loss = lm_loss(model, rows[:, :-1], rows[:, 1:]).item()
    assert loss == pytest.approx(M.read_metrics(out)[-1][P.EVAL_LOSS], rel=1e-4)

    # The tokenizer came along and encodes as the run's did.
    line = hf.lines[0]
    assert (
        AutoTokenizer.from_pretrained(exported)(line)["input_ids"]
        == AutoTokenizer.from_pretrained(hf.tok)(line)["input_ids"]
    )


def test_gpt2_checkpoint_is_loaded_sharded_per_block_and_exported(hf, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from flower_shard.runtime.models import build_model
    from flower_shard.runtime.parallelize import decoder_layers
    from flower_shard.ux.export import export_pretrained

    # Its blocks are found whatever their class's name: `transformer.h`, not `model.layers`.
    gpt2 = build_model(str(hf.gpt2))
    assert decoder_layers(gpt2) == list(gpt2.transformer.h)
    gpt2._no_split_modules = None  # the fallback: the largest list of same-class modules
    assert decoder_layers(gpt2) == list(gpt2.transformer.h)

    out, exported = tmp_path / "run", tmp_path / "export"
    proc = train_cli(
        out,
        *("--model", hf.gpt2, "--data", hf.data, "--groups", "1", "--nproc-per-group", "2"),
        *RUN,
    )
    # Both ranks load the checkpoint; transformers' progress bar is shown once, by rank 0.
    assert (proc.stdout + proc.stderr).count("Loading weights: 100%") == 1, proc.stderr[-3000:]
    final = load_file(out / "final_model.safetensors")
    export_pretrained(out / "final_model.safetensors", str(hf.gpt2), exported)
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    assert type(model).__name__ == "GPT2LMHeadModel"
    state = model.state_dict()
    assert all(torch.equal(state[k], final[k]) for k in final)
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])  # still tied

    # Trained from the checkpoint (4 AdamW steps of lr 1e-3 move no weight far), not from a
    # fresh init of the run's seed (which differs from the checkpoint's by ~0.1).
    start = load_file(hf.gpt2 / "model.safetensors")
    shift = max((final[k] - start[k]).abs().max().item() for k in start if k in final)
    assert 0 < shift < 0.03


@pytest.mark.parametrize(
    "case,message",
    [
        ("no-config", "has no config.json; give a preset"),
        ("vocab", "embeds only"),
        ("positions", "--seq-len 65 exceeds"),
        ("column", "--text-column 'body'"),
        ("parquet", "pip install datasets"),
    ],
)
def test_bad_hf_inputs_fail_with_one_line(hf, tmp_path, case, message):
    if case == "parquet" and any(find_spec(m) for m in ("datasets", "pyarrow")):
        pytest.skip("datasets or pyarrow is installed: .parquet is readable here")
    (tmp_path / "empty").mkdir()
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    args = {
        "no-config": ("--model", tmp_path / "empty"),
        "vocab": ("--model", hf.small_vocab, "--tokenizer", hf.tok, "--data", hf.data, *RUN),
        "positions": ("--model", hf.llama, "--seq-len", "65"),
        "column": ("--data", hf.data, "--text-column", "body"),
        "parquet": ("--data", tmp_path / "x.parquet"),
    }[case]
    out = tmp_path / "run"
    for dry_run in ((), ("--dry-run",)):  # --dry-run refuses what the launch would refuse
        proc = cli("train", "--out", out, *args, *dry_run)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("flower-shard: error:"), proc.stderr
        assert message in lines[0]
        assert not (out / "config.json").exists()  # nothing was launched


DRY = ("--seq-len", "32", "--dry-run")


def test_a_model_directory_with_a_tokenizer_brings_it_along(hf, tmp_path):
    """``--model DIR`` holding a tokenizer and no ``--tokenizer``: the run uses DIR's (its
    embedding's ids), and says so among the settings that differ from the defaults."""
    model = tmp_path / "model"
    shutil.copytree(hf.small_vocab, model)
    for f in hf.tok.iterdir():
        shutil.copy(f, model / f.name)
    proc = cli("train", "--model", model, "--data", hf.data, "--out", tmp_path / "o", *DRY)
    # DIR's embedding is smaller than its tokenizer here: refused, naming the tokenizer found.
    assert proc.returncode == 2 and f"--tokenizer {model} has" in proc.stderr, proc.stderr
    shutil.rmtree(model)
    shutil.copytree(hf.llama, model)
    for f in hf.tok.iterdir():
        shutil.copy(f, model / f.name)
    proc = cli("train", "--model", model, "--data", hf.data, "--out", tmp_path / "o", *DRY)
    assert proc.returncode == 0, proc.stderr
    assert f"tokenizer={model}" in proc.stderr.split("differ from the defaults: ")[1]


def test_export_of_an_unfinished_run_fails_with_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    proc = cli("export", tmp_path, "--out", tmp_path / "export")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no final_model.safetensors" in lines[0], proc.stderr


def test_jsonl_records_are_documents_and_the_cache_knows_the_column(hf, tmp_path):
    info = prepare_corpus(tmp_path / "prep", str(hf.data))
    assert info.train_files + info.eval_files == len(hf.lines) and info.eval_files > 0
    stamp = (tmp_path / "prep" / "train.npy").stat().st_mtime_ns
    assert prepare_corpus(tmp_path / "prep", str(hf.data)) == info
    assert (tmp_path / "prep" / "train.npy").stat().st_mtime_ns == stamp  # reused, not redone
    upper = prepare_corpus(tmp_path / "prep", str(hf.data), text_column="upper")
    assert upper.train_tokens == info.train_tokens  # re-read: same lengths, other bytes
    assert chr(np.load(tmp_path / "prep" / "train.npy")[0]).isupper()
    # A directory holding the file is the same corpus (the same names, so the same split).
    (tmp_path / "dir").mkdir()
    shutil.copy(hf.data, tmp_path / "dir" / hf.data.name)
    assert list_documents(tmp_path / "dir")[1] == [hf.data.name]
    assert prepare_corpus(tmp_path / "prep-dir", str(tmp_path / "dir")).train_tokens == (
        info.train_tokens
    )
    with pytest.raises(ConfigError, match="--text-column 'body'"):
        prepare_corpus(tmp_path / "bad", str(hf.data), text_column="body")


def test_a_node_trains_on_a_jsonl_file_with_the_run_configs_text_column(hf, tmp_path):
    """`flower-shard node --data FILE.jsonl`: its group prepares and trains on the column the
    run config's `text-column` names, as ShardedFedAvg's train message carries it."""
    from flower_shard.config.federation import FederationConfig
    from flower_shard.flower.client.group_client import GroupClient
    from flower_shard.flower.node.launcher import Node, NodeConfig

    run_config = {P.TEXT_COLUMN: "upper", P.NUM_SERVER_ROUNDS: 1, P.LOCAL_STEPS: 2}
    run_config |= {"seq-len": 32, "batch-size": 2, "eval-sequences": 8}
    config = FederationConfig.from_run_config(run_config).group_config()
    config |= {P.SERVER_ROUND: 1, P.GROUP_INDEX: 0, P.NUM_GROUPS: 1, P.RUN_ID: 1}
    assert config[P.TEXT_COLUMN] == "upper"
    work = tmp_path / "node"
    node = Node(NodeConfig(nproc_per_group=1, work_dir=str(work), data=str(hf.data)))
    node.start(supernode=False)  # the group alone: the test plays the ClientApp
    try:
        client = GroupClient(node.address)
        try:
            head, arrays = client.call(P.TRAIN, {P.H_CONFIG: config}, timeout=120)
        finally:
            client.close()
    finally:
        node.stop()
    assert head[P.H_METRICS][P.NUM_TOKENS] == 2 * 2 * 32  # T x batch x seq_len x K
    assert arrays  # the flower transport's reply: the trained weights
    # The group's corpus is the `upper` column's, token for token (bytes: upper-case letters).
    expected = prepare_corpus(tmp_path / "ref", str(hf.data), text_column="upper")
    assert CorpusInfo.load(work / "data") == dataclasses.replace(
        expected, directory=str(work / "data")
    )
    train = np.load(work / "data" / "train.npy")
    assert np.array_equal(train, np.load(tmp_path / "ref" / "train.npy"))
    assert chr(train[0]).isupper()


def test_node_data_is_a_directory_or_a_record_file(hf, tmp_path):
    from flower_shard.flower.node.launcher import NodeConfig

    NodeConfig(data=str(hf.data)).validate()  # .jsonl
    NodeConfig(data=str(hf.root)).validate()  # a directory
    (tmp_path / "notes.csv").write_text("a,b\n")
    for bad in (tmp_path / "notes.csv", tmp_path / "missing"):
        proc = cli("node", "--data", bad, "--work-dir", tmp_path / "node")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"flower-shard: error: --data {bad}: no such directory or .jsonl / .parquet file; "
            "point it at a directory of text files or at a .jsonl / .parquet file"
        ]
    assert not (tmp_path / "node").exists()  # nothing was started


def test_a_flower_run_dir_of_a_preset_exports(tmp_path, capsys):
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    from flower_shard.runtime.models import build_model
    from flower_shard.ux.cli import main

    # What the ServerApp leaves (flower transport): float32 arrays and the summary naming the
    # model; the tiny preset's vocabulary grew to a 300-token tokenizer.
    run = tmp_path / "flower"
    run.mkdir()
    arrays = {
        k: v.detach().numpy() for k, v in build_model("tiny", 300, seed=5).state_dict().items()
    }
    save_file(arrays, str(run / "final_model.safetensors"))
    summary = {"status": "ok", "model": "tiny", "tokenizer": None, "seq_len": 32}
    (run / "summary.json").write_text(json.dumps(summary))
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert back.config.vocab_size == 300 and back.config.use_cache
    state = back.state_dict()
    assert all(np.array_equal(state[k].numpy(), arrays[k]) for k in arrays)

    # A failed run has no model to export: one line, exit 2.
    capsys.readouterr()  # transformers' progress bars of the export above
    (run / "summary.json").write_text(json.dumps({"status": "failed", "error": "boom"}))
    assert main(["export", str(run), "--out", str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "status failed" in err[0]
