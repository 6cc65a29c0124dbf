"""`flash-dllm bench kernels` on a tiny random model (on the CPU the kernels run interpreted): a row per kernel
and batch size, each within the error budget of its reference; a clear error when the kernels cannot run."""
from __future__ import annotations

import torch

from flash_dllm.cli import main

KERNELS = ["fused qkv+rope+cache write", "qkv_rope (the model's path)", "attention", "attention, packed",
           "attention, per query head", "attention + key mass", "verify pass", "rms_norm",
           "silu_mul"]  # llada-tiny: 2 query heads per KV head


def test_bench_kernels_table(capsys):
    device = ["--device", "cuda"] if torch.cuda.is_available() else ["--device", "cpu", "--kernels", "on"]
    assert main(["bench", "kernels", "--model", "random:llada-tiny", "--dtype", "float32", *device,
                 "--batch-sizes", "1", "2", "--rows", "8", "--kv-length", "24", "--warmup", "1", "--iters", "1"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [row[0].lstrip("| ") for row in rows] == KERNELS * 2
    assert [row[1] for row in rows] == ["B=1 rows=8 kv=24"] * 9 + ["B=2 rows=8 kv=24"] * 9
    assert all(float(row[-1].rstrip(" |")) < 1e-5 for row in rows)  # fp32; NaN would print inf


def test_bench_kernels_on_a_mixture_of_experts(capsys):
    """The router and experts' table at each --gemm-rows (touched experts and their read floor), and the attention
    (by default, `packs`) beside a program per KV head (packed) and a program per query head."""
    device = ["--device", "cuda"] if torch.cuda.is_available() else ["--device", "cpu", "--kernels", "on"]
    assert main(["bench", "kernels", "--model", "random:llada2-tiny", "--dtype", "float32", *device,
                 "--batch-sizes", "1", "--rows", "8", "--kv-length", "40", "--warmup", "1", "--iters", "1",
                 "--gemm-rows", "4", "32"]) == 0
    lines = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    moe = [row for row in lines if row[0].lstrip("| ") in ("4", "32")]
    assert [int(row[0].lstrip("| ")) for row in moe] == [4, 32]
    assert all(1 <= int(row[1]) <= 8 and float(row[-1].rstrip(" |")) < 1e-5 for row in moe)  # 8 experts
    attention = {row[0].lstrip("| "): float(row[-1].rstrip(" |")) for row in lines if row[0].startswith("| attention")}
    assert attention.keys() == {"attention", "attention, packed", "attention, per query head", "attention + key mass"}
    assert all(err < 1e-5 for err in attention.values())


def test_bench_kernels_needs_the_kernels(capsys):
    if torch.cuda.is_available():
        return
    assert main(["bench", "kernels", "--model", "random:llada-tiny", "--device", "cpu", "--kernels", "off"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
