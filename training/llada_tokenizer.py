"""Train a byte-level BPE tokenizer in LLaDA's layout (tokenizer.json + tokenizer_config.json with its chat
template): the embedded model's tokenizer (build_assets.py) and the test fixtures' tiny checkpoints."""
from __future__ import annotations

import json
from pathlib import Path

EOT_TOKEN, MASK_TOKEN = "<|eot_id|>", "<|mdm_mask|>"

# LLaDA's special tokens (in the roles of its tokenizer) and its chat template.
LLADA_SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>", EOT_TOKEN, MASK_TOKEN,
                        "<|start_header_id|>", "<|end_header_id|>")
LLADA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def train_llada_tokenizer(corpus, vocab_size: int, path: str | Path, model_max_length: int = 4096):
    """Train a byte-level BPE tokenizer on an iterable of strings and save it in LLaDA's layout
    (tokenizer.json + tokenizer_config.json with its chat template); special tokens take ids 0-5.
    Digits are always single tokens, so that numbers are spelled the same way everywhere."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(LLADA_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    bos, eos, _, mask = LLADA_SPECIAL_TOKENS[:4]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "pad_token": eos, "mask_token": mask, "add_bos_token": False,
              "model_max_length": model_max_length, "chat_template": LLADA_CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tokenizer
