"""How much of the dense attention each routing policy keeps, on the embedded model's passkey prompts (CPU).

For each held-out passkey item of the given lengths: one full forward over the prompt and a 128-mask answer (a
decode's first step). At every layer, the first block's 32 mask rows attend densely; each policy picks the
prompt keys a step would read at an equal budget (a fraction of the prompt, sinks and a recent window included
for the region policies), and the recall is the share of the rows' prompt attention that falls on the picked
keys (mean over layers, heads and rows). Also the share of the attention on the pass key's own tokens (both
occurrences in the needle) that is kept.
Policies: centroid (k-means regions scored by their mean key), kmeans-bound (the same regions scored by their
per-dimension bounds), chunk (chunks scored by their bounds), window (the last keys), random (random chunks).

    PYTHONPATH=src python benchmarks/archive/routing_recall.py --lengths 1024 1900 --items 40 --budgets 0.125 0.0625
"""
from __future__ import annotations

import argparse

import torch

from flash_dllm import LLM
from flash_dllm.cache.regions import chunk_regions, kmeans_regions, region_scores, routed_keys
from flash_dllm.models.layers import apply_rotary, rotary_cos_sin
from flash_dllm.tasks import load_test_set

SIZE, SINKS, WINDOW, BLOCK = 32, 4, 32, 32


def picked(policy: str, keys: torch.Tensor, queries: torch.Tensor, budget: float, group: int, seed: int):
    """keys [Hkv, P, D], queries [T, H, D] -> [Hkv, P] bool, about budget * P keys."""
    Hkv, P, _ = keys.shape
    count = max(1, round(budget * P))
    if policy == "window":
        return (torch.arange(P) >= P - count).expand(Hkv, P)
    regions = kmeans_regions(keys, SIZE) if policy in ("centroid", "kmeans-bound") else chunk_regions(keys, SIZE)
    top_k = max(1, (count - SINKS - WINDOW) // SIZE)
    if policy == "random":
        g = torch.Generator().manual_seed(seed)
        scores = torch.rand(Hkv, regions.sizes.shape[1], generator=g)
        return routed_keys(regions, scores, top_k, SINKS, WINDOW)
    scores = region_scores(regions, queries, group, bounds=policy != "centroid")
    return routed_keys(regions, scores, top_k, SINKS, WINDOW)


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 1900])
    ap.add_argument("--items", type=int, default=40)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.125, 0.0625])
    args = ap.parse_args()
    llm = LLM(device="cpu", dtype="float32")
    model, cfg = llm.model, llm.config
    group = cfg.num_heads // cfg.num_kv_heads
    policies = ["centroid", "kmeans-bound", "chunk", "window", "random"]
    print("| prompt tokens | budget | " + " | ".join(f"{p} recall | {p} key digits" for p in policies) + " |")
    print("|---|---|" + "---|---|" * len(policies))
    for length in args.lengths:
        items = [item for item in load_test_set("passkey") if item.length == length][:args.items]
        totals = {(b, p): [0.0, 0.0, 0] for b in args.budgets for p in policies}
        for index, item in enumerate(items):
            prompt = llm.encode(item.prompt)
            P = len(prompt)
            needle = llm.encode(item.answer, chat_template=False)  # the key's digit tokens, where they occur
            is_key = torch.zeros(P, dtype=torch.bool)
            for start in range(P - len(needle) + 1):
                if prompt[start:start + len(needle)] == needle:
                    is_key[start:start + len(needle)] = True
            assert is_key.any(), "the pass key is not in the prompt's tokens"
            ids = torch.tensor(prompt + [llm.special.mask_id] * 128)[None]
            positions = torch.arange(ids.shape[1])[None]
            cos, sin = rotary_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
            x = model.embed(ids)
            for layer in model.layers:
                h = layer.attn_norm(x)
                q, k, _ = layer.attention.qkv_proj(h).split(layer.attention.qkv_proj.output_sizes, dim=-1)
                q = apply_rotary(q.view(1, -1, cfg.num_heads, cfg.head_dim), cos, sin)[0]
                k = apply_rotary(k.view(1, -1, cfg.num_kv_heads, cfg.head_dim), cos, sin)[0]
                rows = q[P:P + BLOCK]                                                   # [T, H, D]
                keys = k.repeat_interleave(group, dim=1)                                # [L, H, D]
                probs = torch.softmax(torch.einsum("thd,lhd->htl", rows, keys) * cfg.head_dim ** -0.5, dim=-1)
                prompt_probs = probs[..., :P]                                           # [H, T, P]
                for budget in args.budgets:
                    for policy in policies:
                        chosen = picked(policy, k[:P].transpose(0, 1), rows, budget, group, index)  # [Hkv, P]
                        chosen = chosen.repeat_interleave(group, dim=0)[:, None, :]     # [H, 1, P]
                        kept = (prompt_probs * chosen).sum(-1) / prompt_probs.sum(-1)
                        on_key = prompt_probs[..., is_key]
                        key_kept = (on_key * chosen[..., is_key]).sum() / on_key.sum().clamp(min=1e-12)
                        total = totals[budget, policy]
                        total[0] += kept.mean().item()
                        total[1] += key_kept.item()
                        total[2] += 1
                x = layer(x, cos, sin, None)
        for budget in args.budgets:
            cells = []
            for policy in policies:
                recall, key_recall, n = totals[budget, policy]
                cells += [f"{recall / n:.3f}", f"{key_recall / n:.3f}"]
            print(f"| {length} | {budget:g} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
