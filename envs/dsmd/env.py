"""``smart/DSMD-v0``: one step decides the delivery channel of one message type.

A thin gymnasium wrapper over the simulator core (:mod:`envs.dsmd.cost`,
:mod:`envs.dsmd.observation`, :mod:`envs.dsmd.reward`), which does not import gymnasium.

## Description
Each episode is one rate-estimation interval (a *window*) of a scenario's trace, drawn
from the chosen split (train / validation / test, split by time). The window's message
types (destination-hash buckets, Algorithm 1) are decided one per step, largest
``f(m)|D(m)|`` first by default. The final assignment is a solution of DSMD (Eq. 1).

## Action space
``Box(-1, 1, (K+1,), float32)``: one score per channel (0 = RPC, t = MQ topic t), decoded
by :mod:`envs.dsmd.decoding`: ``decoding="feasible"`` (default, as in
``configs/env/dsmd.yaml`` and the exported policy bundles) takes the highest-scoring channel
that keeps Eq. 1's constraints (the argmax if none does), ``"argmax"`` is the paper's plain
argmax; ties are broken uniformly at random by the environment's RNG.
With ``action="discrete"``: ``Discrete(K+1)``, applied as chosen.

## Observation space
``Box(-1, 1, (size,), float32)``; the layout depends on ``observation``
(``paper``, ``paper_type``, ``channel`` (default, as in ``configs/env/dsmd.yaml`` and the
shipped policy bundle)) and is documented in :mod:`envs.dsmd.observation`.

## Reward
Eq. 2 with ``kappa=100``, ``beta=50`` and the variants of :mod:`envs.dsmd.reward`
(default: ``form="delta"``, ``objective="normalized"``, ``node_term="per_node"``).

## Starting state
Every type of the window unassigned (``initial="empty"``), or all on RPC (``"rpc"``; the
episode then re-decides each type).

## Episode end
Terminates after the window's last type; never truncated.

## Info
Every metric of :class:`envs.dsmd.cost.Metrics` for the current assignment, each reward
term, ``window``, ``type`` (instance index just decided), ``channel`` and
``catalog_type``.

## Arguments
``scenario`` (name in ``configs/scenario`` or a :class:`ScenarioSpec`),
``scenario_overrides``, ``split``, ``windows`` (explicit window list), ``observation``,
``action`` (``"box"``/``"discrete"``), ``reward`` (dict of :class:`RewardConfig`),
``order`` (``"rate_desc"``, ``"random"``, ``"index"``), ``decoding`` (``"argmax"``,
``"feasible"``), ``initial``, ``cache_dir``,
``batch_key``, ``problems`` (a prebuilt :class:`ProblemSet`).

## Version history
* v0: initial version.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from .cost import CostState
from .decision import ORDERS, DecisionStep
from .decoding import check_decoding
from .errors import DSMDError
from .instance import RPC
from .observation import ObservationLayout
from .parser import BatchKey
from .problems import DATASETS_DIR, ProblemSet, problems_for
from .reward import RewardConfig, eq2_terms
from .scenarios import ScenarioSpec

__all__ = ["DSMDEnv"]

_REWARD_KEYS = {k: f"reward/{k}" for k in ("objective", "controller_bw_penalty",
                                          "controller_cpu_penalty", "node_penalty", "value")}


class DSMDEnv(gym.Env):
    __doc__ = __doc__
    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 (gym.Env: not a ClassVar)

    def __init__(self, scenario: str | ScenarioSpec = "tiny", *, split: str = "train",
                 windows: list[int] | None = None, observation: str = "channel",
                 action: str = "box", reward: dict | RewardConfig | None = None,
                 order: str = "rate_desc", initial: str = "empty",
                 decoding: str = "feasible", scenario_overrides: dict | None = None,
                 cache_dir: str | Path | None = DATASETS_DIR, batch_key: BatchKey = "hosts",
                 problems: ProblemSet | None = None) -> None:
        super().__init__()
        self.problems = problems if problems is not None else problems_for(
            scenario, scenario_overrides, cache_dir, batch_key)
        if windows is None and split not in self.problems.windows:
            raise DSMDError(f"unknown split '{split}'; expected one of "
                            f"{', '.join(self.problems.windows)}")
        self.windows = list(windows) if windows is not None else self.problems.windows[split]
        empty = [w for w in self.windows if self.problems.instance(w).num_types == 0]
        if empty:
            raise DSMDError(f"windows {empty} have no messages (an episode needs >= 1 type)")
        if not self.windows:
            raise DSMDError(f"split '{split}' of scenario '{self.problems.spec.name}' has no "
                            "windows; lengthen the trace or change the split")
        if isinstance(reward, RewardConfig):
            self.reward_cfg = reward
        else:
            unknown = sorted(set(reward or {}) - set(RewardConfig.__dataclass_fields__))
            if unknown:
                raise DSMDError(f"unknown reward keys {unknown}; expected some of "
                                f"{sorted(RewardConfig.__dataclass_fields__)}")
            self.reward_cfg = RewardConfig(**(reward or {}))
        if action not in ("box", "discrete"):
            raise DSMDError(f"action must be 'box' or 'discrete', got {action!r}")
        if initial not in ("empty", "rpc"):
            raise DSMDError(f"initial must be 'empty' or 'rpc', got {initial!r}")
        if order not in ORDERS:
            raise DSMDError(f"order must be one of {ORDERS}, got {order!r}")
        self.order_mode, self.initial, self.action_mode = order, initial, action
        self.decoding = check_decoding(decoding)
        k = self.problems.spec.num_topics
        self.layout = ObservationLayout(observation, self.problems.catalog_size,
                                        self.problems.num_nodes, k)
        low, high = self.layout.bounds()
        self.observation_space = spaces.Box(low, high, dtype=np.float32)
        self.action_space = (spaces.Box(-1.0, 1.0, (k + 1,), dtype=np.float32)
                             if action == "box" else spaces.Discrete(k + 1))
        self.state: CostState | None = None
        self.decider: DecisionStep | None = None

    # ------------------------------------------------------------------ API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        options = options or {}
        w = options.get("window")
        if w is None:
            w = self.windows[int(self.np_random.integers(len(self.windows)))]
        elif int(w) not in self.windows:
            raise DSMDError(f"window {w} is not one of this environment's windows "
                            f"({self.windows[:8]}{'...' if len(self.windows) > 8 else ''})")
        self.window = int(w)
        self.inst = self.problems.instance(self.window)
        self.state = CostState(self.inst)
        if self.initial == "rpc":
            self.state.assign_all(np.full(self.inst.num_types, RPC))
        # with initial="rpc" the type being decided is taken off RPC first (DecisionStep.
        # observe), so the observation shows the state the decision is made in
        self.decider = DecisionStep(self.inst, self.layout, rng=self.np_random,
                                    order=self.order_mode, decoding=self.decoding,
                                    state=self.state,
                                    progress="step" if self.initial == "rpc" else "decided")
        self.order = self.decider.order
        self._value = eq2_terms(self.state, self.reward_cfg)["value"]
        obs = self.decider.observe()
        return obs, {"window": self.window, "num_types": int(self.inst.num_types)}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        d = self.decider
        if d is None:
            raise DSMDError("call reset() before step()")
        m = d.next_type
        if m is None:
            raise DSMDError("episode is over; call reset()")
        c = d.apply_channel(int(action)) if self.action_mode == "discrete" else d.apply(action)
        done = d.done
        terms = eq2_terms(d.state, self.reward_cfg)
        form = self.reward_cfg.form
        if form == "delta":
            reward = terms["value"] - self._value
        elif form == "dense":
            reward = terms["value"]
        else:
            reward = terms["value"] if done else 0.0
        self._value = terms["value"]
        info = d.state.metrics().as_dict()  # the assignment the reward describes
        for k, v in terms.items():
            info[_REWARD_KEYS[k]] = v
        obs = d.observe()
        catalog = self.inst.catalog_index
        assert catalog is not None  # filled in DSMDInstance.__post_init__
        info.update(window=self.window, type=m, channel=c, catalog_type=int(catalog[m]))
        return obs, float(reward), done, False, info

    # ------------------------------------------------------------------ helpers
    @property
    def next_type(self) -> int | None:
        """The instance index of the type the next step decides (None when the episode is
        over)."""
        return None if self.decider is None else self.decider.next_type

    def final_metrics(self) -> dict:
        if self.state is None:
            raise DSMDError("call reset() first")
        return self.state.metrics().as_dict()
