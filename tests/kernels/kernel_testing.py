"""Shared by the kernel tests: the Triton kernels run on the GPU when there is one, else under the Triton
interpreter on the CPU. Import this module before any kernel module: triton.jit reads TRITON_INTERPRET when
a kernel is defined. (A plain module, not a conftest.py: the other tests import helpers `from conftest`,
which a second conftest.py would shadow.)"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BUDGET = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def e4m3_steps(values: torch.Tensor, ref: torch.Tensor) -> int:
    """The most E4M3 steps between two float8_e4m3fn tensors' values (0: the same values; -0 and 0 are one)."""
    def ordinal(t):  # E4M3 codes count up with the magnitude: sign bit, then exponent and mantissa
        code = t.view(torch.uint8).int()
        return torch.where(code >= 128, -(code & 0x7F), code)
    assert not (values.float().isnan().any() or ref.float().isnan().any())
    return int((ordinal(values) - ordinal(ref)).abs().max()) if values.numel() else 0
