"""Train a tiny LLaDA2.x-format model (model_type llada2_moe) with block diffusion on the arith and trace tasks.

    python training/train_llada2.py --out OUT/model --minutes 7

Objective (block diffusion, as LLaDA2 and BD3-LM train): attention is block-causal over blocks of 32 positions
counted from the prompt's first token, so a block must be predicted from clean earlier blocks. Each example picks one
block b among those that hold its answer up to the <|eot_id|> (the first may hold the prompt's end, which stays clean
and unmasked); the row is cut after b (later positions are invisible to b anyway), b's answer positions are masked
with probability t ~ U(eps, 1), and the loss is their cross-entropy weighted by 1/t, divided by b's answer positions
and averaged over the batch. With --edit-noise, some of b's unmasked answer tokens are also replaced by random ones
and must be recovered (LLaDA2.1's token-to-token editing). The experts are balanced without an auxiliary loss: after
each step, each MoE layer's expert_bias moves by +-u towards equal loads. Data comes from train.py's workers; the
chat prompt, answers (128 tokens), optimiser and wall-clock schedule are train.py's.
"""
import argparse
import collections
import functools
import json
import math
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from train import BOS, EOS, EOT, MASK, init_worker, make_chunk, start_checkpoint  # noqa: E402

from flash_dllm.config import PRESETS  # noqa: E402
from flash_dllm.models import load_model, random_model, save_checkpoint  # noqa: E402
from flash_dllm.models.llada2 import BLOCK_SIZE as BLOCK  # noqa: E402
from flash_dllm.models.moe import SparseMoE, route  # noqa: E402
from flash_dllm.tasks import load_test_set  # noqa: E402

MODEL_CONFIG = {
    **PRESETS["llada2-mini"], "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "moe_intermediate_size": 64,
    "num_experts": 16, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "max_position_embeddings": 2048,
    "vocab_size": 1024, "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": EOS, "mask_token_id": MASK,
}
FIRST_TEXT_ID = 6  # the tokenizer's special tokens are ids 0-5; --edit-noise draws ordinary tokens


def block_batch(pairs, rng: np.random.Generator, device):
    """(prompt, answer) pairs -> ids [B, L] (left-padded), key mask [B, L], and which of each row's last BLOCK
    columns are answer positions [B, BLOCK]. Each row ends with its chosen block b: the columns after it are cut."""
    ends = []
    for prompt, answer in pairs:
        content = np.count_nonzero(answer != EOS)  # the solution and its <|eot_id|>
        # Blocks after the eot's are never decoded: a row finishes once its eot is final.
        first, last = len(prompt) // BLOCK, (len(prompt) + content - 1) // BLOCK
        ends.append(int(rng.integers(first, last + 1) + 1) * BLOCK)
    width = max(ends)
    ids = np.full((len(pairs), width), EOS, dtype=np.int64)
    key_mask = np.zeros((len(pairs), width), dtype=bool)
    is_answer = np.zeros((len(pairs), BLOCK), dtype=bool)
    for row, ((prompt, answer), end) in enumerate(zip(pairs, ends)):
        # The eos padding goes on past the 128 answer tokens: the decoder's last block holds such tail positions.
        ids[row, width - end:] = np.concatenate([prompt, answer, np.full(BLOCK, EOS)])[:end]
        key_mask[row, width - end:] = True
        is_answer[row] = np.arange(end - BLOCK, end) >= len(prompt)
    return tuple(torch.from_numpy(a).to(device, non_blocking=True) for a in (ids, key_mask, is_answer))


