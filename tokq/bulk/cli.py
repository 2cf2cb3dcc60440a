"""`tokq embed-file INPUT --out OUTPUT`: embed a file's rows through a running gateway."""

from __future__ import annotations

import asyncio
import sys

import click

from tokq.client_cli import _timeout, access_options, client_factory, priority_option, target_option

EXIT_ROWS_FAILED = 3  # finished, some rows in the errors file
EXIT_INTERRUPTED = 130


@click.command("embed-file")
@click.argument("input_path", metavar="INPUT",
                type=click.Path(exists=True, dir_okay=False, readable=True))
@click.option("--out", "output", required=True, type=click.Path(dir_okay=False),
              help="OUTPUT: .parquet (id or row column, embedding column) or .npy (float32 rows)")
@click.option("--text-field", default="text", show_default=True,
              help="the field or column holding the text (.jsonl, .csv, .parquet)")
@click.option("--id-field", help="a field or column copied to the output's id column (default: a row column)")
@target_option
@click.option("--dimensions", type=click.IntRange(min=1, max=2**32 - 1), help="Matryoshka truncation")
@click.option("--prompt-name", help="a prompt the model defines, e.g. document")
@click.option("--truncate/--no-truncate", default=False,
              help="cut over-long inputs to the model's limit (default: such rows fail)")
@click.option("--normalize/--no-normalize", default=True, help="unit-length embeddings (default)")
@click.option("--model", default="", help="the served model's name (needed where the gateway serves several)")
@priority_option("batch", "the queue class: batch takes the room live queries leave; interactive "
                 "competes with them")
@access_options
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              callback=_timeout, help="each request's deadline in seconds")
@click.option("--retry-for", type=click.FloatRange(min=0), default=300.0, show_default=True,
              callback=_timeout, help="seconds a gateway that answers nothing is retried before the job stops")
@click.option("--commit-rows", type=click.IntRange(min=1, max=1_000_000), default=2048, show_default=True,
              help="rows per committed part: a crash costs only the parts in flight")
@click.option("--overwrite", is_flag=True, help="replace an output (or parts) of another input or other options")
def embed_file_command(input_path, output, text_field, id_field, target, dimensions, prompt_name, truncate,
                       normalize, model, priority, api_key, tls_ca, tls_cert, tls_key, timeout, retry_for,
                       commit_rows, overwrite) -> None:
    """Embed every row of INPUT (.txt, .jsonl, .csv, .parquet) into OUTPUT, in input order.

    Rerun the same command after a crash or Ctrl-C: it continues from the rows committed in
    OUTPUT.tokq-parts/. Rows that fail go to OUTPUT.errors.jsonl; the exit code is then 3.
    """
    from tokq.bulk.job import JobSpec, run_job
    from tokq.bulk.send import BulkError, EmbedOptions, TargetDown
    from tokq.bulk.sources import SourceError
    from tokq.bulk.store import StoreError, errors_path, parts_path
    from tokq.client import AsyncClient

    connect = client_factory(target, model, api_key, tls_ca, tls_cert, tls_key, client_class=AsyncClient)
    spec = JobSpec(input_path, output, text_field=text_field, id_field=id_field or None, model=model,
                   options=EmbedOptions(dimensions=dimensions, prompt_name=prompt_name, truncate=truncate,
                                        normalize=normalize, priority=priority, timeout_s=timeout,
                                        retry_for_s=retry_for),
                   rows_per_part=commit_rows, overwrite=overwrite)

    try:
        result = asyncio.run(run_job(spec, connect, target=target))
    except KeyboardInterrupt:
        click.echo(f"embed-file: stopped; committed rows are kept in {parts_path(output)}: rerun the "
                   "same command to continue", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except TargetDown as exc:
        click.echo(f"embed-file: the gateway at {target} did not answer: {exc}; committed rows are kept: "
                   "rerun the same command to continue", err=True)
        sys.exit(1)
    except (BulkError, SourceError, StoreError) as exc:
        click.echo(f"embed-file: {exc}", err=True)
        sys.exit(1)
    except OSError as exc:  # e.g. the disk filled up while writing a part or the output
        click.echo(f"embed-file: {exc}; committed rows are kept: rerun the same command to continue", err=True)
        sys.exit(1)
    done = result.finished
    if result.already_done:
        summary = f"{output} is already complete: {done.rows:,} rows"
    else:
        summary = (f"wrote {output}: {done.rows:,} rows ({result.rows_this_run:,} this run"
                   + (f", {result.resumed_rows:,} committed before" if result.resumed_rows else "")
                   + f") in {result.seconds:.1f} s")
    if done.failed:
        summary += f"; {done.failed:,} rows failed, listed in {errors_path(output)}"
    click.echo(summary)
    sys.exit(EXIT_ROWS_FAILED if done.failed else 0)
