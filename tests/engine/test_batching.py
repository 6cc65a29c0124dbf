"""Batched decoding equals decoding each request alone; the scheduler refills rows as requests finish."""
from __future__ import annotations

import pytest
import torch

from conftest import eos_biased_llm

from flash_dllm import LLM, SamplingParams
from flash_dllm.cache import KVCache
from flash_dllm.engine.llm_engine import LLMEngine
from flash_dllm.engine.scheduler import Scheduler
from flash_dllm.engine.sequence import Sequence

PROMPTS = ["What is 3 + 4?", "Tom has 3 apples and buys 4 more. How many?", "x", "The passkey is 48213.",
           "for i in range(3): print(i)"]

PARAMS = [
    SamplingParams(method="reference", max_tokens=32, block_length=8),
    SamplingParams(method="reference", max_tokens=32, block_length=16, steps=8, temperature=1.0, seed=5),
    SamplingParams(method="reference", max_tokens=16, block_length=8, steps=8, cfg_scale=1.0),
    SamplingParams(method="parallel", max_tokens=32, block_length=8, threshold=0.7),
    SamplingParams(method="parallel", max_tokens=32, block_length=16, factor=1.0, temperature=0.5, seed=2),
]


@pytest.fixture(scope="module")
def llm(checkpoint):
    return eos_biased_llm(checkpoint, max_batch_size=2)


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"{p.method}-{p.max_tokens}-{p.block_length}")
def test_batched_equals_alone(llm, params):
    """Five prompts of different lengths through two rows (left padding, rows refilled as others
    finish) give the same tokens as each prompt decoded alone."""
    batched = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched):
        alone = llm.generate([prompt], params)[0]
        assert out.token_ids == alone.token_ids
        assert (out.steps, out.nfe, out.finish_reason) == (alone.steps, alone.nfe, alone.finish_reason)


def test_mixed_settings_in_one_call(llm):
    """Requests with different settings (and so different batches) come back in order, each as if alone."""
    outs = llm.generate(PROMPTS, PARAMS)
    for prompt, params, out in zip(PROMPTS, PARAMS, outs):
        assert out.token_ids == llm.generate([prompt], params)[0].token_ids


def test_per_row_settings_share_a_batch(llm):
    """Temperature, seed and threshold may differ inside one batch."""
    params = [SamplingParams(method="parallel", max_tokens=16, block_length=8, threshold=t, temperature=temp, seed=s)
              for t, temp, s in [(0.5, 0.0, 0), (0.9, 1.0, 1), (0.7, 0.5, 2)]]
    assert len({p.batch_key() for p in params}) == 1
    outs = llm.generate(PROMPTS[:3], params)
    for prompt, p, out in zip(PROMPTS, params, outs):
        assert out.token_ids == llm.generate([prompt], p)[0].token_ids


def test_requests_added_while_running(llm):
    """A request added between steps joins the running batch and decodes as if alone."""
    params = SamplingParams(method="parallel", max_tokens=32, block_length=8, threshold=0.8)
    engine = llm.engine
    first = engine.add_request(llm.encode(PROMPTS[0]), params)
    engine.step()
    engine.step()
    second = engine.add_request(llm.encode(PROMPTS[1]), params)
    while engine.has_unfinished():
        engine.step()
    for seq, prompt in ((first, PROMPTS[0]), (second, PROMPTS[1])):
        assert seq.output_ids == llm.generate([prompt], params)[0].token_ids


def test_scheduler_admits_in_arrival_order_up_to_the_batch_size():
    a, b = SamplingParams(max_tokens=32), SamplingParams(max_tokens=64)
    scheduler = Scheduler(max_batch_size=3)
    seqs = [Sequence(i, [1], p) for i, p in enumerate([a, b, a, a])]
    for seq in seqs:
        scheduler.add(seq)
    admit_all = lambda seq: True
    assert list(scheduler.admit(0, admit_all)) == seqs[:3]           # any key, oldest first, up to the rows
    assert list(scheduler.admit(3, admit_all)) == []
    assert list(scheduler.admit(2, lambda seq: False)) == []         # no cache rows for the oldest yet: none
    assert list(scheduler.admit(2, admit_all)) == [seqs[3]]


