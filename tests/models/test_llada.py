"""The LLaDA forward of flash_dllm against an independent float64 re-implementation that reads the raw
checkpoint tensors under their Hugging Face names (nothing from flash_dllm.models.llada is used for it)."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import flash_dllm
from flash_dllm.models import layers
from conftest import tiny_config, write_checkpoint

P = "model.transformer."
SEQ_LEN = 13


# ----------------------------------------------------------------------------- float64 reference

def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in float64, found through the index's weight_map if there is one."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {file: load_file(str(path / file)) for file in set(weight_map.values())}
        return {name: files[file][name].double() for name, file in weight_map.items()}
    return {name: t.double() for name, t in load_file(str(path / "model.safetensors")).items()}


def rope64(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [L, heads, hd], positions [L]: rotate-half rotary embedding in float64."""
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """q [L, H, hd], k/v [L, KV, hd], key_mask [L] bool; bidirectional, kv head j serves q heads j*g.."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        j = h // group
        scores = torch.einsum("qd,kd->qk", q[:, h], k[:, j]) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~key_mask[None, :], float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, j]
    return out


class Reference:
    """LLaDA forward for one unpadded sequence, float64, straight from the config and tensors."""

    def __init__(self, path: Path):
        cfg = json.loads((path / "config.json").read_text())
        self.w = read_tensors(path)
        self.d, self.n_heads = cfg["d_model"], cfg["n_heads"]
        self.n_kv = cfg.get("n_kv_heads") or self.n_heads
        self.hd = self.d // self.n_heads
        self.n_layers = cfg["n_layers"]
        self.eps, self.theta = cfg["rms_norm_eps"], cfg["rope_theta"]
        self.bias = bool(cfg.get("include_bias", False))
        self.qkv_bias = self.bias or bool(cfg.get("include_qkv_bias", False))
        self.tied = bool(cfg.get("weight_tying", False))
        norm_bias = cfg.get("bias_for_layer_norm")
        self.norm_bias = self.bias if norm_bias is None else bool(norm_bias)

    def linear(self, x, name, bias):
        y = x @ self.w[f"{name}.weight"].T
        return y + self.w[f"{name}.bias"] if bias else y

    def rmsnorm(self, x, name):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[f"{name}.weight"]
        return y + self.w[f"{name}.bias"] if self.norm_bias else y

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor | None = None,
                 key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids [L] -> logits [L, V]."""
        L = ids.shape[0]
        positions = torch.arange(L) if positions is None else positions
        key_mask = torch.ones(L, dtype=torch.bool) if key_mask is None else key_mask
        x = self.w[f"{P}wte.weight"][ids]
        for i in range(self.n_layers):
            b = f"{P}blocks.{i}."
            h = self.rmsnorm(x, b + "attn_norm")
            q = self.linear(h, b + "q_proj", self.qkv_bias).view(L, self.n_heads, self.hd)
            k = self.linear(h, b + "k_proj", self.qkv_bias).view(L, self.n_kv, self.hd)
            q, k = rope64(q, positions, self.theta), rope64(k, positions, self.theta)
            v = self.linear(h, b + "v_proj", self.qkv_bias).view(L, self.n_kv, self.hd)
            att = attention64(q, k, v, key_mask).reshape(L, self.n_heads * self.hd)
            x = x + self.linear(att, b + "attn_out", self.bias)
            h = self.rmsnorm(x, b + "ff_norm")
            gate, up = self.linear(h, b + "ff_proj", self.bias), self.linear(h, b + "up_proj", self.bias)
            x = x + self.linear(gate * torch.sigmoid(gate) * up, b + "ff_out", self.bias)
        x = self.rmsnorm(x, P + "ln_f")
        if self.tied:
            return x @ self.w[f"{P}wte.weight"].T
        return self.linear(x, P + "ff_out", self.bias)

    def batch(self, ids: torch.Tensor, positions=None) -> torch.Tensor:
        return torch.stack([self(row, None if positions is None else positions[i]) for i, row in enumerate(ids)])


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()


# ----------------------------------------------------------------------------- checkpoints

