"""bench/gpu.py, the one command a lent GPU runs first: without a GPU (or with --dry-run) every row is checked as
the bench would parse it and skipped with its reason; a row whose command the bench would refuse is named and
makes the script fail, so a broken row is found on a CPU, not on a GPU's borrowed minutes."""

import pytest
import torch

from bench import gpu


def test_the_dry_run_names_each_row_and_why_it_skips(capsys):
    assert gpu.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [name for name, _, _ in gpu.ROWS]
    assert all("skipped, --dry-run; would run (up to " in line for line in lines), lines
    assert sum(limit for _, limit, _ in gpu.ROWS) <= gpu.BUDGET_S


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the rows")
def test_without_a_gpu_it_is_a_dry_run_that_says_so(capsys):
    assert gpu.main(["--only=step,shared"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("skipped, no CUDA GPU here" in line for line in lines), lines


def test_a_row_the_bench_would_refuse_is_named(monkeypatch, capsys):
    rows = gpu.ROWS + [("typo", 1, ["--only=decode", "--set", "no_such_setting=1"]),
                       ("gone", 1, ["pytest", "tests/test_no_such_file.py"])]
    monkeypatch.setattr(gpu, "ROWS", rows)
    monkeypatch.setattr(gpu, "BUDGET_S", 10_000)
    assert gpu.main(["--dry-run"]) == 1
    out = capsys.readouterr().out
    assert "typo: cannot run: the bench refuses its arguments" in out
    assert "gone: cannot run: no such test file: tests/test_no_such_file.py" in out
