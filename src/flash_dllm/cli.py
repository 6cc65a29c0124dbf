"""The `flash-dllm` command: generate, serve, info, bench, demo, eval, sweep."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from .cache.routing import POLICIES
from .decoding.registry import DEFAULT_METHOD, METHODS, method_of, methods_for
from .engine.warmup import STEADY_BATCH_SIZES
from .extras import MissingExtra, require_extra
from .models.quantization import KV_CACHE_DTYPES, QUANTIZATIONS, kv_dtype_of
from .sampling_params import DEFAULT_KV_BUDGET, SamplingParams, knobs
from .tasks import RETRIEVAL_TASKS, TASKS


class HelpFormatter(argparse.HelpFormatter):
    """--help shows each flag's default, unless its help already says it or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS or \
                "default" in text or not action.option_strings:
            return text
        default = " ".join(map(str, action.default)) if isinstance(action.default, list) else action.default
        return f"{text} (default: {default})".lstrip()


class ArgumentParser(argparse.ArgumentParser):
    """Usage mistakes are one line naming the flag, as the other input errors are (exit code 2)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=HelpFormatter, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def at_least(minimum: int):
    """An argparse type: an int of at least `minimum` (counts, limits, sizes)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    parse.__name__ = f"int >= {minimum}"
    return parse


def port(text: str) -> int:
    """An argparse type: a TCP port."""
    value = at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be at most 65535, got {value}")
    return value


BLOCK_LENGTH_HELP = "semi-autoregressive block size; the last block is shorter where it does not divide max-tokens"
TEMPERATURE_HELP = "0: greedy; > 0: Gumbel-max sampling in float64"
SEED_HELP = "the sampling noise's seed, per request"


def add_model_choice(parser: argparse.ArgumentParser, default_model: str | None = None):
    """--model, --device and --dtype: which model, where, in what."""
    parser.add_argument("--model", default=default_model,
                        help=f"checkpoint directory, Hugging Face repo id, embedded:NAME (default, llada2) or "
                             f"random:PRESET (default: {default_model or 'the embedded model'})")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument("--dtype", default=None,
                        help="bfloat16, float16 or float32 (default: bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="fp8: the decoder layers' projections in E4M3 (weights per channel, inputs per token), "
                             "quantised as the checkpoint loads (default: none, the dtype throughout)")
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=None,
                        help="fp8: the KV cache's K and V in E4M3 with a scale per token and KV head, about half the "
                             "bytes (default: the dtype)")
    parser.add_argument("--tensor-parallel-size", type=at_least(1), default=1,
                        help="split the model over this many GPUs (on the CPU, processes); this process starts the "
                             "others, or under torchrun its ranks are the group")
    parser.add_argument("--expert-parallel", action="store_true",
                        help="with --tensor-parallel-size > 1 on a mixture-of-experts model: each rank holds a share "
                             "of whole experts, not a share of every expert (attention stays tensor-parallel)")


def add_model_args(parser: argparse.ArgumentParser, default_model: str | None = None):
    """The model (add_model_choice) and the engine's options."""
    add_model_choice(parser, default_model)
    parser.add_argument("--kernels", choices=["on", "off"], default=None,
                        help="Triton kernels for the cached methods (default: on with CUDA); off = PyTorch reference")
    parser.add_argument("--cuda-graphs", choices=["on", "off"], default=None,
                        help="replay repeating cached passes from CUDA graphs (default: on with the kernels on CUDA)")
    parser.add_argument("--kv-cache-bytes", type=int, default=None,
                        help="KV cache budget of the cached methods (default: 40%% of free GPU memory; on the CPU "
                             "40%% of available memory, at most 1 GiB)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the same tokens alone or in any batch, in any dtype (on a GPU through the Triton "
                             "kernels; Elastic-Cache on the CPU only)")


def llm_from_args(args, default_device: str | None = None, **options):
    """The LLM that add_model_args' options name (`options`: LLM's other arguments)."""
    from .llm import LLM

    on_off = lambda value: None if value is None else value == "on"
    return LLM(args.model, device=args.device or default_device, dtype=args.dtype, kernels=on_off(args.kernels),
               cuda_graphs=on_off(args.cuda_graphs), kv_cache_bytes=args.kv_cache_bytes,
               batch_invariant=args.batch_invariant, quantization=args.quantization,
               kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
               expert_parallel=args.expert_parallel, **options)


def add_sampling_args(parser: argparse.ArgumentParser):
    """--method, the common fields and one flag per knob of the registered methods (SamplingParams' names)."""
    g = parser.add_argument_group("decoding")
    g.add_argument("--method", default=DEFAULT_METHOD, choices=list(METHODS), help="decoding method (README's table)")
    g.add_argument("--max-tokens", type=int, default=128, help="generation length")
    g.add_argument("--block-length", type=int, default=32, help=BLOCK_LENGTH_HELP)
    g.add_argument("--temperature", type=float, default=0.0, help=TEMPERATURE_HELP)
    g.add_argument("--seed", type=int, default=0, help=SEED_HELP)
    g.add_argument("--kv-routing", choices=POLICIES, help="read only the prompt's KV chunks that each step's "
                   "queries may need (cached methods; default: dense)")
    g.add_argument("--kv-budget", type=float, help=f"with --kv-routing: the fraction of the prompt's keys a step "
                   f"reads, in (0, 1] (default {DEFAULT_KV_BUDGET})")
    for name, knob in knobs().items():
        readers: dict = {}
        for method, default in knob.defaults.items():
            readers.setdefault(default, []).append(method)
        who = "; ".join(", ".join(methods) + ("" if default is None else f": default {default}")
                        for default, methods in readers.items())
        g.add_argument("--" + name.replace("_", "-"), type=knob.type, choices=knob.choices, help=f"{knob.help} ({who})")


def sampling_params_from_args(args) -> SamplingParams:
    given = {name: getattr(args, name) for name in knobs() if getattr(args, name) is not None}
    return SamplingParams(method=args.method, max_tokens=args.max_tokens, block_length=args.block_length,
                          temperature=args.temperature, seed=args.seed, kv_routing=args.kv_routing,
                          kv_budget=args.kv_budget, **given)


STDIN = "-"


