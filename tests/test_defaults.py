"""The same defaults whichever door a user comes in by: each environment's constructor
(``gym.make`` with no arguments), its config (``configs/env/*.yaml``, what ``train.py`` and
the sweeps compose) and, for ``smart/DSMD-v0``, the policy bundle exporter and the learned
policy (which record and replay the decision order and decoding)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
ENV_CONFIGS = sorted(p.stem for p in (ROOT / "configs" / "env").glob("*.yaml"))

# keys of an env config that are not constructor arguments: the gym id, which data is loaded
# (a constructor defaults to a small built-in scenario or dataset so that gym.make works in
# seconds on a fresh clone; the configs name the experiment's data), the settings of the job
# around the environment (evaluation, tuning, baselines, training), and the DSMD trainer's
# ``env.observation``, which configs/train.yaml sets whatever the env group
NOT_CONSTRUCTOR = {
    "dsmd": {"id"},
    "online": {"id", "name", "dataset", "dataset_overrides", "workers", "cache", "eval_traces",
               "eval_windows", "baselines", "learned", "static_params", "tune", "oracle", "stress",
               "train.demo_traces", "train.val_traces", "train.reward_cost", "observation"},
    "shaping": {"id", "suite", "baselines", "eval_episodes", "val_episodes", "observation"},
    "path_shaping": {"id", "suite", "baselines", "eval_episodes", "val_episodes",
                     "observation"},
    "trees": {"id", "suite", "baselines", "eval_episodes", "val_episodes", "observation"},
    "trees_time": {"id", "suite", "baselines", "eval_episodes", "val_episodes", "observation"},
    "trees_time_knob": {"id", "suite", "baselines", "eval_episodes", "val_episodes",
                        "observation"},
    "trees_time_planner": {"id", "suite", "baselines", "eval_episodes", "val_episodes",
                           "observation", "demo_episodes", "val_baselines"},
    "trees_time_dagger": {"id", "suite", "baselines", "eval_episodes", "val_episodes",
                          "observation", "demo_episodes", "dagger_episodes", "workers",
                          "val_baselines"},
}
# a config that is another's variant: the constructor it configures and the arguments it
# sets away from their defaults on purpose (every other key must still equal its default)
VARIANTS = {"trees_time_knob": ("trees_time", {"action": "knob"}),
            "trees_time_planner": ("trees_time", {"action": "knob"}),
            "trees_time_dagger": ("trees_time", {"action": "knob"})}
# where a config key is passed to the constructor under another name or path
RENAMED = {
    "online": {"control.max_headroom": "max_headroom", "control.max_horizon": "max_horizon",
               "control.executor": "executor", "control.features": "features",
               "train.max_intervals": "max_intervals", "train.warmup": "warmup"},
}


def _env_configs(name: str) -> dict[str, dict[str, Any]]:
    """The ``env`` node of ``configs/env/<name>.yaml``: the file itself, and as ``train.py
    env=<name>`` composes it (with configs/train.yaml's settings)."""
    path = ROOT / "configs" / "env" / f"{name}.yaml"
    raw = OmegaConf.load(path)
    if path.read_text().startswith("# @package _global_"):
        raw = raw.env
    with initialize_config_dir(str(ROOT / "configs"), version_base=None):
        composed = compose("train", overrides=[f"env={name}"]).env
    out = {}
    for label, node in ((str(path.relative_to(ROOT)), raw),
                        (f"train.py env={name}", composed)):
        env = OmegaConf.to_container(node, resolve=False)
        kwargs = env.pop("kwargs", None)  # the sub-problems' constructor arguments
        out[label] = {**env, **(kwargs or {})}
    return out


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and f"{prefix}{k}" not in ("cost", "reward"):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _defaults(fn) -> dict[str, Any]:
    return {k: p.default for k, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _dataclass_defaults(cls) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def _constructor(name: str):
    if name == "dsmd":
        from envs.dsmd.env import DSMDEnv

        return DSMDEnv
    if name == "online":
        from envs.dsmd.online_env import DSMDOnlineEnv

        return DSMDOnlineEnv
    if name == "shaping":
        from envs.shaping.env import ShapingEnv

        return ShapingEnv
    if name == "path_shaping":
        from envs.shaping.path_env import PathShapingEnv

        return PathShapingEnv
    if name == "trees":
        from envs.trees.env import MulticastTreeEnv

        return MulticastTreeEnv
    if name in VARIANTS:
        return _constructor(VARIANTS[name][0])
    if name == "trees_time":
        from envs.trees.env_time import MulticastOverTimeEnv

        return MulticastOverTimeEnv
    pytest.fail(f"configs/env/{name}.yaml has no constructor in tests/test_defaults.py")


def _nested_defaults(name: str, key: str) -> dict[str, Any]:
    """The defaults behind a constructor argument that takes a dict (``None`` = defaults)."""
    if key == "reward" and name == "dsmd":
        from envs.dsmd.reward import RewardConfig

        return _dataclass_defaults(RewardConfig)
    if key == "reward" and name == "shaping":
        from envs.shaping.env import REWARD_DEFAULTS

        return dict(REWARD_DEFAULTS)
    if key == "reward" and name == "path_shaping":
        from envs.shaping.path_env import PATH_REWARD_DEFAULTS

        return dict(PATH_REWARD_DEFAULTS)
    if key == "cost" and name == "online":
        from envs.dsmd.online import OnlineCost

        return _dataclass_defaults(OnlineCost)
    raise AssertionError(f"{name}: no known defaults for the dict argument {key!r}")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b


@pytest.mark.parametrize("name", ENV_CONFIGS)
@pytest.mark.parametrize("source", ["file", "composed"])
def test_env_config_equals_constructor_defaults(name, source):
    cls = _constructor(name)
    defaults = _defaults(cls.__init__)
    skip, renamed = NOT_CONSTRUCTOR.get(name, set()), RENAMED.get(name, {})
    differ, unknown = [], []
    label, config = list(_env_configs(name).items())[0 if source == "file" else 1]
    for key, value in _flatten(config).items():
        if key in skip or any(key.startswith(f"{s}.") for s in skip):
            continue
        arg = renamed.get(key, key)
        if arg == "batch_key" and name == "online":  # read by the trace loader
            from envs.dsmd.online_env import load_online_traces

            default = _defaults(load_online_traces)["batch_key"]
        elif arg not in defaults:
            unknown.append(key)
            continue
        else:
            default = VARIANTS.get(name, ("", {}))[1].get(arg, defaults[arg])
        if isinstance(value, dict) and (default is None or isinstance(default, dict)):
            want = _nested_defaults(name, arg)
            differ += [f"{key}.{k}: config {v!r}, default {want.get(k, '<none>')!r}"
                       for k, v in value.items() if not _same(v, want.get(k))]
        elif not _same(value, default):
            differ.append(f"{key}: config {value!r}, {cls.__name__} default {default!r}")
    assert not unknown, (f"{label}: keys {unknown} are no argument of {cls.__name__}; list "
                         "them in tests/test_defaults.py")
    assert not differ, f"{label} differs from {cls.__name__}'s defaults: {differ}"


def test_bundle_and_policy_defaults_equal_the_environments():
    """The decision order and decoding a bundle records by default, and those a learned policy
    decides with by default, are smart/DSMD-v0's defaults."""
    from agents.learned import ActorPolicy
    from envs.dsmd.env import DSMDEnv

    env = _defaults(DSMDEnv.__init__)
    pol = _defaults(ActorPolicy.__init__)
    assert (pol["order"], pol["decoding"]) == (env["order"], env["decoding"])
    from agents.bundle_export import export_bundle

    exp = _defaults(export_bundle)
    assert (exp["order"], exp["decoding"]) == (env["order"], env["decoding"])
