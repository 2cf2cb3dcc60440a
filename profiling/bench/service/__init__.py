"""`tokq bench service`: open-loop load through the whole service against baselines (cli: the
command; systems: starting them; run: driving them; report, plots: its results sections and figures)."""
