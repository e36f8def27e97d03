"""Policies (baselines, exact optimum and RLlib DDPG),
evaluation, experiments and tracking. Imports ``envs`` and the bundle runtime
(``serving.bundles.static``, ``serving.bundles.online``: the format its exporter writes); never the
rest of ``serving``, nor ``delivery``."""
