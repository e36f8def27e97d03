"""Pulsar's TLS, authentication and authorisation: client credentials and the grant model.

Every client authenticates with mutual TLS (:func:`client_args`): the broker takes the
certificate's common name as the client's *role* (``controller``, ``agent-<n>``,
``policy-server``, ``admin``, ``broker``), and its authorisation provider decides what a
role may do on a topic. :func:`grant_default_roles` installs the project's grant model on
a broker (the one :mod:`harness.broker` starts, or a deployment's own; see ``main`` for the
command line), through the admin REST API over HTTPS with the ``admin`` identity:

* ``controller``: an admin role of the tenant (``public``), so it alone of the project's
  roles may produce on the configuration topics of the namespace, create, consume and
  delete any node's durable subscription (it creates them before a node subscribes, and
  again on recovery), read the announcement topic, and grant nodes' subscription
  permissions (:func:`grant_node_subscriptions`). The controller decides what every node
  applies, so this adds no power over the nodes; it is no super-user (no cluster, broker
  or tenant operations, no other tenant).
* ``agent-<n>`` (any ``n``, one wildcard grant ``agent-*``): ``consume`` on the namespace,
  under the namespace's subscription authorisation mode ``Prefix``: a subscription name must
  start with the role, so ``agent-3`` may use ``agent-3`` (:func:`subscription_name`) and no
  ``node-4``/``agent-4``. Since ``agent-3`` is a prefix of ``agent-30``, node ``n``'s
  subscription is also bound to ``agent-<n>`` alone by a subscription permission
  (:func:`grant_node_subscriptions`: one namespace-policy entry per node, made once).
  Agents may not produce anywhere.
* ``policy-server``: ``produce`` on the announcement topic(s) only (topic-level grant).
* ``admin`` and ``broker``: the broker's super-users (operators' tools; the broker's own
  internal client).

Insecure mode (``Security(insecure=True)``) has none of this: :func:`client_args` is ``{}``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import re
import ssl
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterable
from typing import Any

from security.pki import PkiError, agent_principal, parse_ranges
from security.tls import Security, SecurityError, client_ssl_context

log = logging.getLogger("smart.security.pulsar")

DEFAULT_NAMESPACE = "public/default"
ANNOUNCE_TOPIC = "persistent://public/default/smart-announce"
"""The policy server's announcement topic (the default of :mod:`serving.announce`)."""
SUPER_USERS = ("broker", "admin")
AGENT_ROLES = "agent-*"
"""The wildcard role of every node's agent (``authorizationAllowWildcardsMatching``)."""


class PulsarAdminError(SecurityError):
    """An admin REST call failed (the message names the call, the HTTP status and the
    broker's reason; never a key)."""


def client_args(security: Security, principal: str) -> dict[str, Any]:
    """Keyword arguments for ``pulsar.Client(url, **client_args(...))``: mutual TLS with
    ``principal``'s certificate (the broker takes its common name as the role), the
    server verified against the PKI's CA, its host name included (the development
    certificates name ``localhost`` and ``127.0.0.1``); ``{}`` when insecure. The URL must
    be ``pulsar+ssl://`` for a secure broker."""
    if security.insecure:
        return {}
    import pulsar

    ident = security.identity(principal)
    return {"authentication": pulsar.AuthenticationTLS(str(ident.cert), str(ident.key)),
            "tls_trust_certs_file_path": str(ident.ca),
            "tls_allow_insecure_connection": False,
            "tls_validate_hostname": True}


def subscription_name(node: int) -> str:
    """The name of node ``node``'s durable subscriptions: its agent's role, ``agent-<n>``
    (the broker's ``Prefix`` mode lets only a role the name starts with use it, and the
    subscription permission of :func:`grant_node_subscriptions` only ``agent-<n>``)."""
    return agent_principal(node)


# --------------------------------------------------------------------------- admin REST


def ssl_context(security: Security, principal: str = "admin") -> ssl.SSLContext:
    """An HTTPS client context presenting ``principal``'s certificate and verifying the
    server (and its host name) against the PKI's CA."""
    return client_ssl_context(security, principal)


