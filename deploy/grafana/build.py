"""tokq's Grafana dashboards as code (grafana-foundation-sdk): writes dashboards/*.json.

    .venv/bin/python deploy/grafana/build.py           # regenerate the committed JSON
    .venv/bin/python deploy/grafana/build.py --check   # exit 1 if the committed JSON is stale

Every query reads only metrics that tokq.metrics defines (tests/deploy/test_grafana_dashboards.py checks
it). Panels pick their Prometheus through the ``datasource`` variable and filter by ``model``,
so the same JSON works provisioned (deploy/grafana/provisioning) or imported by hand.
Queue metrics are exported once per model (by one elected gateway process), so they add up
like every other metric: sum over processes; only the oldest-entry age takes max.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import heatmap, prometheus, timeseries
from grafana_foundation_sdk.builders.common import VizLegendOptions
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUT_DIR = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
M = 'model=~"$model"'
W = 'model=~"$model", worker=~"$worker"'
# tokq.metrics.ERROR_CODES: the service failed, not the caller
SERVER_ERRORS = 'code=~"UNKNOWN|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED|INTERNAL|UNAVAILABLE|DATA_LOSS"'
# model="": calls refused before they named a served model, the caller's fault whatever the code
ROUTED = 'model!=""'
EMBED_RPCS = 'rpc=~"Embed|http.Embeddings"'  # the Embed call over gRPC and HTTP
RERANK_RPCS = 'rpc=~"Rerank|http.Rerank"'  # the Rerank call over gRPC and HTTP


def query(expr: str, legend: str, ref_id: str = "A") -> prometheus.Dataquery:
    return (prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref_id)
            .datasource(DATASOURCE).range())


def quantiles(metric: str, by: str, where: str, legend: str,
              qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[prometheus.Dataquery]:
    """One histogram_quantile query per quantile, over the rate of ``metric``'s buckets."""
    out = []
    for i, q in enumerate(qs):
        expr = (f"histogram_quantile({q}, sum by ({by}le) "
                f"(rate({metric}_bucket{{{where}}}[{RATE}])))")
        out.append(query(expr, legend.format(q=f"p{round(q * 100)}"), chr(ord("A") + i)))
    return out


def panel(title: str, description: str, unit: str, targets: list[prometheus.Dataquery], *,
          span: int = 12, min_val: float | None = 0, max_val: float | None = None,
          table_legend: bool = False) -> timeseries.Panel:
    p = (timeseries.Panel().title(title).description(description).unit(unit)
         .datasource(DATASOURCE).span(span).height(8).targets(targets).fill_opacity(10))
    if min_val is not None:
        p = p.min(min_val)
    if max_val is not None:
        p = p.max(max_val)
    legend = VizLegendOptions().show_legend(True)
    if table_legend:
        legend = legend.display_mode(LegendDisplayMode.TABLE).placement(LegendPlacement.RIGHT)
    else:
        legend = legend.display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
    return p.legend(legend)


def variables(with_worker: bool) -> list:
    out = [
        gd.DatasourceVariable("datasource").label("Prometheus").type("prometheus"),
        gd.QueryVariable("model").label("Model").datasource(DATASOURCE)
        .query("label_values(tokq_queue_queued_tokens, model)")
        .multi(True).include_all(True).all_value(".*").refresh(VariableRefresh.ON_TIME_RANGE_CHANGED),
    ]
    if with_worker:
        out.append(gd.QueryVariable("worker").label("Worker").datasource(DATASOURCE)
                   .query(f"label_values(tokq_worker_batches_total{{{M}}}, worker)")
                   .multi(True).include_all(True).all_value(".*")
                   .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED))
    return out


def base(uid: str, title: str, description: str, with_worker: bool) -> gd.Dashboard:
    return (gd.Dashboard(title).uid(uid).description(description).tags(["tokq"])
            .time("now-1h", "now").refresh("30s").timezone("browser").editable()
            .variables(variables(with_worker)))


