"""CUDA graphs replay the repeating steps and cached passes with the eager kernel path's tokens (GPU only); a
pass is specialised on every shape it depends on; the whole-step path gives the eager tokens and writes the
batch's tensors in place (CPU, with captures that rerun Python); constants are uploaded once and held by the
graphs that read them; asking for graphs without the kernels on a GPU is an error."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from flash_dllm import LLM, SamplingParams
from flash_dllm.cache import KVCache
from flash_dllm.cache.attention_metadata import AttentionMetadata, cu_seqlens
from flash_dllm.decoding.registry import method_of
from flash_dllm.engine.cuda_graphs import (CAPTURE_AFTER, MAX_GRAPH_ROWS, CudaGraphs, GraphedCalls, bucket,
                                          pad_verify_pass, signature)
from flash_dllm.engine import cuda_graphs
from flash_dllm.engine.counters import ReadyMark
from flash_dllm.engine.llm_engine import LLMEngine
from flash_dllm.engine.warmup import capture_steady_passes

METHODS = [dict(method="prefix-cache"), dict(method="dual-cache"),
           dict(method="flash-cache", tracking_budget=4, mask_window=8),
           dict(method="flash-verify", tracking_budget=4, mask_window=8),
           dict(method="elastic", mask_window=8, drift_threshold=0.95)]
PROMPTS = [[5, 9, 13, 7], [11, 4, 6, 8, 12, 3, 10], [3, 3, 4]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("max_tokens", [32, 20])  # 20: blocks of 8, 8 and 4
@pytest.mark.parametrize("knobs", METHODS, ids=lambda k: k["method"])
def test_graphs_give_the_eager_tokens(gqa_checkpoint, knobs, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, block_length=8, threshold=0.9, **knobs)
    outputs = {}
    for graphs in (False, True):
        llm = LLM(gqa_checkpoint, device="cuda", dtype="float32", kernels=True, cuda_graphs=graphs)
        outputs[graphs] = [out.token_ids for out in llm.generate(PROMPTS, params)]
        if graphs:
            assert llm.runner.graphs.replays > 0
            steps_captured = any(key[0] == "step" for key in llm.runner.graphs.graphs)
            assert steps_captured == method_of(knobs["method"]).replayable
    assert outputs[True] == outputs[False]


class ReplayingCapture:
    """A capture without a GPU: the capturing call runs the function, a replay runs it again. (A real replay runs
    no Python: host work of a step must be in its plan, which this test cannot see; it checks the rest.)"""

    def __init__(self, fn, tensors):
        self.fn = fn
        self.first_outputs = fn(*tensors)

    def replay(self, tensors):
        return self.fn(*tensors)


@pytest.mark.parametrize("method", ["flash-cache", "dual-cache"])
def test_passes_captured_before_ready_give_later_requests_the_eager_tokens(gqa_checkpoint, method, monkeypatch):
    """The steady passes that `capture_steady_passes` captures from synthetic batches (the keys' width padded to its
    bucket) serve later requests of other lengths, after captures stop, with the tokens of a run without graphs
    (CPU, captures that rerun Python)."""
    params = SamplingParams(method=method, max_tokens=24, block_length=8)
    prompts = [[5 + i % 40 for i in range(n)] for n in (150, 333)]
    eager = LLM(gqa_checkpoint, device="cpu", dtype="float32")
    expected = [eager.generate([prompt], params, use_tqdm=False)[0].token_ids for prompt in prompts]
    monkeypatch.setattr(GraphedCalls, "_capture", lambda self, fn, tensors, run_first: ReplayingCapture(fn, tensors))
    llm = LLM(gqa_checkpoint, device="cpu", dtype="float32")
    llm.runner.allocate_cache(with_hidden=False)
    llm.runner.graphs = graphs = CudaGraphs(llm.runner._forward_cached, torch.device("cpu"))
    assert capture_steady_passes(llm, (method,), block_length=8) > 0
    graphs.stop_capturing()
    captured = len(graphs.graphs)
    assert [llm.generate([prompt], params, use_tqdm=False)[0].token_ids for prompt in prompts] == expected
    assert graphs.replays > 0 and len(graphs.graphs) == captured


def batch_tensors(batch) -> list[int]:
    """The storage of every tensor of a batch (a captured step reads and writes them where they were)."""
    tensors = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    for group in (batch.counters, batch.state):
        if group is not None:
            tensors += [getattr(group, f.name) for f in dataclasses.fields(group)]
    return [t.data_ptr() for t in tensors if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("knobs", [k for k in METHODS if method_of(k["method"]).replayable], ids=lambda k: k["method"])
def test_whole_steps_go_through_the_step_graphs_in_place(gqa_checkpoint, knobs, monkeypatch):
    """A replayable method's steps run through the engine's step graphs: the eager tokens and query rows, and a
    step never rebinds a tensor of the batch (a graph would go on writing the old one); a second engine on the
    same runner never replays the first one's graphs."""
    params = SamplingParams(max_tokens=32, block_length=8, threshold=0.9, **knobs)
    expected = LLM(gqa_checkpoint, device="cpu", dtype="float32").generate(PROMPTS, params, use_tqdm=False)

    monkeypatch.setattr(GraphedCalls, "_capture", lambda self, fn, tensors, run_first: ReplayingCapture(fn, tensors))
    llm = LLM(gqa_checkpoint, device="cpu", dtype="float32", max_batch_size=2)  # a refill: a second batch
    llm.runner.graphs = CudaGraphs(llm.runner._forward_cached, torch.device("cpu"))
    storage = {}
    finish_state = LLMEngine._finish_state

    def checked_finish_state(engine, method, batch):
        before = storage.setdefault(batch.number, batch_tensors(batch))
        assert batch_tensors(batch) == before
        return finish_state(engine, method, batch)

    monkeypatch.setattr(LLMEngine, "_finish_state", checked_finish_state)
    for engine in (llm.engine, LLMEngine(llm.runner, llm.special, 2)):
        llm.engine = engine
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
        assert [o.query_rows for o in outputs] == [o.query_rows for o in expected]
    step_keys = [key for key in llm.runner.graphs.graphs if key[0] == "step"]
    assert step_keys and {key[1] for key in step_keys} <= set(storage)
    assert llm.runner.graphs.replays > 0


