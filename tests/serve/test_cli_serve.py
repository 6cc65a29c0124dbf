"""`flash-dllm serve` as a process, and `flash-dllm bench serve` against a server."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from flash_dllm.cli import main


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_process(*flags: str, polls: int = 300) -> tuple[subprocess.Popen, str]:
    """`flash-dllm serve --device cpu` with `flags` on a free port, and its URL once /health answers 200 (it listens
    while it starts: 503 "starting" until its warm-up request is done); polled every 0.1 s, `polls` times."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "flash_dllm.cli", "serve", "--device", "cpu", "--port", str(port),
                                *flags], stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    for _ in range(polls):
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.ConnectError:
            pass
        if process.poll() is not None:
            raise AssertionError(process.stderr.read())
        time.sleep(0.1)
    return process, url


def test_serve_command_answers_and_stops_on_sigint():
    process, url = serve_process("--max-tokens", "32", "--block-length", "8", "--method", "dual-cache",
                                 "--threshold", "0.8", "--max-request-bytes", "2000")
    try:
        models = httpx.get(url + "/v1/models").json()["data"]
        assert models[0]["id"] == "default" and models[0]["vocab_size"] > 0 and models[0]["max_model_len"] > 0
        body = httpx.post(url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "What is 3 + 4?"}]}).json()
        assert body["usage"]["completion_tokens"] <= 32 and body["choices"][0]["message"]["content"]
        too_large = httpx.post(url + "/v1/completions", json={"prompt": "word " * 500})
        assert too_large.status_code == 413 and "limit of 2000 bytes" in too_large.json()["error"]["message"]
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0


def test_health_is_starting_until_the_start_up_is_done(start_server, llm):
    """A server listens while it starts (KV cache, kernel compiles): /health is 503 "starting" and a completion is
    503 with Retry-After, then /health is 200 "ok" and the completion runs."""
    release = threading.Event()
    with start_server(llm, start_up=release.wait) as url, httpx.Client(base_url=url, timeout=60) as client:
        starting = client.get("/health")
        assert starting.status_code == 503 and starting.json() == {"status": "starting"}
        early = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8})
        assert early.status_code == 503 and early.headers["Retry-After"] == "5"
        assert "starting" in early.json()["error"]["message"]
        release.set()
        for _ in range(100):
            if (health := client.get("/health")).status_code == 200:
                break
            time.sleep(0.02)
        assert health.json() == {"status": "ok"}
        assert client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8}).status_code == 200


def test_serve_on_a_taken_port_is_one_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--device", "cpu", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"flash-dllm: error: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_serve_rejects_bad_defaults_in_one_line(capsys):
    assert main(["serve", "--device", "cpu", "--threshold", "1.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "threshold" in err


def test_serve_rejects_a_step_trace_without_its_folder(capsys, tmp_path):
    missing = tmp_path / "no" / "steps.jsonl"
    assert main(["serve", "--device", "cpu", "--step-trace", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"flash-dllm: error: --step-trace {missing}: the folder {missing.parent} does not exist"


def test_bench_serve(server, capsys):
    code = main(["bench", "serve", "--url", server, "--clients", "4", "--duration", "2", "--num-prompts", "4",
                 "--max-tokens", "32", "--fields", json.dumps({"method": "flash-cache"})])
    out = capsys.readouterr().out
    assert code == 0 and "| clients |" in out
    row = out.strip().splitlines()[-1].split("|")[1:-1]
    equal, compared = map(int, row[-1].split("/"))
    assert int(row[3]) == 0 and compared > 0 and equal == compared


def test_bench_serve_without_a_server(capsys):
    assert main(["bench", "serve", "--url", f"http://127.0.0.1:{free_port()}", "--duration", "1"]) == 2
    assert "no server answers" in capsys.readouterr().err


def test_the_start_up_captures_the_served_graph_batch_sizes(llm, monkeypatch):
    """`serve --graph-batch-sizes 1 2`: the start-up's `before_ready` gets them (and its methods)."""
    from flash_dllm.engine import warmup
    from flash_dllm.sampling_params import SamplingParams
    from flash_dllm.serve.api_server import start_up
    from flash_dllm.serve.protocol import ServerDefaults

    calls = []
    monkeypatch.setattr(warmup, "before_ready", lambda llm, **kwargs: calls.append(kwargs) or warmup.StartUpPhases())
    monkeypatch.setattr(warmup, "freeze_heap", lambda: None)
    params = SamplingParams(method="flash-cache", max_tokens=8, block_length=8)
    start_up(llm, ServerDefaults(params, methods=("flash-cache",), graph_batch_sizes=(1, 2)))
    assert calls == [dict(methods=("flash-cache",), block_length=8, graph_batch_sizes=(1, 2))]
    with pytest.raises(ValueError, match=r"graph_batch_sizes must be batch sizes >= 1, got \[0, 2\]"):
        ServerDefaults(params, graph_batch_sizes=(0, 2))
