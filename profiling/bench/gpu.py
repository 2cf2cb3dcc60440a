"""`make bench-gpu`: on a CUDA host, `tokq profile` and `tokq bench service` of the bundled MiniLM and a
Qwen3-0.6B-shaped model; the section gives throughput against one-at-a-time at equal p99, and MFU."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import click

from tokq.profiling import harness
from tokq.profiling.results_md import block, command_line, table, write_block

BLOCK = "tokq bench gpu"
QWEN3_NAME = "qwen3-0.6b-random"
QUICK_STEPS = ["--start-rate", "50", "--step-factor", "1.5", "--step-duration-s", "2", "--max-steps", "14"]
CPUS_PER_GENERATOR = 5  # load-generator processes: one per this many CPUs (the gateways need the rest)


def generator_procs() -> int:
    """Load-generator processes: one sends ~3,000 calls/s, short of an H100's limit, so more where there
    are cores (3 on 16 CPUs)."""
    from tokq.host import usable_cpus

    return max(1, usable_cpus() // CPUS_PER_GENERATOR)


def build_qwen3_shaped(path: Path, *, num_hidden_layers: int = 28, vocab_size: int = 151_669,
                       max_seq_length: int = 256) -> Path:
    """Random weights of Qwen3-Embedding-0.6B's shape, last-token pooling and normalization as it declares
    them, and the bundled model's tokenizer files (valid Qwen3 ids), so gateway and workload work unchanged."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    from tokq.model.info import bundled_model_path

    torch.manual_seed(0)
    Qwen3Model(Qwen3Config(vocab_size=vocab_size, hidden_size=1024, num_hidden_layers=num_hidden_layers,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                           rope_theta=1_000_000.0, max_position_embeddings=32_768)).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(bundled_model_path() / name, path / name)
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 1024, "pooling_mode_lasttoken": True, "include_prompt": True}))
    modules = ("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")
    (path / "modules.json").write_text(json.dumps([{"idx": i, "name": str(i), "path": p,
                                                    "type": f"sentence_transformers.models.{t}"}
                                                   for i, (t, p) in enumerate(modules)]))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return path


def _tokq(*args: str) -> None:
    click.echo("$ " + " ".join(["tokq", *args]), err=True)
    subprocess.run([sys.executable, "-m", "tokq.cli", *args], env=harness.env(), check=True)


def mfu_at(profile: dict, budget: int | None, peak_flops: float | None) -> dict:
    """FLOP/s and MFU of the profiled batch size closest to ``budget``."""
    points = [p for p in profile["points"] if p.get("gflop_per_s")]
    if not points or budget is None:
        return {"tokens": None, "gflop_per_s": None, "mfu": None}
    point = min(points, key=lambda p: abs(p["num_tokens"] - budget))
    return {"tokens": point["num_tokens"], "latency_ms": point["median_ms"], "gflop_per_s": point["gflop_per_s"],
            "tokens_per_s": point["tokens_per_s"],
            "mfu": point["gflop_per_s"] * 1e9 / peak_flops if peak_flops else None}


def run_model(name: str, model_dir: Path | None, out_dir: Path, quick: bool, gateway_procs: int = 0) -> dict:
    profile_json, bench_json = out_dir / f"gpu-profile-{name}.json", out_dir / f"gpu-bench-{name}.json"
    _tokq("profile", "--device", "cuda", *(["--model", str(model_dir), "--served-model-name", name] if model_dir else []),
          *(["--time-per-point-s", "0.3"] if quick else []), "--out", str(profile_json),
          "--plot", str(out_dir / f"gpu-profile-{name}.png"), "--quiet")
    profile = json.loads(profile_json.read_text())
    budget = profile.get("recommended_budget")
    # The defaults first, then the profiled budget; quick steps start higher, as a GPU serves thousands a second.
    systems = ["--system", "tokq-defaults", *(["--system", "tokq", "--token-budgets", str(budget)] if budget else []),
               "--system", "one-at-a-time"]
    _tokq("bench", "service", "--device", "cuda", *(["--model", str(model_dir)] if model_dir else []), *systems,
          *(QUICK_STEPS if quick else []), *(["--gateway-procs", str(gateway_procs)] if gateway_procs else []),
          "--generator-procs", str(generator_procs()), "--profile-json", str(profile_json), "--out", str(bench_json),
          "--plots", str(out_dir / name), "--quiet")
    return {"name": name, "profile": profile, "bench": json.loads(bench_json.read_text())}


def saved_result(name: str, out_dir: Path, gateway_procs: int | None = None) -> dict | None:
    """A model's profile and bench JSON of an earlier run, if both belong together (the bench after the
    profile, at its budget) and its tokq ran ``gateway_procs`` gateway processes (None: any)."""
    profile_json, bench_json = out_dir / f"gpu-profile-{name}.json", out_dir / f"gpu-bench-{name}.json"
    if not (profile_json.exists() and bench_json.exists()):
        return None
    profile, bench = json.loads(profile_json.read_text()), json.loads(bench_json.read_text())
    budgets = {s.get("token_budget") for s in bench["systems"] if s.get("budget_source") == "set"}
    if (bench["meta"].get("started_at", "") < profile.get("started_at", "")
            or (profile.get("recommended_budget") and profile["recommended_budget"] not in budgets)):
        click.echo(f"bench-gpu: {name}: the saved profile and bench in {out_dir} are not from one run", err=True)
        return None
    procs = {s.get("gateway_procs", 1) for s in bench["systems"] if s["kind"] == "tokq"}
    if gateway_procs is not None and procs != {gateway_procs}:
        return None
    return {"name": name, "profile": profile, "bench": bench}


