"""Elastic-Cache: a refresh every step gives the sliding-window threshold rule without cache exactly;
rows refresh from different layers in one batch and decode as if alone; the drift statistic is the
cosine over the key axis."""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch
from conftest import eos_biased_llm, tiny_config, write_checkpoint

from flash_dllm import LLM, SamplingParams, load_model
from flash_dllm.cache import KVCache
from flash_dllm.decoding import elastic
from flash_dllm.decoding.elastic import drift_similarity, select_tracked, window_mask
from flash_dllm.decoding.registry import method_of
from flash_dllm.engine.model_runner import ModelRunner
from flash_dllm.decoding.sampling import NOISE_STREAM, counter_uniform
from flash_dllm.engine.cuda_graphs import CudaGraphs, GraphedCalls
from flash_dllm.models.layers import apply_rotary, rotary_cos_sin

PROMPTS = ["What is 3 + 4?", "Tom has 3 apples and buys 4 more. How many?", "x", "The passkey is 48213."]
CACHE_BYTES = 1 << 22  # zeroing the default 1 GiB would dominate these small runs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels: on the GPU, else interpreted


@pytest.fixture(scope="module")
def llm(gqa_checkpoint):
    return eos_biased_llm(gqa_checkpoint, max_batch_size=3, kv_cache_bytes=CACHE_BYTES)


@pytest.fixture(scope="module")
def deep_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("deep"), tiny_config(n_layers=4))


def window_rule_without_cache(model, prompt: list[int], params: SamplingParams, mask_id: int,
                              stop_ids: tuple[int, ...]) -> tuple[list[int], int]:
    """Plain reference: every step a full forward; the window is the beta leftmost masks before the first
    stop token; unmask every window position with confidence >= eps, and always the most confident."""
    P, G = len(prompt), params.max_tokens
    x = torch.tensor(prompt + [mask_id] * G)
    offsets, stops = torch.arange(G), torch.tensor(stop_ids)

    def end_of_output():
        found = torch.isin(x[P:], stops).nonzero()
        return int(found[0]) if len(found) else G

    step = 0
    while ((x[P:] == mask_id) & (offsets < end_of_output())).any():
        window = offsets[(x[P:] == mask_id) & (offsets < end_of_output())][:params.settings.mask_window]
        logits = model(x[None])[0, P + window].double()
        scores = logits.clone()
        if params.temperature > 0:
            u = counter_uniform(torch.tensor([params.seed]), torch.tensor([step]), window[None], NOISE_STREAM,
                                logits.shape[-1])[0]
            scores = logits - params.temperature * torch.log(-torch.log(u))
        scores[:, mask_id] = float("-inf")
        chosen = scores.argmax(dim=-1)
        confidence = torch.softmax(logits, dim=-1).gather(1, chosen[:, None])[:, 0]
        take = confidence >= params.settings.threshold
        take[confidence.argmax()] = True
        x[P + window[take]] = chosen[take]
        step += 1
    return x[P:P + end_of_output()].tolist(), step


@pytest.mark.parametrize("setting", [dict(mask_window=8), dict(mask_window=4, temperature=0.6, seed=3),
                                     dict(mask_window=64)], ids=["beta8", "beta4-sampled", "beta-over-G"])
def test_refresh_every_step_equals_the_window_rule_without_cache(llm, setting):
    """gamma = 1: every step refreshes from layer 0, a full forward through the cache. Four prompts of
    different lengths through three rows (left padding, a row refilled)."""
    params = SamplingParams(method="elastic", max_tokens=32, threshold=0.7, drift_threshold=1.0, **setting)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        ids = llm.encode(prompt)
        expected, steps = window_rule_without_cache(llm.model, ids, params, llm.special.mask_id, llm.special.stop_ids)
        assert out.token_ids == expected and out.steps == out.nfe == steps
        assert out.query_rows > out.steps * (len(ids) + 32)  # the reuse pass plus a whole refresh per step


def record_refreshes(monkeypatch) -> list[list[int]]:
    """The first refreshed layer of every row, per step (L: none)."""
    steps, refresh = [], elastic._refresh_pass

    def recording(runner, batch, first_layer, *args):
        steps.append(list(first_layer))
        return refresh(runner, batch, first_layer, *args)

    monkeypatch.setattr(elastic, "_refresh_pass", recording)
    return steps


