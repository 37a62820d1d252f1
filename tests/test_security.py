"""Security on a real deployment: TLS on the SuperLink and SuperNode authentication.

One deployment serves the module: ``flower-superlink`` with TLS (a CA and server certificate
made on the fly) and ``--enable-supernode-auth``, two nodes of 2 ranks whose keys were
registered with ``flwr supernode register``. Each test then checks one claim of SECURITY.md on
real processes: an authenticated federation over TLS trains; an unregistered key, a node
without TLS and a node that does not trust the SuperLink's certificate never join.
"""

from __future__ import annotations

import http.client
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.serialization import load_ssh_private_key

from flower_shard import protocol as P
from flower_shard.flower.certificates import make_supernode_keys, make_tls_certificates
from flower_shard.flower.node.launcher import Node, SuperNodeRefused, bin_path
from flower_shard.launch.deployment import LocalDeployment
from flower_shard.launch.processes import ManagedProcess, free_port, marked_pids
from flower_shard.ux.cli import main as cli_main
from flower_shard.ux.metrics import read_metrics

ROUNDS = 2


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    work = tmp_path_factory.mktemp("secure")
    with LocalDeployment(
        work, num_nodes=2, nproc_per_group=2, tls=True, supernode_auth=True
    ) as dep:
        yield dep


def online(dep: LocalDeployment) -> set[int]:
    """IDs of the SuperNodes the SuperLink counts as connected."""
    return {int(n["node-id"]) for n in dep.list_supernodes() if n["status"] == "online"}


def start_lone_supernode(dep: LocalDeployment, work: Path, **overrides) -> Node:
    """A SuperNode without a group (it never gets that far): only its admission is tested."""
    node = Node(dep.node_config(work_dir=str(work), nproc_per_group=1, **overrides))
    node.start_supernode()
    return node


def stop_and_check_gone(node: Node) -> None:
    node.stop()
    if node.supernode is not None:
        assert not node.supernode.alive()
        assert marked_pids(node.supernode.marker) == [], "a SuperNode helper outlived stop()"


def test_tls_federation_with_authenticated_nodes_trains(secure, tmp_path):
    # Exactly the two registered keys joined, each as the ID its registration returned.
    assert len(secure.node_ids) == 2
    assert online(secure) == set(secure.node_ids)
    for node, node_id in zip(secure.nodes, secure.node_ids):
        assert f"SuperNode ID: {node_id}" in node.supernode.log_path.read_text()

    rounds_seen = []
    summary = secure.run(
        {
            P.NUM_SERVER_ROUNDS: ROUNDS,
            P.LOCAL_STEPS: 2,
            P.TRANSPORT: "flower",  # the weights themselves travel through the TLS channel
            P.OUT_DIR: str(tmp_path),
            P.MIN_GROUPS: 2,
            "model": "tiny",
            "seq-len": 32,
            "batch-size": 2,
            "eval-sequences": 8,
            P.COLLECTIVE_ADDRESS: f"127.0.0.1:{free_port()}",
        },
        timeout=300,
        on_round=rounds_seen.append,
    )
    assert summary["status"] == "ok", summary
    rounds = read_metrics(tmp_path)
    assert (
        [r["round"] for r in rounds]
        == list(range(1, ROUNDS + 1))
        == [r["round"] for r in rounds_seen]
    )
    assert all(r["groups_ok"] == 2 and r["groups_rejected"] == 0 for r in rounds), rounds
    assert all(r["exchange_bytes"] > 0 for r in rounds)
    assert (tmp_path / "final_model.safetensors").is_file()


def test_superlink_speaks_only_tls_with_the_generated_certificate(secure):
    trusted = ssl.create_default_context(cafile=secure.ca_cert)
    with urllib.request.urlopen(f"https://{secure.address}/health", context=trusted) as r:
        assert r.status == 200
    with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP: no answer
        urllib.request.urlopen(f"http://{secure.address}/health", timeout=5)
    with pytest.raises(urllib.error.URLError) as untrusted:  # the system CAs do not vouch
        urllib.request.urlopen(
            f"https://{secure.address}/health", context=ssl.create_default_context(), timeout=5
        )
    assert isinstance(untrusted.value.reason, ssl.SSLCertVerificationError), untrusted.value


