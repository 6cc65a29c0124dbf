"""Dream's sampler (`diffusion_generate`, Dream-org/Dream): no blocks, the whole generation starts masked, and
`steps` denoising steps follow the timesteps `linspace(1, eps, steps + 1)`. Step i (t = timesteps[i],
s = timesteps[i + 1]) is one full forward over the sequence, then
    origin        every masked position is revealed independently with probability 1 - s/t (all of them at
                  the last step), its token drawn from the (temperature, top_p, top_k filtered) distribution;
    maskgit_plus  confidence = the chosen token's probability,
    topk_margin   confidence = top-1 minus top-2 probability,
    entropy       confidence = the negative entropy of the distribution:
                  int(masked * (1 - s/t)) positions are revealed (all the remaining ones at the last step), the
                  most confident ones, or, with alg_temp > 0, drawn without replacement from
                  softmax(confidence / alg_temp) (Gumbel-top-k).
The distribution is softmax(logits / temperature) (temperature 0: the logits), top_p then top_k filtered as
the published `top_p_logits` / `top_k_logits` do; temperature > 0 draws the token from it, 0 takes the argmax.

Deliberate differences from the published code:
- the number of positions to reveal uses each row's own masked count (the published code takes the batch's
  mean, so rows of different lengths or progress get the wrong schedule in a batch);
- the randomness is the engine's counter-based noise (decoding/sampling.py): token draws are Gumbel-max,
  the origin reveal and the alg_temp draw are uniform per (seed, step, position), so a request decodes the
  same alone or batched; the draws follow the published distributions, not torch's RNG stream;
- the mask token is never a candidate token (the published code could "reveal" a position as the mask);
- probabilities are computed in float64 (the published code: in the model's dtype);
- rows stop when every position up to the first eos/eot is decoded (the engine's rule; the tokens kept are
  the ones the published code returns before its first eos).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config import ATTENTION_KINDS
from .base import DecodingMethod, Settings, check, knob
from .sampling import NOISE_STREAM, REMASK_STREAM, counter_uniform, gumbel_noise
from .transfer import transfer_top_k

if TYPE_CHECKING:
    from ..batch import DecodeBatch
    from ..engine.model_runner import ModelRunner

ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")
CHUNK_BYTES = 1 << 28  # the float64 logits of one chunk of generated columns, over the whole batch


@dataclass(frozen=True)
class DreamSettings(Settings):
    steps: int | None = knob(None, "total denoising steps (default: max_tokens, one token per step)")
    eps: float = knob(1e-3, "in (0, 1): the last timestep, timesteps = linspace(1, eps, steps + 1)")
    alg: str = knob("origin", "Dream's reveal rule: origin (random, 1 - s/t of the masks), or the most "
                              "confident int(masked * (1 - s/t)) by token probability, top-2 margin or "
                              "negative entropy", choices=ALGORITHMS)
    alg_temp: float = knob(0.0, ">= 0: draw the revealed positions from softmax(confidence / alg_temp) "
                                "(0: the most confident)")
    top_p: float = knob(1.0, "in (0, 1]: nucleus filter of the token distribution (1: off)")
    top_k: int = knob(0, ">= 0: keep only the k most likely tokens (0: off)")

    def __post_init__(self):
        super().__post_init__()
        if self.steps is not None:
            check(self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        check(0 < self.eps < 1, f"eps must be in (0, 1), got {self.eps}")
        check(self.alg_temp >= 0, f"alg_temp must be >= 0, got {self.alg_temp}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k >= 0, f"top_k must be >= 0 (0: off), got {self.top_k}")


def filtered_logits(logits: torch.Tensor, temperature: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """logits [B, n, V] -> float64 logits / temperature (per row; rows with 0 keep the logits), with the tokens
    that top_p, then top_k, remove set to -inf (the published top_p_logits and top_k_logits)."""
    x = logits.double()
    temperature = temperature.double()[:, None, None]
    x = x / torch.where(temperature > 0, temperature, 1.0)
    if top_p < 1:
        ordered, order = torch.sort(x, dim=-1, descending=True)
        remove = torch.softmax(ordered, dim=-1).cumsum(dim=-1) > top_p
        remove = torch.cat([torch.zeros_like(remove[..., :1]), remove[..., :-1]], dim=-1)  # keep the first above
        x = x.masked_fill(torch.zeros_like(remove).scatter(-1, order, remove), float("-inf"))
    if top_k > 0:
        kth = torch.topk(x, min(top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    return x


def dream_tokens(logits: torch.Tensor, batch: DecodeBatch, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, n, V] of the generated positions offsets [B, n] -> (tokens [B, n], confidence [B, n] float64)
    under the alg's confidence."""
    settings = batch.params.settings
    x = filtered_logits(logits, batch.temperature, settings.top_p, settings.top_k)
    scores = x
    if batch.is_sampling:  # Gumbel-max draws from softmax(x); rows with temperature 0 stay greedy
        gumbel = gumbel_noise(batch.seed, batch.counters.steps, offsets, NOISE_STREAM, x.shape[-1])
        scores = x + (batch.temperature > 0).double()[:, None, None] * gumbel
    scores = scores.index_fill(-1, torch.full((1,), batch.mask_id, device=scores.device), float("-inf"))
    tokens = scores.argmax(dim=-1)
    probs = torch.softmax(x, dim=-1)
    if settings.alg == "topk_margin":
        top2 = torch.topk(probs, 2, dim=-1).values
        confidence = top2[..., 0] - top2[..., 1]
    elif settings.alg == "entropy":
        confidence = (probs * torch.log(probs + 1e-10)).sum(dim=-1)
    else:
        confidence = probs.gather(-1, tokens[..., None]).squeeze(-1)
    return tokens, confidence