def test_flash_verify_runs_up_to_its_verify_pass_through_one_graph(gqa_checkpoint, monkeypatch):
    """Flash-Verify's step reads its verify pass's shape back, so the engine cannot replay it whole; its draft pass
    and what follows up to that shape replay as one graph per plan, with the eager tokens (CPU, captures that rerun
    Python, as above)."""
    params = SamplingParams(max_tokens=32, block_length=8, threshold=0.9, **METHODS[3])
    expected = LLM(gqa_checkpoint, device="cpu", dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.setattr(GraphedCalls, "_capture", lambda self, fn, tensors, run_first: ReplayingCapture(fn, tensors))
    # the passes eagerly: a padded verify pass needs the kernels (test_a_padded_verify_pass_gives_the_same_rows)
    monkeypatch.setattr(CudaGraphs, "run_pass", lambda self, *args: self.forward(*args))
    llm = LLM(gqa_checkpoint, device="cpu", dtype="float32")
    llm.runner.graphs = CudaGraphs(llm.runner._forward_cached, torch.device("cpu"))
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert [o.query_rows for o in outputs] == [o.query_rows for o in expected]
    assert any(key[0] == "flash-verify draft" for key in llm.runner.graphs.graphs)
    assert llm.runner.graphs.replays > 0


def test_constants_are_uploaded_once_and_held_by_the_graphs_that_read_them(monkeypatch):
    monkeypatch.setattr(GraphedCalls, "MAX_CONSTANTS", 2)
    graphs = GraphedCalls(torch.device("cpu"))
    first = graphs.constant([3, 4])
    assert graphs.constant([3, 4]) is first and torch.equal(first, torch.tensor([3, 4]))
    graphs.read_by_capture = []  # a capture under way
    graphs.constant([5])
    graphs.constant([3, 4])
    graphs.constant([6])  # the least recently used list, [5], is dropped from the memo
    assert list(graphs.constants) == [(3, 4), (6,)]
    assert [t.tolist() for t in graphs.read_by_capture] == [[5], [3, 4], [6]]  # but the graph holds it


def test_graphs_need_the_kernels_on_a_gpu(gqa_checkpoint):
    with pytest.raises(ValueError, match="cuda_graphs"):
        LLM(gqa_checkpoint, device="cpu", cuda_graphs=True)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda_graphs"):
            LLM(gqa_checkpoint, device="cuda", kernels=False, cuda_graphs=True)


def test_signature_tells_apart_every_shape_a_pass_depends_on():
    def key(counts, max_kv, write_cache=True, track=False, mass=False):
        n = sum(counts)
        table = AttentionMetadata(cu_seqlens_q=cu_seqlens(counts, "cpu"),
                                  kv_start=torch.zeros(len(counts), dtype=torch.long),
                                  kv_len=torch.full((len(counts),), max_kv), slot_mapping=torch.arange(n),
                                  max_q=max(counts), max_kv=max_kv, write_cache=write_cache,
                                  track_rows=torch.ones(n, dtype=torch.bool) if track else None)
        return signature(torch.zeros(n, dtype=torch.long), table, torch.zeros(len(counts), max_kv) if mass else None)

    base = key([4, 4], 20)
    assert key([4, 4], 20) == base
    others = [key([4, 4, 4], 20), key([5, 3], 20), key([4, 4], 21), key([4, 4], 20, write_cache=False),
              key([4, 4], 20, track=True), key([4, 4], 20, track=True, mass=True)]
    assert len({base, *others}) == 1 + len(others)


class CountingForward:
    """Stands in for the cached forward: counts eager passes (no GPU needed for the capture policy)."""

    def __init__(self):
        self.eager = 0

    def __call__(self, input_ids, positions, metadata, key_mass=None):
        self.eager += 1
        return input_ids


class FakeCapture:
    """A capture without a GPU: the capturing call runs the function once, a replay returns its first input."""

    def __init__(self, fn, tensors):
        self.first_outputs = fn(*tensors)
        self.replays = 0

    def replay(self, tensors):
        self.replays += 1
        return tensors[0], None


def make_pass(rows: int, max_kv: int = 20, write_cache: bool = True):
    verify = {} if write_cache else dict(write_cache=False, hidden_keys=torch.zeros(1, max_kv, dtype=torch.bool),
                                         self_visibility=torch.ones(1, rows, rows, dtype=torch.bool))
    table = AttentionMetadata(cu_seqlens_q=cu_seqlens([rows], "cpu"), kv_start=torch.zeros(1, dtype=torch.long),
                       kv_len=torch.full((1,), max_kv), slot_mapping=torch.arange(rows), max_q=rows, max_kv=max_kv,
                       **verify)
    return torch.arange(rows) + 1, torch.arange(rows), table


def test_capture_policy(monkeypatch):
    """Eager for the first CAPTURE_AFTER sightings of a shape, then captured once (the capturing call runs it
    once more) and replayed; the least recently used graph goes first; passes over MAX_GRAPH_ROWS rows are never
    captured."""
    monkeypatch.setattr(GraphedCalls, "_capture", lambda self, fn, tensors, run_first: FakeCapture(fn, tensors))
    model = CountingForward()
    graphed = CudaGraphs(model, torch.device("cpu"), max_graphs=2)
    ids, positions, table = make_pass(8)
    for _ in range(CAPTURE_AFTER + 3):
        graphed.run_pass(ids, positions, table)
    assert (model.eager, graphed.captures, graphed.replays) == (CAPTURE_AFTER + 1, 1, 2)

    for rows in (9, 10):  # two more shapes: the first one's graph is evicted
        for _ in range(CAPTURE_AFTER + 1):
            graphed.run_pass(*make_pass(rows))
    assert graphed.captures == 3 and len(graphed.graphs) == 2
    eager = model.eager
    graphed.run_pass(ids, positions, table)
    assert model.eager == eager + 1  # counted afresh

    big = make_pass(MAX_GRAPH_ROWS + 1)
    for _ in range(CAPTURE_AFTER + 2):
        graphed.run_pass(*big)
    assert graphed.captures == 3


def test_no_capture_once_stopped(monkeypatch):
    """After stop_capturing (a server once ready) the graphs held replay and a new shape stays eager, however
    often it comes; nothing is counted as captured after the ready mark."""
    monkeypatch.setattr(GraphedCalls, "_capture", lambda self, fn, tensors, run_first: FakeCapture(fn, tensors))
    model = CountingForward()
    graphed = CudaGraphs(model, torch.device("cpu"))
    held = make_pass(8)
    for _ in range(CAPTURE_AFTER + 1):
        graphed.run_pass(*held)
    graphed.stop_capturing()
    mark = ReadyMark()
    mark.mark()
    eager, replays = model.eager, graphed.replays
    graphed.run_pass(*held)
    for _ in range(CAPTURE_AFTER + 3):
        graphed.run_pass(*make_pass(9))
    assert (graphed.captures, graphed.replays - replays, model.eager - eager) == (1, 1, CAPTURE_AFTER + 3)
    assert mark.after()["captures"].count == 0


class RecordingCapture:
    """_CapturedCall without a GPU: runs the call first if asked, then "records" it by running its Python again
    (as a real capture does, without its kernels); the call it stands for is the first run, or else a replay."""

    def __init__(self, fn, tensors, pool, stream, run_first):
        self.fn, self.run_first, self.graph = fn, run_first, SimpleNamespace(pool=lambda: None)
        first = fn(*tensors) if run_first else None
        fn(*tensors)
        self.first_outputs = first if run_first else fn(*tensors)

    def replay(self, tensors):
        return self.fn(*tensors)


def test_a_capture_runs_the_call_first_only_where_nothing_warmed_it_up(monkeypatch):
    """The first capture (its stream new) and a key captured at its first sighting run the call before recording
    it; a key seen eagerly is recorded straight away, unless a host list of its eager run has left the memo since
    (a capture cannot upload it): then the capture starts over and runs the call first."""
    monkeypatch.setattr(cuda_graphs, "_CapturedCall", RecordingCapture)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: "stream")
    graphs = GraphedCalls(torch.device("cpu"))
    runs = []

    def call(x):
        runs.append(graphs.constant([int(x.sum())]))
        return (x + 1,)

    def ran_first(key, x, capture_after=None):
        assert torch.equal(graphs.run(key, call, (x,), capture_after)[0], x + 1)
        return graphs.graphs[key].run_first if key in graphs.graphs else None

    one = torch.ones(2)
    assert [ran_first("a", one), ran_first("a", one)] == [None, True]           # eager; the first capture
    assert [ran_first("b", one * 2), ran_first("b", one * 2)] == [None, False]  # eager; recorded straight away
    assert ran_first("c", one * 3, capture_after=0) is True                    # never seen
    assert ran_first("d", one * 4) is None
    graphs.constants.clear()  # its list [8] is no longer on the device
    assert ran_first("d", one * 4) is True and (8,) in graphs.constants
    assert graphs.captures == 4 and graphs.may_upload


