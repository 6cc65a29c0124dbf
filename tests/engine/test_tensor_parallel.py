"""Tensor parallelism on the CPU: 2 ranks over gloo (the LLM starts its worker process) against one process, on tiny
fp32 LLaDA (one KV head, replicated on both ranks; biases everywhere: the row-parallel ones added once) and Dream
(two KV heads, split) checkpoints: logits within 1e-5, the same tokens for every method, batched and alone, the
batch-invariant mode too, and every rank's tokens the driver's. A rank's loaded parameters are exactly its slices
of the whole model's (FP8 weights too). The worker processes, from scripts of their own (each bounded in time): a
script needs no main guard, and no rank waits for one that failed or ended: a worker that cannot start, dies or
fails its part fails the driver's call at once, naming it; the workers end with a terminated or killed driver."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from flash_dllm import LLM, SamplingParams
from flash_dllm.cli import main
from flash_dllm.config import PRESETS
from flash_dllm.decoding.registry import METHODS, methods_for
from flash_dllm.engine.tensor_parallel import finished_tokens
from flash_dllm.models import load_model, random_model, save_checkpoint
from flash_dllm.models.parallel import TensorParallel, check_size

PROMPTS = [[5, 17, 42, 99, 7], [200, 13, 64, 8, 31, 77, 150, 21, 9, 12, 300], [44, 45, 46]]
KNOBS = {"parallel": dict(threshold=0.7), "prefix-cache": dict(threshold=0.7), "dual-cache": dict(threshold=0.7),
         "flash-cache": dict(threshold=0.7, tracking_budget=6, mask_window=8),
         "flash-verify": dict(threshold=0.7, tracking_budget=6, mask_window=8, verify_threshold=0.3),
         "elastic": dict(threshold=0.7, mask_window=6, drift_threshold=0.95),
         "edit": dict(threshold=0.7, edit_threshold=0.5)}
CONFIGS = {"llada": {**PRESETS["llada-tiny"], "n_kv_heads": 1, "include_bias": True},
           "dream": {**PRESETS["dream-tiny"], "num_key_value_heads": 2},
           "llada2": PRESETS["llada2-tiny"]}
OPTIONS = dict(device="cpu", dtype="float32", kv_cache_bytes=1 << 20)


def checkpoint(path: Path, config: dict, seed: int) -> Path:
    """A random checkpoint (std 0.3: confident tokens) with random biases, in two safetensors shards."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    model = random_model(str(path), "cpu", torch.float32, seed=seed, std=0.3)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.normal_(0.0, 0.3, generator=generator)
    save_checkpoint(model, path, config, num_shards=2)
    return path


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    return {name: checkpoint(tmp_path_factory.mktemp(name), config, seed)
            for seed, (name, config) in enumerate(CONFIGS.items())}


def forward_logits(llm, ids: torch.Tensor) -> torch.Tensor:
    """A rank's full forward (run on every rank: its collectives)."""
    return llm.model(ids)


def methods_of(llm: LLM) -> list[str]:
    if llm.config.attention.kind == "block-causal":
        return ["parallel", "edit"]
    return [name for name in methods_for("bidirectional")
            if METHODS[name].handles_logit_shift or not llm.model.logit_shift]


@pytest.fixture(scope="class", params=["llada", "dream", "llada2", "llada2-experts", "llada-invariant", "dream-fp8",
                                        "dream-kernels"])
def pair(request, paths):
    """(one process, two ranks) on an architecture's checkpoint (-invariant: with batch_invariant; -fp8: with FP8
    weights; -kernels: the Triton kernels, interpreted; -experts: expert parallelism), for TestTwoRanks. One
    tensor-parallel LLM per process at a time: each is shut down before the next, the last at the class's end."""
    name, _, option = request.param.partition("-")
    options = dict(OPTIONS, batch_invariant=option == "invariant", quantization="fp8" if option == "fp8" else None,
                   kernels=option == "kernels")
    one = LLM(str(paths[name]), **options)
    two = LLM(str(paths[name]), **options, tensor_parallel_size=2, expert_parallel=option == "experts")
    yield one, two
    two.shutdown()


