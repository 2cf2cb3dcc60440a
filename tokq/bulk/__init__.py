"""Bulk embedding through a tokq fleet: `tokq embed-file` (tokq.bulk.cli) and the column embedder
the Daft and Ray Data integrations share (tokq.bulk.column). docs/bulk.md describes both."""
