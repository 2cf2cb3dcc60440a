"""`tokq profile`: sweep forward passes over batch token counts, fit the latency knee, pick the token
budget (cli: the command; sweep: the timing; batches: what is timed; knee: the fit and the budget;
run: sweep + fit + report; plot: the figure)."""
