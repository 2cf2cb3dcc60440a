"""The `tokq profile` report: the sweep on a loaded Engine, the knee fit and the budget, in one JSON
document and one paragraph."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import datetime, timezone

import numpy as np

from tokq.host import cpu_name
from tokq.latency_goal import DEFAULT_SLO_P99_MS, max_forward_ms
from tokq.profiling.profile.knee import KneeFit, Recommendation, fit_knee, plain, recommend_budget
from tokq.profiling.profile.sweep import Point, SweepConfig, sweep, timer_for
from tokq.profiling.profile.batches import BatchMaker, shared_prompt_ids, token_ids_for
from tokq.profiling.workload import Query, describe

def device_name(device: object) -> str:
    """A human name for the device: the GPU's model, or the CPU's model and thread count."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    threads = torch.get_num_threads()
    return f"{cpu_name()}, {threads} thread{'' if threads == 1 else 's'}"


def analyze(points: Sequence[Point], slo_p99_ms: float = DEFAULT_SLO_P99_MS, stopped_reason: str | None = None
            ) -> tuple[KneeFit | None, Recommendation | None]:
    """Knee fit and recommended budget; (None, None) with fewer than 3 points."""
    if len(points) < 3:
        return None, None
    tokens = np.array([p.num_tokens for p in points], dtype=float)
    latency_ms = np.array([p.median_ms for p in points])
    fit = fit_knee(tokens, latency_ms)
    return fit, recommend_budget(tokens, latency_ms, fit, slo_p99_ms, stopped_reason=stopped_reason)


def token_ids_label(queries: Sequence[Query], has_tokenizer: bool) -> str:
    """Where the batches' token ids came from: a query's text where it has one (and the model a
    tokenizer), else random ids."""
    num_texts = sum(q.text is not None for q in queries) if has_tokenizer else 0
    if num_texts == len(queries):
        return "text"
    if num_texts == 0:
        return "random"
    return f"mixed: text for {num_texts} of {len(queries)} queries, random for the rest"


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not on this platform
        return None


def run_profile(engine, queries: Sequence[Query], config: SweepConfig, *, slo_p99_ms: float = DEFAULT_SLO_P99_MS,
                workload_source: str = "generated", seed: int = 0, timer=None,
                on_progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Profile a loaded Engine; the report ``tokq profile --out`` writes."""
    import torch

    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    load_before, t0 = _load_average(), time.perf_counter()
    token_ids = token_ids_for(engine.info, seed=seed)
    # Behind a default prompt the worker caches, batches count the tokens after it, as the queue does.
    prompt_ids = shared_prompt_ids(engine, token_ids)
    make_batch = BatchMaker(queries, token_ids, engine.info.max_length, prompt_ids=prompt_ids,
                            lead=len(token_ids.prefix))
    result = sweep(engine.embed, make_batch, config, timer or timer_for(engine.device), on_progress,
                   batch_flops=getattr(engine, "batch_flops", None))
    fit, rec = analyze(result.points, slo_p99_ms, result.stopped_reason)
    summary = describe(list(queries))
    info = engine.info
    report = {
        "model": info.name, "model_path": str(info.path), "queue_name": info.queue_name,
        "device": str(engine.device), "device_name": device_name(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."), "attn_backend": engine.attn_backend,
        "torch_version": torch.__version__, "threads": torch.get_num_threads(),
        "load_average": [load_before, _load_average()],  # CPU timings depend on what else runs
        "workload": {"source": workload_source, **summary,
                     "token_ids": token_ids_label(queries, token_ids.has_tokenizer)},
        "prompt": None if prompt_ids is None else {  # the budget counts the tokens after the prompt
            "name": info.default_prompt_name, "tokens": int(prompt_ids.size), "counted": False},
        "sweep": asdict(config), "points": [p.to_dict() for p in result.points],
        "stopped_reason": result.stopped_reason, "out_of_memory_tokens": result.out_of_memory_tokens,
        "fit": fit.to_dict() if fit else None,
        **{k: getattr(fit, k) if fit else None for k in ("knee_tokens", "flat_ms", "slope_ms_per_token")},
        "slo_p99_ms": slo_p99_ms, "max_batch_ms": max_forward_ms(slo_p99_ms),
        "recommended_budget": rec.token_budget if rec else None, "limited_by": rec.limited_by if rec else None,
        "recommendation": rec.to_dict() if rec else None,
        "saturation": {"fraction": rec.saturation_fraction, "tokens": rec.throughput_cap_tokens,
                       "peak_tokens_per_s": rec.peak_tokens_per_s} if rec else None,
        "started_at": started_at, "duration_s": round(time.perf_counter() - t0, 3),
    }
    report["summary"] = summarize(report)
    return report


def summarize(report: dict) -> str:
    """One paragraph a reader can act on without the JSON."""
    points = report["points"]
    head = (f"{report['model']} on {report['device']} ({report['device_name']}; {report['dtype']}, "
            f"attention {report['attn_backend']}): {len(points)} batch sizes")
    if points:
        head += f" from {points[0]['num_tokens']} to {points[-1]['num_tokens']} tokens"
    parts = [head + f" in {report['duration_s']:.0f} s."]
    if report.get("prompt"):
        prompt = report["prompt"]
        parts.append(f"Every query behind the default prompt {prompt['name']!r} ({prompt['tokens']} tokens), "
                     "computed once and cached by the worker: batch sizes count the tokens after it, "
                     "as the queue does.")
    if report["stopped_reason"]:
        parts.append(f"Stopped early: {report['stopped_reason']}.")
    fit, rec = report["fit"], report["recommendation"]
    if fit is None:
        parts.append("Too few points to fit a knee (3 needed): no budget recommended.")
        return " ".join(parts)
    parts.append(fit["reason"][0].upper() + fit["reason"][1:] + ".")
    parts.append(f"Latency goal p99 <= {plain(rec['slo_p99_ms'])} ms: a forward may take "
                 f"{plain(rec['max_batch_ms'])} ms (a request waits for the batch in progress, then rides "
                 "in its own).")
    lat_cap = (f"the largest batch within it is {rec['latency_cap_tokens']} tokens"
               if rec["latency_cap_tokens"] else "no batch measured is within it")
    parts.append(f"Throughput reaches {rec['saturation_fraction']:.0%} of its peak ({rec['peak_tokens_per_s']:,.0f} "
                 f"tokens/s) at {rec['throughput_cap_tokens']} tokens; {lat_cap}.")
    if rec["token_budget"] is None:
        parts.append(rec["reason"][0].upper() + rec["reason"][1:] + ".")
    else:
        parts.append(f"Recommended token budget: {rec['token_budget']} ({rec['tokens_per_s']:,.0f} tokens/s "
                     f"at {plain(rec['latency_ms'], 3)} ms per batch), limited by {rec['limited_by']}: "
                     f"{rec['reason']}.")
    return " ".join(parts)