def block_diffusion_loss(model, ids, key_mask, is_answer, edit_noise: float, eps: float = 1e-3):
    """The loss on each row's last block (block_batch's): its masked answer positions' cross-entropy weighted by 1/t,
    plus its noised ones' unweighted, divided by its answer positions; the mean over the rows."""
    block = ids[:, -BLOCK:]
    t = eps + (1 - eps) * torch.rand(len(ids), 1, device=ids.device)
    masked = is_answer & (torch.rand(block.shape, device=ids.device) < t)
    noisy = torch.where(masked, MASK, block)
    noised = is_answer & ~masked & (torch.rand(block.shape, device=ids.device) < edit_noise)
    noisy = torch.where(noised, torch.randint_like(block, FIRST_TEXT_ID, model.config.vocab_size), noisy)
    noisy = torch.cat([ids[:, :-BLOCK], noisy], dim=1)
    positions = (key_mask.cumsum(dim=1) - 1).clamp(min=0)  # position 0 at each row's first real token
    # bf16 on CUDA only: the CPU's bf16 matmuls are slow, and the CPU is for smoke tests.
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.is_cuda):
        hidden = model.hidden_states(noisy, positions, key_mask)[:, -BLOCK:]
        logits = model.compute_logits(hidden)
    ce = F.cross_entropy(logits.float().flatten(0, 1), block.flatten(), reduction="none").view_as(block)
    return ((ce * (masked / t + noised)).sum(dim=1) / is_answer.sum(dim=1)).mean()


class ExpertBalancer:
    """Aux-loss-free load balancing (LLaDA2, after DeepSeek-V3): forward hooks count the real tokens routed to each
    expert of every MoE layer during a step; `step` then moves each layer's expert_bias by +rate for the experts below
    the layer's mean load and -rate for those above it."""

    def __init__(self, model, rate: float):
        self.moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
        self.rate = rate
        self.loads = torch.zeros(len(self.moes), model.config.num_experts, device=next(model.parameters()).device)
        self.real_tokens = None  # [B * L] the step's key mask: pads are not counted
        self.rows_seen = [0] * len(self.moes)  # the layer's MLP runs in row chunks (layers.MLP_CHUNK_ROWS)
        for i, moe in enumerate(self.moes):
            moe.expert_bias.requires_grad_(False)  # it only selects experts: it has no gradient
            moe.register_forward_hook(functools.partial(self._count, i))

    @torch.no_grad()
    def _count(self, i, moe, args, output):
        x = args[0].reshape(-1, args[0].shape[-1])
        seen = self.rows_seen[i]
        rows = x[self.real_tokens[seen:seen + len(x)]]
        self.rows_seen[i] = (seen + len(x)) % len(self.real_tokens)
        chosen, _ = route(F.linear(rows.float(), moe.router_weight.float()), moe.cfg, moe.expert_bias)
        self.loads[i] += torch.bincount(chosen.flatten(), minlength=self.loads.shape[1])

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """Nudge the biases; returns the step's highest load over its layer's mean (1: balanced)."""
        mean = self.loads.mean(dim=1, keepdim=True)
        for moe, sign in zip(self.moes, torch.sign(mean - self.loads)):
            moe.expert_bias += self.rate * sign
        imbalance = (self.loads / mean).max()
        self.loads.zero_()
        return imbalance


