"""The kernel warm-up runs each kind of cached pass once per row count, dense and routed, once per model and
process, through the first layer; a compile that outlasts a warm disk cache is reported with a bar."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from flash_dllm import LLM, SamplingParams
from flash_dllm.cache import KVCache
from flash_dllm.engine.cuda_graphs import CudaGraphs
from flash_dllm.engine.warmup import CompileProgress, capture_steady_passes, compile_kernels, warm_up_requests


def test_compile_kernels_runs_every_pass_kind_once_per_model(gqa_checkpoint):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(gqa_checkpoint, device=device, dtype="float32", kernels=True, cuda_graphs=False)
    cfg, model = llm.config, llm.model
    cache = KVCache.from_budget(cfg, 16 * KVCache.bytes_per_row(cfg, torch.float32), torch.float32, device)
    passes = []
    forward_cached = model.forward_cached
    model.forward_cached = lambda ids, positions, metadata, cache, key_mass=None, kernels=False: passes.append(
        (metadata.num_seqs, metadata.max_q, metadata.max_kv, metadata.write_cache, key_mass is not None,
         metadata.routing.policies if metadata.routing else (), len(model.layers))
    ) or forward_cached(ids, positions, metadata, cache, key_mass, kernels)
    compile_kernels(model, cache, row_counts=(1, 3, 32), request_counts=(1, 2))  # 32 rows do not fit: skipped
    kinds = [(True, False), (True, True), (False, False)]
    shapes = [(rows, requests) for rows in (1, 3) for requests in (1, 2)]
    # over as many keys as rows, and over the most the cache holds (LONG_KV is more): the split-key variants;
    # then routed over the most keys; then one routed pass per power of two of chunks (here the cache's 16 rows
    # are less than a chunk) and policy kind;
    # through the first layer only (every layer launches the same variants), all of them there again after;
    # on the GPU a first sweep finds the variants without launching them (compiled in parallel), a second runs them
    dense = [(requests, rows, kv, *kind, (), 1) for rows, requests in shapes for kv in (rows, 16) for kind in kinds]
    routed = [(requests, rows, 16, *kind, ("chunk",), 1) for rows, requests in shapes for kind in kinds]
    chunks = [(1, 1, 16, True, False, (policy,), 1) for policy in ("chunk", "kmeans")]
    sweeps = 2 if device == "cuda" else 1
    assert passes == sweeps * dense  # a `generate`'s: no routed pass (they allocate the routing's summaries)
    compile_kernels(model, cache, row_counts=(1, 3, 32), request_counts=(1, 2), routed=True)  # a server's
    assert passes == sweeps * dense + sweeps * (routed + chunks)
    assert len(model.layers) == cfg.num_layers > 1
    compile_kernels(model, cache, row_counts=(1, 3), routed=True)
    assert len(passes) == sweeps * (24 + 12 + 2)


def test_compiles_that_outlast_a_warm_cache_are_reported_with_a_bar(capsys):
    release = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(lambda: None), pool.submit(release.wait)]
        progress = CompileProgress(futures, quiet_s=0.05)
        time.sleep(0.1)
        progress.update()  # between passes: the line, and a bar over the variants found so far
        assert capsys.readouterr().err.startswith("flash-dllm: compiling the cached passes' kernel variants")
        futures.append(pool.submit(release.wait))  # a later pass finds one more
        threading.Timer(0.2, release.set).start()
        progress.wait()
    assert "3/3" in capsys.readouterr().err


def test_variants_from_a_warm_cache_are_loaded_quietly(capsys):
    with ThreadPoolExecutor(2) as pool:
        progress = CompileProgress([pool.submit(time.sleep, 0.05) for _ in range(3)], quiet_s=1.0)
        progress.update()
        progress.wait()
    assert capsys.readouterr().err == ""


class RecordedGraphs(CudaGraphs):
    """The graphs' keys as the runner asks for them, every call run eagerly (no CUDA graph on the CPU)."""

    def __init__(self, runner):
        super().__init__(runner._forward_cached, runner.device)
        self.keys = set()

    def run(self, key, fn, tensors=(), capture_after=None):
        self.keys.add(key)
        return fn(*tensors)


@pytest.mark.parametrize("preset", ["llada-tiny", "dream-tiny"])  # Dream: shifted logits, another pass shape
@pytest.mark.parametrize("method", ["flash-cache", "dual-cache"])
def test_a_requests_steady_passes_find_a_graph_captured_before_ready(method, preset):
    """Requests of lengths the warm-up never ran: every pass but their whole-sequence ones (a first pass, a block's
    refresh) has the shape of one that `capture_steady_passes` captured, at one request a batch."""
    llm = LLM(f"random:{preset}", device="cpu", dtype="float32", kernels=False, kv_cache_bytes=1 << 22)
    runner = llm.runner
    runner.allocate_cache(with_hidden=False)
    runner.graphs = graphs = RecordedGraphs(runner)
    assert capture_steady_passes(llm, (method, "elastic"), block_length=8) > 0  # elastic's rows vary: none
    captured, graphs.keys = graphs.keys, set()
    params = SamplingParams(method=method, max_tokens=24, block_length=8)
    for prompt_length in (150, 333, 700):
        llm.generate([[5 + i % 50 for i in range(prompt_length)]], params, use_tqdm=False)
        passes = {key for key in graphs.keys if not isinstance(key[0], str)}  # not the whole steps'
        assert {key[0] for key in passes - captured} == {prompt_length + 24}, prompt_length
        assert passes & captured
        graphs.keys = set()


