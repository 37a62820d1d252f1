"""Bad values and hostile paths fail before anything starts, in one line (issue 15, item 7).

Every numeric setting of every config dataclass has a declared range that one loop checks
(NaN and inf never pass); HOST:PORT settings take an IPv4 address or a name and a real port;
data entries must be regular readable files; an ``--out`` that is a file, or inside the data,
and a model config that cannot be built fail in one line with exit status 2.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest

from flower_shard.config import ConfigError, TrainConfig
from flower_shard.config.federation import FederationConfig
from flower_shard.config.ranges import numeric_fields, range_of
from flower_shard.flower.node.config import NodeConfig
from flower_shard.preflight import check, check_data, check_out

CONFIGS = (TrainConfig, FederationConfig, NodeConfig)


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_numeric_setting_has_a_range_that_refuses_nan_inf_and_outliers(cls):
    fields = numeric_fields(cls)
    assert fields, cls
    for f in fields:
        rng = range_of(f)
        assert rng is not None, f"{cls.__name__}.{f.name} has no declared range (bounded())"
        integer = str(f.type).startswith("int")
        bad = [rng.lo - 1, rng.hi + 1, True]
        bad += [] if integer else [math.nan, math.inf, -math.inf, "1.0"]
        bad += [1.5] if integer else []
        if rng.open_lo:
            bad.append(rng.lo)
        if rng.open_hi:
            bad.append(rng.hi)
        for value in bad:
            with pytest.raises(ConfigError, match=f.name.replace("_", "-")):
                validate(cls, f.name, value)


def validate(cls, name: str, value) -> None:
    if cls is FederationConfig:
        dataclasses.replace(FederationConfig(), **{name: value}).validate()
    elif cls is NodeConfig:
        NodeConfig(**{name: value}).validate()
    else:
        TrainConfig(**{name: value}).validate()


@pytest.mark.parametrize(
    "run_config,message",
    [
        ({"outlier-factor": math.nan}, "outlier-factor must be >= 0"),
        ({"round-timeout": math.nan}, "round-timeout must be > 0"),
        ({"round-timeout": math.inf}, "round-timeout must be > 0"),
        ({"outer-lr": math.nan}, "--outer-lr must be > 0"),
        ({"lr": math.nan}, "--lr must be > 0"),
        ({"min-groups": 1.5}, "min-groups must be an integer"),
        ({"min-groups": True}, "min-groups must be a number, not a bool"),
        ({"collective-address": "[::1]:29600"}, "IPv6 literals are not supported"),
        ({"collective-address": "::1:29600"}, "IPv6 literals are not supported"),
        ({"collective-address": "127.0.0.1:70000"}, "a port in [1, 65535]"),
        ({"transport": "streaming", "aggregator-addresses": "h:0"}, "a port in [1, 65535]"),
        ({"transport": "streaming", "dataplane-host": "::"}, "IPv6 literals"),
        ({"seed": -1}, "--seed must be an integer in [0, "),
        ({"lr": "fast"}, "--lr must be a number"),
    ],
)
def test_run_config_values_are_checked_like_flags(run_config, message):
    with pytest.raises(ConfigError) as err:
        FederationConfig.from_run_config(run_config)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_data_must_be_a_regular_readable_file(tmp_path):
    fifo = tmp_path / "docs.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        check_data(str(fifo))  # never opened: that would block
    records = tmp_path / "ok.jsonl"
    records.write_text('{"text": "a"}\n')
    check_data(str(records))
    if os.getuid() != 0:  # root reads anything
        records.chmod(0)
        with pytest.raises(ConfigError, match="cannot be read"):
            check_data(str(records))


def test_out_must_be_a_directory_outside_the_data(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "file").write_text("x")
    for out, message in (
        (tmp_path / "file", "is a file"),
        (tmp_path / "file" / "run", "is a file, not a directory"),
        (data / "run", "inside --data"),
        (data, "inside --data"),
    ):
        with pytest.raises(ConfigError, match=message):
            check_out(TrainConfig(out=str(out), data=str(data)))
    check_out(TrainConfig(out=str(tmp_path / "run"), data=str(data)))


@pytest.mark.parametrize(
    "config_json",
    [
        '{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5, '
        '"num_hidden_layers": 1, "intermediate_size": 32, "vocab_size": 300}',
        '{"model_type": "llama", "hidden_size": -8, "num_attention_heads": 2, '
        '"num_hidden_layers": 1, "intermediate_size": 32, "vocab_size": 300}',
        '{"model_type": "llama", "hidden_size": "wide"}',
        "{not json",
    ],
)
def test_a_model_config_that_cannot_be_built_fails_in_one_line(tmp_path, config_json):
    (tmp_path / "config.json").write_text(config_json)
    with pytest.raises(ConfigError) as err:
        check(TrainConfig(model=str(tmp_path)))
    assert str(err.value).startswith(f"--model {tmp_path}") and "\n" not in str(err.value)


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flower_shard.ux.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_path_errors_end_the_cli_in_one_line_before_anything_starts(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("some text " * 100)
    (tmp_path / "file").write_text("x")
    for args, message in (
        (["--out", tmp_path / "file"], "is a file"),
        (["--data", data, "--out", data / "run"], "inside --data"),
        (["--out", tmp_path / "run", "--rdzv-endpoint", "[::1]:29400", "--nnodes", "2"], "IPv6"),
    ):
        proc = cli("train", *args)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], proc.stderr
    assert sorted(p.name for p in data.iterdir()) == ["a.txt"]  # nothing written into the data


def test_node_refuses_a_work_dir_that_others_can_write_or_do_not_own(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    proc = cli("node", "--work-dir", shared, "--superlink", "127.0.0.1:9")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "can be written by others (mode 1777)" in lines[0], proc.stderr
    assert oct(shared.stat().st_mode & 0o7777) == oct(0o1777)  # left as it was
    assert list(shared.iterdir()) == []
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o755)
    if os.getuid() == 0:
        os.chown(foreign, 65534, 65534)
    else:
        foreign = "/"  # root's, not ours
    proc = cli("node", "--work-dir", foreign, "--superlink", "127.0.0.1:9")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "not to you" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
