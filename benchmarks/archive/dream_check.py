"""Dream on the GPU: its logits against the CPU float32 path, and every cached method's tokens with the Triton
kernels against the same method on their PyTorch references (random Dream weights, float32).

    PYTHONPATH=src python benchmarks/archive/dream_check.py [--model random:dream-7b] [--device cuda]
"""
import argparse
import json
import pathlib
import tempfile

import torch

from flash_dllm import LLM, SamplingParams, load_model
from flash_dllm.config import PRESETS
from flash_dllm.markdown import markdown_table
from flash_dllm.models import random_model, save_checkpoint

CACHED_METHODS = {
    "prefix-cache": {}, "dual-cache": {}, "flash-cache": {}, "flash-verify": {},
    "elastic": dict(drift_threshold=0.95),  # some steps refresh, some reuse
}


def rel_err(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert not torch.isnan(a).any()
    return ((a - b).norm() / b.norm()).item()


def logits_rows(device: str) -> list[tuple]:
    """A small Dream (GQA 8/2, biases, 3 layers) saved in bf16: logits on `device` against CPU float32, with a
    left-padded batch (positions from each row's first token)."""
    rows = []
    with tempfile.TemporaryDirectory() as path:
        config = {**PRESETS["dream-tiny"], "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
                  "num_hidden_layers": 3, "intermediate_size": 512}
        pathlib.Path(path, "config.json").write_text(json.dumps(config))
        model = random_model(path, "cpu", torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0.0, 0.02)
        save_checkpoint(model, path, config, num_shards=2, dtype=torch.bfloat16)
        ref = load_model(path, "cpu", torch.float32)
        ids = torch.randint(4, config["vocab_size"], (4, 300))
        mask = torch.ones_like(ids, dtype=torch.bool)
        mask[1, :37] = False  # left padding
        expected = ref(ids, attention_mask=mask)[mask]
        for dtype, budget in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            on_device = load_model(path, device, dtype)
            err = rel_err(on_device(ids.to(device), attention_mask=mask.to(device)).float()[mask.to(device)], expected)
            rows.append((f"Dream logits {str(dtype)[6:]} {device} vs cpu float32", f"{err:.2e}",
                         "ok" if err < budget else "FAIL"))
    return rows


def kernel_rows(spec: str, device: str) -> list[tuple]:
    """Each cached method's tokens with the kernels against its PyTorch references, same random weights."""
    common = dict(device=device, dtype="float32", cuda_graphs=False, kv_cache_bytes=4 << 30)
    with_kernels = LLM(spec, kernels=True, **common)
    generator = torch.Generator().manual_seed(0)
    vocab, mask_id = with_kernels.config.vocab_size, with_kernels.special.mask_id
    prompts = [torch.randint(4, vocab, (int(n),), generator=generator).tolist()
               for n in torch.randint(64, 101, (8,), generator=generator)]
    prompts = [[t for t in p if t != mask_id] for p in prompts]
    outputs = {}
    for method, knobs in CACHED_METHODS.items():
        params = SamplingParams(method=method, max_tokens=32, block_length=16, **knobs)
        outputs[method] = [o.token_ids for o in with_kernels.generate(prompts, params)]
    del with_kernels
    torch.cuda.empty_cache() if device.startswith("cuda") else None
    reference = LLM(spec, kernels=False, **common)
    rows = []
    for method, knobs in CACHED_METHODS.items():
        params = SamplingParams(method=method, max_tokens=32, block_length=16, **knobs)
        plain = [o.token_ids for o in reference.generate(prompts, params)]
        same = sum(a == b for a, b in zip(outputs[method], plain))
        rows.append((f"{method} tokens, kernels vs references ({spec}, float32)", f"{same}/{len(prompts)}",
                     "ok" if same == len(prompts) else "DIFFERS"))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:dream-7b")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    rows = logits_rows(args.device) + kernel_rows(args.model, args.device)
    print(markdown_table(("check", "value", "verdict"), rows))


if __name__ == "__main__":
    main()
