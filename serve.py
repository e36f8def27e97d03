"""Policy server: `python serve.py` (Hydra; see configs/serve.yaml and serving/app.py)."""

import hydra
from omegaconf import DictConfig

import agents.config  # noqa: F401  (registers the ${project_root:} resolver)
from envs.quiet import quiet

quiet()  # known third-party log noise off, before Ray and torch load (envs/quiet.py)


def settings_from(cfg: DictConfig):
    from serving.announce import DEFAULT_TOPIC
    from serving.app import ServerSettings

    def keys(v) -> list[str]:
        if v is None:
            return []
        items = v.split(",") if isinstance(v, str) else list(v)
        return [str(k).strip() for k in items if str(k).strip()]

    ann = cfg.get("announce") or {}
    unknown = sorted(set(ann) - {"url", "topic", "send_timeout_s"})
    if unknown:
        raise ValueError(f"announce.{unknown[0]}: unknown setting (announce takes url, topic "
                         "and send_timeout_s)")
    try:
        send_timeout_s = float(ann.get("send_timeout_s", 2.0))
    except (TypeError, ValueError):
        raise ValueError(f"announce.send_timeout_s must be a number of seconds, got "
                         f"{ann.get('send_timeout_s')!r}") from None
    return ServerSettings(bundle=cfg.bundle, online_bundle=cfg.get("online_bundle"),
                          api_keys=keys(cfg.api_keys),
                          admin_keys=keys(cfg.admin_keys), auth=bool(cfg.auth),
                          fallback=cfg.fallback, max_body_bytes=int(cfg.max_body_bytes),
                          max_batch=int(cfg.max_batch), max_sessions=int(cfg.max_sessions),
                          max_types=int(cfg.max_types), watch=bool(cfg.watch),
                          watch_period_s=float(cfg.watch_period_s),
                          require_policy=bool(cfg.require_policy),
                          freeze_gc=bool(cfg.freeze_gc),
                          batch_threads=None if cfg.get("batch_threads") is None
                          else int(cfg.batch_threads),
                          announce_url=ann.get("url"),
                          announce_topic=ann.get("topic", DEFAULT_TOPIC),
                          announce_send_timeout_s=send_timeout_s)


@hydra.main(config_path="configs", config_name="serve", version_base="1.3")
def main(cfg: DictConfig) -> None:
    import uvicorn

    from serving.app import create_app

    app = create_app(settings_from(cfg))
    uvicorn.run(app, host=cfg.host, port=int(cfg.port), log_level=cfg.log_level)


if __name__ == "__main__":
    main()
