"""The policy server's API, as FastAPI routers over one :class:`~serving.api.server.PolicyServer`
(``serving.app.create_app`` puts them together):

- :mod:`serving.api.settings`: :class:`~serving.api.settings.ServerSettings`;
- :mod:`serving.api.server`: the server's state and shared steps, the routers' dependency;
- :mod:`serving.api.errors`: the body limit, the list limits and the exception handlers;
- :mod:`serving.api.health`: liveness, readiness and the Prometheus metrics;
- :mod:`serving.api.policy`: the static policy (read, download, swap);
- :mod:`serving.api.sessions`: the static sessions, rates and decisions;
- :mod:`serving.api.online`: the online policy, sessions and intervals.
"""
