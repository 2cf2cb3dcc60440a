"""``python -m tokq.profiling.bench.baselines``: serve one baseline until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import signal

import click

from tokq.address import host_port


@click.command()
@click.option("--kind", type=click.Choice(["one-at-a-time", "onnx-one-at-a-time", "padded-batching"]), required=True)
@click.option("--port", type=int, required=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--model", "model_path", default=None, help="model directory [default: bundled all-MiniLM-L6-v2]")
@click.option("--device", default="cpu", show_default=True, help="sentence-transformers baselines: cpu | cuda | cuda:N")
@click.option("--max-batch-size", type=int, default=64, show_default=True, help="padded-batching: inputs per batch")
@click.option("--max-wait-ms", type=float, default=10.0, show_default=True,
              help="padded-batching: longest a request waits for its batch to fill")
@click.option("--onnx-dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="onnx-one-at-a-time: directory of the ONNX export (model.onnx + tokenizer)")
@click.option("--threads", type=int, default=None,
              help="onnx-one-at-a-time: ONNX Runtime intra-op threads [default: OMP_NUM_THREADS, else its own choice]")
def main(kind, port, host, model_path, device, max_batch_size, max_wait_ms, onnx_dir, threads) -> None:
    from tokq.profiling.bench.baselines.runners import ONNX_ONE_AT_A_TIME, make_runner
    from tokq.profiling.bench.baselines.server import load_model, serve

    if kind == ONNX_ONE_AT_A_TIME:
        import os
        from pathlib import Path

        from tokq.model.info import ModelInfo
        from tokq.profiling.bench.baselines.onnx_model import OnnxSentenceEncoder

        if not onnx_dir:
            raise click.UsageError("--kind onnx-one-at-a-time needs --onnx-dir")
        threads = threads if threads is not None else int(os.environ.get("OMP_NUM_THREADS", "0"))
        model = OnnxSentenceEncoder(Path(onnx_dir), threads=threads,
                                    max_seq_length=ModelInfo.load(model_path).max_length)
    else:
        model = load_model(model_path, device)
    # Warm up at the largest batch this server will run, as tokq's workers do.
    model.encode(["warm up the kernels"] * max_batch_size, batch_size=max_batch_size)
    runner = make_runner(kind, model, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(runner, model, port=port, host=host, stop=stop, on_ready=lambda p: click.echo(
            f"baseline {kind} serving on {host_port(host, p)}", err=True))

    asyncio.run(run())


if __name__ == "__main__":
    main()
