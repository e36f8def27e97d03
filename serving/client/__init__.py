"""The controller's side of serving: the thin adapters a live controller imports.

- :mod:`serving.client.static`: :class:`~serving.client.static.ControllerAdapter`, a channel
  for every message type of the static problem;
- :mod:`serving.client.online`: :class:`~serving.client.online.OnlineAdapter`, the plan at
  every interval boundary and a channel for every message;
- :mod:`serving.client.transport`: what both share: the HTTP client with its retries and
  circuit breaker, the download of a policy bundle into the atomic bundle cache, and the
  background refresh;
- :mod:`serving.client.subscriber`: the announcements' subscriber (new policy versions,
  channel health), over Pulsar.
"""