def run_models(models: list[tuple[str, Callable[[], Path | None]]], out_dir: Path, quick: bool,
               saved: dict[str, dict] | None = None, gateway_procs: int = 0) -> list[dict]:
    """Each model in turn (name, what makes its directory), but those ``saved``; a failure is reported."""
    results = []
    for name, make_model in models:
        if name in (saved or {}):
            results.append(saved[name])
            continue
        try:
            results.append(run_model(name, make_model(), out_dir, quick, gateway_procs))
        except subprocess.CalledProcessError as e:  # its own output, just above, says why
            step = " ".join(itertools.takewhile(lambda a: not a.startswith("-"), e.cmd[3:]))  # after -m tokq.cli
            results.append({"name": name, "error": f"`tokq {step}` exited {e.returncode}"})
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            results.append({"name": name, "error": f"{type(e).__name__}: {e}"})
        if "error" in results[-1]:
            click.echo(f"bench-gpu: {name} failed: {results[-1]['error']}", err=True)
    return results


def _at_least(system: dict) -> bool:
    """Whether a rate is a lower bound: no step failed, or the load generator could not offer the next."""
    return system.get("generator_limited", False) or str(system.get("limit", "")).startswith("no step failed")


def _rate(system: dict | None) -> str:
    return f"{'>= ' if _at_least(system) else ''}{system['sustainable_rps']:.0f}" if system else "–"


def _ratio(tokq: dict | None, ref: dict | None) -> str:
    if not tokq or not ref:
        return "–"
    if ref["sustainable_rps"]:
        return f"{'>= ' if _at_least(tokq) else ''}{tokq['sustainable_rps'] / ref['sustainable_rps']:.1f}x"
    if failed := [s["offered_rps"] for s in ref.get("steps", []) if s.get("offered_rps")]:
        # No step met the SLO: its sustainable rate lies below the lowest rate it failed at.
        best = max((step.get("throughput_rps") or 0.0 for step in ref.get("steps", [])), default=0.0)
        return (f"> {math.floor(tokq['sustainable_rps'] / min(failed))}x (one-at-a-time met the SLO at no step, not "
                f"even {min(failed):.0f} req/s; it served at most {best:.1f})")
    return "–"


def _notes(result: dict) -> str:
    """How long each profile point and load step ran, and tokq's cores at its highest sustained rate."""
    from tokq.profiling.bench.service.report import cpu_cores

    sweep, opts = result["profile"].get("sweep", {}), result["bench"]["meta"].get("options", {})
    tokqs = [s for s in result["bench"]["systems"] if s["kind"] == "tokq"]
    procs = max((s.get("gateway_procs", 1) for s in tokqs), default=1)
    n = opts.get("generator_procs", 1)
    best = max((s for s in tokqs if s.get("sustainable")), key=lambda s: s["sustainable_rps"], default=None)
    cpu = (f"CPU at {best['name']}'s {best['sustainable_rps']:.0f} req/s, in cores: {cpu_cores(best['sustainable'])}."
           if best and best["sustainable"].get("cpu_cores") else "CPU per process: not counted by this run.")
    return (f"Profile: {sweep.get('target_s_per_point')} s a point; load steps of {opts.get('step_duration_s')} s from "
            f"{opts.get('start_rate')} req/s, x{opts.get('step_factor')} each, at most {opts.get('max_steps')}; tokq "
            f"with {'one gateway process' if procs == 1 else f'{procs} gateway processes'}"
            f"{f', load from {n} processes' if n > 1 else ''}. {cpu}")