def test_an_admission_that_fails_keeps_the_requests_admitted_before_it():
    """`reserve` may raise (a compaction of the cache out of memory): the requests admitted before it in the same
    call have reached the caller, the failing one still waits."""
    scheduler = Scheduler(max_batch_size=4)
    seqs = [Sequence(i, [1], SamplingParams()) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)

    def reserve(seq):
        if seq is seqs[1]:
            raise MemoryError("compaction")
        return True
    placed = []
    with pytest.raises(MemoryError):
        for seq in scheduler.admit(0, reserve):
            placed.append(seq)
    assert placed == seqs[:1] and list(scheduler.waiting) == seqs[1:]


def test_batches_of_different_keys_share_the_steps(llm):
    """A request of another key starts at once beside a running batch (not after its queue drains), the two
    batches both step, and each request decodes as if alone."""
    common = SamplingParams(method="parallel", max_tokens=32, block_length=8, threshold=0.8)
    rare = SamplingParams(method="reference", max_tokens=16, block_length=8, steps=8)
    engine = llm.engine
    first = engine.add_request(llm.encode(PROMPTS[0]), common)
    other = engine.add_request(llm.encode(PROMPTS[3]), rare)
    later = [engine.add_request(llm.encode(prompt), common) for prompt in PROMPTS[1:3]]
    stepped = []
    while engine.has_unfinished():
        engine.step()
        stepped.append(engine.batch.params.method)
    assert stepped[:2] == ["parallel", "reference"]  # the new batch starts level with the least served
    assert other.start_time < first.finish_time  # it did not wait for the common batch to drain
    assert max(seq.start_time for seq in later) > min(first.finish_time, other.finish_time)  # max_batch_size 2
    for seq, prompt, params in [(first, PROMPTS[0], common), (other, PROMPTS[3], rare),
                                *zip(later, PROMPTS[1:3], [common] * 2)]:
        assert seq.output_ids == llm.generate([prompt], params)[0].token_ids


def test_the_least_served_batch_steps_next(llm):
    """Each batch's steps' seconds per row add up; the least served steps next, and a new batch starts level with
    the least served one (not at 0, which would hold the GPU until it caught up)."""
    engine = LLMEngine(llm.runner, llm.special, max_batch_size=4)
    keys = []
    for max_tokens, served in [(8, 0.5), (16, 0.2)]:
        params = SamplingParams(method="parallel", max_tokens=max_tokens, block_length=8)
        engine.add_request(llm.encode(PROMPTS[0]), params)
        engine.admit()
        keys.append(params.batch_key())
        engine.batches[keys[-1]].served_s = served
    assert engine.next_turn() == keys[1]
    late = SamplingParams(method="parallel", max_tokens=24, block_length=8)
    engine.add_request(llm.encode(PROMPTS[1]), late)
    engine.admit()
    assert engine.batches[late.batch_key()].served_s == 0.2
    while engine.has_unfinished():
        engine.step()
    engine.admit()
    assert not engine.batches  # batches without work leave


def test_step_without_requests_does_nothing(llm):
    assert not llm.engine.has_unfinished()
    assert llm.engine.step() == []


def test_interrupted_generate_leaves_the_engine_clean(gqa_checkpoint):
    """A failure in the middle of a run aborts its requests and frees their cache rows; the next call works."""
    llm = eos_biased_llm(gqa_checkpoint, max_batch_size=2)
    params = SamplingParams(method="dual-cache", max_tokens=32, block_length=8, threshold=0.7)
    expected = llm.generate(PROMPTS[:3], params)
    steps = 0
    real_step = llm.engine.step

    def failing_step():
        nonlocal steps
        steps += 1
        if steps == 3:
            raise KeyboardInterrupt
        return real_step()

    llm.engine.step = failing_step
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:3], params)
    llm.engine.step = real_step
    assert not llm.engine.has_unfinished()
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_rows
    assert [o.token_ids for o in llm.generate(PROMPTS[:3], params)] == [o.token_ids for o in expected]


COMPACTED = [SamplingParams(method=m, max_tokens=16, block_length=8, kv_routing=r, kv_budget=0.5 if r else None)
             for m, r in [("flash-cache", None), ("flash-cache", "chunk"), ("flash-cache", "kmeans"),
                          ("dual-cache", None), ("dual-cache", "kmeans"), ("prefix-cache", "chunk"), ("elastic", None),
                          ("flash-verify", None)]]


