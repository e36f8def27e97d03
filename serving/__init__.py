"""Serving the DSMD policy (SMART Section V-D, online execution): the FastAPI policy server
(:mod:`serving.app`, started by ``serve.py``) and the thin controller adapter
(:mod:`serving.adapter`, remote and Stemflow-style cached modes).

Both decide with one engine (:mod:`serving.session`): the simulator's cost model
(:class:`envs.dsmd.cost.CostState`), observation builder and decoder, and the exported
policy bundle run by ONNX Runtime (:mod:`agents.bundle`). Nothing here imports RLlib or
torch.
"""
