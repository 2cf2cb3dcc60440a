"""Lean model implementations over the packed (varlen) batch."""
