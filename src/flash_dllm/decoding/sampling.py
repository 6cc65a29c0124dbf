"""Token sampling and confidences, with counter-based random numbers.

The noise for a request depends only on (its seed, its step counter, the generated position, the
vocabulary index): never on the batch it shares or on the device. So a sampled request decodes to the
same tokens alone or batched, and the draw needs no generator state (graph-capturable, no host sync).
"""
from __future__ import annotations

import torch

from ..kernels.greedy_tokens import greedy_tokens, greedy_tokens_ref


_MASK64 = (1 << 64) - 1


def _int64(value: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = _int64(0x9E3779B97F4A7C15), _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)
_STEP, _COLUMN = _int64(0xD6E8FEB86659FD93), _int64(0xE7037ED1A0B428DB)
_STREAM = 0xA0761D6478BD642F


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser; int64 products wrap, as the algorithm needs."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def counter_uniform(seed: torch.Tensor, step: torch.Tensor, column: torch.Tensor, stream: int,
                    vocab_size: int | None = None) -> torch.Tensor:
    """Uniform float64 numbers in (0, 1).

    seed, step [B]; column [B, n] (generated positions) -> [B, n], or [B, n, vocab_size] if given.
    """
    key = seed * _GOLDEN + step * _STEP + _int64(stream * _STREAM)
    key = _mix64(key[:, None] + column * _COLUMN)
    if vocab_size is not None:
        key = key[..., None] + torch.arange(vocab_size, device=key.device) * _GOLDEN
    bits = _shift_right(_mix64(key), 11)  # the top 53 bits
    return (bits.double() + 0.5) * 2.0**-53


NOISE_STREAM, REMASK_STREAM = 1, 2


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, column: torch.Tensor, stream: int,
                 vocab_size: int | None = None) -> torch.Tensor:
    """Standard Gumbel noise -log(-log u) on counter_uniform's numbers (same arguments, float64): argmax(x + g)
    draws from softmax(x), argmax(x + T g) from softmax(x / T)."""
    return -torch.log(-torch.log(counter_uniform(seed, step, column, stream, vocab_size)))


# The float64 copies of one chunk of requests' logits (a chunk is at least one request): the sampler's working
# memory is a few of these, not a few copies of the whole batch's (0.5 GB each at batch 32 x 16 columns over
# LLaDA's 126k vocabulary).
CHUNK_BYTES = 1 << 26


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, step: torch.Tensor,
                  column: torch.Tensor, sample: bool, mask_id: int,
                  kernels: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, n, V] -> (tokens [B, n], confidence [B, n] float64 = softmax(logits)[token]).

    With `sample`, tokens are Gumbel-max draws at each row's temperature: argmax(logits + T * g) on float64,
    which equals LLaDA's argmax(exp(logits) / (-log u)^T); rows with T = 0 stay greedy. The mask token is
    never a candidate (LLaDA's code could "decode" a position back to a mask); confidences are the
    unmodified softmax. Requests are taken in chunks of CHUNK_BYTES (every operation is per position, so the
    numbers are those of the whole batch at once). With `kernels` and no sampling, one Triton pass over the
    logits (kernels/greedy_tokens.py: the same tokens, the confidences to float64's last bits).
    """
    if kernels and not sample:
        tokens, confidence = greedy_tokens(logits.reshape(-1, logits.shape[-1]), mask_id)
        return tokens.view(logits.shape[:-1]), confidence.view(logits.shape[:-1])
    per_chunk = max(1, CHUNK_BYTES // max(1, logits[0].numel() * 8))
    if logits.shape[0] <= per_chunk:
        return _sample_chunk(logits, temperature, seed, step, column, sample, mask_id)
    parts = [_sample_chunk(*(t[start:start + per_chunk] for t in (logits, temperature, seed, step, column)),
                           sample, mask_id) for start in range(0, logits.shape[0], per_chunk)]
    return torch.cat([tokens for tokens, _ in parts]), torch.cat([confidence for _, confidence in parts])


def _sample_chunk(logits, temperature, seed, step, column, sample: bool, mask_id: int):
    if not sample:
        return greedy_tokens_ref(logits, mask_id)
    logits = logits.double()
    noisy = logits + temperature.double()[:, None, None] * gumbel_noise(seed, step, column, NOISE_STREAM,
                                                                       logits.shape[-1])
    return greedy_tokens_ref(logits, mask_id, scores=noisy)
