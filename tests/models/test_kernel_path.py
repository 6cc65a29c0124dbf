"""The cached methods give the same tokens through the Triton kernels as through their PyTorch references
(on the CPU the kernels run under the Triton interpreter)."""
from __future__ import annotations

import pytest
import torch

from flash_dllm import LLM, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

PROMPTS = [[5, 9, 13, 7], [11, 4, 6, 8, 12, 3, 10]]
DUAL_CACHE = dict(method="dual-cache")
# Flash-Cache's passes, interpreted on the CPU, are Flash-Verify's drafts: on the GPU only
ON_THE_GPU = pytest.mark.skipif(DEVICE == "cpu", reason="interpreted on the CPU: flash-verify's drafts cover it")
# every method on GQA; the QKV bias (the fused projection's, the same for every method) with the cheapest one
CASES = [("gqa_checkpoint", DUAL_CACHE),
         pytest.param("gqa_checkpoint", dict(method="flash-cache", tracking_budget=4, mask_window=8),
                      marks=ON_THE_GPU),
         ("gqa_checkpoint", dict(method="flash-verify", tracking_budget=4, mask_window=8)),
         ("gqa_checkpoint", dict(method="elastic", mask_window=4)),
         ("bias_checkpoint", DUAL_CACHE)]


@pytest.mark.parametrize("checkpoint, knobs", CASES, ids=lambda v: v["method"] if isinstance(v, dict) else v)
def test_kernels_give_the_reference_tokens(request, checkpoint, knobs):
    params = SamplingParams(max_tokens=6, block_length=4, threshold=0.5, **knobs)  # blocks of 4 and 2 (CI time)
    outputs = {}
    for kernels in (False, True):
        llm = LLM(request.getfixturevalue(checkpoint), device=DEVICE, dtype="float32", kernels=kernels)
        outputs[kernels] = [out.token_ids for out in llm.generate(PROMPTS, params)]
    assert outputs[True] == outputs[False]
