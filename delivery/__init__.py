"""The real dual-channel delivery runtime: RPC (gRPC) and MQ (Apache Pulsar) channels."""
