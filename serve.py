"""Policy server: `python serve.py` (Hydra; see configs/serve.yaml and serving/app.py).

Served over HTTPS by default (uvicorn's own TLS: ``ssl_certfile``/``ssl_keyfile``): the PKI's
``policy-server`` identity (``security.pki_dir``, :mod:`security.pki`) or the files of
``tls.certfile``/``tls.keyfile``; ``security.insecure=true`` serves plain HTTP and warns.
Every bundle it loads must be signed by a key of ``bundle_trust`` (``keys``: public key
files, ``pki_key``: the PKI's ``bundle-signing.pub`` too; :mod:`serving.bundles.signing`).
``bundle`` and ``online_bundle`` take a directory or a registered model of ``registry``'s
MLflow server (``models:/<name>@<alias>``, followed while ``watch``;
:mod:`serving.bundles.registry`)."""

import logging
import sys

import hydra
from omegaconf import DictConfig

import agents.config  # noqa: F401  (registers the ${project_root:} resolver)
from envs.quiet import quiet

quiet()  # known third-party log noise off, before Ray and torch load (envs/quiet.py)


def settings_from(cfg: DictConfig):
    import dataclasses

    from omegaconf import OmegaConf

    from security.tls import Security
    from serving.access import RateLimit, read_key_file
    from serving.app import DEFAULT_AUTH_FAILURES, DEFAULT_RATE_LIMIT, ServerSettings
    from serving.bundles.signing import BundleTrust
    from serving.limits import ResourceLimits

    def keys(v) -> list[str]:
        if v is None:
            return []
        items = v.split(",") if isinstance(v, str) else list(v)
        return [str(k).strip() for k in items if str(k).strip()]

    def all_keys(name: str) -> list[str]:
        """``<name>`` and the keys of ``<name>_file``, in that order, each once."""
        got = keys(cfg.get(name))
        path = cfg.get(f"{name}_file")
        if path:
            got += read_key_file(str(path), f"{name}_file")
        return list(dict.fromkeys(got))

    # a setting the config file leaves out takes ServerSettings' default (written there once)
    default = {f.name: f.default for f in dataclasses.fields(ServerSettings)
               if f.default is not dataclasses.MISSING}
    ann = cfg.get("announce") or {}
    unknown = sorted(set(ann) - {"url", "topic", "send_timeout_s"})
    if unknown:
        raise ValueError(f"announce.{unknown[0]}: unknown setting (announce takes url, topic "
                         "and send_timeout_s)")
    try:
        send_timeout_s = float(ann.get("send_timeout_s", default["announce_send_timeout_s"]))
    except (TypeError, ValueError):
        raise ValueError(f"announce.send_timeout_s must be a number of seconds, got "
                         f"{ann.get('send_timeout_s')!r}") from None
    def block(name: str):
        v = cfg.get(name)
        return OmegaConf.to_container(v, resolve=True) if isinstance(v, DictConfig) else v

    tls = block("tls") or {}
    if not isinstance(tls, dict) or set(tls) - {"certfile", "keyfile"}:
        raise ValueError(f"tls: expected {{certfile, keyfile}} (paths or null), got {tls!r}")
    rate = block("rate_limit") if "rate_limit" in cfg else {
        "requests_per_s": DEFAULT_RATE_LIMIT.requests_per_s, "burst": DEFAULT_RATE_LIMIT.burst}
    failures = block("auth_failures") if "auth_failures" in cfg else {
        "requests_per_s": DEFAULT_AUTH_FAILURES.requests_per_s,
        "burst": DEFAULT_AUTH_FAILURES.burst}
    registry = block("registry") or {}
    if not isinstance(registry, dict) or set(registry) - {"tracking_uri", "cache_dir"}:
        raise ValueError(f"registry: expected {{tracking_uri, cache_dir}} (null or a string "
                         f"each), got {registry!r}")
    security = Security.from_mapping(block("security"))
    # ``main`` warns once for the whole server, bundle verification included
    trust = BundleTrust.from_mapping(block("bundle_trust"), security, warn=False)
    return ServerSettings(security=security, bundle_trust=trust,
                          tls_certfile=tls.get("certfile") or None,
                          tls_keyfile=tls.get("keyfile") or None,
                          rate_limit=RateLimit.from_mapping(rate),
                          auth_failures=RateLimit.from_mapping(failures),
                          limits=ResourceLimits.from_mapping(block("limits")),
                          bundle=cfg.bundle, online_bundle=cfg.get("online_bundle"),
                          api_keys=all_keys("api_keys"),
                          admin_keys=all_keys("admin_keys"),
                          metrics_keys=all_keys("metrics_keys"),
                          min_key_chars=int(cfg.get("min_key_chars", default["min_key_chars"])),
                          auth=bool(cfg.auth),
                          fallback=cfg.fallback, max_body_bytes=int(cfg.max_body_bytes),
                          max_batch=int(cfg.max_batch), max_sessions=int(cfg.max_sessions),
                          max_sessions_per_key=int(cfg.get("max_sessions_per_key",
                                                           default["max_sessions_per_key"])),
                          max_types=int(cfg.max_types), watch=bool(cfg.watch),
                          watch_period_s=float(cfg.watch_period_s),
                          require_policy=bool(cfg.require_policy),
                          freeze_gc=bool(cfg.freeze_gc),
                          batch_threads=None if cfg.get("batch_threads") is None
                          else int(cfg.batch_threads),
                          announce_url=ann.get("url"),
                          announce_topic=ann.get("topic", default["announce_topic"]),
                          announce_send_timeout_s=send_timeout_s,
                          registry_uri=registry.get("tracking_uri") or None,
                          registry_cache_dir=registry.get("cache_dir") or None)


