"""Policies (baselines, exact optimum, and -- from the training issue -- RLlib DDPG),
evaluation, experiments and tracking. Imports ``envs``; never ``serving`` or ``delivery``."""
