"""Block diffusion on a block-causal model (LLaDA2.x): `parallel` is LLaDA2.0's sampler and `edit` LLaDA2.1's
Draft-and-Edit, token for token against re-implementations of the published generate() loops, which re-run the
whole prefix under the block-causal mask every step, while the engine computes one block's rows a step over the
exact block cache. Prompts end mid-block; generations stop on eos; edit runs make edits."""
from __future__ import annotations

import pytest
import torch

from moe_checkpoints import llada2_config, write_moe_checkpoint

from flash_dllm import LLM, SamplingParams
from flash_dllm.tasks import is_correct, load_test_set

BLOCK = 32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels: on the GPU, else interpreted
PROMPTS = ["What is 3 + 4?", "Tom has 3 apples and buys 4 more. How many apples does he have?",
           "x = 5\nfor i in range(3):\n    x = x + i\nprint(x)" * 3, "The passkey is"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """An fp32 LLaDA2 model whose eos logit is scaled up, so that some generations stop early."""
    path = write_moe_checkpoint(tmp_path_factory.mktemp("llada2"), llada2_config(), num_shards=2)
    llm = LLM(str(path), device="cpu", dtype="float32", kernels=False)
    llm.model.lm_head.weight[llm.special.stop_ids[0]] *= 2.0
    return llm


def greedy(logits: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The published argmax and its softmax probability; the mask token is never a candidate (as the engine's,
    where the published code could decode a position back to a mask)."""
    probs = logits.double().softmax(dim=-1)
    tokens = logits.double().index_fill(-1, torch.tensor([mask_id]), float("-inf")).argmax(dim=-1)
    return tokens, probs.gather(-1, tokens[..., None])[..., 0]


def published_generate(model, prompt: list[int], gen_length: int, mask_id: int, eos_id: int, threshold: float,
                       editing_threshold: float | None = None, max_post_steps: int = 16) -> tuple[list[int], int]:
    """LLaDA2's generate() at batch 1, greedy, as published: the canvas padded to whole blocks, every step a forward
    of the whole prefix up to the current block's end; LLaDA2.0's quota rule (steps=32, minimal_topk=1), or with
    editing_threshold LLaDA2.1's fill-and-edit loop; stop after the block whose generated part holds eos; the output
    up to (excluding) its first eos. -> (tokens, edits made)."""
    P = len(prompt)
    num_blocks = (P + gen_length + BLOCK - 1) // BLOCK
    x = torch.full((1, num_blocks * BLOCK), mask_id, dtype=torch.long)
    x[0, :P] = torch.tensor(prompt)
    steps = min(BLOCK, gen_length)
    schedule = [BLOCK // steps + (1 if s < BLOCK % steps else 0) for s in range(steps)]
    edits = 0
    for num_block in range(P // BLOCK, num_blocks):
        end = (num_block + 1) * BLOCK
        start = end - BLOCK
        in_prompt = torch.arange(start, end) < P
        post_steps, step = 0, 0
        while True:
            block = x[0, start:end].clone()
            active = block == mask_id
            if editing_threshold is None and (not active.any() or step == steps):
                break
            if editing_threshold is not None and not active.any():
                post_steps += 1
                if post_steps > max_post_steps:
                    break
            with torch.no_grad():
                logits = model(x[:, :end])[0, start:end]
            x0, p = greedy(logits, mask_id)
            confidence = torch.where(active, p, torch.tensor(float("-inf"), dtype=torch.float64))
            fill = torch.zeros(BLOCK, dtype=torch.bool)
            if active.any():
                quota = schedule[step] if editing_threshold is None else 1
                high = (confidence > threshold) & active
                if int(high.sum()) >= quota:
                    fill = high
                else:
                    fill[torch.topk(confidence, k=min(quota, int(active.sum()))).indices] = True
            edit = torch.zeros(BLOCK, dtype=torch.bool)
            if editing_threshold is not None:
                edit = ~active & ~in_prompt & (x0 != block) & (p > editing_threshold)
                edits += int(edit.sum())
            x[0, start:end] = torch.where(fill | edit, x0, block)
            step += 1
            if editing_threshold is not None and not active.any() and not edit.any():
                break
        generated = x[0, P:end]
        if not (generated == mask_id).any() and (generated == eos_id).any():
            break
    out = x[0, P:P + gen_length].tolist()
    return (out[:out.index(eos_id)] if eos_id in out else out), edits


def run(llm, **settings) -> list:
    params = SamplingParams(max_tokens=settings.pop("max_tokens", 48), **settings)
    return llm.generate(PROMPTS, params)


@pytest.mark.parametrize("threshold, max_tokens", [(0.95, 48), (0.5, 48), (0.8, 20)])
def test_parallel_is_llada2_0_sampler(llm, threshold, max_tokens):
    outputs = run(llm, method="parallel", threshold=threshold, max_tokens=max_tokens)
    eos = llm.special.stop_ids[0]
    for prompt, out in zip(PROMPTS, outputs):
        ids = llm.encode(prompt)
        expected, _ = published_generate(llm.model, ids, max_tokens, llm.special.mask_id, eos, threshold)
        assert out.token_ids == expected, prompt
    assert {out.finish_reason for out in outputs} == {"stop", "length"} or max_tokens < 32
    assert any(len(llm.encode(p)) % BLOCK for p in PROMPTS)


@pytest.mark.parametrize("threshold, edit_threshold, max_post_steps", [(0.95, 0.9, 16), (0.7, 0.5, 16),
                                                                      (0.5, 0.0, 2), (0.5, 0.0, 0)])
def test_edit_is_llada2_1_draft_and_edit(llm, threshold, edit_threshold, max_post_steps):
    outputs = run(llm, method="edit", threshold=threshold, edit_threshold=edit_threshold,
                  max_post_steps=max_post_steps)
    eos, total_edits = llm.special.stop_ids[0], 0
    for prompt, out in zip(PROMPTS, outputs):
        expected, edits = published_generate(llm.model, llm.encode(prompt), 48, llm.special.mask_id, eos, threshold,
                                             edit_threshold, max_post_steps)
        assert out.token_ids == expected, prompt
        total_edits += edits
    if edit_threshold == 0.0 and max_post_steps:
        assert total_edits > 0  # the speed mode's edits happen on this model


def test_flash_cache_with_a_window_over_the_block_is_the_exact_block_cache(llm):
    params = dict(threshold=0.5, max_tokens=48)
    exact = llm.generate(PROMPTS, SamplingParams(method="parallel", **params))
    for budget in (0, 8):
        cached = llm.generate(PROMPTS, SamplingParams(method="flash-cache", mask_window=32, tracking_budget=budget,
                                                      **params))
        assert [(o.token_ids, o.steps, o.query_rows) for o in cached] == \
            [(o.token_ids, o.steps, o.query_rows) for o in exact]


def test_flash_verify_that_accepts_no_candidate_is_the_exact_block_cache(llm):
    """verify_threshold 1 accepts no candidate, so each step fills the masks above threshold, or the most confident:
    LLaDA2.0's rule at a quota of one (max_tokens >= 32), with a verify pass for the rows that had candidates."""
    params = dict(threshold=0.5, max_tokens=48)
    exact = llm.generate(PROMPTS, SamplingParams(method="parallel", **params))
    verified = llm.generate(PROMPTS, SamplingParams(method="flash-verify", mask_window=32, tracking_budget=0,
                                                    verify_threshold=1.0, **params))
    assert [(o.token_ids, o.steps) for o in verified] == [(o.token_ids, o.steps) for o in exact]
    assert all(o.steps < o.nfe <= 2 * o.steps for o in verified)


def test_flash_verify_accepts_verified_drafts(llm):
    """A permissive verify threshold accepts drafts the threshold alone would not: fewer steps than without."""
    params = dict(threshold=0.9, max_tokens=48, mask_window=16, tracking_budget=16)
    strict = llm.generate(PROMPTS, SamplingParams(method="flash-verify", verify_threshold=1.0, **params))
    loose = llm.generate(PROMPTS, SamplingParams(method="flash-verify", verify_threshold=0.0, **params))
    assert all(o.error is None for o in strict + loose)
    assert sum(o.steps for o in loose) < sum(o.steps for o in strict)


def test_flash_cache_computes_its_budget_of_the_block(llm):
    """After a block's first step (the whole block), a step computes mask_window + tracking_budget of its rows:
    the window's masks first, and only they are unmasked."""
    ids = llm.encode(PROMPTS[0])
    steps = []
    real_run = llm.engine.method(SamplingParams(method="flash-cache")).run

    def run(runner, batch, plan):
        steps.append((batch.rows[0].step_in_block, plan.counts[-1], (batch.tokens == batch.mask_id).sum().item()))
        real_run(runner, batch, plan)
    method = llm.engine.method(SamplingParams(method="flash-cache"))
    method.run = run
    try:
        out = llm.generate([ids], SamplingParams(method="flash-cache", threshold=0.99, mask_window=2,
                                                 tracking_budget=6, max_tokens=40))[0]
    finally:
        del method.run
    assert out.error is None and out.finish_reason in ("stop", "length")
    assert all(count == (BLOCK if step == 0 else 8) for step, count, _ in steps)
    masks = [m for _, _, m in steps]
    assert all(0 < before - after <= 2 for before, after in zip(masks, masks[1:]) if after < before)


@pytest.mark.parametrize("method, settings", [("parallel", dict(threshold=0.9)),
                                              ("edit", dict(threshold=0.7, edit_threshold=0.5)),
                                              ("flash-cache", dict(threshold=0.9, mask_window=8, tracking_budget=8))])
def test_the_steady_pass_is_the_steps_inside_a_block(llm, method, settings):
    """The pass a server captures before ready (DecodingMethod.steady_pass) is that of every step with no block
    to write: one group of the current block's rows per request, tracked as the method tracks."""
    params = SamplingParams(method=method, max_tokens=64, **settings)
    decoder = llm.engine.method(params)
    rows, tracked = decoder.steady_pass(params, llm.runner.logit_shift)
    assert tracked == decoder.tracks_attention
    plans, real_plan = [], decoder.plan

    def plan(runner, batch):
        plans.append(real_plan(runner, batch))
        return plans[-1]
    decoder.plan = plan
    try:
        llm.generate(PROMPTS[:2], params)
    finally:
        del decoder.plan
    inside = [p for p in plans if all(kind == "current" for _, kind, _ in p.extra) and
              len(p.counts) == len({b for b, _, _ in p.extra})]
    assert len(inside) > len(plans) // 2 and all(p.counts == (rows,) * len(p.counts) for p in inside[1:])


def test_a_step_computes_one_block(llm):
    """After the first pass (the prompt's whole blocks and the first block), a step computes the current block's
    rows, and once per block that ended, that block's rows again; never the prefix."""
    ids = llm.encode(PROMPTS[2])
    out = llm.generate([ids], SamplingParams(method="parallel", threshold=0.5, max_tokens=64))[0]
    blocks = (len(ids) + 64 - 1) // BLOCK + 1 - len(ids) // BLOCK
    assert out.query_rows <= (len(ids) // BLOCK) * BLOCK + out.nfe * BLOCK + blocks * BLOCK
    assert out.query_rows < out.nfe * (len(ids) + 64) / 2


def test_settings_the_model_does_not_allow_are_refused(llm):
    outputs = llm.generate(["hi"] * 3, [SamplingParams(method="parallel", block_length=16),
                                         SamplingParams(method="parallel", factor=1.0),
                                         SamplingParams(method="prefix-cache")])
    assert [out.error for out in outputs] == [
        "prompt 0: block_length must be 32 on this model (its attention's blocks), got 16",
        "prompt 1: factor is not LLaDA2's rule: method 'parallel' on a block-causal model fills by threshold "
        "(drop factor)",
        "prompt 2: method 'prefix-cache' does not support this model's block-causal (blocks of 32) attention yet; "
        "use reference, parallel, flash-cache, flash-verify, lossless, dream, edit"]


def test_edit_is_refused_on_a_bidirectional_model(gqa_checkpoint):
    llm = LLM(str(gqa_checkpoint), device="cpu", kernels=False)
    out = llm.generate(["hi"], SamplingParams(method="edit"))[0]
    assert out.error.startswith("prompt 0: method 'edit' does not support this model's bidirectional attention")


@pytest.mark.parametrize("method, settings", [
    ("parallel", dict(threshold=0.5)), ("edit", dict(threshold=0.5, edit_threshold=0.0, max_post_steps=2)),
    ("flash-cache", dict(threshold=0.5, mask_window=8, tracking_budget=8)),
    ("flash-verify", dict(threshold=0.9, mask_window=8, tracking_budget=8, verify_threshold=0.3))])
def test_the_kernels_decode_the_same_tokens(llm, method, settings):
    """Through the Triton kernels (interpreted on the CPU): the q/k norms and partial RoPE before the cache write,
    the block-causal attention over the cache, the experts' grouped GEMMs."""
    kernels = LLM(str(llm.path), device=DEVICE, dtype="float32", kernels=True)
    kernels.model.lm_head.weight[kernels.special.stop_ids[0]] *= 2.0
    params = SamplingParams(method=method, max_tokens=16, **settings)
    expected = [out.token_ids for out in llm.generate(PROMPTS[1:2], params)]
    assert [out.token_ids for out in kernels.generate(PROMPTS[1:2], params)] == expected


def long_prompts(count: int = 2, length: int = 300) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 300, (length + 7 * i,), generator=g).tolist() for i in range(count)]


def test_kv_routing_reads_part_of_the_prompt_in_the_blocks_after_it(llm):
    """A budget of 1 is the dense block cache; under 1 the passes without prompt rows (the blocks after the one that
    holds the prompt's end) read the routed chunks; the first block, which recomputes the prompt's last rows, reads
    every key."""
    params = lambda **routing: SamplingParams(method="parallel", threshold=0.5, max_tokens=40, **routing)
    dense = llm.generate(long_prompts(), params())
    assert [o.token_ids for o in llm.generate(long_prompts(), params(kv_routing="chunk", kv_budget=1.0))] == \
        [o.token_ids for o in dense]
    routed = llm.generate(long_prompts(), params(kv_routing="chunk", kv_budget=0.2))
    assert all(0.2 < o.prompt_kv_read < 1 for o in routed)
    kmeans = llm.generate(["hi"], params(kv_routing="kmeans"))[0]
    assert kmeans.error.startswith("prompt 0: kv_routing 'kmeans' lays a prompt's keys out region by region")


def test_routed_block_diffusion_through_the_kernels(llm):
    """Prompts of whole blocks: each step's current block reads the routed prompt, the first step's in the pass that
    writes the prompt's blocks; the kernels (interpreted on the CPU) read the keys the reference reads and decode
    its tokens. (Flash-Verify's routed verify pass: tests/cache/test_routing.py.)"""
    prompts = [prompt[:length] for prompt, length in zip(long_prompts(), (128, 160))]
    params = SamplingParams(method="parallel", threshold=0.5, max_tokens=8, kv_routing="chunk", kv_budget=0.6)
    kernels = LLM(str(llm.path), device=DEVICE, dtype="float32", kernels=True)
    kernels.model.lm_head.weight[kernels.special.stop_ids[0]] *= 2.0
    routed = {engine: engine.generate(prompts, params) for engine in (llm, kernels)}
    assert [o.token_ids for o in routed[kernels]] == [o.token_ids for o in routed[llm]]
    assert [o.prompt_kv_read for o in routed[kernels]] == pytest.approx([o.prompt_kv_read for o in routed[llm]])
    assert all(o.prompt_kv_read < 0.9 for o in routed[llm])


def test_requests_decode_the_same_alone_and_joining_a_running_batch(llm):
    """Continuous batching: a request that joins while others run (mid-block, at another block index) decodes as it
    does alone."""
    params = SamplingParams(method="edit", threshold=0.7, edit_threshold=0.5, max_tokens=48)
    alone = [llm.generate([prompt], params)[0].token_ids for prompt in PROMPTS]
    engine = llm.engine
    first = [engine.add_request(llm.encode(prompt), params) for prompt in PROMPTS[:2]]
    for _ in range(5):
        engine.step()
    late = [engine.add_request(llm.encode(prompt), params) for prompt in PROMPTS[2:]]
    while engine.has_unfinished():
        engine.step()
    assert [seq.output_ids for seq in first + late] == alone


@pytest.fixture(scope="module")
def trained():
    """The embedded LLaDA2 model (training/train_llada2.py, arith and trace): confident, learnt decisions rather than
    a random model's near-ties."""
    return LLM("embedded:llada2", device="cpu", dtype="float32", kernels=False)


def held_out(count: int) -> list[str]:
    return [item.prompt for task in ("arith", "trace") for item in load_test_set(task)[:count]]


def up_to_stop(llm, ids: list[int]) -> list[int]:
    """The published loop's output (up to its eos) up to the first of the model's stop tokens (its <|eot_id|> too)."""
    stops = [i for i, token in enumerate(ids) if token in llm.special.stop_ids]
    return ids[:stops[0]] if stops else ids


@pytest.mark.parametrize("threshold", [0.95, 0.6])
def test_parallel_on_the_trained_model_is_llada2_0_sampler(trained, threshold):
    prompts = held_out(2)
    outputs = trained.generate(prompts, SamplingParams(method="parallel", threshold=threshold, max_tokens=128))
    eos = trained.special.stop_ids[0]
    for prompt, out in zip(prompts, outputs):
        expected, _ = published_generate(trained.model, trained.encode(prompt), 128, trained.special.mask_id, eos,
                                         threshold)
        assert out.token_ids == up_to_stop(trained, expected), prompt
    assert sum(len(o.token_ids) for o in outputs) > 3 * sum(o.steps for o in outputs)  # many confident tokens a step


def test_edit_on_the_trained_model_is_llada2_1_draft_and_edit(trained):
    prompts = held_out(2)
    outputs = trained.generate(prompts, SamplingParams(method="edit", threshold=0.7, edit_threshold=0.5,
                                                       max_tokens=128))
    eos, total_edits = trained.special.stop_ids[0], 0
    for prompt, out in zip(prompts, outputs):
        expected, edits = published_generate(trained.model, trained.encode(prompt), 128, trained.special.mask_id, eos,
                                             0.7, 0.5)
        assert out.token_ids == up_to_stop(trained, expected), prompt
        total_edits += edits
    assert total_edits > 0


def test_the_trained_model_solves_trace_items(trained):
    items = load_test_set("trace")[:20]
    outputs = trained.generate([item.prompt for item in items], SamplingParams(method="parallel", max_tokens=128))
    assert sum(is_correct(item, out.text) for item, out in zip(items, outputs)) >= 12  # 18 here; 77% of 100 on the GPU
