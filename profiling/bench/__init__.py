"""`tokq bench`: the benchmarks, one module per subcommand (service/: the whole service
under open-loop load against baselines/), with the open-loop load generator they share."""
