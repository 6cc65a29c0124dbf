"""The mixed-load benchmark: a seeded mix, and offline after the server's warm-up no kernel variant is new."""
from __future__ import annotations

import json
import os

import pytest

from flash_dllm import LLM
from flash_dllm.bench.mix import (LoadSample, MixAnswer, MixResult, MixSpec, format_report, metric_sums,
                                  load_answers, mix_requests, run_offline, save_answers, worst_shape_ratio)
from flash_dllm.engine.counters import StepShape
from flash_dllm.engine.warmup import before_ready


def test_the_mix_is_seeded_and_draws_from_its_spec():
    spec = MixSpec(num_requests=400, rate=4.0, prompt_lengths=(64, 512), max_tokens=(32, 256),
                   methods=("parallel", "flash-cache"), routings=(None, "chunk"), seed=3)
    requests = mix_requests(spec)
    assert requests == mix_requests(spec) and requests != mix_requests(MixSpec(**{**spec.__dict__, "seed": 4}))
    assert {len(r.prompt_ids) for r in requests} == {64, 512} and {r.max_tokens for r in requests} == {32, 256}
    assert {r.group for r in requests} == {("parallel", "dense"), ("flash-cache", "dense"), ("flash-cache", "chunk")}
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and 400 / arrivals[-1] == pytest.approx(4.0, rel=0.2)  # Poisson at the rate
    assert max(max(r.prompt_ids) for r in mix_requests(spec, vocab_size=100)) < 100
    even = mix_requests(MixSpec(**{**spec.__dict__, "arrivals": "even"}))  # the same requests, a quarter second apart
    assert [r.arrival_s for r in even] == pytest.approx([(i + 1) / 4 for i in range(400)])
    assert [(r.prompt_ids, r.max_tokens, r.group) for r in even] == [(r.prompt_ids, r.max_tokens, r.group)
                                                                      for r in requests]
    with pytest.raises(ValueError, match="arrivals must be one of poisson, even, got 'burst'"):
        MixSpec(arrivals="burst")


def test_report_per_method_and_shape():
    spec = MixSpec(num_requests=4, methods=("flash-cache",), routings=(None,), prompt_lengths=(64,), max_tokens=(32,))
    requests = mix_requests(spec)
    answers = [MixAnswer(r, True, 0.1, e2e, 32) for r, e2e in zip(requests, (1.0, 1.0, 1.2, 2.0))]
    assert worst_shape_ratio(answers) == 2.0  # p99 2.0 over p50 1.0
    row = MixResult(answers, wall_s=4.0).group_rows()[0]
    assert row[:4] == ("flash-cache", "dense", 4, 0) and row[7:] == ("1.000", "2.000", "2.000", "2.00")
    assert "| 4 | 0 | 4.0 | 1.00 | 32.0 | 0 |" in format_report(MixResult(answers, wall_s=4.0))
    assert format_report(MixResult(answers, wall_s=4.0)).split("\n")[2].endswith("| - | - | - |")  # no load sampled
    prefill, steady = StepShape("flash-cache", 2, 1024), StepShape("flash-cache", 2, 32)
    steps = [(0.5, prefill), (0.010, steady), (0.010, steady), (0.030, steady)]
    load = [LoadSample(2, 0, 0.25)] * 8 + [LoadSample(1, 0, 0.1), LoadSample(2, 3, 0.9)]
    report = format_report(MixResult(answers, wall_s=4.0, steps=steps, load=load))
    # the worst steady step: 3x its shape's median, not the prefill (after no compile, capture or full collection);
    # the load: 1-2 requests running, a queue in one sample of ten, a quarter of the KV cache held
    assert "| 0 | 0.00 | 0 | 0.00 | 0 | 0.00 | 3.00 (3 steps) | 1/2/2 | 0/0/0 | 0.10/0.25/0.25 |" in report
    assert "| flash-cache | 2 | 1024 | 0 | 1 | 500.0 | 1.00 |" in report
    assert "| flash-cache | 2 | 32 | 0 | 3 | 10.0 | 3.00 |" in report
    assert "minute of arrival" not in report  # one minute: no table by minute
    assert metric_sums('# HELP x y\nx{replica="0"} 1\nx{replica="1"} 2.5\nz 3\n') == {"x": 3.5, "z": 3.0}


