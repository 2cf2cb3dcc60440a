"""Numbers as the profile's report, table, results file block and figure print them."""

from __future__ import annotations


def plain(value: float, digits: int = 4) -> str:
    """``value`` to ``digits`` significant figures with thousands separators: 0.93 -> '0.93',
    22 -> '22', but 10000 -> '10,000', where ``:g`` alone writes '1e+04'."""
    text = f"{value:,.{digits}g}"
    # :g turns to e-notation from 10**digits up; whole units are precise enough there. Tiny
    # values keep theirs ('1e-06'): written out they would be all zeros.
    return f"{value:,.0f}" if "e+" in text else text
