"""Where a k-means rebuild's time goes (cache/routing.update_kmeans, one layer): the seeding, the Lloyd iterations,
the regions' summaries and the region-ordered layout, at LLaDA-8B's KV heads (32 x 128, bf16) and one request of
P prompt keys; each part timed eagerly (as a rebuild runs) with CUDA events, the median of 5 after a warm-up.

    PYTHONPATH=src python benchmarks/archive/kmeans_rebuild.py --prompt-lengths 4096 8192 16384
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from flash_dllm.cache.regions import farthest_directions, kmeans_assignment, region_summaries
from flash_dllm.cache.routing import CHUNK, SINKS, WINDOW, region_layout

KV_HEADS, HEAD_DIM = 32, 128


def timed_ms(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    args = ap.parse_args()
    torch.manual_seed(0)
    print("| prompt keys | regions | seeding ms | Lloyd (4) ms | summaries ms | layout ms | rebuild ms (all) |")
    print("|---|---|---|---|---|---|---|")
    for P in args.prompt_lengths:
        keys = torch.randn(KV_HEADS, P, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        position = torch.arange(P, device="cuda")
        routable = ((position >= SINKS) & (position < P - WINDOW)).expand(KV_HEADS, P)
        R = -(-P // CHUNK)
        keys32 = keys.float().masked_fill(~routable[..., None], 0.0)
        directions = F.normalize(keys32 - keys32.mean(dim=1, keepdim=True), dim=-1)
        seeding = timed_ms(lambda: farthest_directions(directions, routable, R))
        assignment = timed_ms(lambda: kmeans_assignment(keys, CHUNK, routable))
        assign = kmeans_assignment(keys, CHUNK, routable)
        summaries = timed_ms(lambda: region_summaries(keys, assign, R))
        layout = timed_ms(lambda: keys.gather(1, region_layout(assign[None], routable[:1])[0][..., None]
                                              .expand(-1, -1, HEAD_DIM)))
        print(f"| {P} | {R} | {seeding:.1f} | {assignment - seeding:.1f} | {summaries:.1f} | {layout:.1f} | "
              f"{assignment + summaries + layout:.1f} |", flush=True)


if __name__ == "__main__":
    main()