def test_rows_refreshing_from_different_layers_decode_as_alone(deep_checkpoint, monkeypatch):
    """Rows of one batch trigger at different layers, some not at all; each request decodes as alone, and
    later requests reuse the cache rows of finished ones."""
    llm = LLM(str(deep_checkpoint), device="cpu", dtype="float32", max_batch_size=2, kv_cache_bytes=CACHE_BYTES)
    params = SamplingParams(method="elastic", max_tokens=16, threshold=0.9, mask_window=6, drift_threshold=0.97,
                            temperature=0.5, seed=1)
    refreshes = record_refreshes(monkeypatch)
    batched = llm.generate(PROMPTS, params)
    layers = llm.config.num_layers
    assert any(len(set(step)) > 1 and 0 < min(step) < layers for step in refreshes)
    for prompt, out in zip(PROMPTS, batched):
        alone = llm.generate([prompt], params)[0]
        assert (out.token_ids, out.steps, out.query_rows) == (alone.token_ids, alone.steps, alone.query_rows)


def test_no_refresh_recomputes_only_the_query_set(llm, monkeypatch):
    refreshes = record_refreshes(monkeypatch)
    params = SamplingParams(method="elastic", max_tokens=32, threshold=0.95, mask_window=4, drift_threshold=0.0)
    out = llm.generate(PROMPTS[1], params)[0]
    layers = llm.config.num_layers
    assert all(first == layers for step in refreshes for first in step)
    length = len(out.prompt_token_ids) + 32
    # a full first pass, then at most the window, its newly decoded positions and one tracked per layer
    assert length < out.query_rows <= length + (out.steps - 1) * (4 + 4 + layers)


