"""`tokq bench queue`: a tiny run against a real embedded Redis rewrites its block of RESULTS.md
(once, in place, the rest of the file kept) with the command that made it."""

from __future__ import annotations

from click.testing import CliRunner

from tokq.profiling.bench.queue import SECTION_START, queue_command


def test_tokq_bench_queue_rewrites_its_block(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\n## Other\nkept\n")
    args = ["--num-claims", "20", "--rounds", "1", "--results-md", str(results)]
    for _ in range(2):
        done = CliRunner().invoke(queue_command, args, catch_exceptions=False)
        assert done.exit_code == 0, done.output
    text = results.read_text()
    assert text.startswith("# Results\n\n## Other\nkept\n") and text.count(SECTION_START) == 1
    assert f"Command: `tokq bench queue {' '.join(args)}`" in text
    assert "| claim, Redis time |" in text and "strict FIFO (look-ahead 0): 0.9" in text
