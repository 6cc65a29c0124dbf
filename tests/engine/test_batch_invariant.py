"""Batch-invariant decoding: with batch_invariant=True every method decodes each request to the same tokens
alone and in batches of 2, 8 and 32 (continuous batching refills the smaller ones), in bf16 on random weights
whose near-ties flip on any change of rounding; and twice the same. On the PyTorch path (CPU) and on the kernel
path (the GPU's; interpreted on the CPU, on fewer prompts and tokens)."""
from __future__ import annotations

import pytest
import torch

from flash_dllm import LLM, SamplingParams
from flash_dllm.decoding.registry import methods_for
from flash_dllm.engine.model_runner import ModelRunner

KNOBS = {"parallel": dict(threshold=0.9), "prefix-cache": dict(threshold=0.9), "dual-cache": dict(threshold=0.9),
         "flash-cache": dict(threshold=0.9, tracking_budget=6, mask_window=8),
         "flash-verify": dict(threshold=0.9, tracking_budget=6, mask_window=8, verify_threshold=0.3),
         "elastic": dict(threshold=0.9, mask_window=6, drift_threshold=0.95)}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """10 prompts of 3 to 100 tokens: a batch pads the short ones by up to 97 columns; more than a batch of 8 holds
    (a refill), fewer than 32 (all at once). The rows cost CI time on the CPU (16 prompts: twice the time)."""
    g = torch.Generator().manual_seed(1)
    lengths = [3, 100, 17, 64, 5, 41, 88, 9, 30, 72]
    return [torch.randint(5, 320, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=["llada-tiny", "dream-tiny"])
def llms(request) -> dict[int, LLM]:
    return {size: LLM(f"random:{request.param}", device="cpu", dtype="bfloat16", max_batch_size=size,
                      batch_invariant=True) for size in (1, 2, 8, 32)}


@pytest.mark.parametrize("method", methods_for("bidirectional"))
def test_alone_and_in_any_batch_give_the_same_tokens(llms, prompts, method):
    params = SamplingParams(method=method, max_tokens=16, block_length=8, **KNOBS.get(method, {}))
    alone = [out.token_ids for out in llms[1].generate(prompts, params, use_tqdm=False)]  # one at a time
    assert any(alone)
    for size in (2, 8, 32):
        assert [out.token_ids for out in llms[size].generate(prompts, params, use_tqdm=False)] == alone, size
    assert [out.token_ids for out in llms[2].generate(prompts, params, use_tqdm=False)] == alone  # and again


@pytest.mark.parametrize("method", ["parallel", "flash-verify", "dream"])
def test_sampled_requests_too(llms, prompts, method):
    """Temperature > 0: the noise is counter-based (seed, step, position, token), the logits batch-invariant."""
    params = SamplingParams(method=method, max_tokens=16, block_length=8, temperature=0.8, seed=3,
                            **KNOBS.get(method, {}))
    alone = [out.token_ids for out in llms[1].generate(prompts, params, use_tqdm=False)]
    assert [out.token_ids for out in llms[8].generate(prompts, params, use_tqdm=False)] == alone


KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernels interpreted


@pytest.fixture(scope="module")
def kernel_llms() -> dict[int, LLM]:
    # a small cache each: by default a GPU's takes 0.4 of the free memory, and Elastic's hidden states come on top
    return {size: LLM("random:llada-tiny", device=KERNEL_DEVICE, dtype="bfloat16", max_batch_size=size,
                      kernels=True, batch_invariant=True, kv_cache_bytes=1 << 28) for size in (1, 8)}


# Interpreted on the CPU (minutes a method): there Flash-Cache (cached passes with the key mass, a first full pass)
# and Elastic-Cache (its drift test) stand for the others, which the GPU runs too.
ON_THE_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="interpreted on the CPU: covered there by "
                                "flash-cache and elastic")


@pytest.mark.parametrize("method", [pytest.param("parallel", marks=ON_THE_GPU), pytest.param("dual-cache",
                                    marks=ON_THE_GPU), "flash-cache", pytest.param("flash-verify", marks=ON_THE_GPU),
                                    "elastic"])
def test_the_kernel_path_is_batch_invariant_too(kernel_llms, prompts, method):
    """The invariant GEMM, one tiling of the attention and norm kernels, the key mass summed in order; Elastic's
    drift test through the invariant GEMM, batched matmul and sums."""
    # one block of 4 (its first pass and 3 cached passes) and 3 and 17 tokens of prompt: the interpreter is slow
    params = SamplingParams(method=method, max_tokens=4, block_length=4, **KNOBS.get(method, {}))
    subset = [prompts[i] for i in (0, 2)]
    alone = [out.token_ids for out in kernel_llms[1].generate(subset, params, use_tqdm=False)]
    assert any(alone)
    assert [out.token_ids for out in kernel_llms[8].generate(subset, params, use_tqdm=False)] == alone


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the PyTorch path is batch-invariant on the CPU")
def test_the_gpu_refuses_the_pytorch_path(kernel_llms):
    """On a GPU, PyTorch's GEMMs and reductions group their sums by the shape: batch_invariant needs the kernels."""
    with pytest.raises(ValueError, match="batch_invariant"):
        ModelRunner(kernel_llms[1].model, kernels=False, batch_invariant=True)