def read_prompts(args, stdin=None) -> list[tuple[str, object, str | None]]:
    """(where, prompt, problem) for the prompt arguments, then the file's lines: one prompt per non-blank line,
    or per jsonl line an object with a prompt, messages or prompt_token_ids. `where` names the argument or
    file:line; a line that cannot be read has a problem instead of a prompt, and fails alone.
    Standard input, as Unix tools read it: the argument `-` is the whole of it as one prompt (also when it is
    piped in and nothing else is given); `--file -` reads it as a file, jsonl when its first non-blank line is a
    JSON object."""
    stdin = sys.stdin if stdin is None else stdin
    arguments = list(args.prompts)
    if not arguments and not args.file and not stdin.isatty():
        arguments = [STDIN]
    if arguments.count(STDIN) + (args.file == STDIN) > 1:
        raise ValueError("standard input (-) can be read once: as one prompt argument or as --file -")
    prompts = []
    for number, prompt in enumerate(arguments, 1):
        where = f"argument {number}"
        if prompt == STDIN:
            prompt, where = stdin.buffer.read().decode("utf-8", errors="surrogateescape"), "stdin"
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # argv's escape for a byte that is not UTF-8
            prompts.append((where, None, "not valid UTF-8"))
            continue
        prompts.append((where, prompt, None))
    if args.file:
        if args.file == STDIN:
            path, data = Path("<stdin>"), stdin.buffer.read()
            first = next((line for line in data.splitlines() if line.strip()), b"")
            jsonl = first.lstrip().startswith(b"{")
        else:
            path = Path(args.file)
            if not path.is_file():
                raise FileNotFoundError(f"prompt file {path} does not exist")
            data, jsonl = path.read_bytes(), path.suffix == ".jsonl"
        for number, raw in enumerate(data.splitlines(), 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                prompts.append((f"{path}:{number}", None, f"not valid UTF-8 (byte {e.start + 1})"))
                continue
            if line.strip():
                prompt, problem = _jsonl_prompt(line) if jsonl else (line, None)
                prompts.append((f"{path}:{number}", prompt, problem))
    if not prompts:
        raise ValueError("no prompts: give them as arguments, with --file, or on standard input (-)")
    return prompts


JSONL_KEYS = {"prompt": str, "messages": list, "prompt_token_ids": list}


def _jsonl_prompt(line: str) -> tuple[object, str | None]:
    """A jsonl line's prompt, or None and what is wrong with the line."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg}, column {e.colno})"
    key = next((key for key in JSONL_KEYS if isinstance(item, dict) and key in item), None)
    if key is None:
        return None, "expected an object with a prompt, messages or prompt_token_ids key"
    if not isinstance(item[key], JSONL_KEYS[key]):
        return None, f"{key} must be a {JSONL_KEYS[key].__name__}, got {type(item[key]).__name__}"
    return item[key], None


def cmd_generate(args) -> int:
    """Each result is printed as it finishes; a prompt that fails is reported on stderr (its index and
    argument or file:line) while the others run. Exit code 1 if any failed, 130 on an interrupt."""
    from .llm import RequestOutput

    params = sampling_params_from_args(args)
    prompts = read_prompts(args)
    llm = llm_from_args(args, max_batch_size=args.batch_size,
                        chat_template=False if args.no_chat_template else None)
    printed: list[RequestOutput] = []

    def emit(out: RequestOutput):
        printed.append(out)
        if out.error is not None:
            print(f"flash-dllm: error: {out.error}", file=sys.stderr, flush=True)
        if args.json:
            record = {"index": out.index, "prompt": out.prompt, "text": out.text, "token_ids": out.token_ids,
                      "finish_reason": out.finish_reason, "nfe": out.nfe, "steps": out.steps,
                      "query_rows": out.query_rows}
            print(json.dumps(record if out.error is None else {**record, "error": out.error}), flush=True)
        elif out.error is None:
            print(f"--- request {out.index} ({prompts[out.index][0]}, {out.finish_reason}, {len(out.token_ids)} "
                  f"tokens, {out.steps} steps, NFE {out.nfe}, {out.query_rows_per_step:.0f} query rows per step)")
            print(out.token_ids if llm.tokenizer is None else out.text, flush=True)

    def named(index: int, problem: str) -> str:
        return f"prompt {index} ({prompts[index][0]}): {problem}"

    runnable = [index for index, (_, _, problem) in enumerate(prompts) if problem is None]
    for index, (_, _, problem) in enumerate(prompts):
        if problem is not None:
            emit(RequestOutput.failed(index, None, named(index, problem)))

    def on_output(out: RequestOutput):  # out.index counts the runnable prompts only
        index = runnable[out.index]
        if out.error is not None:
            out.error = named(index, out.error.removeprefix(f"prompt {out.index}: "))
        out.index = index
        emit(out)

    library_log = logging.getLogger("flash_dllm")
    level = library_log.level
    library_log.setLevel(logging.ERROR)  # emit() reports each failed prompt, with its argument or file:line
    start = time.perf_counter()
    try:
        llm.generate([prompts[index][1] for index in runnable], params,
                     use_tqdm=False if args.no_progress else None, on_output=on_output)
    except KeyboardInterrupt:
        print(f"flash-dllm: interrupted: {len(printed)} of {len(prompts)} requests finished", file=sys.stderr)
        return 130
    finally:
        library_log.setLevel(level)
    wall = time.perf_counter() - start
    done = [out for out in printed if out.error is None]
    failed = len(printed) - len(done)
    tokens = sum(len(o.token_ids) for o in done)
    steps = sum(o.steps for o in done)
    print(f"{len(done)} requests{f' ({failed} failed)' if failed else ''}, {tokens} tokens in {wall:.2f} s: "
          f"{tokens / wall:.1f} tokens/s (no warm-up), NFE {sum(o.nfe for o in done) / max(len(done), 1):.1f} "
          f"per request, {tokens / max(steps, 1):.2f} tokens per step", file=sys.stderr)
    return 1 if failed else 0


def cmd_info(args):
    from .cache.kv_cache import KVCache
    from .llm import RANDOM_PREFIX, default_model_path, resolve_device, resolve_dtype
    from .models import build_model, config_from_dir, resolve_checkpoint
    from .models.loader import random_config

    spec = args.model or str(default_model_path())
    if spec.startswith(RANDOM_PREFIX):
        cfg = random_config(spec[len(RANDOM_PREFIX):])
    else:
        cfg = config_from_dir(resolve_checkpoint(spec))
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    name = str(dtype).removeprefix("torch.")
    model = build_model(cfg, "meta", dtype, quantization=args.quantization)
    num_params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    print(f"model: {spec}")
    for key, value in vars(cfg).items():
        print(f"  {key}: {value}")
    print(f"runs on: {device} in {name}" + (f", projections in {args.quantization}" if args.quantization else ""))
    print(f"parameters: {num_params:,} ({weight_bytes / 1e9:.2f} GB in {name}"
          + (f" with {args.quantization} projections and their scales)" if args.quantization else ")"))
    per_token = KVCache.bytes_per_row(cfg, dtype, kv_dtype=kv_dtype_of(args.kv_cache_dtype))
    kv_name = f"{args.kv_cache_dtype} with a scale per KV head" if args.kv_cache_dtype else name
    print(f"KV cache per token: {per_token:,} bytes ({kv_name}, all layers; {per_token * 1000 / 2**20:.1f} MiB per "
          f"1k tokens)")
    if args.tensor_parallel_size > 1:
        from .models.parallel import TensorParallel

        shard = build_model(cfg, "meta", dtype, quantization=args.quantization,
                            tp=TensorParallel(0, args.tensor_parallel_size, expert_parallel=args.expert_parallel))
        shard_bytes = sum(t.numel() * t.element_size() for t in (*shard.parameters(), *shard.buffers()))
        print(f"per rank of {args.tensor_parallel_size}: {shard_bytes / 1e9:.2f} GB of weights, KV cache "
              f"{KVCache.bytes_per_row(shard.shard_config, dtype, kv_dtype=kv_dtype_of(args.kv_cache_dtype)):,} "
              f"bytes per token")


def bench_cases(args):
    """(SamplingParams, batch size) for each method (at its published block length unless --block-length says
    otherwise) and batch size of a `bench step` or `bench generate` command."""
    routings = getattr(args, "kv_routing", None) or ["dense"]
    if getattr(args, "kv_budget", None) is not None and routings == ["dense"]:
        raise ValueError(f"--kv-budget applies only with --kv-routing ({', '.join(POLICIES)})")
    for method in args.methods or METHODS:
        for routing in routings:
            routed = {} if routing == "dense" else dict(kv_routing=routing, kv_budget=args.kv_budget)
            params = SamplingParams(method=method, max_tokens=args.max_tokens,
                                    block_length=args.block_length or method_of(method).published_block_length,
                                    **routed)
            for batch in args.batch_sizes:
                yield params, batch


def cmd_bench(args):
    import torch

    from .bench.forward import bench_forward, format_table
    from .bench.kernels import (bench_fp8_gemms, bench_fp8_kernels, bench_kernels, bench_moe_kernels, format_gemm_table,
                                format_moe_table, format_table as format_kernel_table)
    from .bench.generate import bench_generate, format_table as format_generate_table
    from .bench.step import bench_step, format_table as format_step_table

    cases = list(bench_cases(args)) if args.bench in ("step", "generate") else []  # checked before the model loads
    if args.bench in ("forward", "kernels") and args.tensor_parallel_size > 1:
        raise ValueError(f"bench {args.bench} times one process's model: --tensor-parallel-size must be 1")
    llm = llm_from_args(args, max_batch_size=max(getattr(args, "batch_sizes", [32])))
    if cases and args.methods is None:  # every method that runs on this model's attention pattern
        args.methods = methods_for(llm.config.attention.kind)
        cases = list(bench_cases(args))
    device_name = torch.cuda.get_device_name(llm.device) if llm.device.type == "cuda" else "cpu"
    quantization = ((f", projections in {args.quantization}" if args.quantization else "")
                    + (f", KV cache in {args.kv_cache_dtype}" if args.kv_cache_dtype else ""))
    tensor_parallel = f", tensor-parallel size {llm.tp.size}" if llm.tp.size > 1 else ""
    print(f"# bench {args.bench}: {args.model} on {device_name}, {llm.dtype}{quantization}{tensor_parallel}")
    if args.bench == "kernels":
        if llm.device.type != "cuda" and not llm.runner.kernels:
            raise ValueError("bench kernels runs the Triton kernels: it needs a CUDA device (or TRITON_INTERPRET=1)")
        if getattr(llm.config, "num_experts", 0):
            print(format_moe_table(bench_moe_kernels(llm.model, args.gemm_rows, args.iters)))
        if args.quantization:
            results = [r for batch in args.batch_sizes
                       for r in bench_fp8_kernels(llm.model, batch * args.rows, args.iters)]
            print(format_kernel_table(results))
            print(format_gemm_table(bench_fp8_gemms(llm.model, args.gemm_rows, args.iters)))
            return
        results = [r for batch in args.batch_sizes
                   for r in bench_kernels(llm.model, batch, args.rows, args.kv_length, args.warmup, args.iters)]
        print(format_kernel_table(results))
        return
    if args.bench == "forward":
        results = [bench_forward(llm.model, batch, args.length, rows, iters=args.iters)
                   for batch in args.batch_sizes
                   for rows in (None, args.block_length)]  # the reference code's full LM head, then ours
        print(format_table(results))
        return
    kernels, graphs = ("on" if flag else "off" for flag in (llm.runner.kernels, llm.runner.cuda_graphs))
    switches = f"kernels {kernels}, CUDA graphs {graphs}"
    if args.bench == "generate":
        prompts = args.prompts or ("random" if llm.tokenizer is None else "tasks")
        if prompts == "tasks" and llm.tokenizer is None:
            raise ValueError(f"--prompts tasks: {args.model} has no tokenizer; use --prompts random")
        if prompts == "tasks" and args.prompt_length is not None:
            raise ValueError("--prompt-length sets the random prompts' length; the task prompts have their own "
                             "(use --prompts random)")
        length = (args.prompt_length or 256) if prompts == "random" else None
        print(f"# prompts: {'the embedded tasks (chat)' if length is None else f'random, {length} tokens'}, "
              f"generation {args.max_tokens}, one timed LLM.generate call per row after a warm-up call; {switches}")
        results = []
        for params, batch in cases:
            results.append(r := bench_generate(llm, params, batch, length))
            print(f"{params.method} batch {batch}: {r.ms_per_iter:.2f} ms/iter over {r.iterations} iterations, "
                  f"{r.tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
        if any(r.tokens == 0 for r in results):
            print("warning: some rows generated no tokens (every request stopped at once): their tok/s is 0",
                  file=sys.stderr)
        print(format_generate_table(results))
        return
    print(f"# prompt {args.prompt_length}, generation {args.max_tokens}, {args.warmup} warm-up + {args.iters} "
          f"timed iterations; {switches}")
    results = []
    for params, batch in cases:
        results.append(r := llm.workers.everywhere(bench_step, llm, params, batch, args.prompt_length, args.warmup,
                                                   args.iters) if llm.workers else
                       bench_step(llm, params, batch, args.prompt_length, args.warmup, args.iters))
        print(f"{params.method} {r.routing} batch {batch}: {r.ms_per_iter:.2f} ms/iter, {r.query_rows:.0f} query "
              f"rows, {r.ratio:.2f}x floor", file=sys.stderr, flush=True)  # progress, in case a long run is cut short
    if not all(r.forced for r in results):
        print("warning: some method decoded other than 1 token per iteration; the work is not identical "
              "across methods (a trained model?)", file=sys.stderr)
    print(format_step_table(results))


def demo_variants() -> dict[str, dict]:
    """The rows `demo` compares: each method with its defaults, and the variants it names."""
    return {label: dict(method=method.name, **settings) for method in METHODS.values()
            for label, settings in (method.demo_variants or {method.name: {}}).items()}


DEMO_ITEMS = 4  # held-out items per task: a k/n per method and task, the default methods in a minute on 2 CPU cores
# One token per forward pass like reference, at its compute (dream) or twice it (lossless, which trades compute for
# fewer sequential passes): on a CPU, where passes are compute-bound, reference alone is the demo's baseline.
DEMO_ON_REQUEST = ("lossless", "dream")
DEMO_TASKS = ("arith", "trace", "passkey")
DEMO_EXAMPLES = 2  # tasks whose first item the demo shows with the default method's whole answer


def default_demo_methods() -> list[str]:
    return [label for label in demo_variants() if label not in DEMO_ON_REQUEST]


def demo_items(args) -> dict[str, list]:
    """The first --items held-out items of each task (a retrieval task's: those of --prompt-length tokens). Without
    --tasks, the tasks are those of DEMO_TASKS an embedded model was trained on (all of them for another model)."""
    from .tasks import load_test_set

    if args.tasks is None:
        args.tasks = [task for task in DEMO_TASKS if task in (embedded_tasks(args.model) or DEMO_TASKS)]
    items = {}
    for task in args.tasks:
        test_set = load_test_set(task)
        if task in RETRIEVAL_TASKS:
            lengths = sorted({item.length for item in test_set})
            if args.prompt_length not in lengths:
                raise ValueError(f"--prompt-length {args.prompt_length}: {task} has items of "
                                 f"{', '.join(map(str, lengths))} tokens")
            test_set = [item for item in test_set if item.length == args.prompt_length]
        items[task] = test_set[:args.items]
    return items


def shortened(text: str, keep: int = 240) -> str:
    """A long prompt (a retrieval task's filler) as its start and end."""
    return text if len(text) <= keep else f"{text[:keep // 3]} [...] {text[-2 * keep // 3:]}"


def cmd_demo(args):
    from .eval.embedded import run_task
    from .markdown import markdown_table
    from .tasks import answer_length

    items = demo_items(args)  # checked before the model loads
    llm = llm_from_args(args, max_batch_size=args.batch_size)
    columns = [task + (f"@{args.prompt_length}" if task in RETRIEVAL_TASKS else "") for task in args.tasks]
    results, variants = {}, demo_variants()
    attention = llm.config.attention

    def runs(label: str) -> bool:  # the model's engine would admit the row's requests
        method = method_of(variants[label]["method"], attention.kind)
        try:
            method.check_model(llm.config, SamplingParams(block_length=args.block_length, **variants[label]))
        except ValueError:
            return False
        return attention.kind in method.attention_patterns
    default = args.methods is None
    if default:  # the default rows that this model's attention pattern admits
        args.methods = [label for label in default_demo_methods() if runs(label)]
    elif refused := [label for label in args.methods if not runs(label)]:
        raise ValueError(f"--methods {' '.join(refused)}: not supported on this model ({attention} attention)")
    for label in args.methods:
        params = {task: SamplingParams(max_tokens=args.max_tokens or answer_length(task),
                                       block_length=args.block_length, **variants[label]) for task in args.tasks}
        if llm.device.type == "cuda":  # kernel compiles and graph captures stay out of the timing; one block does it
            warmup = SamplingParams(max_tokens=args.block_length, block_length=args.block_length, **variants[label])
            llm.generate(items[args.tasks[0]][0].prompt, warmup)
        print(f"{label}:", end="", file=sys.stderr, flush=True)  # progress, a task at a time
        results[label] = []
        for task, column in zip(args.tasks, columns):
            results[label].append(r := run_task(llm, task, label, items[task], params[task]))
            print(f" {column} {r.num_correct}/{r.num_items} ({r.wall_s:.1f} s)", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    print(f"Correct answers to {args.items} held-out item{'s' * (args.items > 1)} per task; forward passes (NFE) per "
          f"item, tokens per denoising step, query rows per step and tokens/s over all tasks:")
    rows = []
    for label, rs in results.items():
        tokens, steps = sum(r.tokens for r in rs), max(1, sum(r.steps for r in rs))
        rows.append((label, *(f"{r.num_correct}/{r.num_items}" for r in rs),
                     f"{sum(r.nfe for r in rs) / sum(r.num_items for r in rs):.1f}", f"{tokens / steps:.2f}",
                     f"{sum(r.query_rows for r in rs) / steps:.0f}", f"{tokens / sum(r.wall_s for r in rs):.1f}"))
    print(markdown_table(("method", *columns, "NFE", "tokens/step", "query rows/step", "tokens/s"), rows))
    if default:
        print(f"Not run by default: {', '.join(DEMO_ON_REQUEST)} (one token per forward pass as reference, at up to "
              f"twice its compute: minutes on a CPU); add them with --methods")
    shown = DEFAULT_METHOD if DEFAULT_METHOD in results else args.methods[0]
    for task, r in list(zip(args.tasks, results[shown]))[:DEMO_EXAMPLES]:
        item = items[task][0]
        print(f"\n{shown} on {task} #0: {'right' if r.verdicts[0] else 'wrong'} (expected {item.answer})\n"
              f"prompt: {shortened(item.prompt)}\nanswer: {r.texts[0]}")


EVAL_TASKS = ("gsm8k", "math500", "humaneval", "mbpp", *TASKS)


def add_eval_args(parser: argparse.ArgumentParser):
    parser.add_argument("--task", required=True, choices=EVAL_TASKS,
                        help="a benchmark, or one of the embedded model's tasks (README's Evaluation)")
    parser.add_argument("--data", help="mbpp: a local jsonl in the standard MBPP format (else the Hugging Face hub)")
    parser.add_argument("--limit", type=at_least(1), help="the first N items only")
    parser.add_argument("--prompt-length", type=at_least(1),
                        help="retrieval tasks (passkey, multikey): the items of this prompt length only")
    parser.add_argument("--batch-size", type=at_least(1), default=32, help="most requests decoded together")
    parser.add_argument("--no-chat-template", action="store_true", help="plain few-shot text prompts")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def check_eval_args(args):
    """What an eval or sweep can check before the model loads: --prompt-length, and the task's extra."""
    from .eval.benchmarks import get_benchmark

    if args.prompt_length is not None and args.task not in RETRIEVAL_TASKS:
        raise ValueError(f"--prompt-length selects the items of a retrieval task ({', '.join(RETRIEVAL_TASKS)}); "
                         f"task {args.task!r} has none")
    get_benchmark(args.task).require()


def embedded_tasks(model: str | None) -> tuple[str, ...] | None:
    """The tasks an embedded model (`--model` unset, `embedded:NAME` or its directory) was trained on; None for any
    other model."""
    from .models.hub import EMBEDDED_TASKS, embedded_name

    return EMBEDDED_TASKS.get("default" if model is None else embedded_name(model))


def warn_if_untrained(args):
    """An embedded model knows only its own tasks: on any other it scores near 0, which the user should know
    before the run, not after it."""
    trained = embedded_tasks(args.model)
    if trained is not None and args.task not in trained:
        print(f"flash-dllm: warning: this embedded model was trained only on {', '.join(trained)}; {args.task} will "
              f"score near 0: load a real checkpoint with --model", file=sys.stderr)


def load_eval_llm(args, ctx):
    """The LLM of an eval or sweep, on this rank's device under torchrun."""
    return llm_from_args(args, ctx.device, max_batch_size=args.batch_size,
                         chat_template=False if args.no_chat_template else None)


def cmd_eval(args):
    from .eval.benchmarks import get_benchmark
    from .eval.distributed import init_from_env, shutdown
    from .eval.harness import evaluate, summary_path, write_result

    if args.max_tokens is None:  # the field's generation length for the task
        args.max_tokens = get_benchmark(args.task).max_tokens
    params = sampling_params_from_args(args)
    check_eval_args(args)
    ctx = init_from_env(args.tensor_parallel_size)
    try:
        if ctx.is_main:
            warn_if_untrained(args)
        llm = load_eval_llm(args, ctx)
        result = evaluate(llm, args.task, params, data=args.data, limit=args.limit, ctx=ctx,
                          length=args.prompt_length, progress=not args.no_progress)
        if ctx.is_main:
            if args.output:
                write_result(result, args.output)
                print(f"wrote {args.output} and {summary_path(args.output)}", file=sys.stderr)
            print(json.dumps(result.summary, indent=2))
    finally:
        shutdown(ctx)


def cmd_sweep(args):
    from .eval.benchmarks import get_benchmark
    from .eval.distributed import init_from_env, shutdown
    from .eval.sweep import grid, run_sweep

    values = {name: getattr(args, name) or [] for name in knobs()}
    max_tokens = args.max_tokens or get_benchmark(args.task).max_tokens
    points = grid(args.methods, values, max_tokens=max_tokens, block_length=args.block_length,
                  temperature=args.temperature, seed=args.seed)
    check_eval_args(args)
    require_extra("eval", "flash-dllm sweep", "matplotlib")  # the plot, drawn after the whole sweep
    ctx = init_from_env(args.tensor_parallel_size)
    try:
        if ctx.is_main:
            warn_if_untrained(args)
        llm = load_eval_llm(args, ctx)
        rows = run_sweep(llm, args.task, points, args.out_dir, data=args.data, limit=args.limit, ctx=ctx,
                         progress=not args.no_progress, length=args.prompt_length)
        if ctx.is_main:
            print((Path(args.out_dir) / "sweep.md").read_text())
            print(f"{len(rows)} points: wrote {args.out_dir}/sweep.png, sweep.md, sweep.json and points/",
                  file=sys.stderr)
    finally:
        shutdown(ctx)


def graph_batch_sizes(args) -> tuple[int, ...]:
    """--graph-batch-sizes, each at most --max-batch (a larger batch never runs); left out: the default sizes up
    to --max-batch."""
    if args.graph_batch_sizes is None:
        return tuple(size for size in STEADY_BATCH_SIZES if size <= args.max_batch)
    if max(args.graph_batch_sizes) > args.max_batch:
        raise ValueError(f"--graph-batch-sizes {max(args.graph_batch_sizes)} is more than --max-batch "
                         f"{args.max_batch}: no batch would replay it")
    return tuple(sorted(set(args.graph_batch_sizes)))


def step_trace_path(args) -> str | None:
    """--step-trace, checked before the model loads: its folder must exist."""
    if args.step_trace is None:
        return None
    folder = Path(args.step_trace).resolve().parent
    if not folder.is_dir():
        raise ValueError(f"--step-trace {args.step_trace}: the folder {folder} does not exist")
    return args.step_trace


def cmd_serve(args):
    require_extra("serve", "flash-dllm serve", "fastapi", "uvicorn")
    from functools import partial

    from .serve.api_server import MAX_REQUEST_BYTES, ServeConfig, listening_socket, serve
    from .serve.protocol import ServerDefaults
    from .serve.replicas import ModelFront, ReplicaError, ReplicaPool, replica_devices

    params = sampling_params_from_args(args)  # the server's defaults, checked before the model loads
    given = {name: getattr(args, name) for name in knobs() if getattr(args, name) is not None}
    config = ServeConfig(model_name=args.served_model_name or Path(args.model or "default").name,
                         defaults=ServerDefaults(params, given, tuple(args.methods) if args.methods else None,
                                                 graph_batch_sizes=graph_batch_sizes(args)),
                         max_queue=args.max_queue,
                         max_request_bytes=args.max_request_bytes or MAX_REQUEST_BYTES,
                         api_key=args.api_key,
                         step_trace=step_trace_path(args))
    replicas = args.data_parallel_size
    if replicas > 1 or args.engine_process:
        devices = replica_devices(replicas, args.device, args.tensor_parallel_size)
    sock = listening_socket(args.host, args.port)
    if replicas == 1 and not args.engine_process:  # the engine loop in this process
        llm, pool = llm_from_args(args, max_batch_size=args.max_batch), None
    else:  # this process tokenises; each replica process loads the model
        llm = ModelFront(args.model)
        options = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
        if devices[0] is not None:  # a replica sees only its GPUs (cuda:0 ...)
            options.device = "cuda"
        pool = ReplicaPool(partial(llm_from_args, options, max_batch_size=args.max_batch), config.defaults,
                           devices, args.max_batch, config.step_trace)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"flash-dllm: warning: serving on {args.host} without --api-key", file=sys.stderr)
    print(f"flash-dllm: serving {config.model_name} on http://{args.host}:{args.port}"
          + (f" with {replicas} replicas" if replicas > 1 else " from an engine process" if pool else ""),
          file=sys.stderr)
    try:
        serve(llm, config, sock, pool)
    except ReplicaError as error:  # the replica printed its traceback
        print(f"flash-dllm: error: {error}", file=sys.stderr)
        return 1


def mix_spec_from_args(args):
    from .bench.mix import MixSpec

    return MixSpec(num_requests=args.requests, rate=args.rate, prompt_lengths=tuple(args.mix_prompt_lengths),
                   max_tokens=tuple(args.mix_max_tokens), methods=tuple(args.mix_methods),
                   routings=tuple(None if r == "dense" else r for r in args.mix_routings),
                   block_length=args.mix_block_length, arrivals=args.mix_arrivals, seed=args.mix_seed)


def describe_mix(spec) -> str:
    routings = ", ".join(r or "dense" for r in spec.routings)
    arrivals = "Poisson" if spec.arrivals == "poisson" else "evenly spaced"
    return (f"{spec.num_requests} requests at {spec.rate:g}/s ({arrivals}, seed {spec.seed}); prompt lengths "
            f"{list(spec.prompt_lengths)}, max_tokens {list(spec.max_tokens)}, methods {', '.join(spec.methods)}, "
            f"routings {routings}")


def cmd_bench_mix(args):
    """The mix offline: the engine's loop with arrivals, after the warm-up `serve` runs before ready."""
    import torch

    from .bench.mix import format_report, run_offline, save_answers, warm_up

    spec, sizes = mix_spec_from_args(args), graph_batch_sizes(args)
    llm = llm_from_args(args, max_batch_size=args.max_batch)
    start = time.perf_counter()
    phases = warm_up(llm, spec, requests=not args.no_warm_up_requests, capture_after_ready=args.capture_after_ready,
                     graph_batch_sizes=sizes)
    device_name = torch.cuda.get_device_name(llm.device) if llm.device.type == "cuda" else "cpu"
    print(f"# bench mix: {args.model} on {device_name}, {llm.dtype}, max batch {args.max_batch}; "
          f"{describe_mix(spec)}; warm-up {time.perf_counter() - start:.1f} s"
          + (" (KV cache and compile_kernels only)" if phases is None else f" ({phases})")
          + ("; CUDA graphs captured during the mix" if args.capture_after_ready and llm.runner.graphs else ""))
    result = run_offline(llm, spec)
    print(format_report(result))
    if args.mix_save:
        save_answers(result, args.mix_save)


def cmd_bench_serve(args):
    require_extra("serve", "flash-dllm bench serve", "httpx")
    from .bench.serve import HEADER, ServeBenchConfig, bench_serve
    from .markdown import markdown_table

    try:
        fields = json.loads(args.fields)
    except json.JSONDecodeError as e:
        raise ValueError(f"--fields is not valid JSON ({e.msg})") from None
    if not isinstance(fields, dict):
        raise ValueError("--fields must be a JSON object of request fields")
    if args.mix:
        from .bench.mix import MixServeConfig, bench_serve_mix, format_report, save_answers

        spec = mix_spec_from_args(args)
        result = bench_serve_mix(MixServeConfig(url=args.url, spec=spec, fields=fields, api_key=args.api_key))
        print(f"# bench serve --mix: {args.url}; {describe_mix(spec)}; fields {json.dumps(fields)}")
        print(format_report(result))
        if args.mix_save:
            save_answers(result, args.mix_save)
        for answer in [a for a in result.answers if a.error][:5]:
            print(f"error: request {answer.request.index}: {answer.error}", file=sys.stderr)
        return
    fields.update({name: getattr(args, name) for name in ("method", "max_tokens", "temperature")
                   if getattr(args, name) is not None})
    config = ServeBenchConfig(url=args.url, clients=args.clients, duration_s=args.duration, prompts=args.prompts,
                              num_prompts=args.num_prompts, prompt_length=args.prompt_length, fields=fields,
                              api_key=args.api_key)
    result = bench_serve(config)
    print(f"# bench serve: {args.url}, {args.clients} clients x {args.duration:.0f} s, {args.prompts} prompts, "
          f"fields {json.dumps(fields)}")
    print(markdown_table(HEADER, [result.row()]))
    for answer in [a for a in result.answers if a.error][:5]:
        print(f"error: prompt {answer.prompt}: {answer.status} {answer.error}", file=sys.stderr)


def add_mix_args(parser):
    from .bench.mix import ARRIVALS, MixSpec

    d = MixSpec()
    parser.add_argument("--rate", type=float, default=d.rate, help="mix: requests per second")
    parser.add_argument("--requests", type=at_least(1), default=d.num_requests, help="mix: requests sent")
    parser.add_argument("--mix-prompt-lengths", type=at_least(1), nargs="+", default=list(d.prompt_lengths),
                        help="mix: prompt lengths (random token ids), one drawn per request")
    parser.add_argument("--mix-max-tokens", type=at_least(1), nargs="+", default=list(d.max_tokens),
                        help="mix: generation lengths, one drawn per request")
    parser.add_argument("--mix-methods", nargs="+", choices=list(METHODS), default=list(d.methods),
                        help="mix: methods, one drawn per request")
    parser.add_argument("--mix-routings", nargs="+", choices=["dense", *POLICIES], default=["dense", "chunk"],
                        help="mix: prompt-KV routings of the cached methods' requests, one drawn per request")
    parser.add_argument("--mix-block-length", type=at_least(1), default=d.block_length,
                        help="mix: block length (at most each request's max_tokens)")
    parser.add_argument("--mix-arrivals", choices=list(ARRIVALS), default=d.arrivals,
                        help="mix: arrivals as a Poisson process at --rate, or evenly spaced at it (the same requests)")
    parser.add_argument("--mix-seed", type=int, default=d.seed, help="mix: the seed of the whole mix")
    parser.add_argument("--mix-save", metavar="PATH", help="mix: also write every request's shape, arrival, TTFT and "
                        "end-to-end time to PATH, one JSON object a line")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="flash-dllm", description="Fast inference for diffusion language models")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)

    gen = sub.add_parser("generate", help="generate text for prompts")
    gen.add_argument("prompts", nargs="*", help="prompt strings; - reads one prompt from standard input (as does "
                     "piping into the command without arguments)")
    gen.add_argument("--file", help="prompts: a text file (one per line) or .jsonl with prompt/messages/"
                                    "prompt_token_ids (blank lines skipped); - reads standard input")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--batch-size", type=at_least(1), default=32, help="most requests decoded together")
    gen.add_argument("--no-chat-template", action="store_true", help="encode string prompts as raw text")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object per request as it finishes, with its index (and error if it failed)")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="every decoding method on held-out items of the embedded tasks")
    add_model_args(demo)
    demo.add_argument("--items", type=at_least(1), default=DEMO_ITEMS, help="held-out items per task")
    demo.add_argument("--tasks", nargs="+", choices=list(TASKS),
                      help=f"the embedded models' tasks (default: {' '.join(DEMO_TASKS)}, those an embedded "
                           f"model was trained on)")
    demo.add_argument("--methods", nargs="+", choices=list(demo_variants()),
                      help=f"methods and named variants (default: those the model's attention admits, but "
                           f"{', '.join(DEMO_ON_REQUEST)}: one token per forward pass, minutes on a CPU)")
    demo.add_argument("--prompt-length", type=at_least(1), default=256,
                      help="retrieval tasks: the items of this length")
    demo.add_argument("--max-tokens", type=int, help="generation length (default: the task's, passkey, multikey "
                      "and the choice tasks 32, arith and trace 128)")
    demo.add_argument("--block-length", type=int, default=32, help=BLOCK_LENGTH_HELP)
    demo.add_argument("--batch-size", type=at_least(1), default=32, help="most requests decoded together")
    demo.set_defaults(func=cmd_demo)

    ev = sub.add_parser("eval", help="accuracy and speed of one method on a benchmark (torchrun: data-parallel)")
    add_model_args(ev)
    add_eval_args(ev)
    add_sampling_args(ev)
    ev.set_defaults(max_tokens=None)  # default: the task's (gsm8k 256, math500/humaneval/mbpp 512, embedded 128)
    ev.add_argument("--output", help="per-item results (.jsonl); the summary goes beside it as .summary.json")
    ev.set_defaults(func=cmd_eval)

    sweep = sub.add_parser("sweep", help="a grid of methods and knobs on one task: Pareto plot and table")
    add_model_args(sweep)
    add_eval_args(sweep)
    sweep.add_argument("--methods", nargs="+", required=True, choices=list(METHODS), help="the methods to compare")
    sweep.add_argument("--max-tokens", type=int, help="generation length (default: the task's)")
    sweep.add_argument("--block-length", type=int, default=32, help=BLOCK_LENGTH_HELP)
    sweep.add_argument("--temperature", type=float, default=0.0, help=TEMPERATURE_HELP)
    sweep.add_argument("--seed", type=int, default=0, help=SEED_HELP)
    values = sweep.add_argument_group("knob values (each varies only for the methods that read it)")
    for name, knob in knobs().items():
        values.add_argument("--" + name.replace("_", "-"), type=knob.type, nargs="+", metavar=name.upper(),
                            help=f"values to try: {knob.help} ({', '.join(knob.defaults)})")
    sweep.add_argument("--out-dir", default="sweep", help="sweep.png, sweep.md, sweep.json and points/*.jsonl")
    sweep.set_defaults(func=cmd_sweep)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_model_args(srv)
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to bind; 0.0.0.0 serves every interface (then set --api-key)")
    srv.add_argument("--port", type=port, default=8000, help="port to bind (0: any free one)")
    srv.add_argument("--max-batch", type=at_least(1), default=32, help="most requests decoded together")
    srv.add_argument("--max-queue", type=at_least(0), default=256, help="requests waiting beyond the batch before 429")
    srv.add_argument("--max-request-bytes", type=at_least(1),
                     help="the largest request body in bytes; a larger one gets a 413 before it is read (default: "
                          "4 MiB, a 131,072-token prompt at 32 bytes a token)")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    srv.add_argument("--served-model-name", help="the model's id in the API (default: the directory's name)")
    srv.add_argument("--data-parallel-size", type=at_least(1), default=1,
                     help="engine replicas behind this one HTTP front, each a process on GPUs of its own (times the "
                          "tensor-parallel size) or on the CPU; a request goes to the one with the fewest requests")
    srv.add_argument("--engine-process", action="store_true",
                     help="with one replica, run its engine loop in a process of its own as each data-parallel "
                          "replica's is, so that the HTTP front's Python work (parsing, tokenising, streaming) never "
                          "holds the GIL that the engine's steps need")
    srv.add_argument("--methods", nargs="+", choices=list(METHODS),
                     help="the methods the server runs (default: every one); a request for another gets a 400. The "
                          "start-up warms only these, and without elastic the KV cache keeps no room for per-layer "
                          "hidden states: about 1.5x the rows for LLaDA-8B in the same memory")
    srv.add_argument("--graph-batch-sizes", type=at_least(1), nargs="+",
                     help="batch sizes whose steady passes (Flash-Cache, dual-cache) the start-up captures as CUDA "
                          "graphs, for every width of the keys: a batch of another size runs them eagerly. Each "
                          "size adds about 20 graphs a method (~1.4 s) to the start-up (default: "
                          f"{' '.join(map(str, STEADY_BATCH_SIZES))}, those within --max-batch)")
    srv.add_argument("--step-trace", metavar="PATH",
                     help="write every engine step to PATH as a JSON line, from ready on: its wall and CPU seconds, "
                          "shape (method, batch size, query rows, routed rows) and load; with replicas one file "
                          "each (PATH.replica0 ...). For finding what made a step slow; off by default")
    add_sampling_args(srv)  # the defaults of the fields a request leaves out
    srv.set_defaults(func=cmd_serve)

    info = sub.add_parser("info", help="print a model's configuration, parameter count and KV bytes per token, "
                                       "in the dtype it would run in")
    add_model_choice(info)
    info.set_defaults(func=cmd_info)

    bench = sub.add_parser("bench", help="benchmarks against the roofline floor")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    forward = bench_sub.add_parser("forward", help="one full forward pass per batch size")
    add_model_args(forward, default_model="random:llada-8b")
    forward.add_argument("--batch-sizes", type=at_least(1), nargs="+", default=[1, 32], help="one row each")
    forward.add_argument("--length", type=at_least(1), default=512, help="sequence length")
    forward.add_argument("--block-length", type=int, default=32, help="LM-head rows of the engine's variant")
    forward.add_argument("--iters", type=at_least(1), default=10, help="timed passes")
    forward.set_defaults(func=cmd_bench)
    kernels = bench_sub.add_parser("kernels", help="each Triton kernel against its PyTorch path and cuBLAS / SDPA")
    add_model_args(kernels, default_model="random:llada-8b")
    kernels.set_defaults(func=cmd_bench)
    kernels.add_argument("--batch-sizes", type=at_least(1), nargs="+", default=[1, 32], help="requests per launch")
    kernels.add_argument("--rows", type=at_least(1), default=128, help="query rows per request")
    kernels.add_argument("--kv-length", type=at_least(1), default=768, help="cache positions per request")
    kernels.add_argument("--warmup", type=at_least(0), default=10, help="untimed calls per kernel first")
    kernels.add_argument("--iters", type=at_least(1), default=50, help="timed calls per kernel (median)")
    kernels.add_argument("--gemm-rows", type=at_least(1), nargs="+", default=[32, 144, 1760, 4646],
                         help="with --quantization: the FP8 GEMMs' row counts; on a mixture-of-experts model also "
                              "the router's and experts' (one table row each)")
    step = bench_sub.add_parser("step", help="one decoding iteration per method and batch size (forced schedule)")
    add_model_args(step, default_model="random:llada-8b")
    step.add_argument("--methods", nargs="+", choices=list(METHODS),
                      help="one row each (default: every method that runs on the model)")
    step.add_argument("--batch-sizes", type=at_least(1), nargs="+", default=[1, 8, 16, 32], help="one row each")
    step.add_argument("--prompt-length", type=at_least(1), default=256, help="random prompts' length in tokens")
    step.add_argument("--max-tokens", type=int, default=512, help="generation length")
    step.add_argument("--block-length", type=int,
                      help="every method's block length (default: each method's published setting: "
                           + ", ".join(f"{m.name} {m.published_block_length}" for m in METHODS.values()) + ")")
    step.add_argument("--warmup", type=at_least(0), default=8,
                      help="untimed iterations first (the first pass, then the sightings and capture of the steady "
                           "step's CUDA graph)")
    step.add_argument("--iters", type=at_least(1), default=64,
                      help="timed iterations; a multiple of the block lengths times each cache refresh at its rate")
    step.add_argument("--kv-routing", nargs="+", choices=["dense", *POLICIES],
                      help="each method with each of these prompt-KV routings (default: dense only)")
    step.add_argument("--kv-budget", type=float, help=f"with --kv-routing: the fraction of the prompt's keys a "
                      f"routed step reads, in (0, 1] (default {DEFAULT_KV_BUDGET})")
    step.set_defaults(func=cmd_bench)
    generate = bench_sub.add_parser("generate", help="end to end through LLM.generate: wall time per iteration, "
                                                     "tokens/s, NFE and tokens per step per method and batch size")
    add_model_args(generate, default_model="random:llada-8b")
    generate.set_defaults(func=cmd_bench)
    generate.add_argument("--methods", nargs="+", choices=list(METHODS),
                          help="one row each (default: every method that runs on the model)")
    generate.add_argument("--batch-sizes", type=at_least(1), nargs="+", default=[1, 32], help="one row each")
    generate.add_argument("--prompts", choices=["random", "tasks"],
                          help="random token ids (for random weights), or the embedded tasks' held-out items as chat "
                               "(for a trained model, which stops at once on random ids) (default: tasks when the "
                               "model has a tokenizer)")
    generate.add_argument("--prompt-length", type=at_least(1), help="random prompts' length in tokens (default 256)")
    generate.add_argument("--max-tokens", type=int, default=512, help="generation length")
    generate.add_argument("--block-length", type=int, help="every method's block length (default: its published one)")
    bserve = bench_sub.add_parser("serve", help="concurrent clients against a running server; checks every answer")
    bserve.add_argument("--url", default="http://127.0.0.1:8000", help="the server's address")
    bserve.add_argument("--clients", type=at_least(1), default=64, help="concurrent clients, one request at a time "
                                                                         "each")
    bserve.add_argument("--duration", type=float, default=60.0, help="seconds of timed load")
    bserve.add_argument("--prompts", choices=["tasks", "random"], default="tasks",
                        help="tasks: the embedded tasks' items as chat; random: token ids (a model without tokenizer)")
    bserve.add_argument("--num-prompts", type=at_least(1), default=64,
                        help="distinct prompts (prompt k is sent with seed k)")
    bserve.add_argument("--prompt-length", type=at_least(1), default=256, help="random prompts' length in tokens")
    bserve.add_argument("--method", help="request field (default: the server's)")
    bserve.add_argument("--max-tokens", type=int, help="request field (default: the server's)")
    bserve.add_argument("--temperature", type=float, help="request field (default: the server's)")
    bserve.add_argument("--fields", default="{}", help='other request fields as JSON, e.g. \'{"threshold": 0.8}\'')
    bserve.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (the server's --api-key)")
    bserve.add_argument("--mix", action="store_true", help="instead: a seeded mix of prompt lengths, max_tokens, methods "
                        "and routings arriving at --rate (Poisson); TTFT and end-to-end p50/p90/p99 per method, the "
                        "compiles and graph captures after ready")
    add_mix_args(bserve)
    bserve.set_defaults(func=cmd_bench_serve)
    bmix = bench_sub.add_parser("mix", help="bench serve --mix offline: the engine's loop with arrivals, after the "
                                            "server's warm-up")
    add_model_args(bmix, default_model="random:llada-8b")
    bmix.add_argument("--max-batch", type=at_least(1), default=32, help="most requests decoded together")
    bmix.add_argument("--no-warm-up-requests", action="store_true",
                      help="warm up as before issue 40: the KV cache and the synthetic passes' compiles only")
    bmix.add_argument("--capture-after-ready", action="store_true",
                      help="capture CUDA graphs during the mix too, as before issue 40 (serve captures none after "
                           "ready)")
    bmix.add_argument("--graph-batch-sizes", type=at_least(1), nargs="+",
                      help="as serve's: batch sizes whose steady passes the warm-up captures (default: "
                           f"{' '.join(map(str, STEADY_BATCH_SIZES))}, those within --max-batch)")
    add_mix_args(bmix)
    bmix.set_defaults(func=cmd_bench_mix)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0, 1 (some prompt failed), 2 (a usage or input error, one line), 130 (interrupted)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help, or a usage error already printed as one line
        return done.code
    try:
        return args.func(args) or 0
    except (ValueError, OSError, MissingExtra) as e:  # the user's input or setup: one line, no traceback
        print(f"flash-dllm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flash-dllm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
