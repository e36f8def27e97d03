"""The shaping sub-problem's agents side: the learning contract's suite (baselines on
``smart/Shaping-v0``) and the reproduction of Sincon's Figs. 5-6 (:mod:`.experiment`)."""
