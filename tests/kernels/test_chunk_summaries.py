"""The chunk summaries kept beside the cache (kernels/chunk_summaries.py) against their reference: rows of several
chunks, runs of rows in one chunk, a chunk cut by its prompt's end, rows that write no prompt key; from an fp8 cache,
of its dequantised keys."""
from kernel_testing import DEVICE, rel_err  # first: it picks the interpreter on the CPU

import pytest
import torch

from flash_dllm.cache.routing import CHUNK
from flash_dllm.kernels.chunk_summaries import write_chunk_summaries, write_chunk_summaries_ref
from flash_dllm.kernels.fp8 import quantize_rows_ref
from flash_dllm.kernels.kv_fp8 import dequantize_kv


@pytest.mark.parametrize("fp8", [False, True], ids=["cache", "fp8-cache"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(dtype, fp8):
    g = torch.Generator().manual_seed(0)
    rows, Hkv, D = 6 * CHUNK + 1, 2, 24
    k_cache = torch.randn(rows, Hkv, D, generator=g).to(dtype).to(DEVICE)
    scale = {}
    if fp8:  # summarised as the keys they hold: each times its scale, in fp32
        k_cache, scale = quantize_rows_ref(k_cache)
        scale = dict(k_scale=scale)
    # chunks 0, 0, 0 (a run), 2, 5 cut at row 5 * CHUNK + 7, none, 2 again (not next to its other row)
    chunk = torch.tensor([0, 0, 0, 2, 5, -1, 2], device=DEVICE)
    prompt_end = torch.tensor([3 * CHUNK] * 3 + [3 * CHUNK, 5 * CHUNK + 7, 0, 3 * CHUNK], device=DEVICE)
    out, ref = (torch.full((6, 3, Hkv, D), 9.0, dtype=dtype, device=DEVICE) for _ in range(2))
    write_chunk_summaries(k_cache, out, chunk, prompt_end, **scale)
    write_chunk_summaries_ref(k_cache, ref, chunk, prompt_end, **scale)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert (out[[1, 3, 4]] == 9.0).all()  # chunks no row wrote are left alone
    keys = dequantize_kv(k_cache, scale["k_scale"], torch.float32) if fp8 else k_cache
    cut = keys[5 * CHUNK:5 * CHUNK + 7].float()
    # (fp32 bounds of dequantised keys rounded to bf16: the interpreter's cast truncates)
    assert torch.allclose(out[5, 1].float(), cut.amax(dim=0).to(dtype).float(), rtol=2 ** -7 if fp8 else 1e-5)