def overview() -> gd.Dashboard:
    req = f"tokq_gateway_requests_total{{{M}}}"
    # "or vector(0)": no failed request is 0 %, not an empty graph
    server_errors = (f"(sum(rate(tokq_gateway_requests_total{{{M}, {ROUTED}, {SERVER_ERRORS}}}[{RATE}])) "
                     "or vector(0))")
    return (
        base("tokq-overview", "tokq / Overview",
             "Requests, latency and the queue: is tokq keeping up?", with_worker=False)
        .with_row(gd.Row("Requests"))
        .with_panel(panel("Request rate", "Finished RPCs per second, by RPC and gRPC status.",
                          "reqps", [query(f"sum by (rpc, code) (rate({req}[{RATE}]))",
                                          "{{rpc}} {{code}}")]))
        .with_panel(panel(
            "Error rate", "Share of requests that failed: server errors (tokq's fault) and "
            "client errors (bad input, unknown model, no API key).", "percentunit",
            [query(f"{server_errors} / sum(rate({req}[{RATE}]))", "server errors"),
             query(f'((sum(rate(tokq_gateway_requests_total{{{M}, code!="OK"}}[{RATE}])) or vector(0)) '
                   f"- {server_errors}) / sum(rate({req}[{RATE}]))", "client errors", "B")]))
        .with_panel(panel("Embed latency", "Whole Embed call (gRPC and HTTP) as the gateway saw it.",
                          "s", quantiles("tokq_gateway_request_duration_seconds", "",
                                         f"{M}, {EMBED_RPCS}", "{q}")))
        .with_panel(panel(
            "Where a request's time goes (p90)",
            "Tokenizing in the gateway, waiting in the Redis queue, and the forward pass, "
            "each as the request saw it (its slowest item).", "s",
            [query(f"histogram_quantile(0.9, sum by (le) (rate(tokq_gateway_{stage}"
                   f"_duration_seconds_bucket{{{M}}}[{RATE}])))", stage, ref)
             for stage, ref in (("tokenize", "A"), ("queue", "B"), ("inference", "C"))]))
        .with_panel(panel("Input tokens per request", "Tokens in one Embed request.", "none",
                          quantiles("tokq_gateway_request_input_tokens", "", M, "{q}"), span=8))
        .with_panel(panel("In-flight requests", "RPCs being served now, all gateways.", "none",
                          [query(f"sum(tokq_gateway_inflight_requests{{{M}}})", "in flight")],
                          span=8))
        .with_panel(panel("Queue flow", "Items entering the queue, and answered with an "
                          "embedding (acked), per second. Error answers: failed, under Requeues "
                          "and expirations.",
                          "cps", [query(f"sum by (model) (rate(tokq_queue_{c}_total{{{M}}}"
                                        f"[{RATE}]))", f"{{{{model}}}} {c}", ref)
                                  for c, ref in (("enqueued", "A"), ("acked", "B"))], span=8))
        .with_panel(panel("Embed latency by priority", "Whole Embed call (gRPC and HTTP) by "
                          "priority class: interactive work is served first, batch-class work "
                          "takes the room it leaves (docs/design.md, priority classes).", "s",
                          quantiles("tokq_gateway_request_duration_seconds", "priority, ",
                                    f"{M}, {EMBED_RPCS}", "{{{{priority}}}} {q}", qs=(0.5, 0.99))))
        .with_panel(panel("Rerank latency", "Whole Rerank call (gRPC and HTTP) as the gateway saw "
                          "it: one call scores all its documents, each pair a queue item.",
                          "s", quantiles("tokq_gateway_request_duration_seconds", "",
                                         f"{M}, {RERANK_RPCS}", "{q}")))
        .with_row(gd.Row("Queue"))
        .with_panel(panel("Queue depth (tokens)", "Tokens waiting to be claimed, and claimed "
                          "items not yet answered.", "none",
                          [query(f"sum by (model) (tokq_queue_queued_tokens{{{M}}})",
                                 "{{model}} queued tokens"),
                           query(f"sum by (model) (tokq_queue_inflight_items{{{M}}})",
                                 "{{model}} in-flight items", "B")]))
        .with_panel(panel("Oldest queued entry age", "Age of each priority class's oldest queued "
                          "entry. Interactive rising towards the clients' deadline means too few "
                          "workers; a bulk backlog's batch age grows with its depth.", "s",
                          [query(f"max by (model, priority) "
                                 f"(tokq_queue_priority_oldest_age_seconds{{{M}}})",
                                 "{{model}} {{priority}}")]))
        .with_panel(panel(
            "Requeues and expirations", "Requeued: a worker's lease ran out (crash or a "
            "forward longer than the lease). Expired: dropped at the deadline before running. "
            "Rejected: refused at a priority class's token cap (rejected_batch: the batch "
            "class's of them). Failed: answered with an error.", "cps",
            [query(f"sum by (model) (rate(tokq_queue_{c}_total{{{M}}}[{RATE}]))",
                   f"{{{{model}}}} {c}", ref)
             for c, ref in (("requeued", "A"), ("expired", "B"), ("rejected", "C"),
                            ("rejected_batch", "D"), ("failed", "E"))], span=16))
        .with_panel(panel("Queue shards not answering", "Share of a model's queue shards whose "
                          "Redis node is out: calls on them fail UNAVAILABLE, and the gauges "
                          "above cover the others only.", "percentunit",
                          [query(f"max by (model) (tokq_queue_unreadable_shards_ratio{{{M}}})",
                                 "{{model}}")], span=8))
        .with_panel(panel("Queue depth by lane", "Tokens and entries waiting per lane: light "
                          "(interactive requests of at most TOKQ_LIGHT_TOKENS), heavy (larger ones "
                          "and redone items), batch (batch-class work). Read beside the workers' "
                          "claim stops.", "none",
                          [query(f"sum by (model, lane) (tokq_queue_lane_queued_tokens{{{M}}})",
                                 "{{model}} {{lane}} tokens"),
                           query(f"sum by (model, lane) (tokq_queue_lane_queued_entries{{{M}}})",
                                 "{{model}} {{lane}} entries", "B")], span=24))
    )


