"""Cold start (issue 15): process start to the first result of a cached method at batch 1, and a server's start to
/health ok and to its first cached answer, with an empty Triton cache (a fresh machine), then with the cache that
run filled (a later process). Random LLaDA-8B weights built on the device: no checkpoint.

    python benchmarks/cold_start.py --src src --baseline OLD_SRC --out DIR

Every run is a fresh `python -m flash_dllm.cli` process with PYTHONPATH=SRC and TRITON_CACHE_DIR a directory of its
own; --baseline runs the same against another source tree (the code before the change). --phases first times one
process phase by phase (imports, CUDA, weights, compile_kernels, the request), with an empty and then a warm cache.
Logs (stderr and stdout with seconds since the start) go to DIR; the markdown table is printed last. Runs that would
start after --budget-s are skipped (the device lease).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

PROMPT = list(range(200, 264))  # 64 token ids (the random model has no tokenizer)
DECODING = ["--max-tokens", "32", "--block-length", "32"]
MODEL = ["--model", "random:llada-8b"]


def python_path(src: Path) -> str:
    """PYTHONPATH with `src` first (and what it held: e.g. carried wheels)."""
    return os.pathsep.join(filter(None, [str(src.resolve()), os.environ.get("PYTHONPATH")]))


class Process:
    """A child process whose output lines are kept with their time since its start (and logged)."""

    def __init__(self, args: list[str], src: Path, cache: Path, log: Path):
        env = {**os.environ, "PYTHONPATH": python_path(src), "TRITON_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
        self.start = time.perf_counter()
        self.popen = subprocess.Popen([sys.executable, "-m", "flash_dllm.cli", *args], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: dict[str, list[tuple[float, str]]] = {"stdout": [], "stderr": []}
        self.log = log.open("w")
        self.readers = [threading.Thread(target=self._read, args=(name,), daemon=True) for name in self.lines]
        for reader in self.readers:
            reader.start()

    def _read(self, name: str):
        for line in getattr(self.popen, name):
            now = self.elapsed()
            self.lines[name].append((now, line.rstrip("\n")))
            self.log.write(f"{now:8.2f} {name} {line}")

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def wait(self, timeout: float) -> float:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        for reader in self.readers:
            reader.join(5)
        self.log.close()
        return self.elapsed()

    def compiled(self) -> str:
        """The warm-up's compile report: '<variants> variants in <s> s' (from its bar), or '-' if it said nothing."""
        err = "\r".join(line for _, line in self.lines["stderr"])
        bars = re.findall(r"(\d+)/(\d+) \[(\d+):(\d+)<", err)
        if "kernel variants (first run" not in err or not bars:
            return "-"
        _, total, minutes, seconds = bars[-1]
        return f"{total} variants in {int(minutes) * 60 + int(seconds)} s"


def generate(src: Path, cache: Path, log: Path) -> dict:
    prompts = log.with_suffix(".jsonl")
    prompts.write_text(json.dumps({"prompt_token_ids": PROMPT}) + "\n")
    p = Process(["generate", *MODEL, "--method", "dual-cache", *DECODING, "--no-progress",
                 "--json", "--file", str(prompts)], src, cache, log)
    wall = p.wait(timeout=240)
    first = p.lines["stdout"][0][0] if p.lines["stdout"] else None
    return {"first": first, "wall": wall, "code": p.popen.returncode, "compiled": p.compiled()}


def health(url: str) -> int | None:
    """/health's status code, or None while nothing listens."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def serve(src: Path, cache: Path, log: Path) -> dict:
    """The server with its default method (parallel, no KV cache), then one dual-cache request: the issue's case."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    p = Process(["serve", *MODEL, "--port", str(port), *DECODING], src, cache, log)
    listening = ready = answered = None
    while p.popen.poll() is None and p.elapsed() < 240:
        status = health(url)
        if status is not None and listening is None:
            listening = p.elapsed()
        if status == 200:
            ready = p.elapsed()
            break
        time.sleep(0.1)
    if ready is not None:
        body = json.dumps({"prompt": PROMPT, "max_tokens": 32, "method": "dual-cache"}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=240):
                answered = p.elapsed()
        except urllib.error.HTTPError as error:
            print(f"{log.name}: the completion answered {error.code}: {error.read()[:300]}", flush=True)
    p.popen.send_signal(signal.SIGINT)
    wall = p.wait(timeout=60)
    return {"listening": listening, "ready": ready, "answered": answered, "wall": wall, "code": p.popen.returncode,
            "compiled": p.compiled()}


