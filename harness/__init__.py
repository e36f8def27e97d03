"""Real components started and stopped on loopback for the tests, the benchmarks, the
testbed and local runs (not part of a deployment):

- :mod:`harness.broker`: a standalone Apache Pulsar broker (``python -m harness.broker
  fetch|start|stop``; :class:`~harness.broker.PulsarStandalone` in Python), with TLS and
  authorisation from the project's PKI;
- :mod:`harness.pulsar_cluster`: a small Pulsar cluster (a metadata store, bookies and
  brokers) for the failover tests and benchmark.
"""
