"""SiLU(gate) * up over the packed gate|up projection (Triton), beside its PyTorch reference.

In PyTorch that is two launches (silu, mul) and a [N, I] intermediate; the kernel reads gate_up once and
writes the product once, with the reference's rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton; only the kernel needs it
    triton = None


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 I] (gate | up, as LLaDABlock's gate_up_proj packs them) -> silu(gate) * up [..., I].

    With 16-bit inputs PyTorch computes silu in fp32 and rounds it, then rounds the product again."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The Triton kernel of silu_mul_ref (same argument, same result). Graph capturable: no host syncs."""
    if triton is None:
        raise RuntimeError("silu_mul needs triton; use silu_mul_ref")
    inter = gate_up.shape[-1] // 2
    assert gate_up.shape[-1] == 2 * inter
    x = gate_up.reshape(-1, 2 * inter)
    assert x.stride(-1) == 1
    N = x.shape[0]
    out = torch.empty(N, inter, dtype=x.dtype, device=x.device)
    if N == 0:
        return out.view(*gate_up.shape[:-1], inter)
    block_i = min(1024, triton.next_power_of_2(inter))
    block_n = min(triton.next_power_of_2(N), max(1, 4096 // block_i))  # several rows a program when I is small
    grid = (triton.cdiv(N, block_n), triton.cdiv(inter, block_i))
    _silu_mul_kernel[grid](x, out, N, x.stride(0), out.stride(0), inter, BLOCK_N=block_n, BLOCK_I=block_i,
                           num_warps=max(1, min(8, block_n * block_i // 256)))
    return out.view(*gate_up.shape[:-1], inter)


if triton is not None:
    @triton.jit(do_not_specialize=["N"])  # the row count varies by step: no recompilation per N % 16
    def _silu_mul_kernel(x_ptr, out_ptr, N, stride_xn, stride_on, inter,
                         BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
        # Program (row block, column block) of the output; up is the same columns of gate_up shifted by I.
        o_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        o_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        m = (o_n < N)[:, None] & (o_i < inter)[None, :]
        p_x = x_ptr + o_n[:, None] * stride_xn + o_i[None, :]
        b_gate = tl.load(p_x, mask=m, other=0.0).to(tl.float32)
        b_up = tl.load(p_x + inter, mask=m, other=0.0).to(tl.float32)
        # silu as PyTorch writes it, x / (1 + exp(-x)): -0 for very negative x, whose exp(-x) is inf.
        # Rounded to the input dtype before the product, as F.silu's output is.
        b_silu = tl.div_rn(b_gate, 1.0 + tl.exp(-b_gate)).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + o_n[:, None] * stride_on + o_i[None, :], (b_silu * b_up).to(out_ptr.dtype.element_ty),
                 mask=m)
