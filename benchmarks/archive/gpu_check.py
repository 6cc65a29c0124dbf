"""GPU correctness of the foundation: the model and the decoders on CUDA against the CPU float32 path.

    PYTHONPATH=src python benchmarks/archive/gpu_check.py
"""
import json
import pathlib
import tempfile

import torch

from flash_dllm import LLM, SamplingParams, load_model
from flash_dllm.config import PRESETS
from flash_dllm.models import random_model, save_checkpoint


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    assert not torch.isnan(a).any()
    return ((a - b).norm() / b.norm()).item()


def main():
    rows = []
    with tempfile.TemporaryDirectory() as path:
        config = {**PRESETS["llada-tiny"], "d_model": 256, "n_heads": 8, "n_kv_heads": 4, "n_layers": 3,
                  "mlp_hidden_size": 512}
        pathlib.Path(path, "config.json").write_text(json.dumps(config))
        # Weights at a trained model's scale for the logits check; larger ones (peaked confidences)
        # for the decoding check below.
        save_checkpoint(random_model(path, "cpu", torch.float32), path, config, num_shards=2, dtype=torch.bfloat16)
        ref = load_model(path, "cpu", torch.float32)
        ids = torch.randint(0, config["vocab_size"], (4, 300))
        expected = ref(ids)
        for dtype, budget in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            gpu = load_model(path, "cuda", dtype)  # safetensors read straight to the GPU
            mask = torch.ones_like(ids, dtype=torch.bool)
            err = rel_err(gpu(ids.cuda(), attention_mask=mask.cuda()).float(), expected)
            rows.append((f"logits {dtype}", f"{err:.2e}", "ok" if err < budget else "FAIL"))
        save_checkpoint(random_model(path, "cpu", torch.float32, std=0.3), path, config, num_shards=2)
        prompts = [[0, 5, 6, 7, 8], [0, 9] * 20, [0, 11, 12]]
        for params in (SamplingParams(method="reference", max_tokens=64, block_length=16),
                       SamplingParams(method="parallel", max_tokens=64, block_length=16, threshold=0.5),
                       SamplingParams(method="reference", max_tokens=32, block_length=16, steps=16,
                                      temperature=1.0, seed=3)):
            outs = {device: LLM(path, device=device, dtype="float32").generate(prompts, params)
                    for device in ("cpu", "cuda")}
            same = all(a.token_ids == b.token_ids for a, b in zip(outs["cpu"], outs["cuda"]))
            rows.append((f"{params.method} T={params.temperature} tokens cuda fp32 == cpu fp32", str(same),
                         "ok" if same else "FAIL"))
    print("| check | value | verdict |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
