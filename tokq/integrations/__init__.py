"""tokq fleets inside dataframe engines: ``tokq.integrations.daft`` (a Daft class) and
``tokq.integrations.ray`` (a Ray Data callable class). Each sends a text column through the
same client as `tokq embed-file` (tokq.bulk.column.ColumnEmbedder), with tokens in flight
bounded per actor. Neither engine is a tokq dependency: install the one you use."""

from __future__ import annotations

import grpc


def credentials_from(tls_ca: str | None, tls_cert: str | None, tls_key: str | None):
    """TLS credentials from PEM file paths (read where the actor runs), None for plaintext."""
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("tls_cert and tls_key go together")
    if not (tls_ca or tls_cert):
        return None
    from tokq.client import read_pem

    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(tls_ca) if tls_ca else None,
        private_key=read_pem(tls_key) if tls_key else None,
        certificate_chain=read_pem(tls_cert) if tls_cert else None)
