"""Compiles (under the interpreter: first launches of a variant key), captures, full garbage collections and steps,
counted after ready."""
from __future__ import annotations

import gc
import os

import pytest
import torch

from flash_dllm.engine.counters import (COUNTERS, Counters, ReadyMark, StepLog, StepShape, Tally,
                                        install_collection_hook, install_compile_hooks, percentile, step_ratios,
                                        work_class)
from flash_dllm.engine.warmup import freeze_heap

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts interpreted launches")


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert [percentile(values, q) for q in (0.5, 0.9, 0.99, 1.0)] == [50.0, 90.0, 99.0, 100.0]
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([7.0], 0.99) == 7.0 and percentile([], 0.5) == 0.0


def test_ready_mark_counts_what_follows_it():
    counters = Counters()
    counters.record("compiles", 1.0, "before")
    mark = ReadyMark(counters)
    assert mark.after()["compiles"].count == 0
    mark.mark()
    counters.record("compiles", 0.25, "a")
    counters.record("captures", 0.5, "b")
    after = mark.after()
    assert (after["compiles"].count, after["compiles"].seconds) == (1, 0.25)
    assert (after["captures"].count, after["captures"].seconds) == (1, 0.5)
    counters.record("compiles", 0.75, "a")
    assert mark.after_by_name() == {("compiles", "a"): Tally(2, 1.0), ("captures", "b"): Tally(1, 0.5)}


def test_full_garbage_collections_are_counted_and_younger_ones_not():
    install_collection_hook()
    install_collection_hook()  # idempotent: one count per collection
    mark = ReadyMark()
    mark.mark()
    gc.collect(0)
    gc.collect(1)
    assert mark.after()["collections"] == Tally()
    gc.collect()
    gc.collect(2)
    after = mark.after()["collections"]
    assert after.count == 2 and after.seconds > 0
    assert mark.after_by_name() == {("collections", "full"): after}


def test_a_collection_inside_a_record_is_counted_too():
    """The collector may run (and record) while the same thread is recording: the lock is re-entrant."""
    counters = Counters()
    with counters._lock:
        counters.record("collections", 0.5, "full")
    assert counters.snapshot()["collections"] == Tally(1, 0.5)


def test_the_heap_a_start_up_leaves_is_frozen_out_of_later_collections():
    survivor = [[] for _ in range(100)]  # noqa: F841  alive at the freeze
    try:
        freeze_heap()
        assert gc.get_freeze_count() > 100 and not any(o is survivor for o in gc.get_objects())
        fresh = [[]]
        assert any(o is fresh for o in gc.get_objects())  # allocated since: collected as before
    finally:
        gc.unfreeze()


def test_a_steps_work_class_is_its_query_rows_to_a_quarter_octave():
    assert [work_class(n) for n in (0, 1, 2, 3, 8, 9, 32, 33, 144, 192, 4096, 4097)] == \
        [1, 1, 2, 3, 8, 10, 32, 40, 160, 192, 4096, 5120]
    for rows in range(1, 5000):  # one class holds rows within 1.25x of each other
        assert rows <= work_class(rows) <= 1.25 * rows


def test_the_engine_classes_each_step_by_the_rows_it_computed():
    """Dual-cache: each block starts with a full pass over the sequence (a prefill's work), its other steps
    compute the block; both are told apart from the step's query rows."""
    from flash_dllm import LLM, SamplingParams

    llm = LLM("random:llada-tiny", device="cpu", dtype="float32")
    shapes, step_batch = [], llm.engine.step_batch
    llm.engine.step_batch = lambda turn: (step_batch(turn), shapes.append(llm.engine.last_step))[0]
    params = SamplingParams(method="dual-cache", max_tokens=16, block_length=8, threshold=1.0)
    llm.generate([list(range(20, 120))], params, use_tqdm=False)
    assert shapes[0] == StepShape("dual-cache", 1, work_class(116))  # the prompt and the canvas
    assert {shape.query_rows for shape in shapes} == {work_class(116), work_class(8)}
    assert sum(shape.query_rows == 128 for shape in shapes) == 2  # one full pass per block


def test_a_routed_requests_steps_are_classed_apart_from_dense_ones():
    """A routed pass replays no graph: its steps are compared with routed ones (of the same batch size)."""
    from flash_dllm import LLM, SamplingParams

    llm = LLM("random:llada-tiny", device="cpu", dtype="float32")
    shapes, step_batch = [], llm.engine.step_batch
    llm.engine.step_batch = lambda turn: (step_batch(turn), shapes.append(llm.engine.last_step))[0]
    prompt = list(range(20, 120))
    for routing in (None, "chunk"):
        params = SamplingParams(method="flash-cache", max_tokens=8, block_length=8, kv_routing=routing)
        llm.generate([prompt, prompt], params, use_tqdm=False)
    dense = sum(shape.routed_rows == 0 for shape in shapes)
    assert 0 < dense < len(shapes) and all(shape.routed_rows == 2 for shape in shapes[dense:])
    assert all(shape.batch_size == 2 for shape in shapes)


def test_a_step_is_measured_against_the_median_of_its_shape():
    log = StepLog(window_s=60)
    small, large, other = StepShape("flash-cache", 8, 256), StepShape("flash-cache", 32, 1024), \
        StepShape("elastic", 8, 256)
    for seconds, shape in [(0.010, small), (0.012, small), (0.011, small), (0.050, large), (0.040, large),
                           (0.045, large), (0.030, other), (0.030, other)]:
        log.record(seconds, shape, now=100.0)
    assert log.longest(now=100.0) == (0.050, pytest.approx(0.050 / 0.045), 3)  # elastic's are not flash-cache's
    log.record(0.033, small, now=100.0)  # 3x the median of its shape, though shorter than batch 32's steps
    assert log.longest(now=100.0) == (0.050, pytest.approx(0.033 / 0.0115), 4)
    prefill = StepShape("flash-cache", 8, 8192)
    for seconds in (0.500, 0.450):  # prefills: the longest steps, against prefills' median
        log.record(seconds, prefill, now=100.0)
    assert log.longest(now=100.0) == (0.500, pytest.approx(0.033 / 0.0115), 4)
    assert step_ratios([(s, shape) for _, s, shape in log.steps])[small] == (4, 0.0115, pytest.approx(0.033 / 0.0115))
    assert log.longest(now=200.0) == (0.0, 0.0, 0)  # a minute later: none


@interpreted
def test_interpreted_launches_count_each_variant_key_once():
    import triton
    import triton.language as tl

    @triton.jit
    def scale(x_ptr, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(x_ptr + o, tl.load(x_ptr + o, mask=o < n) * 2, mask=o < n)

    assert install_compile_hooks() == "interpreter"
    x = torch.ones(64)
    before = COUNTERS.snapshot()["compiles"].count
    count = lambda: COUNTERS.snapshot()["compiles"].count - before
    scale[(1,)](x, 5, BLOCK=64)
    scale[(1,)](x, 7, BLOCK=64)  # the same key: n is neither 1 nor a multiple of 16 either time
    assert count() == 1
    scale[(1,)](x, 32, BLOCK=64)  # n % 16 == 0: a variant of its own, as Triton specialises it
    scale[(1,)](x, 32, BLOCK=32)  # a constexpr
    scale[(1,)](x, 33, BLOCK=32, num_warps=2)  # a launch option
    assert count() == 4