def test_report_by_minute_of_arrival(tmp_path):
    """Slow requests that cluster in one minute (an episode of the engine's) stand out from the mix's spread."""
    spec = MixSpec(num_requests=6, rate=1 / 30, arrivals="even", methods=("flash-cache",), routings=(None,),
                   prompt_lengths=(64,), max_tokens=(32,))
    requests = mix_requests(spec)  # two arrivals a minute: at 30 and 60 s, 90 and 120 s, 150 and 180 s
    answers = [MixAnswer(r, True, 0.1, e2e, 32) for r, e2e in zip(requests, (1.0, 1.0, 2.0, 1.2, 1.0, 1.0))]
    assert MixResult(answers, wall_s=200.0).minute_rows() == [(0, 1, "1.00", "1.00", "1.00", 0),
                                                              (1, 2, "1.00", "2.00", "2.00", 1),
                                                              (2, 2, "1.00", "1.20", "1.20", 0),
                                                              (3, 1, "1.00", "1.00", "1.00", 0)]
    assert "| 1 | 2 | 1.00 | 2.00 | 2.00 | 1 |" in format_report(MixResult(answers, wall_s=200.0))
    save_answers(MixResult(answers, wall_s=200.0), tmp_path / "requests.jsonl")  # --mix-save: every request
    saved = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert [(s["index"], s["arrival_s"], s["e2e_s"], s["prompt_length"], s["routing"]) for s in saved[:3]] == [
        (0, 30.0, 1.0, 64, "dense"), (1, 60.0, 1.0, 64, "dense"), (2, 90.0, 2.0, 64, "dense")]
    loaded = load_answers(tmp_path / "requests.jsonl")  # what mix_queue_model.py --fit reads back
    assert [(a.request.shape, a.request.arrival_s, a.e2e_s) for a in loaded] == [
        (a.request.shape, a.request.arrival_s, a.e2e_s) for a in answers]
    assert worst_shape_ratio(loaded) == worst_shape_ratio(answers)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernels, interpreted on the CPU")
def test_no_kernel_variant_is_new_after_the_warm_up():
    """A scripted Elastic-Cache mix (the method that compiled most after ready on the H100; requests arriving
    together, dense and routed in one batch, prompt lengths the warm-up did not run, and routing policies it did not
    run: the chunk-scored one stands for the others) after `serve`'s warm-up for its method, dense and chunk-routed:
    no launch of a variant key the warm-up did not launch. The warm-up's synthetic passes
    stop at the tile classes this mix can reach (at most 28 rows a request: row counts 1 and 32, the attention
    kernel's 16- and 32-row tiles; 1 and 4 requests a pass, which reach the GEMM-and-epilogue path of passes over
    64 rows; too few requests for GQA packing, kernels/flash_attention.packs)."""
    methods = ("elastic",)
    spec = MixSpec(num_requests=6, rate=1e6, prompt_lengths=(12, 20), max_tokens=(8,), methods=methods,
                   routings=(None, "chunk", "centroid", "window", "random"), block_length=8, seed=0)
    requests = mix_requests(spec, vocab_size=320)
    assert {r.kv_routing for r in requests} == set(spec.routings) and {r.method for r in requests} == set(methods)
    llm = LLM("random:llada-tiny", device="cpu", dtype="float32", kernels=True, max_batch_size=8,
              kv_cache_bytes=1 << 18)  # 256 rows: the warm-up's long-key passes stay short (CI time)
    before_ready(llm, methods, (None, "chunk"), prompt_lengths=(16,), max_tokens=(8,), block_length=8,
                 row_counts=(1, 32), request_counts=(1, 4))
    result = run_offline(llm, spec, requests)
    assert all(a.ok and 0 < a.ttft_s <= a.e2e_s for a in result.answers), result.answers
    assert result.compiles == (0, 0.0), result.after_ready
    assert result.captures == (0, 0.0)  # no CUDA graphs on the CPU