class TestTwoRanks:
    """Two ranks against one process."""

    def test_logits_match_one_process(self, pair):
        one, two = pair
        ids = torch.randint(5, 320, (2, 24), generator=torch.Generator().manual_seed(0))
        expected, logits = one.model(ids), two.workers.everywhere(forward_logits, two, ids)
        assert logits.shape == expected.shape
        if one.quantization is None:  # relative to the logits' largest (|logits| up to ~10 here)
            assert (logits - expected).abs().max().item() < 1e-5 * expected.abs().max().item()
            return
        # FP8: a row-parallel input is quantised per row of each rank's part (as the kernels do), not of its whole row:
        # other roundings (here 11% apart), as far from the model's fp32 logits as one process's (24% on these weights)
        full = load_model(one.path)(ids)
        error = lambda logits: ((logits - full).norm() / full.norm()).item()
        assert error(logits) < 1.1 * error(expected)


    def test_every_method_decodes_the_same_tokens_batched_and_alone(self, pair):
        """And every rank decodes the driver's tokens; in the batch-invariant mode, a request's tokens alone are its
        tokens in the batch (its all-reduces are an all-gather and a sum in rank order)."""
        one, two = pair
        exact = one.quantization is None  # FP8: other roundings than one process's (test_logits_match_one_process)
        interpreted = one.runner.kernels  # slow: one method (cached passes with attention mass, the drift kernel)
        prompts = PROMPTS[:2] if interpreted else PROMPTS
        for method in ("elastic",) if interpreted else methods_of(one) if exact else ("flash-cache",):
            params = SamplingParams(method=method, max_tokens=8 if interpreted else 12,
                                    block_length=one.config.attention.block_size or (4 if interpreted else 6),
                                    **KNOBS.get(method, {}))
            batched = two.generate(prompts, params)
            tokens = [out.token_ids for out in batched]
            assert any(tokens)
            worker_tokens, = two.workers.ask(finished_tokens, [out.request_id for out in batched])
            assert worker_tokens == tokens, method
            if not exact:
                continue
            assert tokens == [out.token_ids for out in one.generate(prompts, params)], method
            if interpreted:
                continue
            alone = [two.generate([prompt], params)[0].token_ids for prompt in prompts]
            assert alone == [one.generate([prompt], params)[0].token_ids for prompt in prompts], method
            if one.runner.batch_invariant:
                assert alone == tokens, method

    def test_one_tensor_parallel_llm_at_a_time(self, pair, paths):
        with pytest.raises(ValueError, match="one tensor-parallel LLM per process at a time"):
            LLM(str(paths["dream"]), **OPTIONS, tensor_parallel_size=2)

    def test_sampled_tokens_match_too(self, pair):
        one, two = pair
        if one.quantization or one.runner.batch_invariant or one.runner.kernels or one.model.logit_shift:
            pytest.skip("once, on LLaDA")
        params = SamplingParams(method="flash-cache", max_tokens=12, block_length=6, temperature=0.8, seed=3)
        assert [out.token_ids for out in two.generate(PROMPTS, params)] == \
            [out.token_ids for out in one.generate(PROMPTS, params)]


# ----------------------------------------------------------------------------- a rank's shard of the checkpoint