def workers() -> gd.Dashboard:
    fwd = "tokq_worker_forward_duration_seconds"
    return (
        base("tokq-workers", "tokq / Workers",
             "Batches, throughput and MFU per worker: are batches full, should GPUs be added?",
             with_worker=True)
        .with_row(gd.Row("Batches"))
        .with_panel(panel("Batch fill ratio", "Mean tokens forwarded per batch / token budget "
                          "(items refused before the forward are not forwarded). Low with a "
                          "deep queue: the claim rule is starved; low with an empty queue: "
                          "more workers than traffic.", "percentunit",
                          [query(f"sum by (model, worker) (rate(tokq_worker_batch_fill_ratio_sum{{{W}}}"
                                 f"[{RATE}])) / sum by (model, worker) (rate(tokq_worker_batch_fill_"
                                 f"ratio_count{{{W}}}[{RATE}]))", "{{model}} {{worker}}")], max_val=1))
        .with_panel(heatmap.Panel().title("Batch fill ratio distribution")
                    .description("Batches per fill-ratio bucket.").datasource(DATASOURCE)
                    .span(12).height(8).calculate(False).show_tooltip().show_legend()
                    .y_axis(heatmap.YAxisConfig().unit("percentunit"))
                    .with_target(query(f"sum by (le) (increase(tokq_worker_batch_fill_ratio_"
                                       f"bucket{{{W}}}[{RATE}]))", "{{le}}")
                                 .format(PromQueryFormat.HEATMAP)))
        .with_panel(panel("Batch tokens vs budget", "Median tokens forwarded per batch against the "
                          "token budget in force.", "none",
                          quantiles("tokq_worker_batch_tokens", "model, worker, ", W,
                                    "{{{{model}}}} {{{{worker}}}} {q}", qs=(0.5,))
                          + [query(f"max by (model, worker) (tokq_worker_budget_tokens{{{W}}})",
                                   "{{model}} {{worker}} budget", "B")]))
        .with_panel(panel("Items per batch", "Sequences forwarded in one batch.", "none",
                          quantiles("tokq_worker_batch_items", "model, worker, ", W,
                                    "{{{{model}}}} {{{{worker}}}} {q}", qs=(0.5, 0.99))))
        .with_panel(panel("Pre-emptions and CUDA graphs", "Light batches per second run nested "
                          "inside a heavy forward (mostly heavy-lane or batch-class work: "
                          "workers/preempt.py) and batches replayed from "
                          "a CUDA graph (workers/cuda_graphs.py), beside all batches per second.",
                          "cps",
                          [query(f"sum by (model, worker) (rate(tokq_worker_preemptions_total{{{W}}}"
                                 f"[{RATE}]))", "{{model}} {{worker}} nested"),
                           query(f"sum by (model, worker) (rate(tokq_worker_batches_total{{{W}}}"
                                 f"[{RATE}]))", "{{model}} {{worker}} all", "B"),
                           query(f"sum by (model, worker) (rate(tokq_worker_graphed_batches_total{{{W}}}"
                                 f"[{RATE}]))", "{{model}} {{worker}} graphed", "C")], span=24))
        .with_panel(panel("Claim stops", "Claims per second by why their batch stopped growing "
                          "(tokq/queue/claim_rule.py): full, heavy_item (the heavy lane's next entry "
                          "did not fit), batch_item (the batch lane's), lookahead, dry (the lanes "
                          "ran out), isolated, dropped, "
                          "preempt (light-only, nested), heavy_only, backlog (light-only refused: "
                          "a light backlog goes in full batches).", "cps",
                          [query(f"sum by (model, reason) (rate(tokq_worker_claim_stops_total{{{W}}}"
                                 f"[{RATE}]))", "{{model}} {{reason}}")], span=24))
        .with_row(gd.Row("Throughput"))
        .with_panel(panel("Tokens/s per worker", "Tokens forwarded per second.", "none",
                          [query(f"sum by (model, worker) (rate(tokq_worker_forward_tokens_total{{{W}}}"
                                 f"[{RATE}]))", "{{model}} {{worker}}")]))
        .with_panel(panel("MFU", "Model FLOPs per second / the device's dense 16-bit peak. "
                          "Empty for devices with no known peak (set TOKQ_DEVICE_PEAK_FLOPS).",
                          "percentunit",
                          [query(f"sum by (model, worker) (rate(tokq_worker_forward_flops_total{{{W}}}"
                                 f"[{RATE}])) / on (model, worker) max by (model, worker) "
                                 f"(tokq_worker_device_peak_flops_per_second{{{W}}} > 0)",
                                 "{{model}} {{worker}}")], max_val=1))
        .with_panel(panel("Forward time per 1,000 tokens", "Forward seconds per 1,000 tokens "
                          "forwarded. Falling while batches grow: a larger budget is nearly "
                          "free (tokq profile measures the curve).", "s",
                          [query(f"1000 * sum by (model, worker) (rate({fwd}_sum{{{W}}}[{RATE}])) / "
                                 f"sum by (model, worker) (rate(tokq_worker_forward_tokens_total{{{W}}}"
                                 f"[{RATE}]))", "{{model}} {{worker}}")]))
        .with_panel(panel("Forward latency", "Forward pass per worker.", "s",
                          quantiles(fwd, "model, worker, ", W, "{{{{model}}}} {{{{worker}}}} {q}",
                                    qs=(0.5, 0.99))))
        .with_row(gd.Row("Health"))
        .with_panel(panel("Claim latency", "One call of the claim script.", "s",
                          quantiles("tokq_worker_claim_duration_seconds", "model, worker, ", W,
                                    "{{{{model}}}} {{{{worker}}}} {q}", qs=(0.5, 0.99)), span=8))
        .with_panel(panel("Worker errors", "Errors per second by kind.", "cps",
                          [query(f"sum by (model, worker, kind) (rate(tokq_worker_errors_total{{{W}}}"
                                 f"[{RATE}]))", "{{model}} {{worker}} {{kind}}")], span=8))
        .with_panel(panel("Heartbeat age", "Seconds since each worker's last heartbeat.", "s",
                          [query(f"time() - max by (model, worker) "
                                 f"(tokq_worker_heartbeat_timestamp_seconds{{{W}}})",
                                 "{{model}} {{worker}}")], span=8))
    )


DASHBOARDS = {"tokq-overview.json": overview, "tokq-workers.json": workers}


def render(builder: gd.Dashboard) -> str:
    model = builder.build()
    for i, p in enumerate(model.panels or []):
        p.id_val = i + 1  # Grafana keys panel state and links by id: keep them stable
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the JSON on disk is stale")
    args = parser.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path, text = OUT_DIR / name, render(build())
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
        else:
            OUT_DIR.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("stale (run deploy/grafana/build.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
