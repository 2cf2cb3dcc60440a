"""The shared-prompt benchmark: batches counted as the queue counts them, and a run that
rewrites its own RESULTS.md section (per device) and leaves the rest of the file alone."""

from __future__ import annotations

import os

import numpy as np
from click.testing import CliRunner

from tokq.profiling.bench import prefix as bench_prefix


def test_batches_count_queued_tokens():
    prompt = np.arange(1, 21)
    seqs = [np.concatenate([prompt, np.arange(100, 110)]) for _ in range(10)]
    full = bench_prefix.batches(seqs, [20] * 10, budget=100, shared=False)
    shared = bench_prefix.batches(seqs, [20] * 10, budget=100, shared=True)
    assert [b.num_seqs for b in full] == [3, 3, 3, 1] and all(b.prefix_lens is None for b in full)
    assert [b.num_queued_tokens for b in shared] == [100] and (shared[0].prefix_lens == 20).all()


def _tiny_model(path, layers):
    """The benchmark's plumbing on a small Qwen3 (the 0.6B widths cost minutes here)."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.Qwen3Model(transformers.Qwen3Config(
        vocab_size=bench_prefix.VOCAB, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96,
        max_position_embeddings=256)).save_pretrained(path)


def test_run_writes_and_rewrites_its_section(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_prefix, "build_model", _tiny_model)
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nkept\n")
    args = ["--layers", "1", "--token-budget", "64", "--queries", "6", "--rounds", "1", "--threads", "1",
            "--results-md", str(results)]  # in the order the command lists its options
    for _ in range(2):
        done = CliRunner().invoke(bench_prefix.prefix_command, args, catch_exceptions=False)
        assert done.exit_code == 0, done.output
    text = results.read_text()
    assert text.startswith("# Results\n\nkept\n")
    assert text.count("<!-- tokq bench prefix (cpu): start") == 1
    assert text.count("<!-- tokq bench prefix (cpu): end -->") == 1
    assert f"Command: `tokq bench prefix {' '.join(args)}`" in text
    assert f" A shared {os.cpu_count()}-CPU machine: the ratios" in text  # this machine's, not a fixed count
    assert "| instruction (20 tok) + 10-token queries | prompt computed once | 1 | 180 | 60 |" in text