def evaluate(path: Path, device: str, num_items: int):
    """Accuracy, NFE and tokens per step of LLaDA2.0's threshold sampler and LLaDA2.1's Draft-and-Edit."""
    from flash_dllm import LLM, SamplingParams
    from flash_dllm.eval.embedded import run_task
    llm = LLM(str(path), device=device, dtype="bfloat16")
    methods = {"parallel": SamplingParams(method="parallel", threshold=0.95, max_tokens=128),
               "edit": SamplingParams(method="edit", threshold=0.7, edit_threshold=0.5, max_tokens=128)}
    for label, params in methods.items():
        for task in ("arith", "trace"):
            result = run_task(llm, task, label, load_test_set(task)[:num_items], params)
            print(f"eval {label} {task}: accuracy {100 * result.accuracy:.1f}% ({result.num_correct}/"
                  f"{result.num_items}) NFE {result.nfe / result.num_items:.1f} tokens/step "
                  f"{result.tokens_per_step:.2f}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--assets", type=Path, default=Path("src/flash_dllm/assets/default"),
                        help="directory with the tokenizer files")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=7.0, help="wall-clock budget of the training loop")
    parser.add_argument("--init", type=Path, help="start from this checkpoint's weights (a resumed run)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--short-batch", type=int, default=768, help="arith + trace items (one block each) per step")
    parser.add_argument("--arith-share", type=float, default=0.5, help="fraction of arith among the items")
    parser.add_argument("--edit-noise", type=float, default=0.0,
                        help="probability that an unmasked answer token of the block is replaced by a random one")
    parser.add_argument("--balance-rate", type=float, default=1e-2, help="expert_bias change per step (u)")
    parser.add_argument("--eval", type=int, default=50, help="held-out items per task evaluated at the end (0: none)")
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True

    start_checkpoint(args.assets, args.out, MODEL_CONFIG)
    if args.init:
        model = load_model(args.init, device, torch.float32)
    else:
        model = random_model(str(args.out), device, torch.float32, seed=args.seed, std=0.02)
        for layer in model.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.expert_bias.zero_()  # no expert preferred before any load is seen
    model.train().requires_grad_(True)
    balancer = ExpertBalancer(model, args.balance_rate)
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim >= 2]
    no_decay = [p for p in trained if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    num_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {num_params:,} ({num_params * 2 / 1e6:.1f} MB in bf16)", flush=True)

    pool = mp.get_context("spawn").Pool(args.workers, init_worker, (str(args.assets / "tokenizer.json"),))
    # train.py's chunks without retrieval batches (make_chunk still draws one short passkey item; it is dropped).
    chunk_args = (256, 0, (128, 128), args.arith_share, 0.0)
    next_seed = args.seed * 10**6
    pending = collections.deque()
    while len(pending) < 2 * args.workers:
        pending.append(pool.apply_async(make_chunk, (next_seed, *chunk_args)))
        next_seed += 1
    items, rng = [], np.random.default_rng(args.seed)

    budget_s, step, log = args.minutes * 60, 0, []
    warmup = args.warmup if args.init is None else 50
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < budget_s:
        while len(items) < args.short_batch:
            items += pending.popleft().get()["short"]
            pending.append(pool.apply_async(make_chunk, (next_seed, *chunk_args)))
            next_seed += 1
        batch, items = items[:args.short_batch], items[args.short_batch:]
        # Linear warm-up, then cosine to 10% over the wall-clock budget.
        lr_scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * elapsed / budget_s)))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_scale
        ids, key_mask, is_answer = block_batch(batch, rng, device)
        balancer.real_tokens = key_mask.flatten()
        loss = block_diffusion_loss(model, ids, key_mask, is_answer, args.edit_noise)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        imbalance = balancer.step()
        if step % 100 == 0:
            log.append((step, elapsed, loss.item(), imbalance.item()))
            print(f"step {step} {elapsed:.0f}s loss {log[-1][2]:.4f} max load/mean {log[-1][3]:.2f} "
                  f"lr {args.lr * lr_scale:.2e}", flush=True)
        step += 1
    pool.terminate()
    model.eval().requires_grad_(False)
    save_checkpoint(model, args.out, MODEL_CONFIG, dtype=torch.bfloat16)
    generation = {"bos_token_id": BOS, "eos_token_id": [EOS, EOT], "pad_token_id": EOS, "mask_token_id": MASK}
    (args.out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    with open(args.out.parent / "loss.csv", "w") as f:
        f.write("step,seconds,loss,max_load_over_mean\n")
        f.writelines(",".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in row) + "\n" for row in log)
    print(f"trained {step} steps in {elapsed:.0f} s; saved {args.out}", flush=True)
    if args.eval:
        evaluate(args.out, args.device, args.eval)


if __name__ == "__main__":
    main()
