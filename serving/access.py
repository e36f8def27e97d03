"""Who calls the policy server and what each key may do: the caller's key id and owner id,
the audit log of admin actions, the per-key rate limit, and the ``Allow`` answer of every
resource.

* A key is never stored, logged or returned: a caller is known by its **owner id** (the
  SHA-256 of its key, stored on every session it creates) and, in logs, by its **key id**
  (``key-`` and the first 12 hex digits of that digest).
* **Ownership.** A session (``/v1/sessions``, ``/v1/online/sessions``) belongs to the key
  that created it; any other key gets the same 404 as for an unknown id. An admin key may
  read and delete any session (to clean up after a controller that is gone); each such
  access to another key's session is audited. It may not change another key's session.
* **Audit.** Every admin action (policy and online-policy loads, an admin's access to
  another key's session) and every refused one (a controller key asking for an admin
  action, an invalid key on an admin endpoint) is logged once on the ``smart.audit`` logger
  as ``audit who=<key id> action=<action> target=<target> outcome=<outcome>[ detail=...]``
  (INFO when done, WARNING when refused or failed). Refused session accesses (another
  key's session) are logged there too, at WARNING.
* **Rate limit.** One token bucket per key (``requests_per_s`` refill, ``burst`` capacity),
  charged by work: a request takes ``1 + body bytes // bytes_per_token`` tokens (at most
  ``burst``), so a batch of 20,000 types costs what its size says, not what one type does.
  A key over its limit gets 429 with ``Retry-After`` (whole seconds, at least 1) while the
  other keys are served as before; counted in ``smart_rate_limited_total{key}``; the first
  refusal of a run of refusals is logged (WARNING), and how many there were at the first
  request served a second or more after the run's last refusal (INFO).
* **Key strength.** Every configured key has at least ``min_key_chars`` characters (32 by
  default, what ``secrets.token_urlsafe(24)`` gives) and at least
  :data:`MIN_DISTINCT_CHARS` distinct ones: a key id (12 hex digits of an unsalted digest)
  then says nothing an attacker can search offline. :func:`check_key_strength` names the
  weak key by its list and index, never by its text.
* **Key files.** Keys are read from files (``api_keys_file``, ``admin_keys_file``,
  ``metrics_keys_file``; :func:`read_key_file`), one per line, that other users cannot
  read: a key on a command line is visible to every local user (``ps``).
* **Roles.** A controller key (``api_keys``) uses sessions and decisions; an admin key
  (``admin_keys``) also swaps policies and reads the metrics; a metrics key
  (``metrics_keys``, a Prometheus scraper's) reads ``/v1/metrics`` and nothing else.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, Request, Security
from fastapi.routing import iter_route_contexts
from fastapi.security import APIKeyHeader
from starlette.types import ASGIApp, Receive, Scope, Send

from .logsafe import log_field

__all__ = ["ANONYMOUS", "API_KEY_HEADER", "AUDIT", "DEFAULT_MIN_KEY_CHARS", "MIN_DISTINCT_CHARS",
           "MIN_KEY_CHARS_FLOOR", "AdminCaller", "AllowMiddleware", "Caller", "ControllerCaller",
           "RateLimit", "RateLimiter", "allowed_methods", "audit", "caller_for",
           "check_key_strength", "document_contract", "key_id", "log_field", "read_key_file",
           "require_admin", "require_controller", "require_metrics", "write_key_file"]

AUDIT = logging.getLogger("smart.audit")
API_KEY_HEADER = "X-API-Key"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def key_id(key: str) -> str:
    """The name of a key in logs: ``key-`` and 12 hex digits of its SHA-256."""
    return "key-" + _digest(key)[:12]


#: the fewest characters a configured key may have (``min_key_chars``'s default)
DEFAULT_MIN_KEY_CHARS = 32
#: ``min_key_chars`` may not be set below this
MIN_KEY_CHARS_FLOOR = 16
#: the fewest distinct characters a configured key may have ("aaaa...", "0101..." refused)
MIN_DISTINCT_CHARS = 10
_MAKE_KEY = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def check_key_strength(keys: Sequence[str], setting: str,
                       min_chars: int = DEFAULT_MIN_KEY_CHARS) -> None:
    """Raise ValueError naming the first key of ``keys`` (``setting[i]`` and its key id,
    never its text) shorter than ``min_chars`` or with fewer than
    :data:`MIN_DISTINCT_CHARS` distinct characters."""
    for i, k in enumerate(keys):
        if len(k) < min_chars:
            why = f"has {len(k)} characters, fewer than min_key_chars={min_chars}"
        elif len(set(k)) < MIN_DISTINCT_CHARS:
            why = (f"has {len(set(k))} distinct characters, fewer than "
                   f"{MIN_DISTINCT_CHARS}")
        else:
            continue
        raise ValueError(f"{setting}[{i}] ({key_id(k)}) is too weak: it {why}; make one "
                         f"with {_MAKE_KEY}")


def read_key_file(path: str | os.PathLike[str], setting: str) -> list[str]:
    """The keys of a key file: one per line, blank lines and ``#`` comments skipped. The
    file must be a regular file that neither its group nor other users can read or write
    (``chmod 600``): ValueError naming ``setting``, the path and what is wrong."""
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except OSError as e:
        raise ValueError(f"{setting}: cannot read {p}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{setting}: {p} is not a regular file")
    if st.st_mode & 0o077:
        raise ValueError(f"{setting}: {p} has mode {stat.S_IMODE(st.st_mode):o}, so other "
                         f"users may read or change its keys; run chmod 600 {p}")
    try:
        with open(p, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{setting}: cannot read {p}: {e}") from None
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def write_key_file(path: str | os.PathLike[str], keys: Sequence[str]) -> str:
    """Write ``keys`` (one per line) to a file only its owner can read or write (mode 600,
    whether or not it existed), the form :func:`read_key_file` takes; returns the path."""
    p = os.fspath(path)
    for k in keys:
        if not k or k != k.strip() or "\n" in k or "\r" in k or k.lstrip().startswith("#"):
            raise ValueError(f"key {key_id(k)} cannot be written to a key file: empty, "
                             "surrounded by blanks, starting with '#' or holding a line break")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write("".join(k + "\n" for k in keys))
    return p


@dataclass(frozen=True)
class Caller:
    """An authenticated caller: ``owner`` (the SHA-256 of its key, stored on its sessions),
    ``key_id`` (its name in logs), whether it holds an admin key, and whether it holds a
    metrics key (``scraper``: it may read ``/v1/metrics`` and nothing else)."""

    owner: str
    key_id: str
    admin: bool
    scraper: bool = False

    def __repr__(self) -> str:
        return f"Caller({self.key_id}, admin={self.admin}, scraper={self.scraper})"


#: the caller of a server without authentication (``auth=false``): one caller, admin
ANONYMOUS = Caller("anonymous", "anonymous", True)


def caller_for(key: str, admin: bool, scraper: bool = False) -> Caller:
    d = _digest(key)
    return Caller(d, "key-" + d[:12], admin, scraper)


def audit(who: str, action: str, target: object, outcome: str, detail: object = None, *,
          level: int = logging.INFO) -> None:
    """One line on ``smart.audit``: who (a key id or a peer address, never a key), what,
    on what, and how it ended."""
    msg = (f"audit who={log_field(who)} action={log_field(action)} target={log_field(target)} "
           f"outcome={outcome}")
    if detail is not None:
        msg += f" detail={log_field(detail)}"
    AUDIT.log(level, "%s", msg)


# --------------------------------------------------------------------------- dependencies


class Gate(Protocol):
    """What an app keeps in ``app.state.access`` (its
    :class:`serving.api.server.PolicyServer`): the caller of a request, or the HTTPException
    refusing it."""

    def controller(self, request: Request, key: str | None, body_bytes: int = 0
                   ) -> Caller: ...

    def admin(self, request: Request, key: str | None, body_bytes: int = 0) -> Caller: ...

    def metrics_reader(self, request: Request, key: str | None) -> Caller: ...


api_key_header = APIKeyHeader(name=API_KEY_HEADER, auto_error=False,
                              description="A controller's API key")


async def _body_bytes(request: Request) -> int:
    """The request body's size, what the rate limit charges for (FastAPI has read and
    cached the body before it solves the dependencies)."""
    return len(await request.body())


async def require_controller(request: Request,
                             key: str | None = Security(api_key_header)) -> Caller:
    """The dependency of every endpoint that takes a key (``app.dependency_overrides`` may
    replace it)."""
    gate: Gate = request.app.state.access
    return gate.controller(request, key, await _body_bytes(request))


async def require_admin(request: Request, key: str | None = Security(api_key_header)) -> Caller:
    """The dependency of the admin endpoints (a policy swap)."""
    gate: Gate = request.app.state.access
    return gate.admin(request, key, await _body_bytes(request))


async def require_metrics(request: Request,
                          key: str | None = Security(api_key_header)) -> Caller:
    """The dependency of ``/v1/metrics``: an admin or metrics key, in ``X-API-Key`` or as
    ``Authorization: Bearer <key>`` (Prometheus's ``authorization`` scrape setting)."""
    if key is None:
        scheme, _, cred = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and cred.strip():
            key = cred.strip()
    gate: Gate = request.app.state.access
    return gate.metrics_reader(request, key)


#: an endpoint parameter: the caller, any valid key
ControllerCaller = Annotated[Caller, Depends(require_controller)]
#: an endpoint parameter: the caller, an admin key
AdminCaller = Annotated[Caller, Depends(require_admin)]


# --------------------------------------------------------------------------- rate limit


@dataclass(frozen=True)
class RateLimit:
    """``requests_per_s``: tokens added per second to each key's bucket; ``burst``: its
    capacity (the requests a key may send at once after a quiet period);
    ``bytes_per_token``: a request takes one token and one more per this many body bytes
    (:meth:`cost`)."""

    requests_per_s: float
    burst: int
    bytes_per_token: int = 4096

    def __post_init__(self) -> None:
        if (isinstance(self.requests_per_s, bool) or not isinstance(self.requests_per_s,
                                                                       int | float)
                or not math.isfinite(self.requests_per_s) or self.requests_per_s <= 0):
            raise ValueError(f"rate_limit.requests_per_s must be a positive number, got "
                             f"{self.requests_per_s!r}")
        if isinstance(self.burst, bool) or not isinstance(self.burst, int) or self.burst < 1:
            raise ValueError(f"rate_limit.burst must be an integer >= 1, got {self.burst!r}")
        if (isinstance(self.bytes_per_token, bool) or not isinstance(self.bytes_per_token, int)
                or self.bytes_per_token < 1):
            raise ValueError(f"rate_limit.bytes_per_token must be an integer >= 1, got "
                             f"{self.bytes_per_token!r}")

    def cost(self, body_bytes: int) -> float:
        """The tokens a request with a body of ``body_bytes`` takes: ``1 + body_bytes //
        bytes_per_token``, at most ``burst`` (so any request the body limit lets through
        can be served from a full bucket)."""
        return float(min(self.burst, 1 + max(0, body_bytes) // self.bytes_per_token))

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any] | RateLimit | None) -> RateLimit | None:
        """``{requests_per_s, burst[, bytes_per_token]}``; ``None``: no limit. Unknown keys
        are refused."""
        if m is None or isinstance(m, RateLimit):
            return m
        if not isinstance(m, Mapping):
            raise ValueError(f"rate_limit: expected a mapping {{requests_per_s, burst}} or "
                             f"null, got {type(m).__name__}")
        unknown = sorted(set(m) - {"requests_per_s", "burst", "bytes_per_token"})
        if unknown:
            raise ValueError(f"rate_limit: unknown key(s) {unknown}; known: "
                             f"['burst', 'bytes_per_token', 'requests_per_s']")
        missing = sorted({"requests_per_s", "burst"} - set(m))
        if missing:
            raise ValueError(f"rate_limit: missing {missing} (or set rate_limit: null)")
        return cls(m["requests_per_s"], m["burst"], m.get("bytes_per_token", 4096))


class RateLimiter:
    """One token bucket per name: a key id (only valid keys reach the per-key limiter, so it
    holds at most one bucket per configured key) or a client address (the limiter of
    requests with an invalid key). ``max_keys`` bounds the buckets held: past it, the
    buckets that have refilled (the same as no bucket) are dropped, then the least recently
    used. Not thread-safe: called on the server's event loop."""

    def __init__(self, limit: RateLimit, on_refused: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 max_keys: int | None = None) -> None:
        self.limit, self.clock, self.on_refused = limit, clock, on_refused
        self.max_keys = max_keys
        self._buckets: dict[str, list[float]] = {}  # key id -> [tokens, last refill time]
        # key id -> [refusals in the current run, time of the last one]
        self._refused: dict[str, list[float]] = {}
        #: a run of refusals ends at the first request served this long after the last one
        self.quiet_s = max(1.0, 1.0 / limit.requests_per_s)

    def take(self, who: str, what: str, cost: float = 1.0) -> float:
        """Take ``cost`` tokens of ``who``'s bucket (at most its ``burst``): 0.0 if it held
        them, else the seconds until it does (the request is refused)."""
        cost = min(float(self.limit.burst), max(1.0, cost))
        now = self.clock()
        b = self._buckets.get(who)
        if b is None:
            if self.max_keys is not None and len(self._buckets) >= self.max_keys:
                self._prune(now)
            b = self._buckets[who] = [float(self.limit.burst), now]
        tokens = min(float(self.limit.burst), b[0] + (now - b[1]) * self.limit.requests_per_s)
        b[1] = now
        run = self._refused.get(who)
        if tokens >= cost:
            b[0] = tokens - cost
            if run is not None and now - run[1] >= self.quiet_s:
                del self._refused[who]
                audit(who, "rate_limit", "-", "lifted",
                      f"{int(run[0])} request(s) refused meanwhile")
            return 0.0
        b[0] = tokens
        wait = (cost - tokens) / self.limit.requests_per_s
        if run is None:
            run = self._refused[who] = [0, now]
        run[0] += 1
        run[1] = now
        if run[0] == 1:
            audit(who, what, "-", "refused",
                  f"429: over its rate limit ({self.limit.requests_per_s:g} requests/s, burst "
                  f"{self.limit.burst}); retry after {wait:.3f} s; further refusals are "
                  "counted, not logged, until it is under its limit", level=logging.WARNING)
        if self.on_refused is not None:
            self.on_refused(who)
        return wait


    def _prune(self, now: float) -> None:
        """Make room for one more bucket (``max_keys``): drop the full ones, then the least
        recently used half."""
        rate, burst = self.limit.requests_per_s, float(self.limit.burst)
        full = [w for w, (tok, t) in self._buckets.items() if tok + (now - t) * rate >= burst]
        for w in full:
            del self._buckets[w]
            self._refused.pop(w, None)
        assert self.max_keys is not None
        if len(self._buckets) >= self.max_keys:
            oldest = sorted(self._buckets, key=lambda w: self._buckets[w][1])
            for w in oldest[:max(1, len(oldest) // 2)]:
                del self._buckets[w]
                self._refused.pop(w, None)


def retry_after(wait_s: float) -> str:
    """The ``Retry-After`` value (whole seconds, at least 1) for a wait."""
    return str(max(1, math.ceil(wait_s)))


# --------------------------------------------------------------------------- methods


def allowed_methods(app: FastAPI, path: str) -> list[str] | None:
    """Every method some route of ``app`` takes on ``path`` (and OPTIONS), or None if no
    route matches the path."""
    methods: set[str] = set()
    for r in iter_route_contexts(app.router.routes):  # included routers' routes too
        rx, ms = getattr(r, "path_regex", None), r.methods
        if rx is not None and ms and rx.match(path):
            methods |= set(ms)
    return sorted(methods | {"OPTIONS"}) if methods else None


class AllowMiddleware:
    """Pure ASGI: ``OPTIONS`` on any resource answers 204 with an ``Allow`` header naming
    every method the resource takes (the router alone would name only the first route's
    methods)."""

    def __init__(self, app: ASGIApp, api: FastAPI) -> None:
        self.app, self.api = app, api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "OPTIONS":
            methods = allowed_methods(self.api, scope["path"])
            if methods is not None:
                await send({"type": "http.response.start", "status": 204,
                            "headers": [(b"allow", ", ".join(methods).encode())]})
                await send({"type": "http.response.body", "body": b""})
                return
        await self.app(scope, receive, send)


# --------------------------------------------------------------------------- OpenAPI

_RETRY_AFTER = {"description": "Seconds to wait before this key's next request is served "
                "(429 for the rate limit).",
                "schema": {"type": "integer", "minimum": 1}}
_RATE_LIMITED = "This key is over its rate limit (see `Retry-After`)"
_FOREIGN = " (or one another key created: the same answer)"

#: (creation path, the paths of its sessions' operations, the ids the creation gives them)
SESSION_FAMILIES = (("/v1/sessions", "/v1/sessions/{session_id}", ("session_id",)),
                    ("/v1/online/sessions", "/v1/online/sessions/{session_id}",
                     ("session_id", "window")))


def document_contract(schema: dict[str, Any], rate_limited: bool,
                      max_items: Mapping[tuple[str, str], int] | None = None
                      ) -> dict[str, Any]:
    """Complete ``schema`` (the app's OpenAPI document, changed in place): links from each
    session creation (its 201 response) to every operation on the session it created, so a
    client or a stateful fuzzer can follow them; the ownership rule on the 404s; with
    ``rate_limited``, the 429 (with ``Retry-After``) of every operation that takes a key;
    and ``max_items`` ((model, field) -> the app's limit) as those lists' ``maxItems``."""
    paths: dict[str, dict[str, Any]] = schema.get("paths", {})
    models = schema.get("components", {}).get("schemas", {})
    for (model, name), limit in (max_items or {}).items():
        prop = models.get(model, {}).get("properties", {}).get(name)
        if prop is not None:
            for s in [prop, *prop.get("anyOf", [])]:
                if s.get("type") == "array":
                    s["maxItems"] = limit
    for create, prefix, ids in SESSION_FAMILIES:
        created = paths.get(create, {}).get("post", {}).get("responses", {}).get("201")
        if created is None:
            continue
        links: dict[str, Any] = {}
        for path, ops in paths.items():
            if not (path == prefix or path.startswith(prefix + "/")):
                continue
            for method, op in ops.items():
                if not isinstance(op, dict) or "operationId" not in op:
                    continue
                params = {p: f"$response.body#/{p}" for p in ids if "{" + p + "}" in path}
                name = "".join(w.capitalize() for w in re.split(r"[^A-Za-z0-9]+",
                                                               f"{method} {path[len(prefix):]}")
                               if w)
                links[name or method.capitalize()] = {
                    "operationId": op["operationId"], "parameters": params,
                    "description": f"{method.upper()} {path} on the session just created"}
                r404 = op.get("responses", {}).get("404")
                if r404 is not None and _FOREIGN not in r404.get("description", ""):
                    r404["description"] = r404.get("description", "Not Found") + _FOREIGN
        created["links"] = links
    if rate_limited:
        for ops in paths.values():
            for op in ops.values():
                if not isinstance(op, dict) or not op.get("security"):
                    continue
                rs = op.setdefault("responses", {})
                r = rs.setdefault("429", {"description": _RATE_LIMITED, "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorOut"}}}})
                if _RATE_LIMITED not in r.get("description", ""):
                    r["description"] = f"{r.get('description', '')}, or: {_RATE_LIMITED}"
                r.setdefault("headers", {})["Retry-After"] = _RETRY_AFTER
    return schema
