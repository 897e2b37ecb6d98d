"""An attacker next to a running ps and worker: malicious pickles, forged signatures, unknown methods,
altered tensor bytes, replayed frames, and a flood of oversized unsigned requests.

    python ps_attack.py OUT_DIR PS_ADDRESS WORKER_ADDRESS   (PHALANX_CLUSTER_SECRET: the real secret)

The attacker uses the secret only to stand in for frames it *captured* from the cluster (a
listener on the network sees every signed frame when TLS is off); everything it sends on its own
is unsigned or signed with a wrong secret. Writes OUT_DIR/attack.json, then shuts both servers down
with a correctly signed request.
"""

import json
import os
import pickle
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

from phalanx.ps import pickling, wire
from phalanx.ps.transport import GrpcTransport, TransportError

OUT, PS, WORKER = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
MARKER = OUT / "pwned"
SECRET = os.environ["PHALANX_CLUSTER_SECRET"].encode()
CLUSTER = wire.Signer(SECRET, "chief:0")  # stands in for the frames the attacker captured


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


EVIL = pickle.dumps(Evil())
transport = GrpcTransport()
ps = transport.connect(PS, "phalanx.ParameterServer")
worker = transport.connect(WORKER, "phalanx.Worker")


def signed(method, blobs=(), secret=SECRET, header=None, tensors=()):
    return wire.Signer(secret).encode(method, header or {}, tensors, blobs)


def attempt(channel, method, chunks):
    t = time.monotonic()
    try:
        channel.call(method, chunks, timeout=5)
        code = "ok"
    except TransportError as e:
        code = e.code
    return {"method": method, "code": code, "seconds": round(time.monotonic() - t, 3)}


def call(channel, method, header=None, tensors=(), blobs=()):
    frame = CLUSTER.encode(method, header or {}, tensors, blobs)
    reply = channel.call(method, frame.chunks(), timeout=10)
    return wire.Verifier(SECRET).decode(method, reply, reply_to=frame.head)


def ping(channel):
    return call(channel, "ping").header


deadline = time.monotonic() + 90
while True:  # wait until both serve
    try:
        ping(ps), ping(worker)
        break
    except TransportError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)

pids = {t: int((OUT / f"pid_{t}").read_text()) for t in ("ps_0", "worker_0")}
results = []
for method in ("create", "read", "assign", "add", "apply", "ping", "shutdown"):
    results.append({"target": "ps", "payload": "raw pickle", **attempt(ps, method, [EVIL])})
for method in ("run", "resources", "ping", "shutdown"):
    results.append({"target": "worker", "payload": "raw pickle", **attempt(worker, method, [EVIL])})
for method in ("run", "resources"):
    results.append(
        {
            "target": "worker",
            "payload": "pickle signed with a wrong secret",
            **attempt(worker, method, signed(method, [EVIL], secret=b"not-the-cluster-secret").chunks()),
        }
    )
    results.append(
        {
            "target": "worker",
            "payload": "pickle signed for another method",
            **attempt(worker, method, signed("ping", [EVIL]).chunks()),
        }
    )
results.append(
    {
        "target": "ps",
        "payload": "correctly signed pickle (a PS never unpickles)",
        **attempt(ps, "create", signed("create", [EVIL], header={"vars": []}).chunks()),
    }
)
for method in ("os.system", "builtins.eval", "__reduce__"):
    results.append({"target": "ps", "payload": "unknown method", **attempt(ps, method, signed(method).chunks())})
    results.append(
        {"target": "worker", "payload": "unknown method", **attempt(worker, method, signed(method).chunks())}
    )

# Altered tensor bytes: a captured `assign` of w = 1 with one byte of the tensor replaced.
call(ps, "create", {"vars": [{"key": "w", "trainable": True}]}, [torch.zeros(4)])
frame = bytearray(CLUSTER.encode("assign", {"keys": ["w"]}, [torch.ones(4)]).to_bytes())
frame[-2 - 16] = 0x44  # 1.0 -> 1234.5-like garbage in the last element (the frame ends with a 16-byte tag)
tampered = attempt(ps, "assign", [bytes(frame)])
after_tamper = call(ps, "read", {"keys": ["w"]}).tensors[0].tolist()

# Replays over the network: each captured frame sent a second time.
replays = {}
for method, header, tensors in (
    ("ping", {}, []),
    ("read", {"keys": ["w"]}, []),
    ("assign", {"keys": ["w"]}, [torch.full((4,), 2.0)]),
    ("add", {"keys": ["w"]}, [torch.ones(4)]),
):
    captured = list(CLUSTER.encode(method, header, tensors).chunks())
    replays[method] = [attempt(ps, method, captured)["code"], attempt(ps, method, captured)["code"]]
after_replay = call(ps, "read", {"keys": ["w"]}).tensors[0].tolist()  # 2 + 1 once: 3.0
captured = list(CLUSTER.encode("run", {"closure": "c"}, (), [pickling.dumps((print, ("ran",), {}))]).chunks())
replays["worker run"] = [attempt(worker, "run", captured)["code"], attempt(worker, "run", captured)["code"]]

# A flood of unsigned requests: oversized single messages, and endless streams of 1 MiB chunks.
server = psutil.Process(pids["ps_0"])
rss = {"before": server.memory_info().rss, "peak": 0}
sampling = threading.Event()


def sample():
    while not sampling.is_set():
        try:
            rss["peak"] = max(rss["peak"], server.memory_info().rss)
        except psutil.Error:
            return
        time.sleep(0.005)


import grpc  # noqa: E402 - a raw channel: phalanx's own refuses to send messages over 1 MiB

raw = grpc.insecure_channel(PS, options=[("grpc.max_send_message_length", -1)])
raw_apply = raw.stream_stream("/phalanx.ParameterServer/apply")


def raw_attempt(chunks):
    t = time.monotonic()
    try:
        list(raw_apply(chunks, timeout=30))
        code = "ok"
    except grpc.RpcError as e:
        code = e.code().name
    return {"code": code, "seconds": round(time.monotonic() - t, 3)}


def oversized(i):
    flood.append(raw_attempt(iter([os.urandom(1 << 10) * (64 << 10)])))  # one 64 MiB message


def endless(i):
    junk = os.urandom(1 << 20)
    flood.append(raw_attempt(iter(lambda: junk, None)))  # 1 MiB chunks with no end


flood: list = []
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
t = time.monotonic()
threads = [threading.Thread(target=f, args=(i,)) for i in range(8) for f in (oversized, endless)]
for th in threads:
    th.start()
for th in threads:
    th.join(60)
flood_s = time.monotonic() - t
time.sleep(0.5)
sampling.set()
sampler.join()
rss["after"] = server.memory_info().rss
time.sleep(0.5)  # anything the payloads could have started has had time to run

listening = sorted(
    {
        f"{c.laddr.ip}:{c.laddr.port}"
        for pid in pids.values()
        for c in psutil.Process(pid).net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    }
)
after = {"ps": ping(ps), "worker": ping(worker)}
(OUT / "attack.json").write_text(
    json.dumps(
        {
            "results": results,
            "marker_exists": MARKER.exists(),
            "listening": listening,
            "after": after,
            "tampered": tampered,
            "after_tamper": after_tamper,
            "replays": replays,
            "after_replay": after_replay,
            "flood": flood,
            "flood_s": flood_s,
            "flood_bytes_sent": 8 * (64 << 20),
            "rss": rss,
        },
        indent=1,
    )
)
raw.close()
for channel in (ps, worker):
    call(channel, "shutdown")
    channel.close()
