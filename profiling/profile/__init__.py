"""`tokq profile`: sweep forward passes over batch token counts, fit the latency knee, pick the budget."""
