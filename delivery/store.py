"""The metadata store of Fig. 1: the controller writes each message type's channel (topic
mapping, step P-2) and each node's topic subscriptions; an agent reads its subscriptions when
it starts or recovers from a crash (step S-1, Section VI-A).

Beside them the controller keeps its **outbox**: every configuration message it accepts is
written here (the encoded message, a CRC-32 of it, and one row per destination node) before
the request is acknowledged, and a destination row is deleted when that node's packed reply
(Section VI-C) reports the message applied, a duplicate or superseded. What is left is what
a restarted controller must deliver again; agents drop what they already have (Section VI-B),
so re-delivery is safe.

SQLAlchemy Core, so any database URL works (``sqlite:///path`` by default; a server such as
PostgreSQL by config). SQLite is opened in WAL mode with a busy timeout, so the controller
and many agent processes can share one file. Every write is one transaction: a failure leaves
what was stored before.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import (
    BigInteger,
    Column,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    bindparam,
    create_engine,
    event,
    func,
    select,
)
from sqlalchemy.engine import Engine

__all__ = ["MetadataStore", "OutboxRow", "StoreError", "Subscription", "SubscriptionChange"]

log = logging.getLogger(__name__)

_meta = MetaData()

topic_mapping = Table(
    "topic_mapping", _meta,
    Column("type_id", Integer, primary_key=True),
    Column("channel", Integer, nullable=False),          # 0 = RPC, t = MQ topic t
    Column("topic", String(512), nullable=True),          # the Pulsar topic of channel t
    Column("hosts", Text, nullable=False),                # JSON list of destination node ids
    Column("updated_ns", BigInteger, nullable=False),
)

subscriptions = Table(
    "subscriptions", _meta,
    Column("node_id", Integer, primary_key=True),
    Column("topic", String(512), primary_key=True),
    Column("subscription", String(256), nullable=False),
    Column("since_ns", BigInteger, nullable=False),
    Column("until_ns", BigInteger, nullable=True),        # set when unsubscribed (kept)
)


outbox = Table(
    "outbox", _meta,
    Column("ts_ns", BigInteger, primary_key=True, autoincrement=False),  # generation time
    Column("type_id", Integer, nullable=False),
    Column("vpc_id", Integer, nullable=False),
    Column("body", LargeBinary, nullable=False),          # the encoded ConfigMessage
    Column("crc32", BigInteger, nullable=False),          # zlib.crc32 of body
    Column("accepted_ns", BigInteger, nullable=False),
)

outbox_dest = Table(
    "outbox_dest", _meta,
    Column("ts_ns", BigInteger, nullable=False),
    Column("node_id", Integer, nullable=False),           # a destination not yet confirmed
    PrimaryKeyConstraint("ts_ns", "node_id"),
)


class StoreError(ValueError):
    """A stored row that cannot be used; the text names the table and the row."""


@dataclass(frozen=True)
class OutboxRow:
    """One accepted message not yet confirmed by every destination."""

    ts_ns: int
    type_id: int
    vpc_id: int
    body: bytes
    crc32: int
    nodes: tuple[int, ...]          # destinations that have not confirmed it

    @property
    def intact(self) -> bool:
        return zlib.crc32(self.body) == self.crc32


@dataclass(frozen=True)
class Subscription:
    topic: str
    subscription: str
    since_ns: int
    until_ns: int | None

    @property
    def active(self) -> bool:
        return self.until_ns is None


@dataclass(frozen=True)
class SubscriptionChange:
    node_id: int
    topic: str
    subscription: str
    subscribe: bool


class MetadataStore:
    """``synchronous``: SQLite's ``PRAGMA synchronous`` (``NORMAL``: a committed write
    survives a crash of the process; ``FULL``: also a power loss)."""

    def __init__(self, url: str, synchronous: str = "NORMAL") -> None:
        if synchronous not in ("NORMAL", "FULL"):
            raise StoreError(f"synchronous must be NORMAL or FULL, got {synchronous!r}")
        self.url = url
        kw = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {}
        self.engine: Engine = create_engine(url, future=True, **kw)
        if url.startswith("sqlite"):
            @event.listens_for(self.engine, "connect")
            def _pragmas(conn, _record) -> None:
                cur = conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute(f"PRAGMA synchronous={synchronous}")
                cur.execute("PRAGMA busy_timeout=30000")
                cur.close()
        _meta.create_all(self.engine)

    # ------------------------------------------------------------------ topic mapping
    def write_mapping(self, rows: Iterable[tuple[int, int, str | None, Iterable[int]]],
                      timestamp_ns: int) -> int:
        """Upsert ``(type_id, channel, topic, hosts)`` rows in one transaction."""
        rows = list(rows)
        if not rows:
            return 0
        with self.engine.begin() as c:
            ids = [r[0] for r in rows]
            known = set(c.execute(select(topic_mapping.c.type_id)
                                  .where(topic_mapping.c.type_id.in_(ids))).scalars())
            new = [r for r in rows if r[0] not in known]
            old = [r for r in rows if r[0] in known]
            if new:
                c.execute(topic_mapping.insert(), [
                    {"type_id": int(t), "channel": int(ch), "topic": tp,
                     "hosts": json.dumps([int(h) for h in hs]), "updated_ns": timestamp_ns}
                    for t, ch, tp, hs in new])
            for t, ch, tp, hs in old:
                c.execute(topic_mapping.update().where(topic_mapping.c.type_id == int(t))
                          .values(channel=int(ch), topic=tp, updated_ns=timestamp_ns,
                                  hosts=json.dumps([int(h) for h in hs])))
        return len(rows)

    def mapping(self) -> dict[int, tuple[int, str | None]]:
        """type id -> (channel, topic)."""
        with self.engine.connect() as c:
            return {int(r.type_id): (int(r.channel), r.topic)
                    for r in c.execute(select(topic_mapping))}

    # ------------------------------------------------------------------ subscriptions
    def apply_changes(self, changes: Iterable[SubscriptionChange], timestamp_ns: int) -> int:
        """Record subscribe/unsubscribe changes in one transaction (an unsubscription keeps
        its row with ``until_ns``, so a restarting agent can still drain that topic)."""
        changes = list(changes)
        if not changes:
            return 0
        t = subscriptions
        with self.engine.begin() as c:
            for ch in changes:
                key = (t.c.node_id == ch.node_id) & (t.c.topic == ch.topic)
                row = c.execute(select(t.c.since_ns).where(key)).first()
                if ch.subscribe:
                    vals = {"subscription": ch.subscription, "since_ns": timestamp_ns,
                            "until_ns": None}
                    if row is None:
                        c.execute(t.insert().values(node_id=ch.node_id, topic=ch.topic, **vals))
                    else:
                        c.execute(t.update().where(key).values(**vals))
                elif row is not None:
                    c.execute(t.update().where(key).values(until_ns=timestamp_ns))
        return len(changes)

    def subscriptions_of(self, node_id: int) -> list[Subscription]:
        t = subscriptions
        with self.engine.connect() as c:
            rows = c.execute(select(t).where(t.c.node_id == int(node_id))
                             .order_by(t.c.topic)).all()
        return [Subscription(r.topic, r.subscription, int(r.since_ns),
                             None if r.until_ns is None else int(r.until_ns)) for r in rows]

    def active_topics(self) -> dict[int, set[str]]:
        """node id -> topics it is subscribed to now."""
        t = subscriptions
        out: dict[int, set[str]] = {}
        with self.engine.connect() as c:
            for r in c.execute(select(t.c.node_id, t.c.topic).where(t.c.until_ns.is_(None))):
                out.setdefault(int(r.node_id), set()).add(r.topic)
        return out

    def mapping_rows(self) -> dict[int, tuple[int, str | None, tuple[int, ...]]]:
        """type id -> (channel, topic, destination hosts)."""
        with self.engine.connect() as c:
            out = {}
            for r in c.execute(select(topic_mapping)):
                try:
                    hosts = tuple(int(h) for h in json.loads(r.hosts))
                except (ValueError, TypeError) as e:
                    raise StoreError(f"topic_mapping row of type {r.type_id}: hosts "
                                     f"{r.hosts!r} is not a JSON list of node ids ({e})") from None
                out[int(r.type_id)] = (int(r.channel), r.topic, hosts)
            return out

    def subscription_rows(self) -> list[tuple[int, Subscription]]:
        """Every (node id, subscription) row, active or left."""
        t = subscriptions
        with self.engine.connect() as c:
            rows = c.execute(select(t).order_by(t.c.node_id, t.c.topic)).all()
        return [(int(r.node_id), Subscription(r.topic, r.subscription, int(r.since_ns),
                                              None if r.until_ns is None else int(r.until_ns)))
                for r in rows]

    # ------------------------------------------------------------------ outbox
    def outbox_put(self, rows: Iterable[tuple[int, int, int, bytes, Iterable[int]]],
                   accepted_ns: int) -> int:
        """Store accepted messages ``(ts_ns, type_id, vpc_id, body, nodes)`` in one
        transaction: when it returns they survive a crash of the process."""
        rows = list(rows)
        if not rows:
            return 0
        with self.engine.begin() as c:
            c.execute(outbox.insert(), [
                {"ts_ns": int(ts), "type_id": int(t), "vpc_id": int(v), "body": bytes(b),
                 "crc32": zlib.crc32(b), "accepted_ns": int(accepted_ns)}
                for ts, t, v, b, _ in rows])
            c.execute(outbox_dest.insert(), [
                {"ts_ns": int(ts), "node_id": int(n)} for ts, _, _, _, ns in rows for n in ns])
        return len(rows)

    def outbox_confirm(self, pairs: Iterable[tuple[int, int]]) -> int:
        """Delete the destination rows of ``(node_id, ts_ns)`` pairs, and the messages no
        destination waits for any more, in one transaction; returns the rows deleted."""
        pairs = sorted({(int(n), int(ts)) for n, ts in pairs})
        if not pairs:
            return 0
        d = outbox_dest
        with self.engine.begin() as c:
            deleted = c.execute(d.delete().where((d.c.node_id == bindparam("n"))
                                                 & (d.c.ts_ns == bindparam("ts"))),
                                [{"n": n, "ts": ts} for n, ts in pairs]).rowcount
            done = {ts for _, ts in pairs}
            still = set(c.execute(select(d.c.ts_ns).where(d.c.ts_ns.in_(done))).scalars())
            gone = sorted(done - still)
            if gone:
                c.execute(outbox.delete().where(outbox.c.ts_ns.in_(gone)))
        return deleted

    def outbox_unconfirmed(self) -> list[OutboxRow]:
        """Every stored message some destination has not confirmed, in timestamp order."""
        with self.engine.connect() as c:
            dests: dict[int, list[int]] = {}
            for r in c.execute(select(outbox_dest).order_by(outbox_dest.c.ts_ns,
                                                            outbox_dest.c.node_id)):
                dests.setdefault(int(r.ts_ns), []).append(int(r.node_id))
            rows = c.execute(select(outbox).order_by(outbox.c.ts_ns)).all()
        return [OutboxRow(int(r.ts_ns), int(r.type_id), int(r.vpc_id), bytes(r.body),
                          int(r.crc32), tuple(dests[int(r.ts_ns)]))
                for r in rows if int(r.ts_ns) in dests]

    def outbox_size(self) -> tuple[int, int]:
        """(messages, destination rows) in the outbox."""
        with self.engine.connect() as c:
            return (int(c.execute(select(func.count()).select_from(outbox)).scalar_one()),
                    int(c.execute(select(func.count()).select_from(outbox_dest)).scalar_one()))

    def max_timestamp(self) -> int:
        """The largest timestamp stored anywhere (outbox, mapping, subscriptions): a
        restarted controller's timestamps start above it."""
        with self.engine.connect() as c:
            vals = [c.execute(select(func.max(outbox.c.ts_ns))).scalar(),
                    c.execute(select(func.max(topic_mapping.c.updated_ns))).scalar(),
                    c.execute(select(func.max(subscriptions.c.since_ns))).scalar(),
                    c.execute(select(func.max(subscriptions.c.until_ns))).scalar()]
        return max((int(v) for v in vals if v is not None), default=0)

    def close(self) -> None:
        self.engine.dispose()