class PulsarAdmin:
    """A client of a broker's admin REST API as ``principal``: mutual TLS for an
    ``https://`` URL (:func:`ssl_context`), over one kept-alive connection (a new TLS
    handshake per call costs far more than the call). Thread-safe; :meth:`close` it."""

    def __init__(self, admin_url: str, security: Security, principal: str = "admin",
                 timeout: float = 10.0) -> None:
        parts = urllib.parse.urlsplit(admin_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PulsarAdminError(f"admin URL {admin_url!r}: expected http(s)://host:port")
        self.admin_url, self.principal, self.timeout = admin_url.rstrip("/"), principal, timeout
        self._https = parts.scheme == "https"
        self._host, self._port, self._base = parts.hostname, parts.port, parts.path.rstrip("/")
        self._ctx = (ssl_context(security, principal) if self._https and not security.insecure
                     else None)
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"PulsarAdmin({self.admin_url!r}, principal={self.principal!r})"

    def __enter__(self) -> PulsarAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def call(self, method: str, path: str, body: Any = None, ok: Iterable[int] = ()) -> Any:
        """One call (``path`` below the admin URL, JSON ``body``): the decoded JSON answer
        (``None`` if empty). An HTTP status in ``ok`` counts as success (e.g. 409 for
        "already exists"); any other error is a :class:`PulsarAdminError` naming the call,
        the status and the broker's reason. A redirect (307 or 308: in a cluster, another
        broker owns the topic) is followed, up to three hops."""
        what = f"{method} {self.admin_url}{path} as {self.principal!r}"
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        with self._lock:
            for attempt in (0, 1):
                fresh = self._conn is None
                if self._conn is None:
                    self._conn = (http.client.HTTPSConnection(
                        self._host, self._port, timeout=self.timeout, context=self._ctx)
                        if self._https else http.client.HTTPConnection(
                            self._host, self._port, timeout=self.timeout))
                try:
                    self._conn.request(method, self._base + path, body=data, headers=headers)
                    resp = self._conn.getresponse()
                    text = resp.read().decode(errors="replace")
                    break
                except (http.client.HTTPException, OSError) as exc:
                    self._conn.close()
                    self._conn = None
                    if fresh or attempt:  # (else: a kept-alive connection the server closed)
                        raise PulsarAdminError(f"{what}: {exc}") from None
        for _ in range(3):  # a cluster's broker redirects a topic's call to its owner
            location = resp.getheader("Location")
            if resp.status not in (307, 308) or not location:
                break
            what = f"{method} {location} as {self.principal!r} (redirected)"
            resp, text = self._follow(location, method, data, headers, what)
        if resp.status in set(ok):
            return None
        if resp.status >= 300:
            raise PulsarAdminError(f"{what}: HTTP {resp.status} {text[:300] or resp.reason}")
        try:
            return json.loads(text) if text.strip() else None
        except ValueError:
            return text

    def _follow(self, url: str, method: str, data: bytes | None, headers: dict[str, str],
                what: str) -> tuple[http.client.HTTPResponse, str]:
        """The same call on a redirect's ``url`` (another broker), on a connection of its
        own presenting the same certificate."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PulsarAdminError(f"{what}: redirect to {url!r}, not an http(s) URL")
        conn = (http.client.HTTPSConnection(parts.hostname, parts.port, timeout=self.timeout,
                                            context=self._ctx) if parts.scheme == "https"
                else http.client.HTTPConnection(parts.hostname, parts.port,
                                                timeout=self.timeout))
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        try:
            conn.request(method, target, body=data, headers=headers)
            resp = conn.getresponse()
            return resp, resp.read().decode(errors="replace")
        except (http.client.HTTPException, OSError) as exc:
            raise PulsarAdminError(f"{what}: {exc}") from None
        finally:
            conn.close()



def admin_call(admin_url: str, method: str, path: str, body: Any = None, *,
               security: Security, principal: str = "admin", timeout: float = 10.0,
               ok: Iterable[int] = ()) -> Any:
    """One admin REST call on a connection of its own (:meth:`PulsarAdmin.call`)."""
    with PulsarAdmin(admin_url, security, principal, timeout) as admin:
        return admin.call(method, path, body, ok)


def _topic_path(topic: str) -> str:
    if not topic.startswith("persistent://"):
        raise PulsarAdminError(f"topic {topic!r}: expected persistent://tenant/namespace/name")
    return "/admin/v2/persistent/" + urllib.parse.quote(topic.removeprefix("persistent://"))


def _bind_nodes(admin: PulsarAdmin, nodes: Iterable[int], namespace: str) -> int:
    count = 0
    for n in nodes:
        path = (f"/admin/v2/namespaces/{namespace}/permissions/subscription/"
                f"{urllib.parse.quote(subscription_name(n))}")
        for attempt in range(5):  # 409: a concurrent change of the namespace's policies
            try:
                admin.call("POST", path, [agent_principal(n)])
                break
            except PulsarAdminError as exc:
                if "HTTP 409" not in str(exc) or attempt == 4:
                    raise
                time.sleep(0.05 * (attempt + 1))
        count += 1
    return count


def grant_node_subscriptions(admin_url: str, security: Security, nodes: Iterable[int], *,
                             namespace: str = DEFAULT_NAMESPACE,
                             principal: str = "admin") -> int:
    """Bind node ``n``'s subscription (:func:`subscription_name`) to role ``agent-<n>`` for
    each of ``nodes`` (a namespace subscription permission; idempotent). Needs a tenant
    admin (``admin``, or ``controller`` binding lazily, :class:`NodeSubscriptionGrants`).
    Returns the number of nodes bound."""
    with PulsarAdmin(admin_url, security, principal) as admin:
        return _bind_nodes(admin, nodes, namespace)


def node_subscription_grants(admin_url: str, security: Security, *,
                             namespace: str = DEFAULT_NAMESPACE,
                             principal: str = "admin") -> dict[str, list[str]]:
    """The namespace's subscription permissions: subscription name -> roles."""
    got = admin_call(admin_url, "GET", f"/admin/v2/namespaces/{namespace}/permissions/"
                     f"subscription", security=security, principal=principal)
    return {str(k): sorted(v) for k, v in (got or {}).items()}


class NodeSubscriptionGrants:
    """Binds nodes' subscriptions to their agents on first need, for a controller (a tenant
    admin): :meth:`ensure` binds those of ``nodes`` not bound yet (one GET of the
    namespace's permissions at first use, then one POST per new node on a kept-alive
    connection; nothing for a node already bound). Thread-safe. Insecure: no-op."""

    def __init__(self, admin_url: str, security: Security, *, principal: str = "controller",
                 namespace: str = DEFAULT_NAMESPACE) -> None:
        self.security, self.namespace = security, namespace
        self._admin = None if security.insecure else PulsarAdmin(admin_url, security,
                                                                  principal)
        self._bound: set[int] | None = None
        self._lock = threading.Lock()

    def ensure(self, nodes: Iterable[int]) -> int:
        """Bind each of ``nodes`` not bound yet; returns how many were bound now.
        :class:`PulsarAdminError` if the admin API refuses or cannot be reached (what was
        not bound is tried again by the next call)."""
        if self._admin is None:
            return 0
        with self._lock:
            if self._bound is None:
                got = self._admin.call("GET", f"/admin/v2/namespaces/{self.namespace}/"
                                       "permissions/subscription") or {}
                self._bound = {int(sub.removeprefix("agent-")) for sub, roles in got.items()
                               if re.fullmatch(r"agent-\d+", sub) and list(roles) == [sub]}
            todo = sorted({int(n) for n in nodes} - self._bound)
            for n in todo:
                _bind_nodes(self._admin, [n], self.namespace)
                self._bound.add(n)
            return len(todo)

    def close(self) -> None:
        if self._admin is not None:
            self._admin.close()


def grant_default_roles(admin_url: str, security: Security, *,
                        namespace: str = DEFAULT_NAMESPACE,
                        announce_topics: Iterable[str] = (ANNOUNCE_TOPIC,),
                        nodes: Iterable[int] = (),
                        controller: str = "controller",
                        policy_server: str = "policy-server",
                        principal: str = "admin", create_topics: bool = True) -> None:
    """Install the grant model of the module docstring on the broker at ``admin_url``
    (HTTPS, as ``principal``, a super-user): the controller an admin of ``namespace``'s
    tenant (kept: the tenant's other admin roles), ``Prefix`` subscription authorisation on
    ``namespace``, ``consume`` for ``agent-*``, ``produce`` for the policy server on each of
    ``announce_topics`` (created first if ``create_topics``: a broker refuses a topic's grant
    before the topic exists unless ``allowAclChangesOnNonExistentTopics``), and the
    subscription permissions of ``nodes``. Idempotent: an operator may run it against their
    own broker (``python -m security.pulsar grant``), which needs
    ``authorizationAllowWildcardsMatching=true``."""
    if security.insecure:
        raise SecurityError("grant_default_roles: security.insecure is set (a broker without "
                            "authorisation has nothing to grant)")
    tenant = namespace.split("/", 1)[0]
    with PulsarAdmin(admin_url, security, principal) as admin:
        info = admin.call("GET", f"/admin/v2/tenants/{tenant}") or {}
        admins = sorted(set(info.get("adminRoles") or ()) | {controller})
        if admins != sorted(info.get("adminRoles") or ()):
            admin.call("POST", f"/admin/v2/tenants/{tenant}",
                       {"adminRoles": admins,
                        "allowedClusters": info.get("allowedClusters") or []})
        admin.call("POST", f"/admin/v2/namespaces/{namespace}/subscriptionAuthMode", "Prefix")
        admin.call("POST", f"/admin/v2/namespaces/{namespace}/permissions/{AGENT_ROLES}",
                   ["consume"])
        for topic in announce_topics:
            if create_topics:
                admin.call("PUT", _topic_path(topic), ok=(409,))  # exists already: fine
            admin.call("POST", f"{_topic_path(topic)}/permissions/{policy_server}",
                       ["produce"])
        _bind_nodes(admin, nodes, namespace)
    log.info("Pulsar grants installed on %s (namespace %s): controller tenant admin, "
             "%s consume (Prefix subscriptions), %s produce on %s", admin_url, namespace,
             AGENT_ROLES, policy_server, list(announce_topics))


def parse_nodes(text: str) -> list[int]:
    """``"0-99,200"`` -> ``[0, ..., 99, 200]`` (the ``--nodes`` option)."""
    return parse_ranges(text, "--nodes")


def main(argv: list[str] | None = None) -> int:
    """``python -m security.pulsar grant --admin-url https://host:port [--pki-dir D]
    [--namespace public/default] [--announce-topic T ...] [--nodes 0-99]``."""
    ap = argparse.ArgumentParser(prog="python -m security.pulsar",
                                 description="Install the project's Pulsar grant model.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grant", help="grant the project's roles on a broker (idempotent)")
    g.add_argument("--admin-url", required=True, help="https://host:port of the admin API")
    g.add_argument("--pki-dir", default=None, help="PKI directory (its admin identity is used)")
    g.add_argument("--namespace", default=DEFAULT_NAMESPACE)
    g.add_argument("--announce-topic", action="append", default=None,
                   help=f"announcement topic(s) (default {ANNOUNCE_TOPIC})")
    g.add_argument("--nodes", default="", help="nodes whose subscriptions to bind, e.g. 0-99")
    args = ap.parse_args(argv)
    sec = Security(pki_dir=args.pki_dir)
    try:
        grant_default_roles(args.admin_url, sec, namespace=args.namespace,
                            announce_topics=args.announce_topic or (ANNOUNCE_TOPIC,),
                            nodes=parse_nodes(args.nodes))
    except PkiError as exc:  # SecurityError, PulsarAdminError: the message says what
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"granted on {args.admin_url} ({args.namespace})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