def randomise_biases(path: Path, seed: int = 1, std: float = 0.3) -> Path:
    """random_model zeroes every bias; give them values so that a dropped or misplaced bias shows."""
    gen = torch.Generator().manual_seed(seed)
    for file in sorted(path.glob("*.safetensors")):
        tensors = load_file(str(file))
        for name, t in tensors.items():
            if name.endswith(".bias"):
                tensors[name] = torch.randn(t.shape, generator=gen, dtype=t.dtype) * std
        save_file(tensors, str(file), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def random_bias_checkpoint(bias_checkpoint, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bias_random") / "ckpt"
    shutil.copytree(bias_checkpoint, path)
    return randomise_biases(path)


@pytest.fixture(scope="module")
def qkv_bias_checkpoint(tmp_path_factory) -> Path:
    path = write_checkpoint(tmp_path_factory.mktemp("qkv_bias"), tiny_config(include_qkv_bias=True),
                            with_tokenizer=False, seed=2)
    return randomise_biases(path)


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory) -> Path:
    # A tied head has no bias of its own, even with include_bias.
    path = write_checkpoint(tmp_path_factory.mktemp("tied"), tiny_config(weight_tying=True, include_bias=True),
                            num_shards=1, with_tokenizer=False, seed=3)
    return randomise_biases(path)


CHECKPOINTS = ["mha_checkpoint", "gqa_checkpoint", "bias_checkpoint", "random_bias_checkpoint",
               "qkv_bias_checkpoint", "tied_checkpoint"]


@pytest.fixture(params=CHECKPOINTS, ids=lambda name: name.removesuffix("_checkpoint"))
def any_checkpoint(request) -> Path:
    return request.getfixturevalue(request.param)


def random_ids(path: Path, shape=(2, SEQ_LEN), seed=0) -> torch.Tensor:
    vocab = json.loads((path / "config.json").read_text())["embedding_size"]
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- tests

def test_reference_reads_every_checkpoint_tensor(any_checkpoint):
    """Guards the reference itself: biases are really there (and nonzero where randomised)."""
    ref = Reference(any_checkpoint)
    biases = [n for n in ref.w if n.endswith(".bias")]
    expected = ((ref.n_layers * 3 if ref.qkv_bias else 0) + (ref.n_layers * 4 + (not ref.tied) if ref.bias else 0)
                + (ref.n_layers * 2 + 1 if ref.norm_bias else 0))
    assert len(biases) == expected
    assert (f"{P}ff_out.weight" in ref.w) != ref.tied


def test_forward_matches_float64_reference(any_checkpoint):
    model = flash_dllm.load_model(any_checkpoint)
    ids = random_ids(any_checkpoint)
    with torch.no_grad():
        logits = model(ids)
    expected = Reference(any_checkpoint).batch(ids)
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    assert not logits.isnan().any()
    assert rel_err(logits, expected) < 1e-5


def test_explicit_positions_match_reference(checkpoint):
    """Arbitrary, per-row positions (not just arange) must reach RoPE unchanged."""
    model = flash_dllm.load_model(checkpoint)
    ids = random_ids(checkpoint, seed=1)
    gen = torch.Generator().manual_seed(1)
    positions = torch.stack([torch.randperm(SEQ_LEN, generator=gen) * (r + 2) + 5 * r for r in range(2)])
    with torch.no_grad():
        logits = model(ids, positions, torch.ones_like(ids, dtype=torch.bool))
    assert rel_err(logits, Reference(checkpoint).batch(ids, positions)) < 1e-5


@pytest.mark.parametrize("name", ["mha_checkpoint", "gqa_checkpoint", "random_bias_checkpoint"])
def test_left_padded_batch_matches_unpadded_rows(request, name):
    path = request.getfixturevalue(name)
    model, ref = flash_dllm.load_model(path), Reference(path)
    pads = [0, 5, SEQ_LEN - 1]  # a full row, a padded row, a row with a single real token
    ids = random_ids(path, shape=(len(pads), SEQ_LEN), seed=2)  # padding slots hold random ids on purpose
    cols = torch.arange(SEQ_LEN)
    mask = torch.stack([cols >= p for p in pads])
    positions = torch.stack([(cols - p).clamp(min=0) for p in pads])
    with torch.no_grad():
        logits = model(ids, positions, mask)
    assert torch.isfinite(logits).all()
    for row, p in enumerate(pads):
        expected = ref(ids[row, p:])
        err = rel_err(logits[row, p:], expected)
        assert err < 1e-5, f"row {row} (left padding {p}): relative error {err:.2e}"


# The conftest checkpoints use std 0.3 weights, so sensitive that rounding the weights alone to bf16 moves
# the logits by ~2% (relative); the 1e-2 bound is checked at std 0.02, the scale of real LLaDA weights.
@pytest.fixture(scope="module", params=[{"n_kv_heads": 4}, {"n_kv_heads": 2}, {"include_bias": True}],
                ids=["mha", "gqa", "bias"])
def realistic_checkpoint(request, tmp_path_factory) -> Path:
    path = write_checkpoint(tmp_path_factory.mktemp("std002"), tiny_config(**request.param),
                            with_tokenizer=False, std=0.02, seed=4)
    return randomise_biases(path, std=0.02)


def bf16_logits(path: Path, ids, positions=None):
    model = flash_dllm.load_model(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with torch.no_grad():
        logits = model(ids, positions)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    return logits


def test_bf16_load_close_to_reference(realistic_checkpoint):
    ids = random_ids(realistic_checkpoint)
    logits = bf16_logits(realistic_checkpoint, ids)
    assert rel_err(logits, Reference(realistic_checkpoint).batch(ids)) < 1e-2


def test_bf16_load_of_sensitive_fixtures(any_checkpoint):
    ids = random_ids(any_checkpoint)
    assert rel_err(bf16_logits(any_checkpoint, ids), Reference(any_checkpoint).batch(ids)) < 6e-2


def test_bf16_rope_at_large_positions(checkpoint):
    """Positions near 4000 are not representable in bf16, so RoPE angles must be computed in fp32 (a bf16
    angle computation gives a relative error near 1 here, the fp32 one about 3%)."""
    ids = random_ids(checkpoint, seed=5)
    positions = torch.arange(SEQ_LEN) + torch.tensor([[4001], [3077]])
    logits = bf16_logits(checkpoint, ids, positions)
    assert rel_err(logits, Reference(checkpoint).batch(ids, positions)) < 6e-2


def test_compute_logits_of_hidden_states_is_forward(checkpoint):
    model = flash_dllm.load_model(checkpoint)
    ids = random_ids(checkpoint, seed=3)
    with torch.no_grad():
        hidden = model.hidden_states(ids)
        assert hidden.shape == (*ids.shape, json.loads((checkpoint / "config.json").read_text())["d_model"])
        assert torch.equal(model.compute_logits(hidden), model(ids))
        # Only some rows' logits are wanted in decoding: compute_logits must work on any leading shape.
        rows = hidden[:, 4:9].reshape(-1, hidden.shape[-1])
        torch.testing.assert_close(model.compute_logits(rows), model(ids)[:, 4:9].reshape(rows.shape[0], -1))


def test_mlp_in_row_chunks_matches_reference(checkpoint, monkeypatch):
    """A pass over more than MLP_CHUNK_ROWS rows runs its MLP in row chunks (a batch-32 first pass's memory)."""
    model = flash_dllm.load_model(checkpoint)
    ids = random_ids(checkpoint, seed=5)
    with torch.no_grad():
        whole = model(ids)
        monkeypatch.setattr(layers, "MLP_CHUNK_ROWS", 5)  # 2 x 13 rows: six chunks, the last one short
        chunked = model(ids)
    assert not chunked.isnan().any()
    assert rel_err(chunked, Reference(checkpoint).batch(ids)) < 1e-5
    assert rel_err(chunked, whole) < 1e-6


def test_default_positions_and_mask(checkpoint):
    """No positions / no mask means arange(L) and every key visible."""
    model = flash_dllm.load_model(checkpoint)
    ids = random_ids(checkpoint, seed=4)
    positions = torch.arange(SEQ_LEN).expand_as(ids)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), model(ids, positions, torch.ones_like(ids, dtype=torch.bool)))
