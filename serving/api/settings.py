"""The policy server's settings: :class:`ServerSettings`, one pydantic-settings class with each
default written once, checked whole when made (a ValueError names the setting).

``serve.py`` makes it from ``configs/serve.yaml`` (a setting the file leaves out takes the
default here); a program embedding the server makes it directly, and any setting it does not
pass is read from the environment as ``SMART_<NAME>`` (``SMART_AUTH=false``,
``SMART_MAX_BATCH=5000``, the blocks as JSON: ``SMART_RATE_LIMIT='{"requests_per_s": 100,
"burst": 200}'``); the key lists there are comma-separated (``SMART_API_KEYS=k1,k2``)."""

from __future__ import annotations

import os
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, InstanceOf, ValidationError, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from security.tls import Security as TransportSecurity

from ..access import (
    DEFAULT_MIN_KEY_CHARS,
    MIN_KEY_CHARS_FLOOR,
    RateLimit,
    check_key_strength,
)
from ..announce import DEFAULT_TOPIC, check_settings
from ..bundles.registry import RegistryError, RegistryRef, is_registry_uri
from ..bundles.signing import BundleTrust
from ..limits import ResourceLimits
from ..session import FALLBACKS

__all__ = ["DEFAULT_AUTH_FAILURES", "DEFAULT_RATE_LIMIT", "ServerSettings", "key_list"]

#: per key: far above what a controller, ``make run`` or the testbed sends, far below what
#: one process serves (a flooding key is refused long before it slows the others)
DEFAULT_RATE_LIMIT = RateLimit(requests_per_s=2000.0, burst=4000)
#: per client address, requests with a missing or invalid key: enough for a controller
#: whose key was rotated to notice, far too few to guess keys or flood the audit log
DEFAULT_AUTH_FAILURES = RateLimit(requests_per_s=5.0, burst=20)


def key_list(v: Any) -> Any:
    """A key list: a comma-separated string (the environment's form) or a list, each key
    stripped, empty ones dropped."""
    if v is None:
        return []
    if isinstance(v, str):
        v = v.split(",")
    if isinstance(v, list | tuple):
        return [str(k).strip() for k in v if str(k).strip()]
    return v


def _path_str(v: Any) -> Any:
    """A path setting given as a path object (``pathlib.Path``): its text."""
    return os.fspath(v) if isinstance(v, os.PathLike) else v


#: a path or URI setting (a string; a ``pathlib.Path`` is taken as its text)
PathText = Annotated[str | None, BeforeValidator(_path_str)]


def _bundle_trust(v: Any) -> Any:
    if v is not None and not isinstance(v, BundleTrust):
        raise ValueError("bundle_trust: expected a serving.bundles.signing.BundleTrust "
                         f"(or None), got {type(v).__name__}")
    return v


def _min_key_chars(v: Any) -> Any:
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise ValueError(f"min_key_chars must be an integer >= {MIN_KEY_CHARS_FLOOR}, got "
                         f"{v!r}")
    return v


#: a list of keys (never shown: not in the repr, not in an error)
Keys = Annotated[list[str], NoDecode, BeforeValidator(key_list), Field(repr=False)]