@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "kernels"])
def test_reuse_pass_drift_is_the_cosine_of_the_cache_before_and_after(request, monkeypatch, kernels):
    """Each layer's similarity in the reuse pass against one computed from snapshots of the cache: the tracked
    rows' attention from their cached inputs over the keys before the pass, against that from the inputs the pass
    wrote over the keys after it (plain einsum attention). Through the kernels (interpreted on the CPU), the
    drift test is kernels/drift_cosine.py's."""
    llm = (eos_biased_llm(request.getfixturevalue("gqa_checkpoint"), max_batch_size=3, kv_cache_bytes=CACHE_BYTES,
                          kernels=True, device=DEVICE) if kernels else request.getfixturevalue("llm"))
    checked = []

    def reuse_pass(runner, batch, reuse, tracked, drift):
        cache = runner.cache
        keys_before = [k.clone() for k in cache.k]
        inputs_before = [h.clone() for h in cache.hidden_states()]
        x, key_mass, similarity = real_reuse_pass(runner, batch, reuse, tracked, drift)
        if not drift:
            return x, key_mass, similarity
        cfg, width, lengths, base = runner.model.config, batch.tokens.shape[1], batch.lengths, batch.cache_base
        columns, valid = elastic.leading_columns(tracked, min(cfg.num_layers * batch.params.settings.track_num, width))
        position = (columns - (width - lengths)[:, None]).clamp(min=0)
        cos, sin = rotary_cos_sin(position, cfg.head_dim, cfg.rope_theta)
        key_valid = torch.arange(width, device=base.device) < lengths[:, None]
        key_slot = base[:, None] + torch.where(key_valid, torch.arange(width, device=base.device), 0)
        slot = base[:, None] + position

        def attention(layer, inputs, keys):
            q = layer.queries(inputs[slot], cos, sin).float()
            k = keys[key_slot].repeat_interleave(cfg.num_heads // cfg.num_kv_heads, dim=2).float()
            scores = torch.einsum("bthd,bkhd->bhtk", q, k) * cfg.head_dim ** -0.5
            return scores.masked_fill(~key_valid[:, None, None, :], float("-inf")).softmax(dim=-1)

        for index, layer in enumerate(runner.model.layers):
            before = attention(layer, inputs_before[index], keys_before[index])
            after = attention(layer, cache.hidden_states()[index], cache.k[index])
            expected = drift_similarity(before, after, valid)
            torch.testing.assert_close(similarity[index], expected, rtol=0, atol=1e-6)
        checked.append(bool((similarity < 1 - 1e-6).any()))
        return x, key_mass, similarity

    real_reuse_pass = elastic._reuse_pass
    monkeypatch.setattr(elastic, "_reuse_pass", reuse_pass)
    params = SamplingParams(method="elastic", max_tokens=24, threshold=0.95, mask_window=4, drift_threshold=0.5)
    llm.generate(PROMPTS[:3], params)
    assert len(checked) > 3 and any(checked)  # steps with a drift test, some where the attention moved


def test_refresh_is_a_forward_from_the_cached_inputs(deep_checkpoint):
    """_refresh_pass from layer 2 for one row and layer 1 for another (a third not refreshing) equals, per
    row, the plain forward of those layers from the cached input hidden states of the first one."""
    model = load_model(deep_checkpoint)
    close = partial(torch.testing.assert_close, rtol=1e-4, atol=1e-4)  # fp32, different attention paths
    cfg, layers = model.config, model.layers
    lengths, bases, first_layer = [9, 6, 7], [20, 0, 40], [2, 4, 1]
    cache = KVCache(cfg, 60, torch.float32, "cpu")
    generator = torch.Generator().manual_seed(0)
    for buffer in [*cache.k, *cache.v, *cache.hidden_states()]:  # arbitrary stale state
        buffer.copy_(torch.randn(buffer.shape, generator=generator))
    before = [h.clone() for h in cache.hidden_states()]
    k_before = [k.clone() for k in cache.k]
    width = max(lengths)
    columns = torch.arange(width)
    params = SamplingParams(method="elastic")
    batch = SimpleNamespace(tokens=torch.zeros(3, width, dtype=torch.long), lengths=torch.tensor(lengths),
                            cache_base=torch.tensor(bases), rows=[SimpleNamespace(length=n, params=params)
                                                                  for n in lengths],
                            attention_mask=columns >= width - torch.tensor(lengths)[:, None],
                            count_query_rows=lambda counts: None)
    key_mass = torch.zeros(cfg.num_layers, 3, width)
    runner = ModelRunner(model, kernels=False)
    runner.cache = cache
    refresh, out = elastic._refresh_pass(runner, batch, first_layer, torch.zeros(3, width, dtype=torch.bool), key_mass)
    for row, (n, base, first) in enumerate(zip(lengths, bases, first_layer)):
        rows = slice(base, base + n)
        if first == cfg.num_layers:
            assert all(torch.equal(h[rows], b[rows]) for h, b in zip(cache.hidden_states(), before))
            assert all(torch.equal(k[rows], b[rows]) for k, b in zip(cache.k, k_before))
            continue
        x = before[first][rows][None]
        cos, sin = rotary_cos_sin(torch.arange(n)[None], cfg.head_dim, cfg.rope_theta)
        for layer in range(first, cfg.num_layers):
            block = layers[layer]
            qkv_proj = block.attention.qkv_proj
            k = qkv_proj(block.attn_norm(x)).split(qkv_proj.output_sizes, dim=-1)[1]
            k = apply_rotary(k.view(1, n, cfg.num_kv_heads, cfg.head_dim), cos, sin)[0]
            close(cache.hidden_states()[layer][rows], x[0])
            close(cache.k[layer][rows], k)
            x = block(x, cos, sin, None)
        for layer in range(first):
            assert torch.equal(cache.k[layer][rows], k_before[layer][rows])
        close(out[refresh.flat_of_column[row, width - n:]], x[0])


class StaticCapture:
    """A capture without a GPU that keeps a real one's data flow: its inputs are static copies, refilled before
    each replay, which reruns the function on them (a real replay runs no Python) and hands out copies of its
    outputs."""

    def __init__(self, fn, tensors):
        self.fn, self.inputs = fn, tuple(t.clone() for t in tensors)
        self.first_outputs = fn(*self.inputs)

    def replay(self, tensors):
        for static, t in zip(self.inputs, tensors):
            static.copy_(t)
        return tuple(None if t is None else t.clone() for t in self.fn(*self.inputs))


@pytest.mark.parametrize("drift_threshold", [1.0, 0.97])
def test_refresh_passes_replay_with_the_eager_tokens(deep_checkpoint, monkeypatch, drift_threshold):
    """Refreshes whose first layers and lengths repeat replay from one graph each (here with captures that rerun
    Python on static inputs), with the eager tokens, steps and query rows; the reuse passes and the decoding of the
    window after them too."""
    params = SamplingParams(method="elastic", max_tokens=24, threshold=0.9, mask_window=6,
                            drift_threshold=drift_threshold, temperature=0.5, seed=1)
    llm = LLM(str(deep_checkpoint), device="cpu", dtype="float32", max_batch_size=2, kv_cache_bytes=CACHE_BYTES)
    expected = llm.generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.setattr(GraphedCalls, "_capture", lambda self, fn, tensors, run_first: StaticCapture(fn, tensors))
    llm.runner.graphs = CudaGraphs(llm.runner._forward_cached, torch.device("cpu"), max_graphs=64)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [(o.token_ids, o.steps, o.query_rows) for o in outputs] == \
        [(o.token_ids, o.steps, o.query_rows) for o in expected]
    captured = {key[0] for key in llm.runner.graphs.graphs}
    assert {"elastic refresh", "elastic reuse", "elastic decode"} <= captured and llm.runner.graphs.replays > 0


DRIFT_MODES = {"default": {}, "ordered": dict(ordered=True), "kernels": dict(ordered=True, kernels=True)}


@pytest.mark.parametrize("mode", DRIFT_MODES)
def test_drift_is_the_cosine_over_keys(mode):
    """Head 0 keeps its attention row, head 1 moves it to another key: over keys the cosines are 1 and 0
    (mean 0.5); over heads, as the published code takes it, they would average to (1/sqrt 2) / 3. In each mode
    (the batch-invariant ones: PyTorch's, and the invariant kernels' on the GPU, here interpreted)."""
    drift_similarity = partial(elastic.drift_similarity, **DRIFT_MODES[mode])
    before = torch.tensor([[[[1.0, 0.0, 0.0]], [[1.0, 0.0, 0.0]]]], device=DEVICE)   # [B=1, H=2, T=1, K=3]
    after = torch.tensor([[[[1.0, 0.0, 0.0]], [[0.0, 1.0, 0.0]]]], device=DEVICE)
    valid = torch.tensor([[True]], device=DEVICE)
    assert drift_similarity(before, after, valid).item() == pytest.approx(0.5)
    over_heads = torch.nn.functional.cosine_similarity(before, after, dim=1).mean()
    assert over_heads.item() == pytest.approx(2 ** -0.5 / 3)
    # tracked rows that are not valid do not count; a row that tracks nothing shows no drift
    padded_before, padded_after = torch.cat([before, after], dim=2), torch.cat([after, before[:, [1, 0]]], dim=2)
    rows_valid = torch.tensor([[True, False]], device=DEVICE)
    assert drift_similarity(padded_before, padded_after, rows_valid).item() == pytest.approx(0.5)
    assert drift_similarity(before, after, torch.tensor([[False]], device=DEVICE)).item() == 1.0


@pytest.mark.parametrize("heads, kv_heads, dim, rows, keys, dtype", [
    (4, 4, 16, 5, 11, torch.bfloat16), (4, 2, 16, 5, 11, torch.bfloat16), (6, 2, 16, 5, 11, torch.float32),
    (32, 32, 128, 32, 768, torch.bfloat16)])  # LLaDA-8B's heads, 32 tracked rows, 768 keys
def test_attention_rows_are_einsums_bit_for_bit(heads, kv_heads, dim, rows, keys, dtype):
    """The drift test's attention (keys copied once to the GEMM's layout) is the plain fp32 einsum's, bit for bit
    (GQA, masked keys; a request with no visible key gets NaN rows in both)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, rows, heads, dim, generator=g).to(DEVICE, dtype)
    k = torch.randn(3, keys, kv_heads, dim, generator=g).to(DEVICE, dtype)
    key_valid = (torch.rand(3, keys, generator=g) < 0.7).to(DEVICE)
    key_valid[2] = False
    expanded = k.repeat_interleave(heads // kv_heads, dim=2).float()
    scores = torch.einsum("bthd,bkhd->bhtk", q.float(), expanded) * dim ** -0.5
    expected = scores.masked_fill(~key_valid[:, None, None, :], float("-inf")).softmax(dim=-1)
    attention = elastic.attention_rows(q, elastic.key_layout(k, heads), key_valid)
    assert torch.equal(attention[:2], expected[:2])
    assert attention[2].isnan().all() and expected[2].isnan().all()


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_set_keys_is_the_layout_of_the_rewritten_keys(ordered, kv_heads):
    """The reuse pass's "after" keys: the "before" layout with the query rows' keys overwritten in place is the
    layout of the keys as the cache holds them after the layer, bit for bit (so the drift test reads one gather
    of the keys a layer, not two)."""
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(3, 9, kv_heads, 8, generator=g).bfloat16().to(DEVICE)
    request, position = torch.tensor([0, 0, 2, 1], device=DEVICE), torch.tensor([3, 8, 0, 5], device=DEVICE)
    rewritten = torch.randn(4, kv_heads, 8, generator=g).bfloat16().to(DEVICE)
    layout = elastic.key_layout(keys, 4, ordered)
    elastic.set_keys(layout, request, position, rewritten, ordered)
    keys[request, position] = rewritten
    assert torch.equal(layout, elastic.key_layout(keys, 4, ordered))


def test_the_kernel_drift_test_is_the_same_alone_and_padded():
    """attention_rows and drift_similarity through the invariant kernels: PyTorch's within rounding, and a
    request's bits the same alone as in a batch that pads its keys and tracked rows (and after the padding the
    attention is exactly 0)."""
    g = torch.Generator().manual_seed(0)
    q, keys = (torch.randn(*shape, generator=g).bfloat16().to(DEVICE) for shape in ((2, 3, 4, 16), (2, 10, 2, 16)))
    lengths = torch.tensor([7, 10], device=DEVICE)
    key_valid = torch.arange(10, device=DEVICE) < lengths[:, None]
    def rows(q, keys, key_valid):
        return elastic.attention_rows(q, elastic.key_layout(keys, 4, ordered=True), key_valid, ordered=True,
                                      kernels=True)
    batched = rows(q, keys, key_valid)                                               # [B, H, T, K]
    reference = elastic.attention_rows(q, elastic.key_layout(keys, 4), key_valid)
    assert ((batched - reference).norm() / reference.norm()).item() < 1e-5
    assert torch.equal(rows(q[:1], keys[:1, :7], key_valid[:1, :7]), batched[:1, ..., :7])
    assert not batched[0, ..., 7:].any()
    assert torch.equal(rows(q[1:, :2], keys[1:], key_valid[1:]), batched[1:, :, :2])

    after = rows(q + 0.3 * torch.randn(q.shape, generator=g).bfloat16().to(DEVICE), keys, key_valid)
    valid = torch.tensor([[True, True, False], [True, True, True]], device=DEVICE)
    drift = partial(drift_similarity, ordered=True, kernels=True)
    similarity = drift(batched, after, valid)
    assert torch.allclose(similarity, drift_similarity(batched, after, valid), atol=1e-6)
    assert torch.equal(drift(batched[:1, :, :2, :7], after[:1, :, :2, :7], valid[:1, :2]), similarity[:1])


def test_window_and_tracked_positions():
    M, E = 9, 1  # mask and stop ids
    tokens = torch.tensor([[0, 5, 6, 7, M, 8, M, M, E, M],     # generated region from column 4
                           [2, 2, 5, 6, M, M, M, M, M, M]])    # the first two columns are padding
    window = window_mask(tokens, 4, 2, M, torch.tensor([E]))
    assert window.nonzero().tolist() == [[0, 4], [0, 6], [1, 4], [1, 5]]  # nothing right of the stop token
    assert window_mask(tokens, 4, 3, M, torch.tensor([E]))[0].nonzero().flatten().tolist() == [4, 6, 7]
    lengths = torch.tensor([10, 8])
    decoded = (tokens != M) & (torch.arange(10) >= 10 - lengths[:, None])
    key_mass = torch.zeros(2, 2, 10)                                   # [layers, rows, positions]
    key_mass[0, 0, [4, 2]] = torch.tensor([0.9, 0.5])                  # column 4 is a mask: never tracked
    key_mass[1, 0, 5] = 0.7
    key_mass[:, 1, 1] = 0.3                                             # position 1 = column 3 of row 1
    tracked = select_tracked(key_mass, decoded, lengths, k=1)
    assert tracked.nonzero().tolist() == [[0, 2], [0, 5], [1, 3]]


@pytest.mark.parametrize("kwargs, match", [
    (dict(drift_threshold=-0.1), "drift_threshold must be in \\[0, 1\\], got -0.1"),
    (dict(drift_threshold=1.5), "drift_threshold must be in \\[0, 1\\], got 1.5"),
    (dict(track_num=0), "track_num must be positive"),
    (dict(mask_window=0), "mask_window must be positive"),
    (dict(factor=1.0), "factor applies to method parallel or prefix-cache"),
    (dict(refresh_interval=1), "refresh_interval applies to method prefix-cache or dual-cache"),
])
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(method="elastic", **kwargs)


def test_elastic_settings_belong_to_elastic():
    with pytest.raises(ValueError, match="drift_threshold applies to method elastic, not 'parallel'"):
        SamplingParams(method="parallel", drift_threshold=0.9)
    with pytest.raises(ValueError, match="track_num applies to method elastic, not 'flash-cache'"):
        SamplingParams(method="flash-cache", track_num=2)
    params = SamplingParams(method="elastic", max_tokens=20, block_length=32)  # no blocks: any length
    settings = params.settings
    assert (settings.mask_window, settings.drift_threshold, settings.track_num) == (16, 0.9, 1)
    assert method_of("elastic").uses_cache
