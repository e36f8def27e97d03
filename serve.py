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


#: ServerSettings fields that ``settings_from`` makes itself rather than pass as given
MADE_HERE = ("security", "bundle_trust", "api_keys", "admin_keys", "metrics_keys")
#: the config's blocks whose keys are ServerSettings fields of another name
BLOCKS = {"announce": {"url": "announce_url", "topic": "announce_topic",
                       "send_timeout_s": "announce_send_timeout_s"},
          "tls": {"certfile": "tls_certfile", "keyfile": "tls_keyfile"},
          "registry": {"tracking_uri": "registry_uri", "cache_dir": "registry_cache_dir"}}


def settings_from(cfg: DictConfig):
    """The server's :class:`~serving.api.settings.ServerSettings` from the Hydra config: each
    setting the config gives; one it leaves out is read from the environment
    (``SMART_<NAME>``) or takes the class's default (written there, once)."""
    from omegaconf import OmegaConf

    from security.tls import Security
    from serving.access import read_key_file
    from serving.api.settings import ServerSettings, key_list
    from serving.bundles.signing import BundleTrust

    def block(name: str):
        v = cfg.get(name)
        return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v

    def all_keys(name: str) -> list[str]:
        """``<name>`` (a list, or a comma-separated string) and the keys of
        ``<name>_file``, in that order, each once."""
        got = list(key_list(block(name)))
        path = cfg.get(f"{name}_file")
        if path:
            got += read_key_file(str(path), f"{name}_file")
        return list(dict.fromkeys(got))

    # the config's settings named as ServerSettings fields, passed as given
    values = {k: block(k) for k in ServerSettings.model_fields
              if k in cfg and k not in MADE_HERE}
    for name, fields in BLOCKS.items():
        b = block(name)
        if b is None:
            continue
        if not isinstance(b, dict) or set(b) - set(fields):
            raise ValueError(f"{name}: expected a mapping of {sorted(fields)}, got {b!r}")
        for k, given in b.items():
            v = None if given == "" and name != "announce" else given  # "": no path or URI
            if v is None and name == "announce" and k != "url":  # null: the default
                continue
            values[fields[k]] = v
    security = Security.from_mapping(block("security"))
    # ``main`` warns once for the whole server, bundle verification included
    trust = BundleTrust.from_mapping(block("bundle_trust"), security, warn=False)
    try:
        return ServerSettings(**values, security=security, bundle_trust=trust,
                              **{k: all_keys(k) for k in ("api_keys", "admin_keys",
                                                          "metrics_keys")})
    except ValueError as e:  # name a block's setting by its path in the config file
        problem = e
    msg = str(problem)
    for name, fields in BLOCKS.items():
        for k, field in fields.items():
            if msg.startswith(f"{field}: "):
                raise ValueError(f"{name}.{k}: {msg[len(field) + 2:]}") from None
    raise problem


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