@pytest.mark.parametrize("method", ["flash-cache", "dual-cache"])
def test_graph_batch_sizes_capture_the_steady_passes_of_batches_of_that_size(method):
    """`serve --graph-batch-sizes 1 2`: a batch of two requests of lengths the warm-up never ran finds its steady
    passes captured before ready (only its whole-sequence passes are not); with batch size 1 alone it finds none."""
    llm = LLM("random:llada-tiny", device="cpu", dtype="float32", kernels=False, kv_cache_bytes=1 << 22)
    runner = llm.runner
    runner.allocate_cache(with_hidden=False)
    params = SamplingParams(method=method, max_tokens=24, block_length=8)
    prompts = [[5 + i % 50 for i in range(n)] for n in (150, 333)]
    whole = {150 + 24, 333 + 24, 150 + 333 + 48}  # the first passes and refreshes, alone or together
    for batch_sizes, found in (((1,), False), ((1, 2), True)):
        runner.graphs = graphs = RecordedGraphs(runner)
        capture_steady_passes(llm, (method,), block_length=8, batch_sizes=batch_sizes)
        captured, graphs.keys = graphs.keys, set()
        llm.generate(prompts, params, use_tqdm=False)
        passes = {key for key in graphs.keys if not isinstance(key[0], str)}  # not the whole steps'
        steady = {key for key in passes if key[0] not in whole}
        assert steady and (steady <= captured) == found, batch_sizes


def test_the_warm_up_requests_run_every_method_and_kind_of_routing_alone_and_batched():
    """Each method dense, each cached one also chunk- and k-means-routed (the other policies launch the chunk
    policy's variants); the shortest prompt alone, then it and the longest the model holds (an uncached method:
    the shortest), twice each, in one batch, through the first layer."""
    from flash_dllm.decoding.registry import method_of, methods_for

    llm = LLM("random:llada-tiny", device="cpu", dtype="float32")
    calls, generate = [], llm.generate

    def recorded(prompts, params, **options):
        calls.append((params.method, params.kv_routing, [len(p) for p in prompts], len(llm.model.layers)))
        return generate(prompts, params, **options)

    llm.generate = recorded
    ran = warm_up_requests(llm, prompt_lengths=(16, 100_000))
    longest = llm.config.max_position - 32
    runs = {(m, r) for m in methods_for("bidirectional") for r in (None, "chunk", "kmeans")
            if r is None or method_of(m).uses_cache}
    assert [(m, r) for m, r, _, _ in calls[::2]] == [(m, r) for m, r, _, _ in calls[1::2]]
    assert {(m, r) for m, r, _, _ in calls} == runs and len(calls) == 2 * len(runs)
    batched = lambda method: [16, longest, 16, longest] if method_of(method).uses_cache else [16, 16]
    assert all(lengths == ([16] if i % 2 == 0 else batched(method)) for i, (method, _, lengths, _) in
               enumerate(calls))
    assert {layers for *_, layers in calls} == {1} and ran == sum(1 + len(batched(m)) for m, _ in runs)
    assert len(llm.model.layers) == llm.config.num_layers


def test_generate_warms_each_method_and_routing_at_its_first_use(gqa_checkpoint, monkeypatch):
    """Where a first launch compiles (Triton on CUDA), `LLM.generate` runs the server's warm-up requests of each
    method and kind of routing once, before their first requests; the tokens are those of an LLM without it."""
    import flash_dllm.llm as llm_module

    cold = LLM(gqa_checkpoint, device="cpu", dtype="float32")
    llm = LLM(gqa_checkpoint, device="cpu", dtype="float32")
    monkeypatch.setattr(llm_module, "compiles_on_first_use", lambda runner: runner is llm.runner)
    warmed = []
    monkeypatch.setattr(llm_module, "warm_up_requests", lambda llm, methods, routings: warmed.append(
        (methods, routings)) or warm_up_requests(llm, methods, routings, prompt_lengths=(16, 64)))
    prompts = [[5 + i for i in range(40)], [7 + i for i in range(24)]]
    flash = SamplingParams(method="flash-cache", max_tokens=16, block_length=8)
    routed = SamplingParams(method="dual-cache", max_tokens=16, block_length=8, kv_routing="centroid")
    for params in (flash, [flash, routed], [routed, flash]):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in cold.generate(prompts, params, use_tqdm=False)]
    assert warmed == [(("flash-cache",), (None,)), (("dual-cache",), ("chunk",))]  # centroid launches chunks' variants
    assert set(llm.warm_up_seconds) == {("flash-cache", None), ("dual-cache", "chunk")}
    assert all(seconds > 0 for seconds in llm.warm_up_seconds.values())
    assert cold.warm_up_seconds == {}  # on the CPU without kernels nothing compiles: no warm-up


def test_the_warm_up_keeps_the_graphs_its_cache_allocation_makes(gqa_checkpoint, monkeypatch):
    """A first use's warm-up allocates the KV cache, which makes the CUDA graphs: they are set aside during the
    warm-up (a one-layer capture would replay wrong later) and are the runner's after it."""
    import flash_dllm.engine.model_runner as model_runner

    made = []
    monkeypatch.setattr(model_runner, "CudaGraphs", lambda forward, device: made.append(object()) or made[-1])
    llm = LLM(gqa_checkpoint, device="cpu", dtype="float32")
    llm.runner.cuda_graphs = True  # the CPU runs no graph: the stand-in above is never called
    warm_up_requests(llm, ("flash-cache",), (None,), prompt_lengths=(16,))
    assert len(made) == 1 and llm.runner.graphs is made[0]
