"""Regions of a prompt's keys, and the routing that picks the ones a step reads (issue 17's first pieces).

A long prompt's KV dominates what a denoising step reads. Its keys, per layer and KV head, are grouped into
regions, each summarised by a centroid; a step scores the centroids with its queries and opens only the best
regions, plus the attention sinks (the prompt's first tokens) and a recent window (its last). Two groupings:
    chunk   contiguous runs of `size` positions: centroid = the mean key, with per-dimension bounds (an upper
            bound of any key's score in the chunk, as Quest scores pages);
    kmeans  spherical k-means of the mean-centred keys, about `size` keys a cluster, seeded farthest-first and run
            a few iterations; its centroid is the mean raw key of the cluster, with the cluster's bounds
            (cache/routing.py's `kmeans` policy builds these regions when a pass writes a prompt's keys).
A region is scored by its centroid or by its bounds.
Each grouping also gives the positions in region order (`order`, with `starts`): a kernel that reads a region
reads one contiguous range of it. Everything here is plain PyTorch on the device (no host reads).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


MAX_SIMILARITIES = 2**26  # key-to-centre similarities held at once (256 MB in fp32)


@dataclass
class Regions:
    """A prompt's keys grouped into R regions for each of G groups (layer x KV head, flattened)."""

    centroids: torch.Tensor     # [G, R, D] fp32: the mean key of each region
    lower: torch.Tensor         # [G, R, D] fp32: per-dimension bounds of its keys (+-inf: an empty region)
    upper: torch.Tensor
    order: torch.Tensor         # [G, P] long: the positions, region after region
    starts: torch.Tensor        # [G, R + 1] long: region r is order[g, starts[g, r]:starts[g, r + 1]]

    @property
    def sizes(self) -> torch.Tensor:
        return self.starts.diff(dim=-1)


