"""`tokq bench service`: open-loop load through the whole service against baselines (cli: the
command; systems: starting them; run: driving them; report, plots: the results section and figures;
budget: the profiled budget against fixed ones)."""