def regions(model, scales: bool = False) -> dict[str, torch.Tensor]:
    """Each checkpoint tensor's region of the model's parameters (FP8 weights: their values; `scales`: their scales'
    region instead, for the FP8 weights only)."""
    params, out = dict(model.named_parameters()), {}
    for name, (param, rows, _) in model.checkpoint_layout().items():
        module_name, _, kind = param.rpartition(".")
        if scales:
            if kind != "weight" or not hasattr(model.get_submodule(module_name), "weight_scale"):
                continue
            param = model.get_submodule(module_name).weight_scale
        else:
            param = params[param]
        out[name] = param if rows is None else param[rows]
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_each_rank_loads_exactly_its_slices(paths, name, quantization):
    """FP8: a column-parallel weight's scales are its rows', a row-parallel one's every output channel's (from the
    whole row, as in one process)."""
    whole = load_model(paths[name], quantization=quantization)
    values, scales, parts = regions(whole), regions(whole, scales=True), {}
    for rank in range(2):
        shard = load_model(paths[name], quantization=quantization, tp=TensorParallel(rank, 2))
        layout = shard.checkpoint_layout()
        for tensor, region in regions(shard).items():
            part = layout[tensor].shard
            assert torch.equal(region, values[tensor] if part is None else part.of(values[tensor])), tensor
            parts.setdefault(tensor, set()).add(part)
        for tensor, region in regions(shard, scales=True).items():
            part = layout[tensor].shard
            assert torch.equal(region, scales[tensor] if part is None or part.dim == 1 else part.of(scales[tensor]))
        assert (len(scales) > 0) == (quantization == "fp8")
    kv_replicated = whole.config.num_kv_heads == 1
    for tensor, held in parts.items():  # the ranks' parts tile a split tensor (a single KV head: both hold it)
        replicated = None in held or (kv_replicated and (".k_proj." in tensor or ".v_proj." in tensor))
        assert len(held) == (1 if replicated else 2), tensor
        if not replicated:  # a fused projection's part is several ranges (Pieces): together they tile it
            ranges = sorted((r.start, r.stop) for p in held for r in getattr(p, "parts", (p,)))
            assert ranges[0][0] == 0 and ranges[-1][1] == next(iter(held)).size
            assert all(stop == start for (_, stop), (start, _) in zip(ranges, ranges[1:])), tensor


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_expert_parallel_ranks_hold_whole_experts(paths, quantization):
    """Each rank's stacks are its half of the experts, whole (and their FP8 scales); the router, the shared expert's
    and the attention's shards are those of tensor parallelism; a random model's ranks are its slices too."""
    whole = load_model(paths["llada2"], quantization=quantization)
    plain = [load_model(paths["llada2"], quantization=quantization, tp=TensorParallel(rank, 2)) for rank in range(2)]
    for rank in range(2):
        tp = TensorParallel(rank, 2, expert_parallel=True)
        for shard, source in ((load_model(paths["llada2"], quantization=quantization, tp=tp), whole),
                              (random_model("llada2-tiny", "cpu", torch.float32, seed=4, tp=tp),
                               random_model("llada2-tiny", "cpu", torch.float32, seed=4))):
            for name, tensor in shard.state_dict().items():
                full = source.state_dict()[name]
                if ".w_" in name:  # the stacks and their scales
                    assert torch.equal(tensor, full[4 * rank:4 * (rank + 1)]), name
                elif source is whole:
                    assert torch.equal(tensor, plain[rank].state_dict()[name]), name


def test_expert_parallelism_is_refused_where_it_does_not_apply(paths, capsys):
    assert main(["info", "--model", str(paths["dream"]), "--tensor-parallel-size", "2", "--expert-parallel"]) == 2
    assert capsys.readouterr().err.strip() == ("flash-dllm: error: expert_parallel places a mixture of experts' "
                                               "experts on the ranks: this model has none")
    with pytest.raises(ValueError, match="expert_parallel places a mixture of experts' experts on the ranks: this "
                                         "model has none"):
        LLM(str(paths["dream"]), **OPTIONS, tensor_parallel_size=2, expert_parallel=True)
    with pytest.raises(ValueError, match="expert_parallel .* needs tensor_parallel_size > 1"):
        LLM(str(paths["llada2"]), **OPTIONS, expert_parallel=True)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not split this model \(4 heads, 2 KV heads, "
                                         r"intermediate_size=96, shared_intermediate_size=32, num_experts=8, "
                                         r"vocabulary 320\); valid sizes: 1, 2, 4"):
        check_size(load_model(paths["llada2"]).config, 3, expert_parallel=True)


def test_random_shards_are_slices_of_the_random_model():
    whole = regions(random_model("dream-tiny", "cpu", torch.float32, seed=4))
    for rank in range(2):
        shard = random_model("dream-tiny", "cpu", torch.float32, seed=4, tp=TensorParallel(rank, 2))
        layout = shard.checkpoint_layout()
        for tensor, region in regions(shard).items():
            part = layout[tensor].shard
            assert torch.equal(region, whole[tensor] if part is None else part.of(whole[tensor])), tensor


