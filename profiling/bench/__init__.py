"""`tokq bench`: one module per subcommand (service/: the whole service under open-loop load against
baselines/), the load drivers (loadgen.py) and /proc CPU accounting (proc_cpu.py) they share."""