def step_ratio(batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's 1 - s/t at its step (float32, as the published code computes it) [B], and whether the step
    is its last [B]."""
    settings = batch.params.settings
    steps = settings.steps or batch.params.max_tokens
    timesteps = torch.linspace(1, settings.eps, steps + 1, device=batch.tokens.device)
    i = batch.counters.steps.clamp(max=steps - 1)
    return 1 - timesteps[i + 1] / timesteps[i], batch.counters.steps >= steps - 1


def reveal_counts(masked: torch.Tensor, ratio: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Positions to reveal per row [B]: int(masked * (1 - s/t)) of the row's own masked count; all at the last
    step."""
    count = masked.sum(dim=1)
    return torch.where(last, count, (count.float() * ratio).long())


class Dream(DecodingMethod):
    name = "dream"
    Settings = DreamSettings
    uses_blocks = False
    handles_logit_shift = True  # full forwards: the runner's logits_at applies the shift
    attention_patterns = ATTENTION_KINDS  # full forwards, under the model's pattern

    def step(self, runner: ModelRunner, batch: DecodeBatch):
        settings, start = batch.params.settings, batch.gen_start
        B, generated_length = batch.tokens.shape[0], batch.params.max_tokens
        offsets = torch.arange(generated_length, device=batch.tokens.device).expand(B, -1)
        batch.count_query_rows([row.length for row in batch.rows])
        hidden = runner.full_hidden(batch.tokens, batch.positions, batch.attention_mask)
        # Every generated position's logits at once, in float64, would take B x G x V x 8 bytes several times
        # over (tens of GB at Dream's vocabulary): chunks of columns bound the working memory.
        chunk = max(1, CHUNK_BYTES // (B * runner.model.config.vocab_size * 8))
        tokens, confidence = (torch.cat(parts, dim=1) for parts in zip(*(
            dream_tokens(runner.logits_at(hidden, start + offsets[:, i:i + chunk]), batch, offsets[:, i:i + chunk])
            for i in range(0, generated_length, chunk))))
        generated = batch.tokens[:, start:]
        masked = generated == batch.mask_id
        ratio, last = step_ratio(batch)
        if settings.alg == "origin":
            u = counter_uniform(batch.seed, batch.counters.steps, offsets, REMASK_STREAM)
            reveal = masked & ((u < ratio[:, None]) | last[:, None])
        else:
            confidence = confidence.masked_fill(~masked, float("-inf"))
            if settings.alg_temp > 0:  # k draws without replacement from softmax(confidence / alg_temp)
                confidence = confidence / settings.alg_temp + gumbel_noise(batch.seed, batch.counters.steps, offsets,
                                                                           REMASK_STREAM)
            reveal = transfer_top_k(confidence, masked, reveal_counts(masked, ratio, last))
        batch.tokens[:, start:] = torch.where(reveal, tokens, generated)
        batch.counters.steps += 1
        batch.counters.nfe += 1
