"""An attacker next to a running ps and worker: malicious pickles, forged signatures, unknown methods.

    python ps_attack.py OUT_DIR PS_ADDRESS WORKER_ADDRESS   (PHALANX_CLUSTER_SECRET: the real secret)

Writes OUT_DIR/attack.json, then shuts both servers down with a correctly signed request.
"""

import json
import os
import pickle
import sys
import time
from pathlib import Path

import psutil

from phalanx.ps import wire
from phalanx.ps.transport import GrpcTransport, TransportError

OUT, PS, WORKER = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
MARKER = OUT / "pwned"
SECRET = os.environ["PHALANX_CLUSTER_SECRET"].encode()


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


EVIL = pickle.dumps(Evil())
transport = GrpcTransport()
ps = transport.connect(PS, "phalanx.ParameterServer")
worker = transport.connect(WORKER, "phalanx.Worker")


def signed(method, blobs=(), secret=SECRET, header=None):
    return wire.encode(method, header or {}, (), blobs, secret=secret)


def attempt(channel, method, body):
    t = time.monotonic()
    try:
        channel.call(method, body, timeout=5)
        code = "ok"
    except TransportError as e:
        code = e.code
    return {"method": method, "code": code, "seconds": round(time.monotonic() - t, 3)}


def ping(channel):
    return wire.decode("ping", channel.call("ping", signed("ping"), timeout=5), secret=SECRET, reply=True).header


deadline = time.monotonic() + 90
while True:  # wait until both serve
    try:
        ping(ps), ping(worker)
        break
    except TransportError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)

results = []
for method in ("create", "read", "assign", "add", "apply", "ping", "shutdown"):
    results.append({"target": "ps", "payload": "raw pickle", **attempt(ps, method, EVIL)})
for method in ("run", "resources", "ping", "shutdown"):
    results.append({"target": "worker", "payload": "raw pickle", **attempt(worker, method, EVIL)})
for method in ("run", "resources"):
    results.append({"target": "worker", "payload": "pickle signed with a wrong secret",
                    **attempt(worker, method, signed(method, [EVIL], secret=b"not-the-cluster-secret"))})
    results.append({"target": "worker", "payload": "pickle signed for another method",
                    **attempt(worker, method, signed("ping", [EVIL]))})
results.append({"target": "ps", "payload": "correctly signed pickle (a PS never unpickles)",
                **attempt(ps, "create", signed("create", [EVIL], header={"vars": []}))})
for method in ("os.system", "builtins.eval", "__reduce__"):
    results.append({"target": "ps", "payload": "unknown method", **attempt(ps, method, signed(method))})
    results.append({"target": "worker", "payload": "unknown method", **attempt(worker, method, signed(method))})
time.sleep(0.5)  # anything the payload could have started has had time to run

pids = [int((OUT / f"pid_{t}").read_text()) for t in ("ps_0", "worker_0")]
listening = sorted({f"{c.laddr.ip}:{c.laddr.port}" for pid in pids
                    for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN})
after = {"ps": ping(ps), "worker": ping(worker)}
(OUT / "attack.json").write_text(json.dumps({"results": results, "marker_exists": MARKER.exists(),
                                             "listening": listening, "after": after}, indent=1))
for channel in (ps, worker):
    channel.call("shutdown", signed("shutdown"), timeout=5)
    channel.close()