def test_unregistered_key_is_refused_until_registered(secure, tmp_path):
    keys = make_supernode_keys(tmp_path / "keys", "intruder")
    refused = Node(
        secure.node_config(
            work_dir=str(tmp_path / "refused"),
            nproc_per_group=1,
            auth_private_key=str(keys.private_key),
            ready_timeout=60,
        )
    )
    try:
        with pytest.raises(SuperNodeRefused, match="refused this SuperNode's key"):
            refused.start_supernode()
        assert refused.supernode.proc.returncode not in (None, 0)  # it exited on its own
    finally:
        stop_and_check_gone(refused)
    assert "SuperNode ID" not in refused.supernode.log_path.read_text()
    assert online(secure) == set(secure.node_ids)

    # The same key, once registered, is admitted under the ID the registration returned: the
    # refusal above was the missing registration, nothing else.
    node_id = secure.register_supernode(keys.public_key, name="late")
    admitted = None
    try:
        admitted = start_lone_supernode(
            secure, tmp_path / "admitted", auth_private_key=str(keys.private_key)
        )
        assert node_id in online(secure)
    finally:
        if admitted is not None:
            stop_and_check_gone(admitted)
        # Stopped first (it deactivates cleanly), then unregistered: the module's other tests
        # see only the deployment's own nodes.
        secure.flwr("supernode", "unregister", str(node_id), "local-deployment")


def test_node_without_tls_does_not_join(secure, tmp_path):
    # Plain flower-supernode --insecure (flower-shard node refuses to combine a key with it, so
    # this is the anonymous kind). Flower retries a failed connection forever by default;
    # --max-retries makes it give up, so the outcome is an exit, not a timeout.
    work = tmp_path / "plain"
    work.mkdir()
    node = ManagedProcess(
        "insecure-supernode",
        [
            bin_path("flower-supernode"),
            "--insecure",
            "--superlink",
            secure.address,
            "--port",
            str(free_port()),
            "--max-retries",
            "2",
        ],
        work / "supernode.log",
        secure.env(),
        cwd=work,
    )
    try:
        node.proc.wait(timeout=120)
    finally:
        node.stop()
    assert marked_pids(node.marker) == []
    assert node.proc.returncode != 0, node.tail()  # it gave up: no connection
    assert "SuperNode ID" not in node.log_path.read_text()
    assert online(secure) == set(secure.node_ids)


def test_node_that_does_not_trust_the_superlink_certificate_refuses_it(secure, tmp_path):
    # A SuperLink impostor's view: the node holds a different CA than the one that signed the
    # certificate it is shown, so it must not talk to it (and stops trying).
    other_ca = make_tls_certificates(tmp_path / "other").ca_cert
    node = Node(
        secure.node_config(
            work_dir=str(tmp_path / "wrong-ca"),
            nproc_per_group=1,
            root_certificates=str(other_ca),
            ready_timeout=60,
        )
    )
    try:
        with pytest.raises(SuperNodeRefused, match="could not verify"):
            node.start_supernode()
        assert node.supernode.proc.returncode not in (None, 0)  # it gave up on its own
    finally:
        stop_and_check_gone(node)
    assert "SuperNode ID" not in node.supernode.log_path.read_text()


def test_generated_keys_are_what_flower_reads(tmp_path):
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    keys = make_supernode_keys(tmp_path, "site")
    private = load_ssh_private_key(keys.private_key.read_bytes(), None)  # as flower-supernode
    assert try_load_public_key(keys.public_key) == public_key_to_bytes(private.public_key())
    tls = make_tls_certificates(tmp_path / "tls")
    for secret in (keys.private_key, tls.server_key):
        assert secret.stat().st_mode & 0o777 == 0o600, secret


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--auth-supernode-private-key", "{key}"], "needs both --auth-supernode-private-key"),
        (
            ["--root-certificates", "{ca}", "--auth-supernode-private-key", "{ca}"],
            "--auth-supernode-private-key {ca}: not an unencrypted OpenSSH private key",
        ),
        (
            ["--root-certificates", "{key}"],
            "--root-certificates {key}: not a PEM certificate",
        ),
        (
            [
                "--root-certificates",
                "{ca}",
                "--auth-supernode-private-key",
                "{key}",
                "--auth-supernode-public-key",
                "{other_pub}",
            ],
            "is not the public key of --auth-supernode-private-key",
        ),
    ],
)
def test_node_security_flags_fail_with_one_line(tmp_path, capsys, flags, message):
    keys = make_supernode_keys(tmp_path, "a")
    paths = {
        "key": keys.private_key,
        "other_pub": make_supernode_keys(tmp_path, "b").public_key,
        "ca": make_tls_certificates(tmp_path).ca_cert,
    }
    assert cli_main(["node", *(f.format(**paths) for f in flags)]) == 2  # before any process
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flower-shard: error:"), lines
    assert message.format(**paths) in lines[0]


def _listening(port: int) -> set[str]:
    """Local addresses listening on TCP ``port`` (IPv4 and IPv6), from /proc/net."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                found.add(addr)
    return found


def test_cross_group_rendezvous_listens_on_the_configured_interface_only():
    from flower_shard.flower.server.transports.collective import host_rendezvous
    from flower_shard.launch.processes import free_port

    port = free_port()
    store = host_rendezvous(f"127.0.0.1:{port}", 5.0)
    assert _listening(port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 nor ::
    store.set("k", "v")
    assert store.get("k") == b"v"
    del store
    assert _listening(port) == set()  # gone with the store
