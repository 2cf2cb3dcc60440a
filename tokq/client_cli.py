"""`tokq embed` and `tokq rerank`: call a running gateway and print the result as JSON."""

from __future__ import annotations

import json
import math
import sys

import click

from tokq.queue.priority import PRIORITIES


def _pem(path: str, flag: str, env: str) -> bytes:
    """A PEM file's bytes, or one usage-error line naming the flag."""
    from tokq.client import read_pem

    try:
        return read_pem(path)
    except ValueError as exc:
        raise click.UsageError(f"{flag} {exc} ({env})") from None


def _credentials(tls_ca: str | None, tls_cert: str | None, tls_key: str | None):
    """TLS channel credentials from the flags, None (plaintext) when none is given."""
    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("--tls-cert and --tls-key go together (env TOKQ_CLIENT_TLS_CERT/"
                               "TOKQ_CLIENT_TLS_KEY)")
    if not (tls_ca or tls_cert):
        return None
    import grpc

    # No --tls-ca: the system's roots verify the gateway (a certificate from a public CA).
    return grpc.ssl_channel_credentials(
        root_certificates=_pem(tls_ca, "--tls-ca", "TOKQ_TLS_CA") if tls_ca else None,
        private_key=_pem(tls_key, "--tls-key", "TOKQ_CLIENT_TLS_KEY") if tls_key else None,
        certificate_chain=_pem(tls_cert, "--tls-cert", "TOKQ_CLIENT_TLS_CERT") if tls_cert else None)


def _timeout(ctx, param, value: float) -> float:
    if math.isnan(value):  # FloatRange lets NaN through: it compares false with every bound
        raise click.BadParameter("nan is not a number of seconds")
    return value


def priority_option(default: str | None, help: str):
    return click.option("--priority", type=click.Choice(PRIORITIES), default=default,
                        show_default=default is not None, help=help)


def target_option(f):
    return click.option("--target", default="localhost:50051", show_default=True, envvar="TOKQ_TARGET",
                        help="gateway address host:port ([::1]:50051 for IPv6)")(f)


def access_options(f):
    """--api-key and the client's TLS files, shared by every command that calls a gateway."""
    # Not TOKQ_TLS_CERT/TOKQ_TLS_KEY: those are the gateway's own certificate (tokq gateway, tokq up).
    for option in reversed([
        click.option("--api-key", envvar="TOKQ_API_KEY", help="for a gateway started with --api-key (sent as "
                     "a bearer token); prefer the env var: a flag is visible in ps"),
        click.option("--tls-ca", envvar="TOKQ_TLS_CA", metavar="FILE",
                     help="PEM roots that verify a gateway serving TLS (tokq gateway --tls-cert)"),
        click.option("--tls-cert", envvar="TOKQ_CLIENT_TLS_CERT", metavar="FILE",
                     help="PEM client certificate, for a gateway with --tls-client-ca (mutual TLS; needs --tls-key)"),
        click.option("--tls-key", envvar="TOKQ_CLIENT_TLS_KEY", metavar="FILE", help="PEM private key of --tls-cert"),
    ]):
        f = option(f)
    return f


def client_factory(target, model, api_key, tls_ca, tls_cert, tls_key, client_class=None):
    """Reads the TLS files now; returns what makes a Client (or ``client_class``) for the
    command's options. A bad file or key is a usage error."""
    from tokq.client import Client

    credentials = _credentials(tls_ca, tls_cert, tls_key)

    def make():
        try:
            return (client_class or Client)(target, credentials=credentials, model=model,
                                            api_key=api_key or None)
        except (ValueError, TypeError) as exc:  # e.g. a key holding a newline or non-ASCII character
            raise click.UsageError(f"{exc} (--api-key / TOKQ_API_KEY)") from None
    return make


@click.command("embed")
@click.argument("texts", nargs=-1, required=True)
@target_option
@click.option("--dimensions", type=click.IntRange(min=1, max=2**32 - 1), help="Matryoshka truncation")
@click.option("--prompt-name", help="a prompt the model defines, e.g. query")
@click.option("--truncate/--no-truncate", default=False, help="cut over-long inputs to the model's limit")
@click.option("--normalize/--no-normalize", default=True, help="unit-length embeddings (default)")
@click.option("--model", default="", help="the served model's name (needed where the gateway serves several)")
@priority_option(None, "the queue class: batch work takes the room interactive work leaves "
                 "(default: the API key's, else interactive)")
@access_options
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              callback=_timeout, help="seconds (inf: none of its own, the gateway's default applies)")
def embed_command(texts, target, dimensions, prompt_name, truncate, normalize, model, priority, api_key,
                  tls_ca, tls_cert, tls_key, timeout) -> None:
    """Embed TEXTS with the gateway at --target and print JSON."""
    from tokq.client import TokqError

    with client_factory(target, model, api_key, tls_ca, tls_cert, tls_key)() as client:
        try:
            out = client.embed_full(list(texts), truncate=truncate, normalize=normalize,
                                    dimensions=dimensions, prompt_name=prompt_name, timeout=timeout,
                                    priority=priority)
        except TokqError as exc:
            click.echo(json.dumps({"error": {"code": exc.code.name, "message": exc.message}}), err=True)
            sys.exit(1)
        except (ValueError, TypeError) as exc:  # refused before sending, e.g. text not UTF-8
            raise click.UsageError(str(exc)) from None
    click.echo(json.dumps({
        "model": out.model,
        "embeddings": [[round(float(x), 7) for x in row] for row in out.vectors],
        "usage": {"prompt_tokens": out.prompt_tokens},
        "timing": out.timing,
    }))


@click.command("rerank")
@click.argument("query")
@click.argument("documents", nargs=-1, required=True)
@target_option
@click.option("--top-n", type=click.IntRange(min=1, max=2**32 - 1), help="print only the best N results")
@click.option("--raw-scores", is_flag=True, help="the model's raw logits, without its activation")
@click.option("--return-documents", is_flag=True, help="print each result's document")
@click.option("--truncate/--no-truncate", default=False, help="cut over-long pairs to the model's limit")
@click.option("--model", default="", help="the served reranker's name (needed where the gateway serves several)")
@priority_option(None, "the queue class: batch work takes the room interactive work leaves "
                 "(default: the API key's, else interactive)")
@access_options
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              callback=_timeout, help="seconds (inf: none of its own, the gateway's default applies)")
def rerank_command(query, documents, target, top_n, raw_scores, return_documents, truncate, model, priority,
                   api_key, tls_ca, tls_cert, tls_key, timeout) -> None:
    """Score DOCUMENTS by relevance to QUERY with the reranker at --target; print JSON, best first."""
    from tokq.client import TokqError

    with client_factory(target, model, api_key, tls_ca, tls_cert, tls_key)() as client:
        try:
            out = client.rerank_full(query, list(documents), top_n=top_n, raw_scores=raw_scores,
                                     return_documents=return_documents, truncate=truncate, timeout=timeout,
                                     priority=priority)
        except TokqError as exc:
            click.echo(json.dumps({"error": {"code": exc.code.name, "message": exc.message}}), err=True)
            sys.exit(1)
        except (ValueError, TypeError) as exc:  # refused before sending, e.g. text not UTF-8
            raise click.UsageError(str(exc)) from None
    results = []
    for r in out.results:
        results.append({"index": r.index, "score": round(float(r.score), 7)}
                       | ({"document": r.document} if r.document is not None else {}))
    click.echo(json.dumps({"model": out.model, "results": results,
                           "usage": {"prompt_tokens": out.prompt_tokens}, "timing": out.timing}))
