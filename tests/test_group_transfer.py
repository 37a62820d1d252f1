"""The weights between a ClientApp and its group travel as streams of bounded frames.

gRPC frames a message with a 4-byte length, so one message of the model (32 GB for 8B in
float32) cannot pass; the control service carries weights as a stream of frames of at most
``wire.FRAME_BYTES`` (:func:`flower_shard.flower.wire.frames`), written by the receiver straight
into its arrays. Tested on the framing itself and on the real gRPC service over a Unix socket,
with its message limit in force: a payload several times that limit crosses intact, both ways.
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import torch.distributed as dist

from flower_shard import protocol as P
from flower_shard.flower import wire
from flower_shard.flower.client.group_client import GroupClient
from flower_shard.runtime.distributed import shutdown


def payload(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=(301, 7)).astype(np.float32),  # 8428 bytes: not a frame multiple
        "empty": np.zeros((0, 5), np.float32),
        "q": rng.integers(-128, 128, 1001).astype(np.int8),
        "scale": rng.normal(size=3).astype(np.float32),
    }


def test_frames_are_bounded_and_assemble_to_the_same_arrays():
    arrays = payload()
    out = list(wire.frames({"k": 1}, arrays, frame_bytes=1000))
    assert all(len(f) <= 1000 for f in out[1:])
    # Every array starts a frame of its own: ceil(bytes / 1000) frames each, none for empty.
    assert len(out) == 1 + 9 + 0 + 2 + 1
    header, back = wire.assemble(iter(out))
    assert header == {"k": 1} and list(back) == list(arrays)
    for k in arrays:
        assert back[k].dtype == arrays[k].dtype and back[k].shape == arrays[k].shape
        assert np.array_equal(back[k], arrays[k])


@pytest.mark.parametrize(
    "spoil,reason",
    [
        (lambda f: f[:-1], "the stream ended inside array"),
        (lambda f: f + [b"x"], "frames after the last array"),
        (lambda f: f[:1] + [f[1] + b"xx"] + f[2:], "runs past the end of array"),
        (lambda f: [b"not json"] + f[1:], "bad first frame"),
        (lambda f: [f[0].replace(b"float32", b"object")] + f[1:], "bad first frame"),
        (lambda f: [f[0].replace(b"[301, 7]", b"[-301, 7]")] + f[1:], "bad first frame"),
        (lambda f: [], "bad first frame"),
    ],
)
def test_a_broken_stream_is_refused_with_its_reason(spoil, reason):
    good = list(wire.frames({}, payload(), frame_bytes=1000))
    with pytest.raises(ValueError, match=reason):
        wire.assemble(iter(spoil(good)))


@pytest.fixture
def group_service(tmp_path):
    """The real ControlServer of a one-rank gloo world, its main loop a thread that answers
    Train with the received arrays times two and their checksum."""
    from flower_shard.flower.group.service import ControlServer

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    address = f"unix:{tmp_path / 'group.sock'}"
    server = ControlServer(address)
    server.status[P.H_READY] = True

    def loop():
        while True:
            method, header, arrays, done = server.commands.get()
            if method is None:
                return
            doubled = {k: v * 2 for k, v in arrays.items()}
            total = float(sum(float(v.astype(np.float64).sum()) for v in arrays.values()))
            done.set_result(({P.H_METRICS: {"sum": total, "echo": header}}, doubled))

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    yield address
    server.commands.put((None, None, None, None))
    server.server.stop(0)
    shutdown(clean=True)


def test_a_model_larger_than_the_message_limit_crosses_both_ways(group_service):
    """22 MB of weights, four times the service's message limit (which is in force: one
    message of that size is refused), to the group and back, bit for bit."""
    rng = np.random.default_rng(1)
    big = {"a": rng.normal(size=(5_500_000,)).astype(np.float32), "b": payload()["w"]}
    assert sum(v.nbytes for v in big.values()) > 4 * wire.MAX_MESSAGE
    client = GroupClient(group_service, connect_timeout=10)
    try:
        assert client.health()[P.H_READY] is True
        head, out = client.call(P.TRAIN, {P.H_CONFIG: {"x": 1}}, big)
        assert head[P.H_METRICS]["echo"] == {P.H_CONFIG: {"x": 1}}
        assert head[P.H_METRICS]["sum"] == float(
            sum(v.astype(np.float64).sum() for v in big.values())
        )
        for k in big:
            assert np.array_equal(out[k], big[k] * 2)
        # The limit is real: the same weights as one unary message are refused by gRPC.
        with raw_channel(group_service) as channel:
            unary = channel.unary_unary(f"/{P.SERVICE}/{P.TRAIN}")
            with pytest.raises(grpc.RpcError) as refused:
                unary(wire.encode({}, big), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        client.close()


def test_a_bad_stream_to_the_group_is_answered_with_an_error(group_service):
    with raw_channel(group_service) as channel:
        stub = channel.stream_stream(f"/{P.SERVICE}/{P.TRAIN}")
        frames = list(wire.frames({}, payload(), frame_bytes=1000))[:-1]  # one frame short
        head, _ = wire.assemble(stub(iter(frames), timeout=30))
    assert head[P.H_ERROR].startswith("bad request: the stream ended inside array")


def raw_channel(address: str) -> grpc.Channel:
    """A channel of our own to the service, to send what GroupClient never would."""
    return grpc.insecure_channel(address, options=wire.GRPC_OPTIONS)
