"""Sweeps: the grid of methods and knobs, the Pareto front, and the files a sweep writes."""
from __future__ import annotations

import json
import sys

import pytest

from flash_dllm import LLM
from flash_dllm.eval.sweep import grid, pareto_front, run_sweep
from flash_dllm.extras import MissingExtra


def test_grid_varies_each_knob_only_for_methods_that_read_it():
    points = grid(["parallel", "flash-verify", "reference"],
                  {"threshold": [0.8, 0.9], "factor": [1.0], "verify_threshold": [0.6, 0.8], "steps": [16]},
                  max_tokens=32, block_length=8)
    labels = [p.label for p in points]
    assert labels[:3] == ["parallel thr=0.8", "parallel thr=0.9", "parallel factor=1.0"]
    assert labels[3:7] == ["flash-verify thr=0.8 gamma=0.6", "flash-verify thr=0.8 gamma=0.8",
                           "flash-verify thr=0.9 gamma=0.6", "flash-verify thr=0.9 gamma=0.8"]
    assert labels[7:] == ["reference steps=16"]
    assert all(p.params.max_tokens == 32 for p in points) and points[2].params.settings.factor == 1.0
    assert [p.label for p in grid(["dual-cache"], {})] == ["dual-cache"]


def test_pareto_front():
    rows = [{"accuracy": 0.8, "tokens_per_s": 10}, {"accuracy": 0.7, "tokens_per_s": 20},
            {"accuracy": 0.7, "tokens_per_s": 15}, {"accuracy": 0.9, "tokens_per_s": 5},
            {"accuracy": 0.8, "tokens_per_s": 10}]
    assert pareto_front(rows) == [True, True, False, True, True]  # ties do not dominate each other


def test_sweep_writes_plot_table_and_points(mha_checkpoint, tmp_path):
    llm = LLM(str(mha_checkpoint), device="cpu", dtype="float32", max_batch_size=4)
    points = grid(["parallel", "dual-cache"], {"threshold": [0.9]}, max_tokens=16, block_length=8)
    rows = run_sweep(llm, "arith", points, tmp_path, limit=2, progress=False)
    assert [r["label"] for r in rows] == [p.label for p in points] and any(r["pareto"] for r in rows)
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "sweep.md").read_text()
    assert table.startswith("| method and knobs | # | accuracy % | 95% interval | tokens/s | tokens/step |")
    assert "| dual-cache thr=0.9 | " in table
    assert json.loads((tmp_path / "sweep.json").read_text())[0]["num_items"] == 2
    assert len(list((tmp_path / "points").glob("*.summary.json"))) == 2


def test_sweep_without_matplotlib_stops_before_any_point(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(MissingExtra, match=r"^the sweep's plot needs the eval extra: pip install 'flash-dllm\[eval\]' "
                                           r"\(missing: matplotlib\)$"):
        run_sweep(None, "arith", grid(["parallel"], {}), tmp_path / "sweep")  # no LLM: nothing may run
    assert not (tmp_path / "sweep").exists()