def test_verify_passes_of_one_bucket_share_a_graph(monkeypatch):
    """Passes that do not write the cache are replayed padded to a bucket of rows: row counts that vary
    within one bucket share one graph, and the output keeps only the pass's own rows."""
    monkeypatch.setattr(GraphedCalls, "_capture", lambda self, fn, tensors, run_first: FakeCapture(fn, tensors))
    model = CountingForward()
    graphed = CudaGraphs(model, torch.device("cpu"))
    assert bucket(97) == bucket(100) == 112 and bucket(16) == 16 and bucket(1000) == 1024
    rows_seen = (97, 100, 103, 110, 99, 112)
    for rows in rows_seen:
        out = graphed.run_pass(*make_pass(rows, write_cache=False))
        assert torch.equal(out, torch.arange(rows) + 1)
    assert (model.eager, graphed.captures, graphed.replays) == (CAPTURE_AFTER + 1, 1,
                                                                len(rows_seen) - CAPTURE_AFTER - 1)
    graphed.run_pass(*make_pass(113, write_cache=False))  # the next bucket
    assert model.eager == CAPTURE_AFTER + 2


def test_a_padded_verify_pass_gives_the_same_rows(gqa_checkpoint):
    """The padding rows belong to no request: the kernel path gives the real rows the unpadded values."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(gqa_checkpoint, device=device, dtype="float32", kernels=True, cuda_graphs=False)
    cfg, model = llm.config, llm.model
    cache = KVCache.from_budget(cfg, 64 * KVCache.bytes_per_row(cfg, torch.float32), torch.float32, device)
    g = torch.Generator().manual_seed(0)
    for layer in range(cfg.num_layers):
        cache.k[layer].copy_(torch.randn(cache.k[layer].shape, generator=g))
        cache.v[layer].copy_(torch.randn(cache.v[layer].shape, generator=g))
    counts, kv_len = [5, 3], [12, 9]
    n, max_q = sum(counts), max(counts)
    table = AttentionMetadata(cu_seqlens_q=cu_seqlens(counts, device), kv_start=torch.tensor([0, 20], device=device),
                       kv_len=torch.tensor(kv_len, device=device), slot_mapping=torch.zeros(n, dtype=torch.long,
                       device=device), max_q=max_q, max_kv=max(kv_len), write_cache=False,
                       hidden_keys=(torch.rand(2, max(kv_len), generator=g) < 0.3).to(device),
                       self_visibility=(torch.rand(2, max_q, max_q, generator=g) < 0.6).to(device))
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=g).to(device)
    positions = torch.randint(0, 9, (n,), generator=g).to(device)
    with torch.inference_mode():
        plain = model.forward_cached(ids, positions, table, cache, kernels=True)
        padded_ids, padded_positions, padded_table = pad_verify_pass(ids, positions, table)
        assert padded_ids.shape[0] == bucket(n) and padded_table.max_q == bucket(max_q)
        padded = model.forward_cached(padded_ids, padded_positions, padded_table, cache, kernels=True)[:n]
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
