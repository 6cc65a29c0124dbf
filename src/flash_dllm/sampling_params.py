"""Per-request decoding settings."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("reference", "parallel", "prefix-cache", "dual-cache", "elastic", "flash-cache", "flash-verify",
           "lossless")
CACHED_METHODS = ("prefix-cache", "dual-cache", "elastic", "flash-cache", "flash-verify")
ACCEPTANCE = ("sequential", "cumprod")
REMASKING = ("low_confidence", "random")

# Settings that only some methods read; setting one for another method is an error, not a silent no-op.
_METHOD_ONLY = {"steps": ("reference",), "remasking": ("reference",), "cfg_scale": ("reference",),
                "threshold": ("parallel", *CACHED_METHODS), "factor": ("parallel", "prefix-cache", "dual-cache", "flash-cache"),
                "refresh_interval": ("prefix-cache", "dual-cache"),
                "tracking_budget": ("flash-cache", "flash-verify"),
                "mask_window": ("elastic", "flash-cache", "flash-verify"),
                "drift_threshold": ("elastic",), "track_num": ("elastic",),
                "verify_threshold": ("flash-verify",), "acceptance": ("flash-verify",),
                "draft_length": ("lossless",)}


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    method: "reference" (LLaDA's sampler: `steps` denoising steps spread evenly over the blocks, the
        linear schedule of tokens per step, low-confidence or random remasking, optional classifier-free
        guidance) or "parallel" (Fast-dLLM: every masked position of the block whose confidence reaches
        `threshold`, at least one per step; or, with `factor`, the longest confidence-sorted prefix with
        (n + 1) * (1 - c_n) < factor); "prefix-cache" and "dual-cache" (Fast-dLLM's caches, with the
        parallel rule): a full forward at each block start fills the KV cache; later steps of the block
        recompute the block and everything after it (prefix) or the block alone (dual) and read the rest
        from the cache. `refresh_interval` k also recomputes everything every k steps of a block
        (1 = no reuse, the same tokens as `parallel`). "flash-cache" (selective cache update, with the
        parallel rule): after one full pass, each step recomputes a fixed-size query set, the
        `mask_window` (beta_m) leftmost masked positions and `tracking_budget` (beta_t) decoded positions
        (last step's newly decoded first, then those receiving the most attention from the masked
        queries); every other position is read from the cache. "flash-verify": each iteration is a
        Flash-Cache draft, accepting positions with confidence >= threshold, then one verify pass over the
        rest with isolated draft and mask views (`verify_threshold` gamma, default 0.8; `acceptance`
        "sequential" or "cumprod"). "lossless": exactly the tokens of `reference` with one token per step,
        in fewer sequential forward passes: each pass also evaluates `draft_length` (default 4)
        hypothesised next steps and keeps those the reference rule confirms. "elastic" (Elastic-Cache,
        with the threshold rule): no blocks, a window of the `mask_window` (beta, default 16) leftmost
        masked positions before the first eos/eot; after one full pass, each step recomputes the window,
        the previous step's newly decoded positions and the tracked ones (per layer the `track_num`,
        default 1, decoded positions most attended by the window); at the first layer where the cosine
        (over keys) between the tracked rows' attention before and after this step's update falls below
        `drift_threshold` (gamma, default 0.9), that layer's output and all deeper layers are recomputed
        over the whole sequence (gamma > 1 refreshes every step from layer 0: the threshold rule on the
        same window without cache).
    max_tokens: generation length G (the number of mask positions appended to the prompt).
    block_length: semi-autoregressive block size; blocks are decoded left to right. Ignored by
        "elastic", whose window slides over the whole generated region as in the published code
        (so it need not divide max_tokens there).
    temperature: 0 is greedy; > 0 samples with Gumbel-max noise in float64, reproducible per `seed`.
    """

    method: str = "parallel"
    max_tokens: int = 128
    block_length: int = 32
    temperature: float = 0.0
    seed: int = 0
    steps: int | None = None
    remasking: str | None = None
    cfg_scale: float | None = None
    threshold: float | None = None
    factor: float | None = None
    refresh_interval: int | None = None
    tracking_budget: int | None = None
    mask_window: int | None = None
    verify_threshold: float | None = None
    acceptance: str | None = None
    draft_length: int | None = None
    drift_threshold: float | None = None
    track_num: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        for name, methods in _METHOD_ONLY.items():
            if getattr(self, name) is not None and self.method not in methods:
                raise ValueError(f"{name} applies to method {' or '.join(methods)}, not {self.method!r}")
        _check(self.max_tokens > 0, f"max_tokens must be positive, got {self.max_tokens}")
        _check(self.block_length > 0, f"block_length must be positive, got {self.block_length}")
        _check(self.method == "elastic" or self.max_tokens % self.block_length == 0,
               f"max_tokens ({self.max_tokens}) must be a multiple of block_length ({self.block_length})")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        if self.steps is not None:
            _check(self.steps > 0 and self.steps % self.num_blocks == 0,
                   f"steps ({self.steps}) must be a positive multiple of the number of blocks "
                   f"({self.num_blocks} = max_tokens / block_length)")
        if self.remasking is not None:
            _check(self.remasking in REMASKING, f"remasking must be one of {REMASKING}, got {self.remasking!r}")
        if self.cfg_scale is not None:
            _check(self.cfg_scale >= 0, f"cfg_scale must be >= 0, got {self.cfg_scale}")
        if self.threshold is not None and self.factor is not None:
            raise ValueError("give either threshold or factor, not both")
        if self.factor is not None:
            _check(self.factor > 0, f"factor must be positive, got {self.factor}")
        if self.tracking_budget is not None:
            _check(self.tracking_budget >= 0, f"tracking_budget must be >= 0, got {self.tracking_budget}")
        if self.draft_length is not None:
            _check(0 < self.draft_length <= self.block_length,
                   f"draft_length must be in [1, block_length], got {self.draft_length}")
        if self.acceptance is not None:
            _check(self.acceptance in ACCEPTANCE, f"acceptance must be one of {ACCEPTANCE}, got {self.acceptance!r}")
        if self.verify_threshold is not None:
            _check(0 <= self.verify_threshold <= 1, f"verify_threshold must be in [0, 1], got {self.verify_threshold}")
        if self.method in ("flash-cache", "flash-verify"):
            _check(self.window >= self.block_length,
                   f"mask_window ({self.window}) must cover a block (block_length {self.block_length})")
        if self.method == "elastic":
            _check(self.window > 0, f"mask_window must be positive, got {self.window}")
        if self.drift_threshold is not None:
            _check(self.drift_threshold >= 0, f"drift_threshold must be >= 0, got {self.drift_threshold}")
        if self.track_num is not None:
            _check(self.track_num > 0, f"track_num must be positive, got {self.track_num}")
        if self.refresh_interval is not None:
            _check(self.refresh_interval > 0, f"refresh_interval must be positive, got {self.refresh_interval}")

    @property
    def num_blocks(self) -> int:
        return self.max_tokens // self.block_length

    @property
    def steps_per_block(self) -> int:
        """Reference sampler: denoising steps per block (default: one token per step)."""
        return (self.steps or self.max_tokens) // self.num_blocks

    @property
    def confidence_threshold(self) -> float:
        return 0.9 if self.threshold is None else self.threshold

    @property
    def window(self) -> int:
        """Flash-Cache's beta_m, Elastic-Cache's beta."""
        if self.mask_window is not None:
            return self.mask_window
        return 16 if self.method == "elastic" else 64

    @property
    def tracked(self) -> int:
        """Flash-Cache's beta_t."""
        return 80 if self.tracking_budget is None else self.tracking_budget

    @property
    def gamma(self) -> float:
        """Flash-Verify's acceptance threshold."""
        return 0.8 if self.verify_threshold is None else self.verify_threshold

    @property
    def drift_gamma(self) -> float:
        """Elastic-Cache's refresh threshold on the attention cosine."""
        return 0.9 if self.drift_threshold is None else self.drift_threshold

    @property
    def track_per_layer(self) -> int:
        return 1 if self.track_num is None else self.track_num

    @property
    def drafts(self) -> int:
        return 4 if self.draft_length is None else self.draft_length

    @property
    def uses_cache(self) -> bool:
        return self.method in CACHED_METHODS

    @property
    def caches_hidden_states(self) -> bool:
        """Elastic-Cache's layer-aware refresh reads each layer's cached input hidden states."""
        return self.method == "elastic"

    @property
    def uses_random_remasking(self) -> bool:
        return self.remasking == "random"

    @property
    def guidance(self) -> float:
        return self.cfg_scale or 0.0

    def batch_key(self) -> tuple:
        """Requests with equal keys can share a batch; per-row values (temperature, seed, threshold or
        factor values) may differ inside it."""
        return (self.method, self.max_tokens, self.block_length,
                self.steps_per_block if self.method == "reference" else None,
                self.uses_random_remasking, self.guidance, self.factor is not None, self.refresh_interval,
                self.tracking_budget, self.mask_window, self.acceptance, self.draft_length,
                self.drift_threshold, self.track_num)


def _check(condition: bool, message: str):
    if not condition:
        raise ValueError(message)
