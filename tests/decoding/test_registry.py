"""A decoding method added from outside the package, with one class and one registry call, runs through
`LLM.generate`, the command line (its knob becomes a flag) and `bench step`; knobs belong to their methods."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from flash_dllm import LLM, SamplingParams
from flash_dllm.cli import main
from flash_dllm.config import ATTENTION_KINDS
from flash_dllm.decoding.base import Settings, check, knob
from flash_dllm.decoding.block import BlockMethod
from flash_dllm.decoding.block_diffusion import BlockDiffusion
from flash_dllm.decoding.registry import BLOCK_CAUSAL, METHODS, method_of, register
from flash_dllm.sampling_params import knobs


@dataclass(frozen=True)
class LeftToRightSettings(Settings):
    tokens_per_step: int = knob(1, "masked positions unmasked per step, leftmost first")

    def __post_init__(self):
        super().__post_init__()
        check(self.tokens_per_step > 0, f"tokens_per_step must be positive, got {self.tokens_per_step}")


class LeftToRight(BlockMethod):
    """Autoregressive order: each step unmasks the leftmost `tokens_per_step` masks of the block with their
    greedy tokens, from a full forward."""
    name = "left-to-right"
    Settings = LeftToRightSettings

    def block_logits(self, runner, batch, columns, plan):  # plan: one full forward (BlockMethod's default)
        return runner.full_logits(batch.tokens, batch.positions, batch.attention_mask, columns)

    def unmask(self, batch, confidence, masked):
        return masked & (masked.long().cumsum(dim=1) <= batch.params.settings.tokens_per_step)


@pytest.fixture
def left_to_right():
    register(LeftToRight)
    yield LeftToRight.name
    del METHODS[LeftToRight.name]


def left_to_right_without_engine(model, prompt: list[int], max_tokens: int, k: int, mask_id: int) -> list[int]:
    x = torch.tensor([prompt + [mask_id] * max_tokens])
    while (x == mask_id).any():
        logits = model(x)
        logits[..., mask_id] = float("-inf")
        masked = (x[0] == mask_id).nonzero().flatten()[:k]
        x[0, masked] = logits[0, masked].argmax(dim=-1)
    return x[0, len(prompt):].tolist()


def test_a_registered_method_runs_through_generate(gqa_checkpoint, left_to_right):
    llm = LLM(str(gqa_checkpoint), device="cpu", dtype="float32")
    params = SamplingParams(method=left_to_right, max_tokens=16, block_length=8, tokens_per_step=2)
    prompts = [[5, 9, 13, 7], [11, 4, 6, 8, 12, 2, 10]]  # no mask id (3) in a prompt
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        expected = left_to_right_without_engine(llm.model, prompt, 16, 2, llm.special.mask_id)
        stops = [i for i, t in enumerate(expected) if t in llm.special.stop_ids]
        assert out.token_ids == expected[:stops[0] if stops else None]
        assert out.nfe == out.steps and out.steps <= 8


def test_a_registered_method_through_the_cli_and_bench_step(gqa_checkpoint, left_to_right, capsys):
    assert "tokens_per_step" in knobs()
    assert main(["generate", "--model", str(gqa_checkpoint), "--device", "cpu", "--method", left_to_right,
                 "--tokens-per-step", "4", "--max-tokens", "16", "--block-length", "8", "--json", "--no-progress",
                 "Tom has 3 apples."]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] <= 4
    assert main(["bench", "step", "--model", "random:llada-tiny", "--device", "cpu", "--batch-sizes", "2",
                 "--methods", left_to_right, "--prompt-length", "16", "--max-tokens", "16", "--block-length", "8",
                 "--warmup", "1", "--iters", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {left_to_right} |")]
    assert len(rows) == 1 and "| 1.00 |" in rows[0]  # one token per iteration at the default knob


def test_knobs_belong_to_their_methods(left_to_right):
    with pytest.raises(ValueError, match="tokens_per_step applies to method left-to-right, not 'parallel'"):
        SamplingParams(method="parallel", tokens_per_step=2)
    with pytest.raises(ValueError, match="tokens_per_step must be positive"):
        SamplingParams(method=left_to_right, tokens_per_step=0)
    with pytest.raises(ValueError, match="threshold applies to method parallel or prefix-cache or dual-cache"):
        SamplingParams(method=left_to_right, threshold=0.9)
    with pytest.raises(ValueError, match="already registered"):
        register(LeftToRight)
    params = SamplingParams(method=left_to_right)
    assert params.settings == LeftToRightSettings() and params.to_dict()["tokens_per_step"] == 1


def test_cached_methods_declare_one_attention_pattern():
    """A cached pass reads each request's whole cache range (bidirectional), or with the block-diffusion methods
    each block's keys up to its end (block-causal): a cached method declares the one its passes follow; a full
    forward follows the model's."""
    for method in [*METHODS.values(), *BLOCK_CAUSAL.values()]:
        if method.uses_cache:
            expected = ("block-causal",) if isinstance(method, BlockDiffusion) else ("bidirectional",)
        else:
            expected = ATTENTION_KINDS
        assert method.attention_patterns == expected, method.name
    assert method_of("parallel", "block-causal") is BLOCK_CAUSAL["parallel"] is not method_of("parallel")
