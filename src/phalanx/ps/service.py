"""What every phalanx service does with a request before its operation runs, and how long it lives.

:class:`SignedService` verifies each request (:mod:`phalanx.ps.wire`: signature over every byte,
replay guard), refuses what fails with a rate-limited log line (:class:`RefusalLog`), notes when
the chief was last heard from, and signs the reply, bound to the request. Subclasses implement
``_op_<method>(msg) -> (header, tensors, blobs)``.

Lifetime: a server is *orphaned* when nothing authenticated came from the chief (a frame signed
by task ``chief:*``) for ``PHALANX_ORPHAN_TIMEOUT`` seconds, counted from the server's start, so
a server whose chief died early, or never held the secret, exits too. The chief's strategy pings
every task often enough (:class:`phalanx.ps.client.Keepalive`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from phalanx.ps import wire
from phalanx.ps.errors import AuthenticationError, OverloadedError, ProtocolError
from phalanx.ps.transport import ServiceError

log = logging.getLogger("phalanx.ps")

REFUSAL_LOG_INTERVAL = 10.0


def peer_host(peer: str) -> str:
    """``ipv4:10.0.0.3:51234`` -> ``ipv4:10.0.0.3`` (a client's ports change with every connection)."""
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


class RefusalLog:
    """Logs refused requests: at most one line per peer host per ``interval``, with a count.

    The first refusal from a host is logged at once; the ones after it within the interval are
    counted and summarised by the next line (or by :meth:`flush`). At most ``max_peers`` hosts are
    tracked; beyond them refusals are counted under ``other peers``, so a flood from many
    addresses costs bounded memory and log space.
    """

    def __init__(
        self,
        task: str,
        interval: float = REFUSAL_LOG_INTERVAL,
        max_peers: int = 256,
        logger: logging.Logger = log,
        clock: Any = time.monotonic,
    ) -> None:
        self.task, self.interval, self.max_peers = task, interval, max_peers
        self._log, self._clock = logger, clock
        self._peers: OrderedDict[str, list[Any]] = OrderedDict()  # host -> [last line at, count since, last reason]
        self._lock = threading.Lock()

    def refused(self, peer: str, method: str, reason: str) -> None:
        host = peer_host(peer)
        now = self._clock()
        with self._lock:
            if host not in self._peers and len(self._peers) >= self.max_peers:
                host = "other peers"
            entry = self._peers.get(host)
            if entry is None:
                self._peers[host] = [now, 0, reason]
                line = (host, method, reason, 1, None)
            elif now - entry[0] >= self.interval:
                line = (host, method, reason, entry[1] + 1, now - entry[0])
                entry[:] = [now, 0, reason]
            else:
                entry[1] += 1
                entry[2] = f"{method!r}: {reason}"
                return
        self._emit(*line)

    def _emit(self, host: str, method: str, reason: str, count: int, over: float | None) -> None:
        if over is None:
            self._log.warning(
                "phalanx %s: refused a %r request from %s: %s (further refusals from this peer are "
                "summarised every %gs)",
                self.task,
                method,
                host,
                reason,
                self.interval,
            )
        else:
            self._log.warning(
                "phalanx %s: refused %d request(s) from %s in the last %.0fs; the latest, %r: %s",
                self.task,
                count,
                host,
                over,
                method,
                reason,
            )

    def flush(self) -> None:
        """Logs the refusals counted but not yet logged."""
        with self._lock:
            pending = [(h, e[1], e[2], self._clock() - e[0]) for h, e in self._peers.items() if e[1]]
            for e in self._peers.values():
                e[1] = 0
        for host, count, reason, over in pending:
            self._log.warning(
                "phalanx %s: refused %d request(s) from %s in the last %.0fs; the latest, %s",
                self.task,
                count,
                host,
                over,
                reason,
            )


class SignedService:
    """Base of the parameter server's and the worker's services (see the module docstring).

    Args:
        task: this task's name, e.g. ``ps:0``.
        secret: the cluster secret.
        clock: monotonic clock (tests).
    """

    NAME = ""
    METHODS: tuple[str, ...] = ()

    def __init__(self, task: str, secret: bytes, *, clock: Any = time.monotonic) -> None:
        self.task = task
        self._signer = wire.Signer(secret, task)
        self._verifier = wire.Verifier(secret, wire.ReplayGuard())
        self.refusals = RefusalLog(task)
        self._clock = clock
        self.refused = 0
        self.started = clock()
        self.last_contact = 0.0
        self.last_chief_contact = 0.0

    def handle(self, method: str, chunks: Iterable[bytes], peer: str) -> Iterable[bytes]:
        if method not in self.METHODS:
            raise ServiceError("unimplemented", f"{self.task} has no operation {method!r}")
        try:
            msg = self._verifier.decode(method, chunks)  # checked before anything in it is parsed
        except OverloadedError as e:
            raise ServiceError("exhausted", str(e)) from None
        except AuthenticationError as e:
            self.refused += 1
            self.refusals.refused(peer, method, str(e))
            raise ServiceError("unauthenticated", str(e)) from None
        except ProtocolError as e:
            self.refusals.refused(peer, method, f"malformed: {e}")
            raise ServiceError("invalid", str(e)) from None
        now = self._clock()
        self.last_contact = now
        if msg.head is not None and msg.head.task.startswith("chief:"):
            self.last_chief_contact = now
        header, tensors, blobs = self._dispatch(method, msg)
        return self._signer.encode(method, header, tensors, blobs, reply_to=msg.head).chunks()

    def _dispatch(self, method: str, msg: wire.Message) -> tuple[dict, list, list]:
        raise NotImplementedError

    def orphaned(self, timeout: float) -> bool:
        """True when the chief has not been heard from for ``timeout`` seconds (since this service started)."""
        return self._clock() - max(self.started, self.last_chief_contact) > timeout