def chunk_regions(keys: torch.Tensor, size: int) -> Regions:
    """keys [G, P, D] -> contiguous chunks of `size` positions (the last may be shorter)."""
    G, P, D = keys.shape
    R = -(-P // size)
    padded = F.pad(keys.float(), (0, 0, 0, R * size - P)).view(G, R, size, D)
    valid = (torch.arange(R * size, device=keys.device) < P).view(1, R, size, 1)
    count = valid.sum(dim=2).clamp(min=1)
    centroids = padded.sum(dim=2) / count
    lower = torch.where(valid, padded, float("inf")).amin(dim=2)
    upper = torch.where(valid, padded, float("-inf")).amax(dim=2)
    starts = (torch.arange(R + 1, device=keys.device) * size).clamp(max=P).expand(G, R + 1).contiguous()
    return Regions(centroids, lower, upper, torch.arange(P, device=keys.device).expand(G, P).contiguous(), starts)


def farthest_directions(directions: torch.Tensor, valid: torch.Tensor, count: int) -> torch.Tensor:
    """directions [G, P, D] (unit rows) -> [G, count, D]: the first valid row, then each time the valid row least
    similar to those taken (a deterministic k-means++). `count` sequential steps: the cost of a rebuild at long
    prompts (a parallel split into halves took duplicate seeds, and k-means kept two clusters merged)."""
    G, P, D = directions.shape
    taken = directions.new_empty(G, count, D)
    taken[:, :1] = directions.gather(1, valid.long().argmax(dim=1)[:, None, None].expand(G, 1, D))
    nearest = (directions @ taken[:, :1].transpose(1, 2))[..., 0].masked_fill(~valid, float("inf"))  # [G, P]
    for index in range(1, count):
        taken[:, index:index + 1] = directions.gather(1, nearest.argmin(dim=1)[:, None, None].expand(G, 1, D))
        nearest = torch.maximum(nearest, (directions @ taken[:, index:index + 1].transpose(1, 2))[..., 0])
    return taken


def kmeans_assignment(keys: torch.Tensor, size: int, valid: torch.Tensor | None = None,
                      iterations: int = 4) -> torch.Tensor:
    """keys [G, P, D], valid [G, P] bool (default: all) -> [G, P] long: each valid key's cluster (-1: not valid),
    about `size` valid keys a cluster, by spherical k-means of the mean-centred valid keys (cosine assignment),
    seeded by `farthest_directions` (deterministic). Clusters past a group's count (its valid keys / size,
    rounded up) stay unused; a cluster that empties keeps its direction."""
    G, P, D = keys.shape
    valid = torch.ones(G, P, dtype=torch.bool, device=keys.device) if valid is None else valid
    R = -(-P // size)
    step = max(1, MAX_SIMILARITIES // (P * R))
    if G > step:  # the [groups, P, R] similarities of long prompts, a slice of the groups at a time
        return torch.cat([kmeans_assignment(keys[g:g + step], size, valid[g:g + step], iterations)
                          for g in range(0, G, step)])
    count = valid.sum(dim=1)
    live = torch.arange(R, device=keys.device) < (-(-count // size))[:, None]  # [G, R]
    keys32 = keys.float().masked_fill(~valid[..., None], 0.0)
    mean = keys32.sum(dim=1, keepdim=True) / count.clamp(min=1)[:, None, None]
    directions = F.normalize(keys32 - mean, dim=-1).masked_fill(~valid[..., None], 0.0)     # invalid: no weight
    centres = farthest_directions(directions, valid, R)
    nearest = lambda: (directions @ centres.transpose(1, 2)).masked_fill(~live[:, None], float("-inf")).argmax(dim=-1)
    for _ in range(iterations):
        sums = torch.zeros(G, R, D, device=keys.device).scatter_add_(1, nearest()[..., None].expand(G, P, D),
                                                                    directions)
        centres = torch.where(sums.norm(dim=-1, keepdim=True) > 0, F.normalize(sums, dim=-1), centres)
    assign = nearest()
    return assign.masked_fill(~valid, -1)


def region_summaries(keys: torch.Tensor, assign: torch.Tensor, num_regions: int):
    """keys [G, P, D], assign [G, P] (a key's region, -1: none) -> the mean key [G, R, D], per-dimension lower
    and upper bounds [G, R, D] (+-inf: an empty region), all fp32, and the sizes [G, R] of the regions."""
    G, P, D = keys.shape
    member = (assign >= 0)[..., None]
    index = assign.clamp(min=0)[..., None].expand(G, P, D)
    keys32 = keys.float()
    sizes = torch.zeros(G, num_regions, dtype=torch.long, device=keys.device).scatter_add_(
        1, assign.clamp(min=0), (assign >= 0).long())
    sums = torch.zeros(G, num_regions, D, device=keys.device).scatter_add_(1, index, keys32 * member)
    lower = torch.full((G, num_regions, D), float("inf"), device=keys.device).scatter_reduce_(
        1, index, keys32.masked_fill(~member, float("inf")), "amin")
    upper = torch.full((G, num_regions, D), float("-inf"), device=keys.device).scatter_reduce_(
        1, index, keys32.masked_fill(~member, float("-inf")), "amax")
    return sums / sizes.clamp(min=1)[..., None], lower, upper, sizes


def kmeans_regions(keys: torch.Tensor, size: int, iterations: int = 4) -> Regions:
    """keys [G, P, D] -> about P / size clusters per group (`kmeans_assignment`); a cluster's centroid is the mean
    raw key of its members, with their bounds."""
    G, P, D = keys.shape
    assign = kmeans_assignment(keys, size, iterations=iterations)
    centroids, lower, upper, sizes = region_summaries(keys, assign, -(-P // size))
    order = torch.sort(assign, dim=1, stable=True).indices                                 # by cluster, then position
    return Regions(centroids, lower, upper, order, F.pad(sizes.cumsum(dim=1), (1, 0)))


def region_scores(regions: Regions, queries: torch.Tensor, group: int, bounds: bool = True) -> torch.Tensor:
    """queries [T, G * group, D] (a step's query rows of one request; `group` query heads per KV head) ->
    [G, R]: how much each region may matter to the step, shared by all its rows: the largest over rows and
    heads of the upper bound of any key's score in the region (`bounds`), or of the centroid's score (empty
    regions: -inf)."""
    T, H, D = queries.shape
    q = queries.float().view(T, H // group, group, D).permute(1, 0, 2, 3).reshape(H // group, T * group, D)
    if bounds:  # sum over d of max(q_d * lower_d, q_d * upper_d), as two products
        scores = q.clamp(min=0) @ regions.upper.transpose(1, 2) + q.clamp(max=0) @ regions.lower.transpose(1, 2)
    else:
        scores = q @ regions.centroids.transpose(1, 2)
    return scores.amax(dim=1).masked_fill(regions.sizes == 0, float("-inf"))


def routed_keys(regions: Regions, scores: torch.Tensor, top_k: int, sinks: int, window: int) -> torch.Tensor:
    """[G, P] bool: the positions a step reads: the top_k regions by score (a fixed count), the first `sinks`
    and the last `window` positions."""
    G, P = regions.order.shape
    top = scores.topk(min(top_k, scores.shape[1])).indices
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True) & (scores > float("-inf"))
    slots = torch.arange(P, device=scores.device).expand(G, P).contiguous()
    region_of = torch.searchsorted(regions.starts[:, 1:].contiguous(), slots, right=True)  # region of each slot
    visible = torch.zeros(G, P, dtype=torch.bool, device=scores.device)
    visible.scatter_(1, regions.order, chosen.gather(1, region_of.clamp(max=scores.shape[1] - 1)))
    positions = torch.arange(P, device=scores.device)
    return visible | (positions < sinks) | (positions >= P - window)
