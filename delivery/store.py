"""The metadata store of Fig. 1: the controller writes each message type's channel (topic
mapping, step P-2) and each node's topic subscriptions; an agent reads its subscriptions when
it starts or recovers from a crash (step S-1, Section VI-A).

SQLAlchemy Core, so any database URL works (``sqlite:///path`` by default; a server such as
PostgreSQL by config). SQLite is opened in WAL mode with a busy timeout, so the controller
and many agent processes can share one file. Every write is one transaction: a failure leaves
what was stored before.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import (
    BigInteger,
    Column,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    select,
)
from sqlalchemy.engine import Engine

__all__ = ["MetadataStore", "Subscription", "SubscriptionChange"]

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
    def __init__(self, url: str) -> None:
        self.url = url
        kw = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {}
        self.engine: Engine = create_engine(url, future=True, **kw)
        if url.startswith("sqlite"):
            @event.listens_for(self.engine, "connect")
            def _pragmas(conn, _record) -> None:
                cur = conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
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

    def close(self) -> None:
        self.engine.dispose()
