"""The model runner: a cached pass's rows and attention metadata from per-request counts, and logits for
columns that follow the architecture's logit shift (full and cached passes alike)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flash_dllm import SamplingParams
from flash_dllm.config import PRESETS
from flash_dllm.engine import model_runner
from flash_dllm.engine.model_runner import ModelRunner, request_groups, sequence_groups
from flash_dllm.models import LLaDAModel, build_model, parse_config


def batch_of(tokens: torch.Tensor, lengths: list[int], bases: list[int]):
    """What `prepare` reads of a DecodeBatch: left-padded tokens [B, W], lengths, cache bases, each row's
    length and settings (dense prompt KV here)."""
    rows = [SimpleNamespace(length=n, params=SamplingParams(method="dual-cache")) for n in lengths]
    return SimpleNamespace(tokens=tokens, lengths=torch.tensor(lengths), cache_base=torch.tensor(bases), rows=rows,
                           max_length=max(lengths))


def test_prepare_builds_rows_and_metadata_from_counts():
    tokens = torch.arange(24).view(2, 12)
    batch = batch_of(tokens, lengths=[12, 9], bases=[100, 0])
    columns = torch.tensor([[2, 5, 11, 0], [3, 4, 7, 10]])  # the first counts[b] of each row are the queries
    p = ModelRunner(build_model(parse_config(PRESETS["llada-tiny"]), "cpu", torch.float32)).prepare(
        batch, [3, 2], columns, track=tokens % 2 == 0)
    assert p.request.tolist() == [0, 0, 0, 1, 1] and p.column.tolist() == [2, 5, 11, 3, 4]
    assert p.input_ids.tolist() == [2, 5, 11, 15, 16]
    assert p.positions.tolist() == [2, 5, 11, 0, 1]                 # row 1 starts at column 3 (padding before)
    m = p.metadata
    assert m.cu_seqlens_q.tolist() == [0, 3, 5] and m.slot_mapping.tolist() == [102, 105, 111, 0, 1]
    # the keys' width: the longest row (12) rounded up to its bucket (16: cuda_graphs.bucket), shared by nearby lengths
    assert (m.max_q, m.max_kv, m.kv_len.tolist(), m.track_rows.tolist()) == (3, 16, [12, 9], [1, 0, 0, 0, 1])
    assert p.flat_of_column[0, [2, 5, 11]].tolist() == [0, 1, 2] and p.flat_of_column[1, [3, 4]].tolist() == [3, 4]
    assert (p.flat_of_column >= 0).sum() == 5

    reordered = ModelRunner(build_model(parse_config(PRESETS["llada-tiny"]), "cpu", torch.float32)).prepare(
        batch, [2, 1], columns[[1, 0]], order=[1, 0], visibility=torch.ones(2, 2, 2, dtype=torch.bool))
    assert reordered.request.tolist() == [1, 1, 0] and reordered.positions.tolist() == [0, 1, 2]
    m = reordered.metadata
    assert m.kv_start.tolist() == [0, 100] and m.max_kv == 16 and not m.write_cache
    assert m.hidden_keys.nonzero().tolist() == [[0, 0], [0, 1], [1, 2]]  # each group's own positions


class ShiftedLLaDA(LLaDAModel):
    """LLaDA's layers with Dream's logit alignment: row i predicts position i from hidden state i - 1."""
    logit_shift = 1


@pytest.mark.parametrize("shift", [0, 1])
def test_logits_of_columns_follow_the_shift(shift):
    cfg = parse_config(PRESETS["llada-tiny"])
    cls = ShiftedLLaDA if shift else LLaDAModel
    with torch.device("meta"):
        model = cls(cfg)
    model = model.to_empty(device="cpu").float()
    torch.manual_seed(0)
    for param in model.parameters():
        param.data.normal_(0, 0.3)
    runner = ModelRunner(model, kernels=False, kv_cache_bytes=64 * 4096)
    runner.allocate_cache(with_hidden=False)
    ids = torch.randint(4, cfg.vocab_size, (1, 10))
    columns = torch.tensor([[4, 7, 9]])
    expected = model(ids)[0, columns[0]]                             # forward applies the shift itself
    positions, mask = torch.arange(10)[None], torch.ones(1, 10, dtype=torch.bool)
    with torch.inference_mode():
        torch.testing.assert_close(runner.full_logits(ids, positions, mask, columns)[0], expected)
        batch = batch_of(ids, lengths=[10], bases=[0])
        p = runner.prepare(batch, [10], torch.arange(10)[None])
        cached = runner.logits(runner.run(p), p.flat_of_column, columns)[0]
    torch.testing.assert_close(cached, expected, rtol=1e-5, atol=1e-5)


def test_sequence_groups_hold_whole_sequences_within_the_row_budget(monkeypatch):
    monkeypatch.setattr(model_runner, "FULL_PASS_ROWS", 20)
    assert sequence_groups(5, 10) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    assert sequence_groups(2, 30) == [slice(0, 1), slice(1, 2)]    # a sequence longer than the budget: one a group
    assert sequence_groups(2, 10) == [slice(0, 2)]


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_full_forward_in_groups_of_sequences_equals_one_forward(monkeypatch, batch_invariant):
    """A full forward over more than FULL_PASS_ROWS rows runs in groups of whole sequences (its activations'
    memory): the same logits and hidden states as in one forward, left padding included."""
    cfg = parse_config(PRESETS["llada-tiny"])
    model = build_model(cfg, "cpu", torch.float32)
    torch.manual_seed(0)
    for param in model.parameters():
        param.data.normal_(0, 0.3)
    runner = ModelRunner(model, kernels=False, batch_invariant=batch_invariant)
    B, W = 5, 12
    ids = torch.randint(4, cfg.vocab_size, (B, W))
    lengths = torch.tensor([12, 9, 12, 5, 11])
    mask = torch.arange(W) >= (W - lengths)[:, None]
    positions = (torch.arange(W) - (W - lengths)[:, None]).clamp(min=0)
    columns = torch.tensor([[11, 10]] * B)
    with torch.inference_mode():
        whole = runner.full_logits(ids, positions, mask, columns), runner.full_hidden(ids, positions, mask)
        monkeypatch.setattr(model_runner, "FULL_PASS_ROWS", 2 * W)  # groups of 2, 2 and 1 sequences
        grouped = runner.full_logits(ids, positions, mask, columns), runner.full_hidden(ids, positions, mask)
    for one, groups in zip(whole, grouped):
        assert groups.shape == one.shape and not groups.isnan().any()
        torch.testing.assert_close(groups, one, rtol=1e-6, atol=1e-6)


def test_request_groups_hold_whole_requests_within_the_row_budget(monkeypatch):
    monkeypatch.setattr(model_runner, "FULL_PASS_ROWS", 20)
    assert request_groups([8, 8, 8, 30, 1]) == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 5)]
    assert request_groups([5, 5]) == [slice(0, 2)]


def test_a_cached_pass_in_parts_equals_one_pass(monkeypatch):
    """A cached pass over more than FULL_PASS_ROWS rows runs in parts of whole requests on the PyTorch path: the same
    hidden states and key mass as in one pass."""
    model = build_model(parse_config(PRESETS["llada-tiny"]), "cpu", torch.float32)
    torch.manual_seed(0)
    for param in model.parameters():
        param.data.normal_(0, 0.3)
    runner = ModelRunner(model, kernels=False, kv_cache_bytes=64 * 4096)
    runner.allocate_cache(with_hidden=False)
    lengths, W = [12, 7, 10], 12
    tokens = torch.randint(4, model.config.vocab_size, (3, W))
    batch = batch_of(tokens, lengths, bases=[0, 32, 64])
    columns = (W - torch.tensor(lengths))[:, None] + torch.arange(W)  # every position of each row
    track = torch.rand(3, W) < 0.5
    results = []
    with torch.inference_mode():
        for budget in (model_runner.FULL_PASS_ROWS, 12):  # one pass; then parts of 12, 7 and 10 rows
            monkeypatch.setattr(model_runner, "FULL_PASS_ROWS", budget)
            p = runner.prepare(batch, lengths, columns, track=track)
            mass = torch.zeros(3, p.metadata.max_kv)
            results.append((runner.run(p, mass), mass))
    (whole, whole_mass), (parts, parts_mass) = results
    torch.testing.assert_close(parts, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(parts_mass, whole_mass, rtol=1e-6, atol=1e-6)
    assert whole_mass.sum() > 0


def test_a_kv_cache_larger_than_the_memory_is_refused_before_allocating():
    model = build_model(parse_config(PRESETS["llada-tiny"]), "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"^kv_cache_bytes does not fit this machine: the KV cache needs "
                                         r"1,125,899,906,842,624 bytes and cpu has [\d,]+ bytes \(MemAvailable\)$"):
        ModelRunner(model, kernels=False, kv_cache_bytes=1 << 50)