def transport_limits(cfg: DictConfig):
    """The HTTP connection limits of ``transport:`` (:mod:`serving.transport`: header size,
    header deadline, idle timeout); absent: the defaults. ``++transport.<key>=...`` sets
    one whether or not the config file has the block."""
    from omegaconf import OmegaConf

    from serving.transport import TransportLimits

    block = cfg.get("transport")
    if isinstance(block, DictConfig):
        block = OmegaConf.to_container(block, resolve=True)
    return TransportLimits.from_mapping(block)


def keys_on_command_line(argv: list[str]) -> list[str]:
    """The key settings (``api_keys``, ``admin_keys``, ``metrics_keys``) given a value on
    the command line, which every local user can read (``ps``, ``/proc/<pid>/cmdline``)."""
    found = []
    for a in argv[1:]:
        name, eq, value = a.lstrip("+~").partition("=")
        if eq and name in ("api_keys", "admin_keys", "metrics_keys") and value.strip(
                " []'\"") not in ("", "null"):
            found.append(name)
    return found


@hydra.main(config_path="configs", config_name="serve", version_base="1.3")
def main(cfg: DictConfig) -> None:
    import uvicorn

    from serving import logsafe
    from serving.app import create_app
    from serving.transport import uvicorn_options

    logsafe.install()  # one line per record: no request or file can forge a log line

    settings = settings_from(cfg)
    limits = transport_limits(cfg)  # before anything starts: a bad setting fails fast
    settings.security.warn_if_insecure("policy server (plain HTTP, unsigned bundles accepted)")
    if not settings.auth:
        logging.getLogger("smart.security").warning(
            "SECURITY OFF: policy server runs without API keys (auth=false): every caller is "
            "one anonymous admin, sessions have no owner and no rate limit applies")
    on_argv = keys_on_command_line(sys.argv)
    if on_argv:
        logging.getLogger("smart.security").warning(
            "keys given on the command line (%s): every local user can read them (ps); put "
            "them in a key file only you can read (api_keys_file, chmod 600) or the "
            "environment (SMART_API_KEYS)", ", ".join(on_argv))
    tls = settings.tls_files()
    app = create_app(settings)
    ssl = {} if tls is None else {"ssl_certfile": tls[0], "ssl_keyfile": tls[1]}
    uvicorn.run(app, host=cfg.host, port=int(cfg.port), log_level=cfg.log_level, **ssl,
                **uvicorn_options(limits))


if __name__ == "__main__":
    main()
