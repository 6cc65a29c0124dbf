"""The evaluation loop: prompts through the engine in batches, scoring as outputs arrive, a progress bar with
running accuracy and tokens/s, then per-item records and a summary (written as jsonl + json)."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from ..sampling_params import SamplingParams
from .benchmarks import get_benchmark
from .distributed import DistContext, all_gather, shard

# Prompts per generate call, in batches: within a call the engine refills finished rows with waiting requests;
# between calls the progress bar and running accuracy update.
BATCHES_PER_CALL = 4


@dataclass(frozen=True)
class EvalResult:
    records: list[dict]  # one per item, in benchmark order
    summary: dict


def evaluate(llm, task: str, params: SamplingParams, *, data: str | None = None, limit: int | None = None,
             ctx: DistContext = DistContext(), progress: bool = True, warmup: bool = True,
             length: int | None = None) -> EvalResult:
    """Decode and score `task` with one method; under torch.distributed each rank takes a shard and every
    rank returns the merged result. Tokens/s counts generated tokens up to the first eos/eot over the wall
    time of generation (no warm-up, no scoring); across ranks, over the slowest rank's time. length: a
    retrieval task's items of that prompt length only."""
    benchmark = get_benchmark(task)
    benchmark.require()
    chat, batch_size = llm.use_chat_template, llm.engine.scheduler.max_batch_size
    examples = shard(benchmark.examples(chat, data, limit, length), ctx)
    if warmup and examples:  # one full batch: kernel compilation and allocations stay out of the timing
        llm.generate([e.prompt for e in examples[:batch_size]], params, use_tqdm=False)
    records, gen_time = [], 0.0
    bar = None
    if progress and ctx.is_main:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(examples), desc=task, unit="item", dynamic_ncols=True)
    step = batch_size * BATCHES_PER_CALL
    for start in range(0, len(examples), step):
        chunk = examples[start:start + step]
        begin = time.perf_counter()
        outputs = llm.generate([e.prompt for e in chunk], params, use_tqdm=False)
        gen_time += time.perf_counter() - begin
        # a failed prompt scores wrong
        verdicts = benchmark.score([e.doc for e in chunk], [out.text for out in outputs], chat)
        records += [_record(e, out, v) for e, out, v in zip(chunk, outputs, verdicts)]
        if bar is not None:
            bar.update(len(chunk))
            bar.set_postfix(acc=f"{sum(r['correct'] for r in records) / len(records):.3f}",
                            tok_s=f"{sum(r['num_tokens'] for r in records) / gen_time:.1f}")
    if bar is not None:
        bar.close()
    shards = all_gather((records, gen_time), ctx)
    merged = sorted((r for rank_records, _ in shards for r in rank_records), key=lambda r: r["index"])
    slowest = max(t for _, t in shards)
    summary = summarize(merged, slowest, task=task, model=str(llm.path or "random weights"), params=params,
                        batch_size=batch_size, world_size=ctx.world_size, chat_template=chat, limit=limit,
                        **({} if length is None else {"length": length}))
    return EvalResult(merged, summary)


def _record(example, out, verdict) -> dict:
    return {"index": example.index, "id": example.id, "prompt": example.prompt, "output": out.text,
            "extracted": verdict.extracted, "target": example.target, "correct": verdict.correct,
            "num_tokens": len(out.token_ids), "nfe": out.nfe, "steps": out.steps, "time_s": out.time_s,
            "finish_reason": out.finish_reason, "error": out.error, "prompt_kv_read": out.prompt_kv_read}


def summarize(records: list[dict], gen_time: float, *, params: SamplingParams, **fields) -> dict:
    n = max(len(records), 1)
    tokens = sum(r["num_tokens"] for r in records)
    correct = sum(r["correct"] for r in records)
    read = [r["prompt_kv_read"] for r in records if r.get("prompt_kv_read") is not None]
    return {**fields, "num_items": len(records), "num_correct": correct, "accuracy": correct / n,
            "accuracy_ci95": wilson_interval(correct, len(records)),
            "prompt_kv_read": sum(read) / len(read) if read else None,
            "tokens_per_s": tokens / gen_time if gen_time > 0 else 0.0,
            "tokens_per_step": tokens / max(sum(r["steps"] for r in records), 1),
            "nfe": sum(r["nfe"] for r in records) / n, "steps": sum(r["steps"] for r in records) / n,
            "num_tokens": tokens, "generation_time_s": gen_time, "sampling": params.to_dict()}


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> list[float]:
    """The 95% Wilson score interval of a proportion (sound at 0 and 1 correct, unlike the normal one)."""
    if trials == 0:
        return [0.0, 1.0]
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def summary_path(output: str | Path) -> Path:
    """results.jsonl -> results.summary.json"""
    output = Path(output)
    return output.with_name(output.stem + ".summary.json")


def write_result(result: EvalResult, output: str | Path):
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("".join(json.dumps(r) + "\n" for r in result.records))
    summary_path(output).write_text(json.dumps(result.summary, indent=2) + "\n")