class ServerSettings(BaseSettings):
    """Everything the server is configured with (``configs/serve.yaml``; module docstring)."""

    # env_parse_none_str: SMART_RATE_LIMIT=null is "no limit", as ``rate_limit: null`` is
    model_config = SettingsConfigDict(env_prefix="SMART_", extra="forbid",
                                      hide_input_in_errors=True, validate_default=True,
                                      env_parse_none_str="null")

    bundle: PathText = None  # policy bundle directory loaded at start (None: heuristic)
    #: online policy bundle (serving.bundles.online) loaded at start; None: none until a
    #: PUT /v1/online/policy (serving/api/online.py)
    online_bundle: PathText = None
    api_keys: Keys = []  # controllers' keys
    admin_keys: Keys = []  # may swap the policy
    #: may read ``/v1/metrics`` and nothing else (a Prometheus scraper's keys)
    metrics_keys: Keys = []
    #: the fewest characters a configured key may have (serving.access.check_key_strength)
    min_key_chars: Annotated[int, BeforeValidator(_min_key_chars)] = DEFAULT_MIN_KEY_CHARS
    auth: bool = True  # False only for local experiments
    fallback: str = "greedy"  # heuristic when no usable policy: greedy | rpc
    max_body_bytes: int = 4 * 1024 * 1024
    max_batch: int = 20_000
    max_sessions: int = 1_000
    max_sessions_per_key: int = 100  # one key cannot take every slot (each family)
    max_types: int = 200_000  # per session
    watch: bool = False  # reload the bundle when its files change
    watch_period_s: float = 2.0
    require_policy: bool = False  # readiness needs a loaded policy
    #: after start-up, move every object alive then out of the garbage collector's reach
    #: (``gc.freeze``): a full collection would otherwise walk the libraries' ~150,000
    #: objects (tens of milliseconds), a stall that queues every request arriving meanwhile
    freeze_gc: bool = True
    #: threads that score one batch's chunks (``serving.bundles.static.load_bundle``); None:
    #: the cores this process may use, at most 4
    batch_threads: int | None = None
    #: Pulsar service URL of the announcement topic (``announce.url``; None: no
    #: announcements, the adapters poll); the ``pulsar-client`` package is then required
    announce_url: str | None = None
    announce_topic: str = DEFAULT_TOPIC  # ``announce.topic``
    announce_send_timeout_s: float = 2.0  # an announcement not confirmed by then: failed
    #: transport security (``security: {insecure, pki_dir}``): TLS with the PKI's
    #: ``policy-server`` identity unless ``tls_certfile``/``tls_keyfile`` name others;
    #: insecure: plain HTTP (warned). Applied by ``serve.py`` (uvicorn's TLS options).
    security: Annotated[InstanceOf[TransportSecurity],
                        BeforeValidator(TransportSecurity.from_mapping)] = Field(
        default_factory=TransportSecurity)
    tls_certfile: PathText = None  # ``tls.certfile`` (PEM); with tls_keyfile
    tls_keyfile: PathText = None  # ``tls.keyfile`` (PEM, unencrypted)
    #: per-key token bucket (``rate_limit: {requests_per_s, burst}``); None: no limit
    rate_limit: Annotated[InstanceOf[RateLimit] | None,
                          BeforeValidator(RateLimit.from_mapping)] = DEFAULT_RATE_LIMIT
    #: per client address, a token bucket of requests with a missing or invalid key
    #: (``auth_failures: {requests_per_s, burst}``): over it, 429 and one audit line per run
    #: of refusals instead of one per request; None: no limit
    auth_failures: Annotated[InstanceOf[RateLimit] | None,
                             BeforeValidator(RateLimit.from_mapping)] = DEFAULT_AUTH_FAILURES
    #: session sizes, memory budgets and idle expiry (``limits: {...}``, serving.limits)
    limits: Annotated[InstanceOf[ResourceLimits],
                      BeforeValidator(ResourceLimits.from_mapping)] = Field(
        default_factory=ResourceLimits)
    #: the public keys a bundle's signature must verify against, for the policy and the
    #: online policy (``bundle_trust: {keys, pki_key}``, :mod:`serving.bundles.signing`);
    #: None: the PKI's ``bundle-signing.pub`` of ``security`` (unsigned bundles accepted,
    #: warned, when ``security.insecure``)
    bundle_trust: Annotated[InstanceOf[BundleTrust] | None,
                            BeforeValidator(_bundle_trust)] = None
    #: the MLflow tracking server whose model registry ``models:/`` URIs (``bundle``,
    #: ``online_bundle``, a swap's path) are looked up in (``registry.tracking_uri``; None:
    #: ``MLFLOW_TRACKING_URI`` or MLflow's default), and where their files are cached
    #: (``registry.cache_dir``; None: ``~/.cache/smart-dsmd/registry``)
    registry_uri: str | None = None
    registry_cache_dir: PathText = None

    def __init__(self, **values: Any) -> None:
        problem = None
        try:
            super().__init__(**values)
        except ValidationError as e:  # the first problem, as the ValueError that names it
            problem = _first_error(e)
        if problem is not None:  # raised outside the except: no context holding the input
            raise problem

    @model_validator(mode="after")
    def _check(self) -> ServerSettings:
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("tls: give both certfile and keyfile, or neither (then the "
                             "PKI's policy-server identity is used)")
        if self.security.insecure and self.tls_certfile is not None:
            raise ValueError("tls.certfile is set but security.insecure is true: choose one")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        for k in ("bundle", "online_bundle"):
            if is_registry_uri(getattr(self, k)):
                try:
                    RegistryRef.parse(getattr(self, k))
                except RegistryError as e:
                    raise ValueError(f"{k}: {e}") from None
        if self.auth and not self.api_keys:
            raise ValueError("auth is on but no api_keys are configured (set api_keys_file, "
                             "or SMART_API_KEYS=key1,key2, or auth=false for local use)")
        if self.min_key_chars < MIN_KEY_CHARS_FLOOR:
            raise ValueError(f"min_key_chars must be an integer >= {MIN_KEY_CHARS_FLOOR}, got "
                             f"{self.min_key_chars!r}")
        if self.auth:
            for name in ("api_keys", "admin_keys", "metrics_keys"):
                check_key_strength(getattr(self, name), name, self.min_key_chars)
        for k in ("max_body_bytes", "max_batch", "max_sessions", "max_sessions_per_key",
                  "max_types"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} must be positive")
        if self.batch_threads is not None and self.batch_threads < 1:
            raise ValueError(f"batch_threads must be at least 1 (or null), got "
                             f"{self.batch_threads}")
        check_settings(self.announce_url, self.announce_topic)
        if not self.announce_send_timeout_s > 0:
            raise ValueError(f"announce.send_timeout_s must be positive, got "
                             f"{self.announce_send_timeout_s}")
        return self

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Each setting's default (a fresh object for those made by a factory)."""
        return {name: f.get_default(call_default_factory=True)
                for name, f in cls.model_fields.items()}

    def trust(self) -> BundleTrust:
        """``bundle_trust``, or the trust of ``security`` (:meth:`BundleTrust.from_security`:
        the PKI's key; ``PkiError`` if it has none)."""
        if self.bundle_trust is None:
            self.bundle_trust = BundleTrust.from_security(self.security)
        return self.bundle_trust

    def tls_files(self) -> tuple[str, str, str | None] | None:
        """(certfile, keyfile, CA file) uvicorn serves with; None when insecure (plain HTTP).
        The PKI's ``policy-server`` identity unless ``tls_certfile`` is set (CA: None)."""
        if self.security.insecure:
            return None
        if self.tls_certfile is not None and self.tls_keyfile is not None:
            return self.tls_certfile, self.tls_keyfile, None
        ident = self.security.identity("policy-server")
        return str(ident.cert), str(ident.key), str(ident.ca)


def _first_error(e: ValidationError) -> Exception:
    """The exception a settings check raised (its own type and message), or a ValueError
    naming the setting and the problem (never its value: keys are settings too)."""
    err = e.errors(include_input=False)[0]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, Exception):
        return cause
    where = ".".join(str(x) for x in err["loc"]) or "settings"
    return ValueError(f"{where}: {err['msg']}")
