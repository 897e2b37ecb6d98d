"""The parameter-server wire under attack: altered bytes, replays, floods, orphans, a chief without the
secret, refusal logs, and TLS. In-process tests use the production services; the cluster tests real
processes over gRPC (conftest's run_job / run_jobs).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("grpc")
pytest.importorskip("cloudpickle")
pytest.importorskip("cryptography")

from phalanx.ps import frame_mac, pickling, wire  # noqa: E402
from phalanx.ps.errors import AuthenticationError  # noqa: E402
from phalanx.ps.service import RefusalLog  # noqa: E402
from phalanx.ps.testing import InProcessCluster  # noqa: E402
from phalanx.ps.transport import ServiceError  # noqa: E402
from phalanx.ps.variable_server import ParameterServerService  # noqa: E402

from conftest import free_ports, run_job, run_jobs  # noqa: E402

SECRET = b"security-test-secret-0123456789"
SCRIPTS = Path(__file__).parent / "scripts"
JOB = SCRIPTS / "ps_job.py"
TAG = 16  # a frame ends with the tag of its body


@pytest.fixture(scope="module", autouse=True)
def _torch_optim_imported():
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def _send(service, method, chunks):
    return list(service.handle(method, chunks, "ipv4:10.9.8.7:5555"))


def _code(service, method, chunks):
    try:
        _send(service, method, chunks)
    except ServiceError as e:
        return e.code
    return "ok"


# ------------------------------------------------------------------------------------ every byte signed
def test_a_tampered_tensor_byte_is_refused_and_the_weight_keeps_its_value():
    ps = ParameterServerService(0, SECRET)
    chief = wire.Signer(SECRET, "chief:0")
    _send(ps, "create", chief.encode("create", {"vars": [{"key": "w", "trainable": True}]}, [torch.zeros(8)]).chunks())
    frame = bytearray(chief.encode("assign", {"keys": ["w"]}, [torch.ones(8)]).to_bytes())
    frame[-3 - TAG] ^= 0x40  # one byte of the last float (the frame ends with its tag)
    with pytest.raises(ServiceError, match="altered") as e:
        _send(ps, "assign", [bytes(frame)])
    assert e.value.code == "unauthenticated"
    assert torch.equal(ps.value("w"), torch.zeros(8))
    # A reply with an altered tensor byte is refused by the caller too.
    call = chief.encode("read", {"keys": ["w"]})
    reply = bytearray(b"".join(_send(ps, "read", call.chunks())))
    reply[-1 - TAG] ^= 1
    with pytest.raises(AuthenticationError, match="altered"):
        wire.Verifier(SECRET).decode("read", [bytes(reply)], reply_to=call.head)


def test_every_byte_of_a_frame_is_signed_whatever_its_chunking():
    # Header, blob, alignment padding and two tensors, cut into 61-byte chunks (boundaries fall
    # inside every part): flipping any single byte anywhere is refused.
    signer = wire.Signer(SECRET, "chief:0")
    frame = signer.encode(
        "assign", {"keys": ["a", "b"]}, [torch.arange(5.0), torch.ones(3, dtype=torch.int64)], [b"xy"]
    )
    data = frame.to_bytes()
    assert wire.Verifier(SECRET).decode("assign", frame.chunks(61)).blobs == [b"xy"]
    head_len = len(data) - frame.head.body_len - TAG
    for at in range(len(data)):
        bad = bytearray(data)
        bad[at] ^= 0x10
        chunks = [bytes(bad[i : i + 61]) for i in range(0, len(bad), 61)]
        with pytest.raises(AuthenticationError, match="altered" if at >= head_len else None) as e:
            wire.Verifier(SECRET).decode("assign", chunks)
        assert at >= head_len or "altered" not in str(e.value), at  # a head byte fails the head's HMAC


def test_each_frame_has_its_own_body_key_and_nonce():
    # GMAC under one (key, nonce) twice gives away its hash key, after which anyone forges: identical
    # content signed twice, by one sender or by two, must get different tags.
    def tag(frame):
        return frame.to_bytes()[-TAG:]

    a, b = wire.Signer(SECRET, "chief:0"), wire.Signer(SECRET, "chief:0")
    frames = [a.encode("apply", {"keys": ["w"]}, [torch.ones(4)]) for _ in range(2)]
    frames += [frames[0].renewed(), b.encode("apply", {"keys": ["w"]}, [torch.ones(4)])]
    assert frames[3].head.seq == frames[0].head.seq
    assert len({tag(f) for f in frames}) == 4


def test_bodies_tagged_in_one_call_or_streamed_in_slices_get_the_same_tag(monkeypatch):
    # A sender tags a large body chunk by chunk as it copies it, a receiver in one call over the
    # whole body; a body longer than cryptography's limit per call (2**31 - 1 bytes; 7 here, so
    # every path runs) goes in slices. A frame tagged one way verifies the other way, and an
    # altered byte is caught either way.
    w = torch.randn(2000)  # over _SMALL_BODY: GMAC
    in_one_call = wire.Signer(SECRET).encode("assign", {"keys": ["w"]}, [w], [b"blob"]).to_bytes()
    with monkeypatch.context() as m:
        m.setattr(frame_mac, "_ONE_SHOT_MAX", 7)
        streamed = list(wire.Signer(SECRET).encode("assign", {"keys": ["w"]}, [w], [b"blob"]).chunks(61))
        assert torch.equal(wire.Verifier(SECRET).decode("assign", streamed).tensors[0], w)
        assert torch.equal(wire.Verifier(SECRET).decode("assign", [in_one_call]).tensors[0], w)
        bad = bytearray(in_one_call)
        bad[-200] ^= 1
        with pytest.raises(AuthenticationError, match="altered"):
            wire.Verifier(SECRET).decode("assign", [bytes(bad)])
    assert torch.equal(wire.Verifier(SECRET).decode("assign", streamed).tensors[0], w)
    with pytest.raises(AuthenticationError, match="altered"):
        wire.Verifier(SECRET).decode("assign", [bytes(bad)])


def test_large_tensors_travel_in_bounded_chunks_and_arrive_intact():
    big = torch.randn(3 << 20)  # 12 MiB
    frame = wire.Signer(SECRET).encode("assign", {"keys": ["big"]}, [torch.arange(3), big])
    chunks = list(frame.chunks())
    assert max(len(c) for c in chunks) <= wire.CHUNK_BYTES and len(chunks) == 13
    msg = wire.Verifier(SECRET).decode("assign", chunks)
    assert torch.equal(msg.tensors[1], big) and torch.equal(msg.tensors[0], torch.arange(3))


def test_a_frame_that_fits_one_message_goes_as_one_and_each_of_its_bytes_is_signed():
    # A frame of at most MAX_MESSAGE_BYTES (a 1 MiB tensor with its head and header) is one message
    # and its tag (appended to a small frame); the receiver tags the body inside that message. A
    # byte altered there, in the tag, a tag dropped or moved, or the same message arriving in a
    # mutable buffer: each is refused, and the frame decodes whatever its chunking.
    w = torch.randn(wire.CHUNK_BYTES // 4)
    frame = wire.Signer(SECRET, "chief:0").encode("assign", {"keys": ["w"]}, [w], [b"blob"])
    message, tag = list(frame.chunks())
    assert wire.CHUNK_BYTES < len(message) <= wire.MAX_MESSAGE_BYTES and len(tag) == TAG
    assert torch.equal(wire.Verifier(SECRET).decode("assign", [message, tag]).tensors[0], w)
    assert torch.equal(wire.Verifier(SECRET).decode("assign", [message + tag]).tensors[0], w)
    assert torch.equal(wire.Verifier(SECRET).decode("assign", frame.chunks(4099)).tensors[0], w)
    body_at = len(message) - frame.head.body_len
    for at in (body_at, body_at + 9, len(message) // 2, len(message) - 1):
        bad = bytearray(message)
        bad[at] ^= 0x01
        for chunks in ([bytes(bad), tag], [bytes(bad) + tag], [bad, tag]):
            with pytest.raises(AuthenticationError, match="altered"):
                wire.Verifier(SECRET).decode("assign", chunks)
    with pytest.raises(AuthenticationError, match="altered"):
        wire.Verifier(SECRET).decode("assign", [message, bytes([tag[0] ^ 1]) + tag[1:]])
    with pytest.raises(AuthenticationError, match="length"):
        wire.Verifier(SECRET).decode("assign", [message])
    with pytest.raises(AuthenticationError, match="length"):
        wire.Verifier(SECRET).decode("assign", [message, tag, b"x"])
    small = wire.Signer(SECRET, "chief:0").encode("assign", {"keys": ["w"]}, [torch.ones(3)])
    (only,) = small.chunks()
    assert only == small.to_bytes() and len(only) == small.nbytes
    bad = bytearray(only)
    bad[-1 - TAG] ^= 0x01
    with pytest.raises(AuthenticationError, match="altered"):
        wire.Verifier(SECRET).decode("assign", [bytes(bad)])


def test_a_frame_in_chunks_is_tagged_as_it_arrives_from_immutable_or_mutable_buffers():
    # A receiver tags a chunk where the transport delivered it when the buffer cannot change
    # (bytes), else the copy it made (a bytearray could change between the tag and the copy).
    # Either way the frame decodes, and an altered byte in any chunk is refused.
    w = torch.randn(5 * wire.CHUNK_BYTES // 8)  # 2.5 MiB: three chunks and the tag
    frame = wire.Signer(SECRET, "chief:0").encode("assign", {"keys": ["w"]}, [w])
    chunks = list(frame.chunks())
    assert [len(c) for c in chunks[:2]] == [wire.CHUNK_BYTES] * 2 and [len(c) for c in chunks[3:]] == [TAG]
    for deliver in (bytes, bytearray):
        assert torch.equal(wire.Verifier(SECRET).decode("assign", [deliver(c) for c in chunks]).tensors[0], w)
        for i, at in ((0, wire.CHUNK_BYTES - 1), (1, 0), (1, 12345), (2, 0), (2, len(chunks[2]) - 1)):
            bad = [deliver(c) for c in chunks]
            bad[i] = deliver(bytes(bad[i][:at]) + bytes([bad[i][at] ^ 0x20]) + bytes(bad[i][at + 1 :]))
            with pytest.raises(AuthenticationError, match="altered"):
                wire.Verifier(SECRET).decode("assign", bad)


# ------------------------------------------------------------------------------------ replays
PS_CALLS = {
    "ping": ({}, []),
    "create": ({"vars": [{"key": "v", "trainable": True}]}, [torch.zeros(3)]),
    "read": ({"keys": ["v"]}, []),
    "assign": ({"keys": ["v"]}, [torch.ones(3)]),
    "add": ({"keys": ["v"]}, [torch.ones(3)]),
    "apply": (
        {"keys": ["v"], "group_of": [0], "optimizers": [{"class": "SGD", "hyper": {"lr": 1.0}}]},
        [torch.ones(3)],
    ),
    "opt_read": ({"keys": ["v"]}, []),
    "opt_assign": ({"keys": ["v"], "states": [[]], "optimizer": {"class": "SGD", "hyper": {"lr": 1.0}}}, []),
    "shutdown": ({}, []),
}


RAN: list = []


def _record_run():
    RAN.append(1)


def test_a_replayed_frame_is_refused_for_each_method():
    shutdowns = []
    ps = ParameterServerService(0, SECRET, on_shutdown=lambda: shutdowns.append(1))
    assert set(PS_CALLS) == set(ps.METHODS)
    chief = wire.Signer(SECRET, "chief:0")
    for method in ParameterServerService.METHODS:
        header, tensors = PS_CALLS[method]
        captured = list(chief.encode(method, header, tensors).chunks())
        assert _code(ps, method, captured) == "ok", method
        with pytest.raises(ServiceError, match="replay") as e:
            _send(ps, method, captured)
        assert e.value.code == "unauthenticated", method
    assert shutdowns == [1]
    assert torch.equal(ps.value("v"), torch.ones(3))  # assign 1, add 1, apply -1 (lr 1): each once

    with InProcessCluster(num_ps=1, num_workers=1) as cluster:
        worker = cluster.workers[0]
        chief = wire.Signer(b"in-process-test-secret-0123456789", "chief:0")
        RAN.clear()
        calls = {
            "ping": ({}, []),
            "resources": ({"resources": []}, []),
            "run": ({"closure": "c"}, [pickling.dumps((_record_run, (), {}))]),
            "shutdown": ({}, []),
        }
        assert set(calls) == set(worker.METHODS)
        for method, (header, blobs) in calls.items():
            captured = list(chief.encode(method, header, (), blobs).chunks())
            assert _code(worker, method, captured) == "ok", method
            assert _code(worker, method, captured) == "unauthenticated", method
        assert RAN == [1]  # the replayed function did not run again


def test_reordering_beyond_the_window_and_stale_or_future_frames_are_refused():
    now = [1000.0]
    guard = wire.ReplayGuard(window=4, skew=30.0, clock=lambda: now[0])
    head = lambda seq, t=1000.0, sender=b"a" * 16: wire.Head(wire.CALL, sender, seq, t, 0)  # noqa: E731
    for seq in (1, 3, 2, 6):  # out of order within the window: each accepted once
        guard.admit(head(seq))
    with pytest.raises(AuthenticationError, match="older"):
        guard.admit(head(2))  # 4 behind the newest (6): beyond the window
    guard.admit(head(5))
    with pytest.raises(AuthenticationError, match="replay"):
        guard.admit(head(5))
    guard.admit(head(1, sender=b"b" * 16))  # numbers are per sender
    with pytest.raises(AuthenticationError, match="ago"):
        guard.admit(head(7, t=969.0))
    with pytest.raises(AuthenticationError, match="future"):
        guard.admit(head(7, t=1031.0))
    guard.admit(head(7, t=1029.0))


def test_a_retried_call_is_signed_again_and_accepted():
    from phalanx.ps.client import RemoteTask
    from phalanx.ps.transport import InProcessTransport

    hub = InProcessTransport()
    ps = ParameterServerService(0, SECRET)
    hub.serve("127.0.0.1:9", ps)
    task = RemoteTask("ps", 0, "127.0.0.1:9", hub, SECRET, rpc_timeout=1.0, sender="chief:0")
    hub.inject("127.0.0.1:9", "exhausted", 2)  # a server refusing a burst: retried under new numbers
    assert task.call("ping").header["task"] == "ps:0"
    assert ps.refused == 0 and ps.last_chief_contact > 0


def test_a_request_that_never_sends_its_head_is_cancelled_and_its_slot_freed():
    import threading

    import grpc

    from phalanx.ps.transport import GrpcServer

    address = f"127.0.0.1:{free_ports(1)[0]}"
    ps = ParameterServerService(0, SECRET)
    server = GrpcServer(address, ps, head_timeout=0.5)
    channel = grpc.insecure_channel(address)
    release = threading.Event()

    def silent():  # a slow-loris client: opens the stream, sends 10 bytes, then nothing
        yield wire.MAGIC + bytes(6)
        release.wait(30)

    try:
        stub = channel.stream_stream("/phalanx.ParameterServer/ping")
        t = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(stub(silent(), timeout=20))
        assert e.value.code() == grpc.StatusCode.CANCELLED and time.monotonic() - t < 5.0
        frame = wire.Signer(SECRET, "chief:0").encode("ping")  # the server still answers
        assert (
            wire.Verifier(SECRET)
            .decode("ping", list(stub(frame.chunks(), timeout=10)), reply_to=frame.head)
            .header["task"]
            == "ps:0"
        )
    finally:
        release.set()
        channel.close()
        server.stop(0.5)


# ------------------------------------------------------------------------------------ refusal logs
def test_refusal_logs_are_one_line_per_peer_per_interval_with_a_count(caplog):
    ps = ParameterServerService(0, SECRET)
    with caplog.at_level(logging.WARNING, logger="phalanx.ps"):
        for i in range(500):
            with pytest.raises(ServiceError):
                ps.handle("ping", [b"unsigned junk"], f"ipv4:10.0.0.5:{40000 + i}")
        with pytest.raises(ServiceError):
            ps.handle("ping", [b"unsigned junk"], "ipv4:10.0.0.6:1")
        ps.refusals.flush()
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert ps.refused == 501
    assert len(lines) == 3, lines  # the first from each peer, then the summary of the other 499
    assert "from ipv4:10.0.0.5" in lines[0] and "from ipv4:10.0.0.6" in lines[1]
    assert "refused 499 request(s) from ipv4:10.0.0.5" in lines[2]


def test_refusal_log_summarises_after_the_interval_and_bounds_its_peers():
    now = [0.0]
    records = []

    class _Log:
        def warning(self, fmt, *args):
            records.append(fmt % args)

    refusals = RefusalLog("ps:0", interval=10.0, max_peers=2, logger=_Log(), clock=lambda: now[0])
    for t in (0.0, 1.0, 2.0, 11.0):
        now[0] = t
        refusals.refused("ipv4:1.1.1.1:1", "ping", "bad")
    assert len(records) == 2 and "refused 3 request(s) from ipv4:1.1.1.1 in the last 11s" in records[1]
    for host in range(2, 50):
        refusals.refused(f"ipv4:2.2.2.{host}:1", "ping", "bad")
    assert len(records) == 4 and "2.2.2.2" in records[2] and "other peers" in records[3]  # 47 counted, not logged


# ------------------------------------------------------------------------------------ lifetimes
SECRET_TEXT = "test-cluster-secret-0123456789abcdef"


def _jobs(out: Path, tasks, env_of):
    ports = free_ports(3)
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"], "ps": [f"127.0.0.1:{ports[2]}"]}
    return [
        (
            [sys.executable, str(JOB), str(out), "converge"],
            {
                "OMP_NUM_THREADS": "1",
                "PHALANX_RPC_TIMEOUT": "2",
                **env_of(t),
                "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": t, "index": 0}}),
            },
        )
        for t in tasks
    ]


def test_a_lone_server_exits_within_the_orphan_timeout(tmp_path):
    """No chief ever comes: the server exits ORPHAN seconds after it started serving, non-zero, saying why."""
    orphan = 2.0
    jobs = _jobs(
        tmp_path, ["ps"], lambda t: {"PHALANX_CLUSTER_SECRET": SECRET_TEXT, "PHALANX_ORPHAN_TIMEOUT": str(orphan)}
    )
    (result,) = run_jobs(jobs, timeout=60, cwd=tmp_path)
    assert result.returncode == 3, result.output[-3000:]
    assert "never sent an authenticated request" in result.output
    assert result.elapsed < orphan + 25.0  # start-up (imports, ~5-15 s on a loaded host) + the timeout


def test_a_chief_with_a_wrong_secret_takes_the_cluster_down(tmp_path):
    env = {"chief": {"PHALANX_CLUSTER_SECRET": "not-the-cluster-secret-at-all-000"}}
    jobs = _jobs(
        tmp_path,
        ["chief", "worker", "ps"],
        lambda t: {"PHALANX_CLUSTER_SECRET": SECRET_TEXT, "PHALANX_ORPHAN_TIMEOUT": "3", **env.get(t, {})},
    )
    chief, worker, ps = run_jobs(jobs, timeout=90, cwd=tmp_path)
    assert chief.returncode not in (0, None) and "AuthenticationError" in chief.output, chief.output[-3000:]
    assert "refused our 'ping' request" in chief.output and "PHALANX_CLUSTER_SECRET" in chief.output
    for server in (worker, ps):
        assert server.returncode == 3, server.output[-3000:]
        assert "never sent an authenticated request" in server.output
    assert max(r.elapsed for r in (chief, worker, ps)) < 60


# ------------------------------------------------------------------------------------ TLS
def test_tls_settings_are_checked_before_any_connection(tmp_path):
    from phalanx.ps.tls import TlsConfig, TlsConfigError, generate_local

    assert TlsConfig.from_env({}) is None
    env = generate_local(str(tmp_path / "tls"))
    assert (Path(env["PHALANX_TLS_KEY"]).stat().st_mode & 0o777) == 0o600
    with pytest.raises(TlsConfigError, match="PHALANX_TLS_KEY"):
        TlsConfig.from_env({"PHALANX_TLS_CERT": env["PHALANX_TLS_CERT"]})
    with pytest.raises(TlsConfigError, match="cannot be read"):
        TlsConfig.from_env({**env, "PHALANX_TLS_CA": str(tmp_path / "missing.pem")})
    with pytest.raises(TlsConfigError, match="not a PEM"):
        TlsConfig.from_env({**env, "PHALANX_TLS_CA": str(JOB)})


def test_tls_cluster_trains_linear_regression_to_the_least_squares_optimum(tmp_path):
    result = run_job(
        [
            sys.executable,
            "-m",
            "phalanx.cli",
            "run",
            "--ps",
            "1",
            "--workers",
            "2",
            "--tls",
            str(JOB),
            str(tmp_path),
            "lstsq",
        ],
        timeout=150,
        cwd=tmp_path,
        env={"PHALANX_RPC_TIMEOUT": "5"},
    )
    assert result.returncode == 0, result.logs()[-6000:]
    rec = json.loads((tmp_path / "lstsq.json").read_text())
    print(
        f"\nTLS ({'mutual' if rec['mutual'] else 'server'}): loss {rec['loss']:.6f}, least squares "
        f"{rec['optimum']:.6f}; plain-text client: {rec['plaintext']}"
    )
    assert rec["tls"] and rec["mutual"]
    assert rec["plaintext"] == "unavailable"  # a client without TLS cannot even talk to the servers
    assert rec["loss"] <= rec["optimum"] * 1.02
    assert rec["weight_error"] < 0.02