def test_sizes_that_do_not_split_the_model_are_refused(paths):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not split this model .*valid sizes: 1, 2, 4"):
        check_size(load_model(paths["dream"]).config, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not split"):
        LLM(str(paths["dream"]), device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer of at least 1, got 0"):
        LLM(str(paths["dream"]), device="cpu", tensor_parallel_size=0)


# ----------------------------------------------------------------------------- the command line, torchrun

def generate_command(path: Path, prompts: Path, *extra: str) -> list[str]:
    return ["-m", "flash_dllm.cli", "generate", "--model", str(path), "--device", "cpu", "--method", "flash-cache",
            "--max-tokens", "12", "--block-length", "6", "--kv-cache-bytes", str(1 << 20), "--json",
            "--file", str(prompts), *extra]


def test_generate_under_torchrun_matches_one_process(paths, tmp_path):
    """`torchrun --nproc-per-node 2 ... --tensor-parallel-size 2`: rank 0 prints the outputs, rank 1 serves it."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": ids}) + "\n" for ids in PROMPTS))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          *generate_command(paths["llada"], prompts, "--tensor-parallel-size", "2")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert two.returncode == 0, two.stderr[-2000:]
    tokens = [json.loads(line)["token_ids"] for line in two.stdout.splitlines() if line.startswith("{")]
    one = LLM(str(paths["llada"]), **OPTIONS).generate(PROMPTS, SamplingParams(method="flash-cache", max_tokens=12,
                                                                                 block_length=6))
    assert tokens == [out.token_ids for out in one]  # printed once, by rank 0


def test_bench_step_prints_the_size_and_the_collectives(capsys):
    main(["bench", "step", "--model", "random:dream-tiny", "--device", "cpu", "--methods", "flash-cache",
          "--batch-sizes", "2", "--prompt-length", "16", "--max-tokens", "8", "--warmup", "2", "--iters", "4",
          "--tensor-parallel-size", "2"])
    out = capsys.readouterr().out
    assert "tensor-parallel size 2" in out.splitlines()[0]
    header, row = ([cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines()[2:5:2])
    assert header[5:8] == ["ms/iter", "TP", "collectives ms/iter"] and row[6] == "2"
    assert 0 < float(row[7]) <= float(row[5])


# ----------------------------------------------------------------------------- the worker processes

def run_script(path: Path, code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`code` as a script of its own, at its top level like a user's (no main guard), run to its end."""
    path.write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_a_script_without_a_main_guard_runs_tensor_parallel(tmp_path):
    """The workers are fresh interpreters (`python -m flash_dllm.engine.worker`): they never import the script. A
    method the script registers (from a module of its own) runs on them too: the same tokens as in one process."""
    (tmp_path / "my_methods.py").write_text(textwrap.dedent("""
        from flash_dllm.decoding.flash_cache import FlashCache

        class MyFlashCache(FlashCache):
            name = "my-flash-cache"
    """))
    run = run_script(tmp_path / "unguarded.py", """
        import json
        from flash_dllm import LLM, SamplingParams
        from flash_dllm.decoding.registry import register
        from my_methods import MyFlashCache

        register(MyFlashCache)
        two = LLM(device="cpu", tensor_parallel_size=2).generate(
            ["What is 3 + 4?"], SamplingParams(method="my-flash-cache", max_tokens=12, block_length=6))[0]
        one = LLM(device="cpu").generate(
            ["What is 3 + 4?"], SamplingParams(method="flash-cache", max_tokens=12, block_length=6))[0]
        print(json.dumps({"text": two.text, "two": two.token_ids, "one": one.token_ids}))
    """)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["two"] and out["two"] == out["one"]


@pytest.mark.parametrize("module, error", [
    ("flash_dllm.no_such_module", r"tensor-parallel rank 1 exited with code 1 before joining: .*No module named "),
    ("die_at_once", r"tensor-parallel rank 1 was killed by signal 9 \(Killed\) before joining")],
    ids=["missing", "killed"])
def test_a_worker_that_cannot_start_fails_the_llm_at_once(tmp_path, module, error):
    """A worker that exits before it joins the group (its module missing; killed as it starts) fails LLM(...)
    within seconds, in one line naming its rank and why (its stderr's last line)."""
    (tmp_path / "die_at_once.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    run = run_script(tmp_path / "start.py", """
        import sys, time
        import flash_dllm.engine.tensor_parallel as tensor_parallel
        from flash_dllm import LLM

        tensor_parallel.WORKER_MODULE = sys.argv[1]
        start = time.monotonic()
        try:
            LLM(device="cpu", tensor_parallel_size=2)
        except RuntimeError as error:
            print(f"{time.monotonic() - start:.1f}", error)
    """, module)
    assert run.returncode == 0, run.stderr[-2000:]
    seconds, message = run.stdout.splitlines()[-1].split(" ", 1)
    assert re.match(error, message) and float(seconds) < 60, run.stdout


def test_a_worker_that_fails_or_dies_fails_the_call_that_waits_for_it(tmp_path):
    """A worker whose part of an operation fails leaves (the driver's collective fails instead of waiting for it); one
    killed mid-generate fails that call; either names the rank, the LLM then refuses to run, and a new one starts."""
    (tmp_path / "rank_ops.py").write_text(textwrap.dedent("""
        import torch

        def fail_on_rank_1(state):
            if state.tp.rank == 1:
                raise RuntimeError("rank 1 cannot")
            return state.tp.all_reduce(torch.ones(1))
    """))
    run = run_script(tmp_path / "die.py", """
        import os, signal, threading
        from flash_dllm import LLM, SamplingParams
        from rank_ops import fail_on_rank_1

        def fails(call):
            try:
                call()
            except RuntimeError as error:
                print(error, flush=True)

        def generate_until_it_fails():
            while True:
                llm.generate([[5, 17, 42, 99, 7]] * 4, params)

        params = SamplingParams(method="flash-cache", max_tokens=32, block_length=8)
        llm = LLM(device="cpu", tensor_parallel_size=2)
        fails(lambda: llm.workers.everywhere(fail_on_rank_1, llm))
        fails(lambda: llm.generate([[5, 17, 42]], params))
        llm.shutdown()
        llm = LLM(device="cpu", tensor_parallel_size=2)
        worker = llm.workers.processes[0].popen
        threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL)).start()
        fails(generate_until_it_fails)
    """)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == [
        "tensor-parallel rank 1 exited with code 1: tensor-parallel rank 1: fail_on_rank_1 failed: RuntimeError: "
        "rank 1 cannot",
        "the tensor-parallel ranks are out of step: tensor-parallel rank 1 exited with code 1: tensor-parallel rank 1: "
        "fail_on_rank_1 failed: RuntimeError: rank 1 cannot; start a new LLM",
        "tensor-parallel rank 1 was killed by signal 9 (Killed)"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_the_workers_end_with_their_driver_quietly(tmp_path, sig):
    """SIGTERM to the driver mid-generate ends its workers and then itself; a killed driver's workers notice and end.
    Within seconds, and no process prints a traceback."""
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent("""
        from flash_dllm import LLM, SamplingParams

        llm = LLM(device="cpu", tensor_parallel_size=2)
        print(*[process.popen.pid for process in llm.workers.processes], flush=True)
        while True:
            llm.generate([[5, 17, 42, 99, 7]] * 4, SamplingParams(method="flash-cache", max_tokens=32, block_length=8))
            print("generated", flush=True)
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env)
    deadline = threading.Timer(300, driver.kill)  # the reads below wait for it
    deadline.start()
    try:
        workers = [int(pid) for pid in driver.stdout.readline().split()]
        assert driver.stdout.readline() == "generated\n"
        driver.send_signal(sig)
        ended = time.monotonic()
        _, stderr = driver.communicate(timeout=60)  # its stdout closes when the workers (which share it) end too
    finally:
        deadline.cancel()
        driver.kill()
    assert driver.returncode == -sig
    assert all(has_ended(pid) for pid in workers) and time.monotonic() - ended < 30
    assert "Traceback" not in stderr, stderr[-2000:]


def has_ended(pid: int) -> bool:
    """Whether a process has exited (gone, or a zombie not yet reaped by its new parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