@pytest.mark.parametrize("params", COMPACTED, ids=lambda p: f"{p.method}-{p.kv_routing or 'dense'}")
def test_compacting_the_cache_mid_run_keeps_the_tokens(gqa_checkpoint, params):
    """Running requests whose cache rows slide to the cache's start between two steps (their K/V, hidden states,
    chunk summaries and k-means regions moved, their batch's bases updated in place) decode the tokens they decode
    where they were."""
    llm = LLM(str(gqa_checkpoint), device="cpu", dtype="float32", max_batch_size=4)
    prompts = [[16 + (7 * i + j) % 200 for i in range(n)] for j, n in enumerate((150, 96))]
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    engine = llm.engine
    seqs = [engine.add_request(p, params) for p in prompts]
    ghost = engine.allocator.allocate(64)  # rows 0-63 held by no request: the moved ranges start after them
    for _ in range(5):
        engine.step()
    assert min(seq.cache_base for seq in seqs) >= 64 and engine.has_unfinished()
    engine.allocator.release(ghost, 64)
    engine.compact_cache()
    assert min(seq.cache_base for seq in seqs) == 0 and (engine.compactions, engine.rows_moved) == (1, 320)
    while engine.has_unfinished():
        engine.step()
    assert [seq.output_ids for seq in seqs] == expected


def test_a_request_that_fits_only_in_a_compacted_cache_is_admitted_at_once(gqa_checkpoint):
    """Free rows in two holes, neither long enough for the waiting request: the engine compacts the cache and admits
    it, instead of waiting for a neighbour to finish; each request decodes as if alone."""
    probe = LLM(str(gqa_checkpoint), device="cpu", dtype="float32")
    per_row = KVCache.bytes_per_row(probe.config, torch.float32)
    llm = LLM(str(gqa_checkpoint), device="cpu", dtype="float32", max_batch_size=4, kv_cache_bytes=192 * per_row)
    short, long = (SamplingParams(method="flash-cache", max_tokens=n, block_length=8) for n in (8, 32))
    # rows: A 0-31 (24 + 8), B 32-95 and C 96-159 (32 + 32), a tail of 32; D (32 + 32) waits for 64 in one range
    requests = [([16 + i for i in range(24)], short), *(([20 + j + i for i in range(32)], long) for j in range(3))]
    engine = llm.engine
    seqs = [engine.add_request(ids, params) for ids, params in requests]
    engine.admit()
    assert [seq.cache_base for seq in seqs] == [0, 32, 96, None] and engine.allocator.num_rows == 192
    while not seqs[0].is_finished:  # A's batch alone (the batches' turns follow their measured times)
        engine.step_batch(short.batch_key())
    assert seqs[3].cache_base is None and engine.compactions == 0
    engine.step()  # A's 32 rows and the tail's 32: D gets 64 once B and C slide to the start
    assert engine.compactions == 1 and [seq.cache_base for seq in seqs[1:]] == [0, 64, 128]
    while engine.has_unfinished():
        engine.step()
    for seq, (ids, params) in zip(seqs, requests):
        assert seq.output_ids == probe.generate([ids], params)[0].token_ids


def test_a_compaction_that_fails_leaves_every_range_where_it_was(gqa_checkpoint, monkeypatch):
    """A copy that fails (out of memory) leaves the allocator, the sequences' ranges and the waiting request as
    they were; aborting the running requests then frees every row."""
    probe = LLM(str(gqa_checkpoint), device="cpu", dtype="float32")
    per_row = KVCache.bytes_per_row(probe.config, torch.float32)
    llm = LLM(str(gqa_checkpoint), device="cpu", dtype="float32", max_batch_size=4, kv_cache_bytes=192 * per_row)
    params = SamplingParams(method="flash-cache", max_tokens=32, block_length=8)
    engine = llm.engine
    seqs = [engine.add_request([20 + j + i for i in range(32)], params) for j in range(4)]
    ghost = engine.allocator.allocate(32)
    engine.step()  # two run, at 32 and 96; 32 rows are left at the end
    assert [seq.cache_base for seq in seqs] == [32, 96, None, None]
    engine.allocator.release(ghost, 32)  # 32 free rows at the start, 32 at the end: the third fits compacted
    free = [(r.start, r.length) for r in engine.allocator.free]

    def failing(moves):
        raise torch.OutOfMemoryError("staging buffer")
    monkeypatch.setattr(engine.runner.cache, "move_rows", failing)
    with pytest.raises(torch.OutOfMemoryError):
        engine.step()
    assert [(r.start, r.length) for r in engine.allocator.free] == free and engine.compactions == 0
    assert [seq.cache_base for seq in seqs] == [32, 96, None, None] and seqs[2] in engine.scheduler.waiting
    engine.abort([*engine.running, *engine.scheduler.waiting])
    assert engine.allocator.num_free == engine.allocator.num_rows and all(seq.cache_base is None for seq in seqs)
