"""Fast-dLLM's confidence-aware parallel decoding, without cache: per step, every masked position of the
block whose confidence reaches `threshold`, and at least the most confident one; or, with `factor`, the
longest confidence-sorted prefix with (n + 1) * (1 - c_n) < factor. A full forward every step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config import ATTENTION_KINDS
from .base import Settings, StepPlan, check, knob
from .block import BlockMethod
from .transfer import transfer_factor, transfer_threshold

if TYPE_CHECKING:
    from ..batch import DecodeBatch
    from ..engine.model_runner import ModelRunner


@dataclass(frozen=True)
class ThresholdSettings(Settings):
    threshold: float = knob(0.9, "confidence in [0, 1] at or above which a masked position is unmasked (at least "
                                 "one per step; 1: about one per step)", symbol="thr")
    per_row = ("threshold",)

    def __post_init__(self):
        super().__post_init__()
        check(0 <= self.threshold <= 1, f"threshold must be in [0, 1], got {self.threshold}")

    @property
    def rule_value(self) -> float:
        """The rule's per-row value, batch.rule_value."""
        return self.threshold


@dataclass(frozen=True)
class ParallelSettings(ThresholdSettings):
    factor: float | None = knob(None, "use the factor rule with this factor instead of the threshold")
    per_row = ("threshold", "factor")
    exclusive = (("threshold", "factor"),)

    def __post_init__(self):
        super().__post_init__()
        if self.factor is not None:
            check(self.factor > 0, f"factor must be positive, got {self.factor}")

    @property
    def rule_value(self) -> float:
        return self.threshold if self.factor is None else self.factor


class Parallel(BlockMethod):
    name = "parallel"
    Settings = ParallelSettings
    handles_logit_shift = True  # full forwards: the runner's full_logits applies the shift
    attention_patterns = ATTENTION_KINDS  # full forwards, under the model's pattern
    demo_variants = {"parallel": {}, "parallel-factor": {"factor": 1.0}}

    def block_logits(self, runner: ModelRunner, batch: DecodeBatch, columns: torch.Tensor,
                     plan: StepPlan) -> torch.Tensor:
        return runner.full_logits(batch.tokens, batch.positions, batch.attention_mask, columns)

    def unmask(self, batch: DecodeBatch, confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        if batch.params.settings.factor is not None:
            return transfer_factor(confidence, masked, batch.rule_value)
        return transfer_threshold(confidence, masked, batch.rule_value)