def markdown_section(gpu: str, peak_flops: float | None, results: list[dict], command: str,
                     links: dict[str, str] | None = None) -> str:
    """``links``: each model's folder of raw figures, relative to the results file."""
    measured = sorted(r["profile"].get("started_at", "") for r in results if "profile" in r)
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["name"], f"failed: {r['error'][:200]}", *[""] * 9])
            continue
        prof, bench = r["profile"], r["bench"]
        at = mfu_at(prof, prof.get("recommended_budget"), peak_flops)
        tokqs = [s for s in bench["systems"] if s["kind"] == "tokq"]
        profiled = next((s for s in tokqs if s.get("budget_source") == "set"), None)
        defaults = next((s for s in tokqs if s.get("budget_source") != "set"), None)
        ref = next((s for s in bench["systems"] if s["kind"] == "one-at-a-time"), None)
        cos = min((s["vectors"]["min_cos"] for s in tokqs if (s.get("vectors") or {}).get("min_cos") is not None),
                  default=None)
        below = any(not (s.get("vectors") or {}).get("counts", True) for s in tokqs)
        rows.append([r["name"], prof["dtype"], prof.get("recommended_budget") or "–",
                     f"{at['latency_ms']:.2f} ms" if at.get("latency_ms") else "–",
                     f"{at['gflop_per_s'] / 1000:.1f} TFLOP/s" if at.get("gflop_per_s") else "–",
                     f"{at['mfu']:.1%}" if at.get("mfu") is not None else "–", _rate(profiled),
                     _rate(defaults) + (f" ({defaults['token_budget']})" if defaults and defaults.get("token_budget") else ""),
                     _rate(ref), _ratio(max(tokqs, key=lambda s: s["sustainable_rps"], default=None), ref),
                     "–" if cos is None else f"{cos:.5f}{' (below the bench bar, 0.9999)' if below else ''}"])
    tables = ", ".join(f"[{name} profile]({path}/gpu-profile-{name}.json) and [bench]({path}/gpu-bench-{name}.json)"
                       for name, path in (links or {}).items())
    return block(BLOCK, [
        "## GPU benchmark", "", f"Command: `{command}`  ",
        f"Measured: {measured[0] if measured else datetime.now(timezone.utc).isoformat(timespec='seconds')}  ",
        f"GPU: **{gpu}**, dense 16-bit peak {peak_flops / 1e12:.0f} TFLOP/s (tokq.model.flops table)  " if peak_flops
        else f"GPU: **{gpu}** (peak FLOP/s unknown: set TOKQ_DEVICE_PEAK_FLOPS for MFU)  ",
        "Each model: `tokq profile --device cuda`, then `tokq bench service --device cuda` (tokq at the profiled budget "
        "and at `tokq up`'s defaults; sentence-transformers one request at a time on the same GPU, fp32). Rates are "
        "requests a second at p99 <= the SLO; '>=' where the ramp ended before any step failed or the load generator "
        "could not offer the next rate.", "",
        *table("model | dtype | profiled budget (tokens) | forward at budget | model FLOP/s at budget | MFU at budget | "
               "tokq at profiled budget | tokq up defaults (budget) | one-at-a-time | best tokq / one-at-a-time | tokq "
               "vectors vs sentence-transformers (min cos)", rows, "ll" + "r" * 9), "",
        *(f"- {r['name']}: {r['profile']['summary']} {_notes(r)}" for r in results if "error" not in r), "",
        f"Raw figures: {tables} (`tokq bench report` renders a bench's full tables)." if tables else
        "Raw figures: the JSON files in `--out-dir` (`tokq bench report` renders a bench's full tables).", ""]) + "\n"


@click.command("gpu")
@click.option("--results-md", type=click.Path(dir_okay=False), default="profiling/results/gpu.md", show_default=True)
@click.option("--out-dir", type=click.Path(file_okay=False), default="profiling/results/gpu", show_default=True,
              help="Profile and bench JSON and figures of each model.")
@click.option("--quick", is_flag=True, help="0.3 s profile points, 2 s load steps from 50 req/s: ~8 minutes on an H100.")
@click.option("--resume", is_flag=True, help="Read back a model whose profile and bench JSON are in --out-dir.")
@click.option("--gateway-procs", type=click.IntRange(0, 64), default=0, show_default=True,
              help="Gateway processes of the tokq systems (0: as tokq up chooses on a GPU host).")
def gpu_command(results_md, out_dir, quick, resume, gateway_procs) -> None:
    """On a CUDA host: profile and bench the bundled MiniLM and a Qwen3-0.6B-shaped model (`make bench-gpu`)."""
    out = Path(out_dir)
    names = ["all-MiniLM-L6-v2", QWEN3_NAME]
    # --gateway-procs 0: whatever the saved run chose (on its host, which need not be this one)
    saved = {name: r for name in names if (r := saved_result(name, out, gateway_procs or None))} if resume else {}
    for name in saved:
        click.echo(f"bench-gpu: {name}: results of an earlier run in {out}, not measured again", err=True)
    if len(saved) == len(names):  # nothing left to measure: rendered from the saved results, GPU or not
        results = [saved[name] for name in names]
    else:
        import torch

        if not torch.cuda.is_available():
            click.echo("bench-gpu: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing measured, "
                       "no results file changed.")
            return
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="tokq-bench-gpu-") as tmp:
            results = run_models([(names[0], lambda: None),
                                  (QWEN3_NAME, lambda: build_qwen3_shaped(Path(tmp) / QWEN3_NAME))],
                                 out, quick, saved, gateway_procs)
    from tokq.model.flops import device_peak_flops  # a GPU's name looks its peak up as a device would

    gpu = next((r["profile"]["device_name"] for r in results if "profile" in r), None)
    if gpu is None:
        import torch

        gpu = torch.cuda.get_device_name(0)
    links = {r["name"]: os.path.relpath(out, Path(results_md).parent) for r in results if "error" not in r}
    write_block(results_md, BLOCK, markdown_section(gpu, device_peak_flops(gpu), results, command_line(), links))
    click.echo(f"wrote {results_md} and {out}/")
    if any("error" in r for r in results):
        raise SystemExit(1)
