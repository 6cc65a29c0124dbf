"""The protocol of a decoding method, and the base of its settings.

A method is one module in decoding/ with a `DecodingMethod` subclass and one entry in registry.py. It
declares its settings (a frozen dataclass of knobs, each with its default and help: SamplingParams, the CLI
flags and the sweep knobs are derived from them), its per-position state (a dataclass of tensors that the
engine keeps aligned with each sequence's tokens) and its `step`, which advances every row of a batch by one
iteration through the model runner.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:  # types only: the engine imports decoding/, never the other way round
    from ..batch import DecodeBatch
    from ..config import ModelConfig
    from ..engine.model_runner import ModelRunner
    from ..sampling_params import SamplingParams


def knob(default: Any, help: str, *, symbol: str | None = None, choices: tuple | None = None):
    """A settings field: its default, a help line for the CLI, the paper's symbol for sweep labels and the
    allowed values of a string knob."""
    return field(default=default, metadata={"help": help, "symbol": symbol, "choices": choices})


@dataclass(frozen=True)
class Settings:
    """A method's knobs. Subclasses add fields made with `knob` and check their ranges in __post_init__."""

    # Knobs whose values may differ between the rows of one batch (e.g. a confidence threshold is a [B]
    # tensor); the batch key only records whether they are set.
    per_row: ClassVar[tuple[str, ...]] = ()
    # Pairs of knobs that are alternatives (one replaces the other's rule): giving both is an error.
    exclusive: ClassVar[tuple[tuple[str, str], ...]] = ()

    @property
    def rule_value(self) -> float:
        """The per-row value of the method's unmasking rule (batch.rule_value); 0 where it has none."""
        return 0.0

    def batch_key(self) -> tuple:
        return tuple((f.name, getattr(self, f.name) is None) if f.name in self.per_row
                     else (f.name, getattr(self, f.name)) for f in dataclasses.fields(self))

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            check_type(f.name, value, f.type)
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {value!r}")


def check(condition: bool, message: str):
    if not condition:
        raise ValueError(message)


def check_type(name: str, value: Any, annotation: str):
    """A value against its field's annotation ("int", "float | None", "str"): ints are not bools, floats are
    finite numbers."""
    kinds = [kind.strip() for kind in str(annotation).split("|")]
    if value is None:
        check("None" in kinds, f"{name} must be given, got None")
    elif "int" in kinds:
        check(isinstance(value, int) and not isinstance(value, bool),
              f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    elif "float" in kinds:
        check(isinstance(value, (int, float)) and not isinstance(value, bool),
              f"{name} must be a number, got {value!r} ({type(value).__name__})")
        check(math.isfinite(value), f"{name} must be finite, got {value}")
    elif "str" in kinds:
        check(isinstance(value, str), f"{name} must be a string, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class StepPlan:
    """The host values a step's device work depends on: the query rows of its pass for each batch row, and
    whatever else shapes it (hashable). Over one batch, equal plans launch the same kernels on the same shapes."""
    counts: tuple[int, ...]
    extra: tuple = ()

    @property
    def rows(self) -> int:
        return sum(self.counts)


class DecodingMethod:
    """One decoding method. Subclasses set `name` and `Settings`, and implement `step`, or `plan` and `run`.

    A method whose step reads nothing back from the device before it ends splits it in two: `plan` (host: the
    shape of its passes, and the bookkeeping of the query rows they compute) and `run` (the device work, a
    function of the batch's tensors and the plan, which updates them in place and never rebinds them). It sets
    `replayable`, and the engine then replays its steps from CUDA graphs while the batch and the plan repeat.
    """

    name: ClassVar[str]
    Settings: ClassVar[type[Settings]] = Settings
    uses_cache: ClassVar[bool] = False            # needs KV-cache rows per sequence
    caches_hidden_states: ClassVar[bool] = False  # the cache also keeps each layer's input hidden states
    uses_blocks: ClassVar[bool] = True            # decodes block by block (decoding/block.py)
    published_block_length: ClassVar[int] = 32    # the block length of its paper's setting (bench step's default)
    # Its passes give each column j whose logits it needs the hidden state of column j - logit_shift, so it runs
    # on an architecture with shifted logits (Dream). The engine refuses the others on such a model.
    handles_logit_shift: ClassVar[bool] = False
    # The models' attention patterns (config.ATTENTION_KINDS) it decodes exactly. A cached pass attends
    # bidirectionally over each request's cache range; a full forward follows the model's pattern, so the methods of
    # full forwards declare every kind (a cached method that subclasses one declares its own). The engine refuses the
    # others on a model of another pattern.
    attention_patterns: ClassVar[tuple[str, ...]] = ("bidirectional",)
    # `flash-dllm demo`'s rows: label -> settings (default: one row, the method's defaults).
    demo_variants: ClassVar[dict[str, dict] | None] = None
    replayable: ClassVar[bool] = False  # its step is `plan` + `run`, and `run` has no host read

    def validate(self, params: SamplingParams):
        """Checks across the common fields and the settings (ranges of single knobs are the settings')."""

    def check_model(self, config: ModelConfig, params: SamplingParams):
        """Checks of a request's settings against the model that will run it (a ValueError naming the setting)."""

    def tail_tokens(self, params: SamplingParams) -> int:
        """Positions after the generation that a sequence's row holds for the method (it decodes them and drops
        them: a block-causal model's last block is decoded whole)."""
        return 0

    def editable(self, batch: DecodeBatch) -> torch.Tensor | None:
        """[B, max_tokens] bool: decoded generated positions whose tokens the method may still change (a row is
        finished only when the positions up to its first eos/eot are neither masks nor these); None: a decoded
        token is final."""
        return None

    def steady_pass(self, params: SamplingParams, logit_shift: int) -> tuple[int, bool] | None:
        """(query rows per request, whether its attention mass is tracked) of the cached pass that the method's
        steps repeat with these settings, the same for every sequence longer than the rows; None where its passes
        vary from step to step. Such a pass's CUDA graphs are captured before a server is ready
        (engine/warmup.capture_steady_passes)."""
        return None

    def initial_state(self, length: int, device: torch.device) -> Any:
        """The method's per-position state for a new sequence of `length` positions: a dataclass of [length]
        tensors, or None."""
        return None

    def step(self, runner: ModelRunner, batch: DecodeBatch):
        """One iteration for every row: forward passes through `runner`, tokens unmasked in batch.tokens,
        batch.counters advanced."""
        self.run(runner, batch, self.plan(runner, batch))

    def plan(self, runner: ModelRunner, batch: DecodeBatch) -> StepPlan:
        """The host part of a step: its passes' shapes; records the query rows they compute (batch.rows)."""
        raise NotImplementedError

    def run(self, runner: ModelRunner, batch: DecodeBatch, plan: StepPlan):
        """The device part of a step, given its plan."""
        raise NotImplementedError
