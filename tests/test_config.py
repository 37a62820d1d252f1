"""Bad configurations fail before any process starts, with one line that names the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest

from flower_shard.config import ConfigError, TrainConfig
from flower_shard.config.federation import RENAMED, FederationConfig
from flower_shard.flower.compat import check_flwr, supported_range
from flower_shard.preflight import check
from flower_shard.runtime.topology import Topology

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
# A host without CUDA (CI): what a user gets who asks for it there.
NO_CUDA = pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="this host has a GPU")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(world_size=6, groups=4), "not divisible by --groups 4"),
        (
            dict(world_size=8, groups=2, sharding="hsdp", replicate=3),
            "does not divide the group size K = 4",
        ),
        (dict(world_size=4, groups=2, sharding="fsdp", replicate=2), "needs --sharding hsdp"),
        (dict(world_size=4, groups=2, sharding="zero"), "unknown"),
    ],
)
def test_topology_rejects_mismatches(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Topology(**kwargs)


def test_topology_degrees_and_membership():
    t = Topology(world_size=12, groups=3, sharding="hsdp", replicate=2)
    assert (t.group_size, t.shard_degree) == (4, 2)
    assert t.mesh_shape == (3, 2, 2) and t.mesh_dim_names == ("group", "replicate", "shard")
    assert [t.group_of(r) for r in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert Topology(4, 1).mesh_shape == (1, 4)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(local_steps=0), "--local-steps must be a positive integer"),
        (dict(groups=0), "--groups must be a positive integer"),
        (dict(model="gpt5"), "--model 'gpt5' is unknown"),
        (dict(data="/nonexistent/corpus"), "--data /nonexistent/corpus: no such directory"),
        (dict(outer="adam"), "--outer 'adam' is unknown"),
        (dict(nnodes=3), "--nnodes 3 does not divide the world size"),
        (dict(lr=-1.0), "--lr must be > 0"),
        (dict(tokenizer="/nonexistent/tok"), "--tokenizer /nonexistent/tok"),
        (dict(nproc_per_group=2, sharding="hsdp", replicate=4), "--replicate 4 does not divide"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        check(TrainConfig(**kwargs))


@pytest.mark.parametrize(
    "args,message",
    [
        (["--local-steps", "0"], "--local-steps must be a positive integer"),
        (["--model", "gpt5"], "--model 'gpt5' is unknown"),
        (["--data", "/nonexistent/corpus"], "no such directory"),
        (["--groups", "two"], "invalid int value"),
        (["--nproc-per-group", "2", "--sharding", "hsdp", "--replicate", "3"], "--replicate 3"),
        (["--batch-size", "100000"], "fewer than --batch-size"),
        (["--seq-len", "100000000"], "--seq-len must be a positive integer"),
        (["--checkpoint-every", "-1"], "--checkpoint-every must be an integer in [0, "),
        (["--lr", "nan"], "--lr must be > 0 and <= 10, got nan"),
        (["--seed", "-1"], "--seed must be an integer in [0, "),
        (["--nproc-per-group", "1000"], "at most 128"),
        (["--resume", "/nonexistent/run"], "--resume /nonexistent/run: no checkpoints/ there"),
    ],
)
def test_cli_fails_fast_with_one_line(tmp_path, args, message):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "flower_shard.ux.cli", "train", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flower-shard: error:"), proc.stderr
    assert message in lines[0]
    assert not (out / "config.json").exists()  # nothing was launched


def test_config_round_trips_through_json(tmp_path):
    cfg = TrainConfig(groups=3, outer="nesterov", bf16=True, data=str(tmp_path))
    cfg.to_json(tmp_path / "c.json")
    assert TrainConfig.from_json(tmp_path / "c.json") == cfg
    (tmp_path / "bad.json").write_text('{"groups": 2, "gruops": 3}')
    with pytest.raises(ConfigError, match="unknown configuration keys"):
        TrainConfig.from_json(tmp_path / "bad.json")


@pytest.mark.parametrize(
    "args,message",
    [
        (["node", "--superlink", "nohost"], "--superlink 'nohost' must be HOST:PORT"),
        (["node", "--nproc-per-group", "0"], "--nproc-per-group must be a positive integer"),
        (
            ["node", "--nproc-per-group", "1000"],
            "--nproc-per-group must be a positive integer (at most 128)",
        ),
        (["node", "--port", "70000"], "--port must be a positive integer (at most 65535)"),
        (["node", "--superlink", "[::1]:8000"], "IPv6 literals are not supported"),
        (["node", "--superlink", "host:0"], "with a port in [1, 65535]"),
        (["node", "--data", "/nonexistent/text"], "--data /nonexistent/text: no such directory"),
        (["node", "--poll-interval", "0"], "--poll-interval must be > 0 and <= 3"),
        (["node", "--poll-interval", "nan"], "--poll-interval must be > 0 and <= 3"),
        (["node", "--max-restarts", "-1"], "--max-restarts must be an integer in [0, 1000]"),
        (["node", "--root-certificates", "/nonexistent/ca.crt"], "no such file"),
        (["node", "--auth-supernode-private-key", __file__], "needs both"),
        (["plan", "--model", "gpt5"], "--model 'gpt5' is unknown"),
        (["plan", "--gpus", "10", "--gpus-per-node", "4"], "not a multiple of --gpus-per-node"),
        (["plan", "--inter-site-gbps", "0"], "must be > 0"),
        (["demo", "--rounds", "0"], "--rounds must be >= 1"),
        pytest.param(["node", "--device", "cuda"], "--device cuda: no CUDA device", marks=NO_CUDA),
        pytest.param(["train", "--device", "cuda"], "--device cuda: no CUDA device", marks=NO_CUDA),
    ],
)
def test_other_commands_fail_fast_with_one_line(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "flower_shard.ux.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flower-shard: error:"), proc.stderr
    assert message in lines[0]


def test_plan_prints_a_ranked_table_and_a_recommendation():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flower_shard.ux.cli",
            "plan",
            "--gpus",
            "64",
            "--gpus-per-node",
            "8",
            "--nodes-per-site",
            "4",
            "--inter-site-gbps",
            "10",
            "--top",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(ln for ln in lines if ln.startswith("sharding"))
    column = header.split().index("tokens/s")  # found by name: columns get added
    rows = [ln for ln in lines if ln.startswith(("fsdp", "hsdp"))]
    assert len(rows) == 5
    throughput = [float(r.split()[column].replace(",", "")) for r in rows]
    assert throughput == sorted(throughput, reverse=True)
    assert "recommended:" in proc.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-level", "debug", "plan", "--top", "1"],
        ["plan", "--top", "1", "--log-level", "debug"],
    ],
)
def test_the_log_level_goes_before_or_after_the_command_and_into_the_environment(
    argv, monkeypatch, capsys
):
    from flower_shard import logs
    from flower_shard.ux.cli import build_parser
    from flower_shard.ux.cli import main as cli_main

    assert build_parser().parse_args(argv).log_level == "debug"
    monkeypatch.delenv(logs.LEVEL_ENV, raising=False)
    assert cli_main(argv) == 0
    assert os.environ[logs.LEVEL_ENV] == "debug"  # what the processes it starts inherit
    assert "recommended:" in capsys.readouterr().out
    assert build_parser().parse_args(["plan"]).log_level is None  # then: the environment's


def test_choice_flags_offer_the_fields_choices():
    from flower_shard.config import choices as C
    from flower_shard.ux.cli import build_parser

    parser = build_parser()
    for flag, value in (("--sharding", "zero"), ("--outer", "adam"), ("--device", "tpu")):
        with pytest.raises(SystemExit):
            parser.parse_args(["train", flag, value])
    args = parser.parse_args(["train", "--compression", C.INT8, "--partition", C.DIRICHLET])
    assert (args.compression, args.partition) == ("int8", "dirichlet")
    with pytest.raises(SystemExit):
        parser.parse_args(["node", "--device", "tpu"])
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--transport", "carrier-pigeon"])


def test_the_flower_apps_run_config_defaults_are_the_configs_defaults():
    """pyproject.toml's [tool.flwr.app.config] (what `flwr run` uses) says the same defaults as
    TrainConfig and FederationConfig (what `flower-shard train` and the docs use). TOML has no
    null: "" stands for None. Only the run directory differs, on purpose."""
    run_config = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    fed, train = FederationConfig(), TrainConfig()
    differ = {}
    for key, value in run_config.items():
        name = RENAMED.get(key, key.replace("-", "_"))
        owner = fed if name != "train" and hasattr(fed, name) else train
        assert hasattr(owner, name), f"run-config key {key!r} is no setting"
        default = getattr(owner, name)
        if value != ("" if default is None else default):
            differ[key] = (value, default)
    assert differ == {"out-dir": ("runs/flower", "runs/latest")}


@pytest.mark.parametrize("installed", ["1.41.2", "1.43.0", "2.0.0", "nightly"])
def test_a_flwr_release_outside_the_tested_range_is_refused_in_one_line(installed):
    with pytest.raises(ConfigError, match=r"flwr .* is installed, but flower-shard supports") as e:
        check_flwr(installed)
    assert supported_range() in str(e.value) and "\n" not in str(e.value)
    assert check_flwr("1.42.0") == "1.42.0"


def test_the_pinned_flwr_range_is_the_one_checked_and_version_names_it():
    """pyproject.toml pins flwr to exactly the range compat.py accepts; `--version` prints the
    versions that matter to a bug report."""
    from flower_shard import __version__

    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    assert f"flwr[simulation]{supported_range()}" in deps
    proc = subprocess.run(
        [sys.executable, "-m", "flower_shard.ux.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    want = f"flower-shard {__version__} (flwr {version('flwr')}, torch {version('torch')}"
    assert proc.stdout.startswith(want), proc.stdout


def train_dry_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flower_shard.ux.cli", "train", "--dry-run", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def changed_line(stderr: str) -> set[str]:
    line = next(x for x in stderr.splitlines() if "differ from the defaults" in x)
    return set(line.split("defaults: ", 1)[1].split())


def test_train_takes_a_toml_config_and_flags_win_over_it(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        'lr = 1e-3\nlocal-steps = 8\nnum-server-rounds = 2\nbf16 = true\ntokenizer = ""\n'
        "outer_lr = 1\n"
    )
    proc = train_dry_run("--config", str(config), "--rounds", "3", "--out", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr
    assert changed_line(proc.stderr) == {
        "lr=0.001",
        "local-steps=8",
        "rounds=3",  # the flag, not the file's num-server-rounds
        "bf16=True",
        "outer-lr=1.0",
        f"out={tmp_path / 'o'}",
    }


def test_a_run_directorys_saved_config_is_a_config_file(tmp_path):
    saved = TrainConfig(groups=4, nproc_per_group=1, local_steps=2, seed=7, out=str(tmp_path))
    saved.to_json(tmp_path / "config.json")
    proc = train_dry_run("--config", str(tmp_path / "config.json"))
    assert proc.returncode == 0, proc.stderr
    assert changed_line(proc.stderr) == {
        "groups=4",
        "nproc-per-group=1",
        "local-steps=2",
        "seed=7",
        f"out={tmp_path}",
    }
    assert "--nproc-per-node=4" in proc.stdout


@pytest.mark.parametrize(
    "text,message",
    [
        ("local-step = 3\n", "'local-step' is no setting of train; did you mean local-steps"),
        ('lr = "fast"\n', "lr must be a number, got 'fast'"),
        ("lr = nan\n", "--lr must be"),
        ("lr = \n", "not valid TOML"),
        ("lr = [1, 2]\n", "lr must be a single value"),
        ("seed = 1.5\n", "--seed must be"),
    ],
)
def test_a_bad_config_file_fails_in_one_line(tmp_path, text, message):
    config = tmp_path / "run.toml"
    config.write_text(text)
    proc = train_dry_run("--config", str(config))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
