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
