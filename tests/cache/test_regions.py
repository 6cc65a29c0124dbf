"""Regions of a prompt's keys (chunks with bounds, spherical k-means) and the routing that picks a step's keys."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flash_dllm.cache import regions as regions_module
from flash_dllm.cache.regions import chunk_regions, kmeans_assignment, kmeans_regions, region_scores, routed_keys


def clustered_keys(groups: int = 3, positions: int = 96, dim: int = 16, clusters: int = 4, seed: int = 0):
    """Keys drawn around `clusters` well-separated directions, interleaved over the positions; and each key's
    cluster [G, P]."""
    g = torch.Generator().manual_seed(seed)
    directions = F.normalize(torch.randn(groups, clusters, dim, generator=g), dim=-1) * 10
    label = torch.randint(0, clusters, (groups, positions), generator=g)
    keys = directions.gather(1, label[..., None].expand(-1, -1, dim)) + 0.1 * torch.randn(groups, positions, dim,
                                                                                          generator=g)
    return keys, label


def check_partition(regions, P):
    """Every position in exactly one region; `starts` delimit the regions in `order`."""
    assert torch.equal(regions.order.sort(dim=1).values, torch.arange(P).expand_as(regions.order))
    assert (regions.starts[:, 0] == 0).all() and (regions.starts[:, -1] == P).all()
    assert (regions.sizes >= 0).all()


def test_chunks_are_contiguous_means_with_bounds():
    keys = torch.randn(2, 70, 8)
    regions = chunk_regions(keys, 32)
    check_partition(regions, 70)
    assert regions.starts[0].tolist() == [0, 32, 64, 70]
    torch.testing.assert_close(regions.centroids[:, 2], keys[:, 64:].mean(dim=1))
    torch.testing.assert_close(regions.lower[:, 1], keys[:, 32:64].amin(dim=1))
    torch.testing.assert_close(regions.upper[:, 0], keys[:, :32].amax(dim=1))


def test_kmeans_finds_the_clusters_and_lays_them_out_contiguously():
    keys, label = clustered_keys()
    regions = kmeans_regions(keys, size=24)  # 96 / 24 = 4 clusters
    check_partition(regions, 96)
    for g in range(keys.shape[0]):
        for r in range(regions.sizes.shape[1]):
            members = regions.order[g, regions.starts[g, r]:regions.starts[g, r + 1]]
            assert label[g, members].unique().numel() <= 1  # a region holds one true cluster
            if members.numel():
                torch.testing.assert_close(regions.centroids[g, r], keys[g, members].mean(dim=0))
            assert torch.equal(members, members.sort().values)  # positions in order within a region
    again = kmeans_regions(keys, size=24)
    assert torch.equal(again.order, regions.order) and torch.equal(again.centroids, regions.centroids)


@pytest.mark.parametrize("grouping, bounds", [("chunk", True), ("kmeans", True), ("kmeans", False)])
def test_routing_opens_the_region_a_query_points_at_plus_sinks_and_window(grouping, bounds):
    keys, label = clustered_keys(groups=1, positions=128, clusters=4)
    regions = chunk_regions(keys, 16) if grouping == "chunk" else kmeans_regions(keys, 32)
    target = label[0, 70]
    query = keys[0, 70][None, None]  # one row, one head: it points at its own cluster
    scores = region_scores(regions, query, group=1, bounds=bounds)
    visible = routed_keys(regions, scores, top_k=1, sinks=2, window=4)[0]
    assert visible[:2].all() and visible[-4:].all()
    routed = visible.clone()
    routed[:2] = routed[-4:] = False
    if grouping == "kmeans":  # the chosen region is the query's cluster, all of it
        expected = label[0] == target
        expected[:2] = expected[-4:] = False
        assert torch.equal(routed, expected)
    else:  # one chunk of 16, which holds the query's own position's cluster mate with the largest bound
        assert routed.sum() == 16


def test_routing_scores_are_shared_by_rows_and_group_heads():
    """A region that matters to any row or any query head of its KV head is scored by that row."""
    regions = chunk_regions(torch.randn(2, 64, 8), 16)  # 2 KV heads
    queries = torch.randn(5, 4, 8)  # 5 rows, 4 query heads: 2 per KV head
    scores = region_scores(regions, queries, group=2)
    assert scores.shape == (2, 4)
    single = torch.stack([region_scores(regions, queries[t:t + 1], group=2) for t in range(5)]).amax(dim=0)
    torch.testing.assert_close(scores, single)
    by_centroid = region_scores(regions, queries, group=2, bounds=False)
    expected = (queries[:, :2] @ regions.centroids[0].T).amax(dim=(0, 1))  # KV head 0 serves query heads 0, 1
    torch.testing.assert_close(by_centroid[0], expected)


def test_bounds_are_upper_bounds_of_every_key_score():
    keys, q = torch.randn(1, 64, 8), torch.randn(3, 1, 8)
    regions = chunk_regions(keys, 16)
    bound = region_scores(regions, q, group=1)[0]                      # [R]
    exact = (q[:, 0] @ keys[0].T).amax(dim=0).view(4, 16).amax(dim=1)  # the best key score of each chunk
    assert (bound >= exact - 1e-5).all()


def test_the_budget_is_a_fixed_count_of_regions():
    keys, _ = clustered_keys(groups=2, positions=256, clusters=8)
    regions = chunk_regions(keys, 32)
    scores = region_scores(regions, torch.randn(3, 2, 16), group=1)
    visible = routed_keys(regions, scores, top_k=2, sinks=0, window=0)
    assert visible.sum(dim=1).tolist() == [64, 64]


def test_kmeans_of_many_groups_is_computed_a_slice_at_a_time(monkeypatch):
    """Long prompts bound the similarities held at once by slicing the groups: the same regions."""
    keys, _ = clustered_keys(groups=5)
    whole = kmeans_assignment(keys, 24)
    monkeypatch.setattr(regions_module, "MAX_SIMILARITIES", 2 * 96 * 4)  # two groups a slice
    assert torch.equal(kmeans_assignment(keys, 24), whole)


def test_kmeans_of_keys_padded_past_the_valid_ones_is_that_of_the_valid_ones():
    """A pass wider than a request's keys (another request's range is longer) clusters them as their own width does:
    update_kmeans runs k-means over the reclustering requests' keys alone."""
    keys, _ = clustered_keys(groups=3)
    valid = torch.arange(keys.shape[1]) < torch.tensor([96, 70, 50])[:, None]
    padded = torch.cat([keys, torch.randn(3, 160, keys.shape[2], generator=torch.Generator().manual_seed(1))], dim=1)
    wide = kmeans_assignment(padded, 24, torch.cat([valid, torch.zeros(3, 160, dtype=torch.bool)], dim=1))
    assert torch.equal(wide[:, :keys.shape[1]], kmeans_assignment(keys, 24, valid))
    assert (wide[:, keys.shape[1]:] == -1).all() and (wide[:, :keys.shape[1]][valid] >= 0).all()
