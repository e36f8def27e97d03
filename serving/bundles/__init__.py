"""Policy bundles: the files a trained policy is served from.

- :mod:`serving.bundles.format`: what both kinds hold, their errors, the one metadata reader
  and the one hash helper;
- :mod:`serving.bundles.signing`: Ed25519 signatures, the signed serial that refuses
  rollback, the revocation list, and the verified in-memory copy both loaders read from;
- :mod:`serving.bundles.static`: the static policy's bundle (the per-type channel actor) and
  the one ONNX Runtime session builder;
- :mod:`serving.bundles.online`: the online policy's bundle (the knob actor and its
  executor's settings);
- :mod:`serving.bundles.registry`: bundles from an MLflow model registry
  (``models:/<name>@<alias>``).

No module here imports one that imports it back (``tests/test_layering.py``)."""
