"""Build the placeholder embedded model: a tiny LLaDA-format checkpoint with random weights and a small
byte-level BPE tokenizer in LLaDA's layout. It exercises every code path (loading, chat template,
decoding) until the trained embedded model (issue 3) replaces it.

    python training/make_placeholder.py src/flash_dllm/assets/default
"""
import json
import sys
from pathlib import Path

import torch

from flash_dllm.config import PRESETS
from flash_dllm.models import random_model, save_checkpoint
from flash_dllm.tokenizer import train_llada_tokenizer

CONFIG = {**PRESETS["llada-8b"], "d_model": 128, "n_heads": 4, "n_kv_heads": 4, "n_layers": 2,
          "mlp_hidden_size": 256, "vocab_size": 512, "embedding_size": 512, "max_sequence_length": 2048,
          "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1, "mask_token_id": 3}
CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? 48 / 2 = 24. 48 + 24 = 72. #### 72",
    "x = 3\nfor i in range(4):\n    if i % 2 == 0:\n        x = x + i\nprint(x)",
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
    "The pass key is 71432. Remember it. 71432 is the pass key. What is the pass key?",
    "Hello! How can I help you today? Sure, here is the answer to your question.",
] * 10


def main(out: str):
    path = Path(out)
    model = random_model(str(_write_config(path)), "cpu", torch.float32, seed=0, std=0.02)
    save_checkpoint(model, path, CONFIG, dtype=torch.bfloat16)
    train_llada_tokenizer(CORPUS, CONFIG["vocab_size"], path, model_max_length=CONFIG["max_sequence_length"])
    generation = {"bos_token_id": 0, "eos_token_id": [1, 2], "pad_token_id": 1}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _write_config(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2))
    return path


if __name__ == "__main__":
    main(sys.argv[1])
