"""Solvers and baselines of the multicast sub-problem (Optimal Multicast, Zhu et al.): Theorem 1,
Algorithm 1 / Corollary 3 (:mod:`.solver`), the baselines of Section VII (:mod:`.baselines`),
the learning contract's suite (:mod:`.suite`) and the Figs. 8-11 reproduction
(:mod:`.experiment`)."""