def phases(cache: Path):
    """This process's time from its spawn to the first result, phase by phase (with TRITON_CACHE_DIR=cache), and
    which variants Triton compiled where (the parallel sweep's pool, or later on the main thread: the dry run
    missed them) and how many it loaded from the disk cache."""
    spawned = float(os.environ["COLD_START_SPAWN"])
    times = {"interpreter": time.time() - spawned}
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    mark = time.perf_counter()

    def phase(name: str):
        nonlocal mark
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        times[name], mark = time.perf_counter() - mark, time.perf_counter()

    import torch
    phase("import torch")
    import triton

    from flash_dllm import LLM, SamplingParams
    from flash_dllm.engine import warmup
    import flash_dllm.cli  # noqa: F401  (what the command imports)
    phase("import flash_dllm.cli")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.zeros(1, device=device)
    phase("CUDA init")
    import torch._dynamo  # noqa: F401  (building the model on the meta device imports it: its default inits)
    phase("import torch._dynamo")
    compiles = []
    triton.knobs.compilation.listener = lambda src, cache_hit, **_: compiles.append(
        (src.name, threading.current_thread().name.startswith("triton-compile"), cache_hit))
    llm = LLM(MODEL[1], device=device)
    phase("LLM (random weights)")
    parallel = warmup.compile_in_parallel

    def timed(passes):
        start = time.perf_counter()
        parallel(passes)
        times["  of which the parallel sweep"] = time.perf_counter() - start

    warmup.compile_in_parallel = timed
    llm.runner.allocate_cache(with_hidden=False)
    phase("allocate_cache (compile_kernels)")
    llm.generate([PROMPT], SamplingParams(method="dual-cache", max_tokens=32, block_length=32), use_tqdm=False)
    phase("generate (dual-cache, 32 tokens)")
    times["total"] = time.time() - spawned
    kernels: dict[str, list[int]] = {}
    for name, in_pool, _ in compiles:
        kernels.setdefault(name, [0, 0])[0 if in_pool else 1] += 1
    print(json.dumps({"seconds": {k: round(v, 2) for k, v in times.items()}, "threads": warmup.COMPILE_THREADS,
                      "variants compiled in the pool / later": kernels,
                      "loaded from the disk cache": sum(hit for *_, hit in compiles)}), flush=True)


def slowest_imports(stderr: str, count: int = 12) -> list[str]:
    """-X importtime's `count` slowest imports by cumulative time, up to two levels deep."""
    rows = []
    for line in stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[1].strip().isdigit() and len(parts[2]) - len(parts[2].lstrip()) <= 3:
            rows.append((int(parts[1]), parts[2].strip()))
    return [f"{us / 1e6:.2f} s {name}" for us, name in sorted(rows, reverse=True)[:count]]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", type=Path, default=Path("src"))
    parser.add_argument("--baseline", type=Path, help="the source tree before the change")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=420)
    parser.add_argument("--model", default=MODEL[1], help="a checkpoint directory for a trial on the CPU")
    parser.add_argument("--phases", action="store_true", help="first, a process's phases, empty and warm cache")
    parser.add_argument("--phases-here", type=Path, help=argparse.SUPPRESS)  # that process's Triton cache
    args = parser.parse_args()
    MODEL[1] = args.model
    if args.phases_here:
        return phases(args.phases_here)
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    if args.phases:
        cache = Path("/tmp/cold_start_triton/phases")
        shutil.rmtree(cache, ignore_errors=True)
        for state in ("empty", "warm"):
            env = {**os.environ, "PYTHONPATH": python_path(args.src), "COLD_START_SPAWN": repr(time.time())}
            done = subprocess.run([sys.executable, "-X", "importtime", __file__, "--out", str(args.out), "--model",
                                   args.model, "--phases-here", str(cache)], env=env, timeout=240, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            (args.out / f"phases-{state}.err").write_text(done.stderr)
            print(f"phases, {state} cache: {done.stdout.strip()}", flush=True)
            print(f"  slowest imports: {'; '.join(slowest_imports(done.stderr))}", flush=True)
    trees = [("new", args.src)] + ([("old", args.baseline)] if args.baseline else [])
    rows = []
    for code, src in trees:
        where = subprocess.run([sys.executable, "-c", "import flash_dllm; print(flash_dllm.__file__)"], text=True,
                               capture_output=True, env={**os.environ, "PYTHONPATH": python_path(src)}).stdout
        print(f"{code}: flash_dllm from {where.strip()}", flush=True)
        for kind, run in (("generate", generate), ("serve", serve)):
            cache = Path(f"/tmp/cold_start_triton/{code}-{kind}")
            shutil.rmtree(cache, ignore_errors=True)  # empty: a fresh machine
            # the old server's second start adds nothing to the case (its first cached request compiles)
            for state in ("empty",) if (code, kind) == ("old", "serve") else ("empty", "warm"):
                if time.perf_counter() - began > args.budget_s:
                    print(f"skipped {code} {kind} ({state} cache): over the budget", flush=True)
                    continue
                result = run(src, cache, args.out / f"{code}-{kind}-{state}.log")
                print(code, kind, state, json.dumps(result), flush=True)
                rows.append((code, kind, state, result))
    seconds = lambda value: "-" if value is None else f"{value:.1f}"
    print("\n| code | run | Triton cache | first result (s) | /health answers / ok (s) | process (s) | compile |")
    print("|---|---|---|---|---|---|---|")
    for code, kind, state, r in rows:
        first = r["first"] if kind == "generate" else r["answered"]
        health_s = "-" if kind == "generate" else f"{seconds(r['listening'])} / {seconds(r['ready'])}"
        print(f"| {code} | {kind} | {state} | {seconds(first)} | {health_s} | {r['wall']:.1f} (exit {r['code']}) | "
              f"{r['compiled']} |")

if __name__ == "__main__":
    main()
