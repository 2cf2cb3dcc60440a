"""What tokq knows about a model without loading its weights: where its files are (source), its
config (info), its fingerprint (fingerprint) and what a forward computes (flops)."""
