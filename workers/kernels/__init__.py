"""The CPU kernels (C sources compiled on the worker's machine at first use) and their builder."""
