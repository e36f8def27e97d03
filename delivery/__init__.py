"""The real dual-channel delivery runtime: RPC (gRPC) and MQ (Apache Pulsar) channels."""

import os

# gRPC's C core logs every refused TLS handshake at INFO on stderr; the refusals that matter
# are logged by the services themselves (security.tls). Set before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
