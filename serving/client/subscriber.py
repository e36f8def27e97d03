"""The adapters' side of the server's announcements (Stemflow Section IV: subscribed global
knowledge): a non-durable Pulsar reader on the announcement topic (:mod:`serving.announce`).

Each :class:`AnnouncementSubscriber` reads the topic from ``MessageId.latest`` (a reader: the
broker keeps no subscription and no backlog for an adapter; what was announced before it
connected is not replayed, the adapter's own start-up fetch covers that) on a thread of its
own and hands every valid announcement to its callbacks. The adapters of one process share
one ``pulsar.Client`` per service URL (one connection to the broker).

Nothing on the topic can stop the thread: bytes that are not an announcement (not JSON, an
unknown kind, a field of the wrong type) and callbacks that raise are logged as warnings and
counted in :attr:`AnnouncementSubscriber.counts` (``(kind, outcome)``: ``applied``,
``ignored`` (not for this adapter, or nothing new), ``malformed``, ``failed``). While the
broker is away the reader is re-created in the background with a bounded backoff; the
adapters' polling (``refresh_s``) keeps working meanwhile.

The reader authenticates as the ``controller`` principal (the adapter lives in the
controller; :func:`security.pulsar.client_args`), unless ``security`` is insecure.
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from security.pulsar import client_args
from security.tls import Security

from ..announce import (
    DEFAULT_TOPIC,
    HealthAnnouncement,
    MalformedAnnouncement,
    PolicyAnnouncement,
    check_settings,
    decode,
)

__all__ = ["AnnouncementSubscriber"]

log = logging.getLogger(__name__)
PRINCIPAL = "controller"  # the identity the reader presents to the broker


class _ClientPool:
    """One ``pulsar.Client`` per service URL, shared by the subscribers of a process and
    closed with the last of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (url, security) -> [client, references]
        self._clients: dict[tuple[str, Security], list[Any]] = {}

    def acquire(self, url: str, security: Security) -> Any:
        import pulsar

        with self._lock:
            entry = self._clients.get((url, security))
            if entry is None:
                client = pulsar.Client(url, operation_timeout_seconds=5,
                                       connection_timeout_ms=2000,
                                       logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error),
                                       **client_args(security, PRINCIPAL))
                entry = self._clients[(url, security)] = [client, 0]
            entry[1] += 1
            return entry[0]

    def release(self, url: str, security: Security) -> None:
        with self._lock:
            entry = self._clients.get((url, security))
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._clients[(url, security)]
        _quiet_close(entry[0])

    def close_all(self) -> None:
        """Close every client (at exit: a client's threads must not outlive the
        interpreter, and closing also ends a reader creation still waiting for a broker)."""
        with self._lock:
            clients = [e[0] for e in self._clients.values()]
            self._clients.clear()
        for c in clients:
            _quiet_close(c)


_CLIENTS = _ClientPool()
atexit.register(_CLIENTS.close_all)


class AnnouncementSubscriber:
    """Reads ``topic`` at ``url`` and calls ``on_policy`` / ``on_health`` with each valid
    announcement (on the subscriber's thread); a callback returns whether it acted on it
    (``applied``) or not (``ignored``).

    ``retry_s`` .. ``max_retry_s``: the backoff between attempts to create the reader while
    the broker is away; ``read_timeout_s``: how long one read waits (and so how soon
    :meth:`close` is noticed)."""

    def __init__(self, url: str, topic: str = DEFAULT_TOPIC, *,
                 on_policy: Callable[[PolicyAnnouncement], bool],
                 on_health: Callable[[HealthAnnouncement], bool], retry_s: float = 0.5,
                 max_retry_s: float = 30.0, read_timeout_s: float = 0.2,
                 security: Security | None = None) -> None:
        check_settings(url, topic, "announce_url", "announce_topic")
        if retry_s <= 0 or max_retry_s < retry_s or read_timeout_s <= 0:
            raise ValueError("subscriber: retry_s and read_timeout_s must be positive and "
                             "max_retry_s >= retry_s")
        self.url, self.topic = url, topic
        self.on_policy, self.on_health = on_policy, on_health
        self.retry_s, self.max_retry_s, self.read_timeout_s = retry_s, max_retry_s, read_timeout_s
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._released = False
        self.security = security if security is not None else Security()
        if self.security.insecure:
            self.security.warn_if_insecure("announcement subscriber")
        self._client = _CLIENTS.acquire(url, self.security)
        self._thread = threading.Thread(target=self._run, name="announce-subscriber",
                                        daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        """Whether the reader is connected (announcements made from now on arrive)."""
        return self._ready.is_set()

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the reader; returns :attr:`ready`."""
        return self._ready.wait(timeout)

    def _run(self) -> None:
        import pulsar

        reader: Any = None
        delay, warned = self.retry_s, False
        try:
            while not self._stop.is_set():
                if reader is None:
                    try:
                        reader = self._client.create_reader(self.topic, pulsar.MessageId.latest,
                                                            receiver_queue_size=100)
                    except Exception as e:  # broker away: retry; polling covers the gap
                        if not warned:
                            log.warning("announcements: no reader on %s at %s (%s); retrying "
                                        "in the background, polling meanwhile", self.topic,
                                        self.url, e)
                            warned = True
                        self._stop.wait(delay)
                        delay = min(2 * delay, self.max_retry_s)
                        continue
                    delay, warned = self.retry_s, False
                    self._ready.set()
                    log.info("announcements: reading %s at %s", self.topic, self.url)
                    continue
                try:
                    msg = reader.read_next(timeout_millis=int(self.read_timeout_s * 1000))
                except pulsar.Timeout:
                    continue
                except Exception as e:  # the reader broke (closed under us): open another
                    if self._stop.is_set():
                        break
                    log.warning("announcements: read failed (%s); reopening the reader", e)
                    self._ready.clear()
                    _quiet_close(reader)
                    reader = None
                    self._stop.wait(delay)
                    continue
                self.handle(msg.data())
        finally:
            self._ready.clear()
            if reader is not None:
                _quiet_close(reader)

    def handle(self, data: bytes) -> str:
        """Act on one message of the topic; returns its outcome (see the module docstring)."""
        try:
            a = decode(data)
        except MalformedAnnouncement as e:
            log.warning("announcements: ignored a malformed message on %s: %s", self.topic, e)
            return self._count(e.kind, "malformed")
        kind = "policy" if isinstance(a, PolicyAnnouncement) else "health"
        try:
            acted = self.on_policy(a) if isinstance(a, PolicyAnnouncement) else self.on_health(a)
        except Exception as e:  # a callback's failure never ends the thread
            log.warning("announcements: %s announcement not applied: %s", kind, e)
            return self._count(kind, "failed")
        return self._count(kind, "applied" if acted else "ignored")

    def _count(self, kind: str, outcome: str) -> str:
        with self._count_lock:
            self.counts[(kind, outcome)] += 1
        return outcome

    def close(self, timeout: float = 0.2) -> None:
        """Stop reading and release the shared client (closed with its last subscriber,
        which also ends a reader creation still waiting for an absent broker). Returns
        within about ``timeout`` seconds."""
        self._stop.set()
        self._thread.join(timeout=self.read_timeout_s + 0.1)
        if not self._released:
            self._released = True
            _CLIENTS.release(self.url, self.security)
        self._thread.join(timeout=timeout)


def _quiet_close(obj: Any) -> None:
    try:
        obj.close()
    except Exception as e:  # closing after the broker went away
        log.debug("announcements: close: %s", e)
