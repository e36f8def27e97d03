"""Demonstrations (DDPGfD): a baseline's decisions replayed through the environment."""

from __future__ import annotations

import numpy as np

from agents.demonstrations import demonstrations
from agents.greedy import GreedyLocalSearch
from envs.dsmd.cost import CostState

ENV = {"observation": "channel", "reward": {}, "order": "rate_desc", "decoding": "feasible",
       "initial": "empty"}


def test_replayed_demonstrations_reproduce_the_baseline(tiny_problems):
    d = demonstrations(GreedyLocalSearch(), tiny_problems, ENV)
    windows = tiny_problems.windows["train"]
    sizes = [tiny_problems.instance(w).num_types for w in windows]
    assert len(d["obs"]) == sum(sizes) and d["terminateds"].sum() == len(windows)
    assert set(np.unique(d["actions"])) == {-1.0, 1.0}
    assert (d["actions"] == 1.0).sum(axis=1).tolist() == [1] * len(d["obs"])
    np.testing.assert_array_equal(d["obs"][1:sizes[0]], d["next_obs"][:sizes[0] - 1])
    # the episode return telescopes to Eq. 2 of greedy's assignment (delta reward)
    from envs.dsmd.reward import RewardConfig, eq2_terms

    inst = tiny_problems.instance(windows[0])
    ch = GreedyLocalSearch().assign(inst)
    if CostState(inst, ch).metrics().feasible:
        ret = d["rewards"][:sizes[0]].sum()
        start = eq2_terms(CostState(inst), RewardConfig())["value"]
        end = eq2_terms(CostState(inst, ch), RewardConfig())["value"]
        assert abs(ret - (end - start)) < 1e-3
