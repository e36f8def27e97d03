"""Serving the DSMD policy (SMART Section V-D, online execution): the FastAPI policy server
(:mod:`serving.app`, started by ``serve.py``) and the thin controller adapter
(:mod:`serving.client.static`, remote and Stemflow-style cached modes).

Both decide with one engine (:mod:`serving.session`): the simulator's cost model
(:class:`envs.dsmd.cost.CostState`), observation builder and decoder, and the exported
policy bundle run by ONNX Runtime (:mod:`serving.bundles.static`). Nothing here imports RLlib,
torch, gymnasium or :mod:`agents` (``tests/test_install_groups.py``).

The online policy (a plan at every interval boundary from the session's own history) is
served the same way: the endpoints of :mod:`serving.api.online` and the adapter of
:mod:`serving.client.online` share one engine, :mod:`serving.online_session`, which scores
every interval with the simulator itself (``docs/serving-online.md``).
"""
