"""The Slurm examples: shellcheck clean, and the commands they generate are valid and complete.

Each script runs under bash with stand-ins for Slurm (`srun` starts one task per host with that
host's SLURM_NODEID, `scontrol` lists the hosts) and for the programs it launches, which only
record their arguments; the recorded commands are then checked with flower-shard's own parsers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from flower_shard.config.federation import FederationConfig
from flower_shard.flower.certificates import make_supernode_keys, make_tls_certificates

SLURM = Path(__file__).parent.parent / "examples" / "slurm"
SCRIPTS = sorted(SLURM.glob("*.sbatch"))

RECORDER = """#!/bin/bash
python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$(basename "$0")" "$@" >> "$RECORD"
"""
SRUN = """#!/bin/bash
for ((i = 0; i < ${SLURM_NNODES:-1}; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@"; done
"""
SCONTROL = """#!/bin/bash
for ((i = 0; i < SLURM_NNODES; i++)); do echo "node$i"; done
"""


def test_scripts_are_shellcheck_clean():
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    proc = subprocess.run(
        [shellcheck, *map(str, SCRIPTS), str(SLURM.parent / "local_deployment.sh")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout


def run_script(script: str, tmp_path: Path, env: dict, programs: list[str]) -> list[list[str]]:
    """Run ``script`` with Slurm stand-ins; return the recorded [program, args...] calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in [("srun", SRUN), ("scontrol", SCONTROL)] + [(p, RECORDER) for p in programs]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    record = tmp_path / "calls.jsonl"
    full_env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "RECORD": str(record),
        "SLURM_JOB_ID": "42",
    } | env
    proc = subprocess.run(
        ["bash", str(SLURM / script)], env=full_env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in record.read_text().splitlines()]


def dry_run(argv: list[str]) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "flower_shard.ux.cli", *argv, "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_collective_script_gives_every_host_its_own_rank(tmp_path):
    calls = run_script(
        "train_collective.sbatch",
        tmp_path,
        {"SLURM_NNODES": "128", "SLURM_JOB_NODELIST": "node[0-127]"},
        ["flower-shard"],
    )
    assert len(calls) == 128 and {c[0] for c in calls} == {"flower-shard"}
    ranks = [int(c[c.index("--node-rank") + 1]) for c in calls]
    assert sorted(ranks) == list(range(128))  # each task got its host's rank, not host 0's
    assert {c[c.index("--rdzv-endpoint") + 1] for c in calls} == {"node0:29400"}
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "doc.txt").write_text("text to train on\n")  # a dry run reads it
    (tmp_path / "tok").mkdir()
    for call in (calls[0], calls[-1]):
        argv = [
            {
                "/path/to/your/text": str(tmp_path / "data"),
                "/path/to/local/tokenizer": str(tmp_path / "tok"),
            }.get(a, a)
            for a in call[1:]
        ]
        cmd = dry_run(argv)
        rank = call[call.index("--node-rank") + 1]
        # 512 ranks on 128 hosts: 4 per host, host 0 holds the rendezvous.
        assert "--nproc-per-node=4 --nnodes=128" in cmd and f"--node-rank={rank} " in cmd
        assert "--master-addr=node0 --master-port=29400" in cmd


def test_site_node_script_starts_an_authenticated_tls_node(tmp_path):
    from flower_shard.flower.node.config import NodeConfig, add_node_flags, node_config_from_args

    certs = make_tls_certificates(tmp_path / "certs")
    keys = make_supernode_keys(tmp_path, "site")
    (tmp_path / "text").mkdir()
    env = {
        "SUPERLINK": "superlink.example.org:8000",
        "CERTS": str(certs.ca_cert.parent),
        "KEY": str(keys.private_key),
        "DATA": str(tmp_path / "text"),
    }
    calls = run_script("site_node.sbatch", tmp_path, env, ["flower-shard"])
    assert len(calls) == 1 and calls[0][:2] == ["flower-shard", "node"]
    import argparse

    parser = argparse.ArgumentParser()
    add_node_flags(parser)
    cfg = node_config_from_args(parser.parse_args(calls[0][2:]))
    assert isinstance(cfg.validate(), NodeConfig)  # files exist, key and CA are well-formed
    assert cfg.superlink == "superlink.example.org:8000" and cfg.nproc_per_group == 8
    assert cfg.root_certificates == str(certs.ca_cert) and cfg.max_restarts == 3
    # Without SUPERLINK the script stops at once and says what to set.
    proc = subprocess.run(
        ["bash", str(SLURM / "site_node.sbatch")],
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "set SUPERLINK=HOST:PORT" in proc.stderr


def test_superlink_script_serves_tls_with_auth_and_starts_a_valid_run(tmp_path):
    summary = tmp_path / "flower-shard" / "runs" / "cross-site" / "summary.json"
    summary.parent.mkdir(parents=True)
    summary.write_text("{}")  # the script waits for the ServerApp's report
    calls = run_script("superlink.sbatch", tmp_path, {}, ["flower-superlink", "curl", "flwr"])
    (superlink,) = [c for c in calls if c[0] == "flower-superlink"]  # started in background
    for flag in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile"):
        assert flag in superlink
    assert "--enable-supernode-auth" in superlink
    assert superlink[superlink.index("--host") + 1] == "0.0.0.0"
    flwr = next(c for c in calls if c[0] == "flwr")
    assert flwr[1:4] == ["run", ".", "cross-site"]
    pairs = re.findall(r"(\S+?)=('[^']*'|\S+)", flwr[flwr.index("--run-config") + 1])
    run_config = tomllib.loads("\n".join(f"{k} = {v}" for k, v in pairs))
    fed = FederationConfig.from_run_config(run_config)  # every key known, every value valid
    assert fed.transport == "streaming" and fed.min_groups == 2  # 8B: not in Flower Messages
    assert fed.dataplane_certfile.endswith("server.pem") and not fed.dataplane_insecure
    assert fed.train.model == "llama3.1-8b" and fed.train.checkpoint_every == 10


@pytest.mark.parametrize("script", [s.name for s in SCRIPTS])
def test_scripts_explain_themselves(script):
    lines = (SLURM / script).read_text().splitlines()
    assert lines[0] == "#!/bin/bash" and lines[1].startswith("# ")
    assert sum(line.startswith("# ") for line in lines) >= 5
