"""`tokq bench NAME`: one subcommand per benchmark, each imported only when called. With
``--results-md`` each rewrites its own section of its topic's file in profiling/results/."""

from __future__ import annotations

import click

from tokq.cli import LazyGroup

# subcommand -> "module:attribute" of its click.Command, by the results file its section goes to
COMMANDS = {
    # profiling/results/queue.md: the queue's scripts on Redis
    "queue": "tokq.profiling.bench.queue:queue_command",
    "shards": "tokq.profiling.bench.shards:shards_command",
    # model.md: the forward on a CPU (with `tokq profile`)
    "runtime": "tokq.profiling.bench.runtime:runtime_command",
    "dtypes": "tokq.profiling.bench.dtypes:dtypes_command",
    "linear": "tokq.profiling.bench.linear:linear_command",
    "prefix": "tokq.profiling.bench.prefix:prefix_command",
    # gateway.md: what a call costs the gateway's process
    "gateway-cpu": "tokq.profiling.bench.gateway_cpu:gateway_cpu_command",
    "http-cpu": "tokq.profiling.bench.http_cpu:http_cpu_command",
    "spread": "tokq.profiling.bench.spread:spread_command",
    # service.md: the whole service under load, abuse and faults
    "service": "tokq.profiling.bench.service.cli:service_command",
    "report": "tokq.profiling.bench.service.report:report_command",
    "hostile": "tokq.profiling.bench.hostile:hostile_command",
    "crash-recovery": "tokq.profiling.bench.crash_recovery:crash_recovery_command",
    "idle-workers": "tokq.profiling.bench.idle_workers:idle_workers_command",
    "rerank": "tokq.profiling.bench.rerank:rerank_command",  # rerank.md: rerankers and fairness beside Embed
    "bulk": "tokq.profiling.bench.bulk:bulk_command",  # bulk.md: embed-file, live queries beside a bulk job
    # gpu.md: on a CUDA GPU (prefix --device cuda too)
    "gpu": "tokq.profiling.bench.gpu:gpu_command",
    "graphs": "tokq.profiling.bench.graphs:graphs_command",
}


@click.group("bench", cls=LazyGroup, lazy=COMMANDS)
def bench_group() -> None:
    """Benchmarks: each prints ratios against a baseline measured in the same run, and with
    --results-md rewrites its own section of profiling/results/TOPIC.md."""
