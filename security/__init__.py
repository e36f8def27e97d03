"""Transport security shared by every channel of the project.

* :mod:`security.pki`: the development certificate authority and the identities
  (certificate + key) of each component, created on demand outside the repository;
* :mod:`security.tls`: :class:`Security`, the one setting every component takes (a PKI
  directory, or explicit files, or the ``insecure`` debugging flag), and the gRPC helpers
  that turn it into credentials and read a peer's identity back.

Identity convention: a certificate's common name is its *principal* (``controller``,
``agent-17``, ``broker``, ``policy-server``, ``admin``); its role is the URI subject
alternative name ``spiffe://smart-dsmd/<role>/<name>``. Pulsar's TLS authentication uses the
common name as the role it authorises.
"""

import os

# gRPC's C core logs every refused TLS handshake at INFO on stderr; the refusals that matter
# are logged by the services themselves. Set before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from security.pki import Pki, PkiError, TlsIdentity, default_pki_dir
from security.tls import Security, SecurityError, peer_principal

__all__ = ["Pki", "PkiError", "Security", "SecurityError", "TlsIdentity", "default_pki_dir",
           "peer_principal"]
