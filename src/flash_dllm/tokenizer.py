"""Tokenizer and special token ids, both read from the checkpoint directory (the architecture names its special
tokens where neither config.json nor the tokenizer's settings give their ids: ModelConfig.mask_token,
end_of_turn_tokens)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .config import ModelConfig


@dataclass(frozen=True)
class SpecialTokens:
    mask_id: int
    stop_ids: tuple[int, ...]  # generation ends at the first of these (eos, end of turn)
    pad_id: int


def load_tokenizer(path: Path | None, vocab_merges_class: str | None = None):
    """The directory's tokenizer with its chat template, without remote code: from tokenizer.json, or from
    vocab.json + merges.txt through the transformers class the architecture names (Dream ships its tokenizer
    that way, with a remote-code class that copies Qwen2's); None if it has neither."""
    if path is None:
        return None
    import transformers

    if (path / "tokenizer.json").is_file():
        return transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    if vocab_merges_class and (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        return getattr(transformers, vocab_merges_class).from_pretrained(str(path))
    return None


def special_tokens(cfg: ModelConfig, path: Path | None, tokenizer) -> SpecialTokens:
    """The mask id: config.json's, else the tokenizer's mask token, else the architecture's mask token in its
    vocabulary. The stop ids: config.json's eos, the architecture's end-of-turn tokens, the tokenizer's eos and
    generation_config.json's eos."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    mask_id = next((i for i in (cfg.mask_token_id, getattr(tokenizer, "mask_token_id", None),
                                vocab.get(cfg.mask_token)) if i is not None), None)
    if mask_id is None:
        named = f" or a {cfg.mask_token} token" if cfg.mask_token else ""
        raise ValueError(f"no mask token id: config.json has no mask_token_id and the tokenizer no mask_token{named}")
    stops = [cfg.eos_token_id, *(vocab.get(token) for token in cfg.end_of_turn_tokens)]
    if tokenizer is not None:
        stops.append(tokenizer.eos_token_id)
    generation_config = path / "generation_config.json" if path is not None else None
    if generation_config is not None and generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        stops.extend(eos if isinstance(eos, list) else [eos])
    stop_ids = tuple(sorted({int(i) for i in stops if i is not None}))
    if not stop_ids:
        raise ValueError("no eos token id in config.json, generation_config.json or the tokenizer")
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else stop_ids[0]
    for name, value in (("mask", mask_id), ("pad", pad_id), *(("stop", s) for s in stop_ids)):
        if not 0 <= value < cfg.vocab_size:
            raise ValueError(f"{name} token id {value} is outside the vocabulary of {cfg.vocab_size}")
    return SpecialTokens(mask_id=int(mask_id), stop_ids=stop_ids, pad_id=int(pad_id))
