"""Data-parallel eval: two gloo ranks under torchrun give the same results, in the same order, as one process."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from flash_dllm.cli import main
from flash_dllm.eval.distributed import DistContext, all_gather, shard


def test_shard_covers_every_item_once():
    items = list(range(11))
    shards = [shard(items, DistContext(rank, 3)) for rank in range(3)]
    assert sorted(sum(shards, [])) == items and shards[0] == [0, 3, 6, 9]
    assert all_gather("x", DistContext()) == ["x"]


def test_torchrun_two_ranks_equal_one_process(mha_checkpoint, tmp_path):
    args = ["eval", "--task", "trace", "--model", str(mha_checkpoint), "--device", "cpu", "--method", "parallel",
            "--max-tokens", "16", "--block-length", "8", "--limit", "5", "--batch-size", "2", "--no-progress"]
    assert main(args + ["--output", str(tmp_path / "single.jsonl")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "flash_dllm.cli", *args, "--output", str(tmp_path / "dp.jsonl")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]

    def load(name):
        records = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k != "time_s"} for r in records]

    assert load("dp") == load("single")
    assert [r["index"] for r in load("dp")] == list(range(5))
    single, dp = (json.loads((tmp_path / f"{name}.summary.json").read_text()) for name in ("single", "dp"))
    assert dp["world_size"] == 2 and single["world_size"] == 1
    for key in ("num_items", "num_correct", "accuracy", "num_tokens", "tokens_per_step", "nfe"):
        assert dp[key] == single[key], key
    assert dp["tokens_per_s"] > 0
