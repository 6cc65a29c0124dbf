"""Data-parallel serving: `flash-dllm serve --data-parallel-size 2` on the CPU, as a process with two replica
processes (spawned once for the module), against the one-replica server of conftest."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import time

import httpx
import pytest

from flash_dllm import SamplingParams
from flash_dllm.cli import main
from flash_dllm.serve import replicas as replicas_module
from flash_dllm.serve.async_engine import Failed, Request
from flash_dllm.serve.replicas import ReplicaPool, replica_devices, replica_trace_path

from .test_api_server import MESSAGES, PROGRAM, QUESTION, SLOW, metric, stream_events
from .test_cli_serve import free_port, serve_process

# The conftest server's defaults, given in each request (the replicas' defaults are the command's).
FIELDS = {"max_tokens": 32, "block_length": 8, "return_token_ids": True}
# Long enough to be running when its replica is killed, short enough for the other replica to finish soon.
RUNNING = {"method": "reference", "remasking": "random", "max_tokens": 48, "block_length": 48, "steps": 48}


@pytest.fixture(scope="module")
def dp_server():
    # 503 "starting" until both replicas have run their warm-up request
    process, url = serve_process("--data-parallel-size", "2", "--max-batch", "8", "--kv-cache-bytes", str(2**27),
                                 "--max-tokens", "32", "--block-length", "8", polls=1200)
    try:
        yield url, process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def pids(url: str) -> list[int]:
    return [replica["pid"] for replica in httpx.get(url + "/health").json()["replicas"]]


def until(condition, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def in_flight(url: str) -> list[int]:
    return [replica["requests"] for replica in httpx.get(url + "/health").json()["replicas"]]


def test_health_reports_each_replica(dp_server):
    url, _ = dp_server
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok"
    replicas = [(r["replica"], r["status"], r["devices"], r["requests"]) for r in health["replicas"]]
    assert replicas == [(0, "ok", "cpu", 0), (1, "ok", "cpu", 0)]


def test_answers_equal_one_replicas_for_the_same_seeds(dp_server, server):
    """Six prompts of one request go to both replicas (three each: the fewest in flight, ties to the lowest index);
    every answer equals the one-replica server's."""
    url, _ = dp_server
    prompts = [QUESTION, PROGRAM, "Once upon a time", "2 + 3 =", "def f(x):", "The capital of France"]
    bodies = [("/v1/completions", {"prompt": prompts, "seed": 7, "temperature": 0.8, **FIELDS}),
              ("/v1/completions", {"prompt": [QUESTION, PROGRAM], "method": "flash-cache", "threshold": 0.8, **FIELDS}),
              ("/v1/chat/completions", {"messages": MESSAGES, "seed": 3, "temperature": 0.5, **FIELDS})]
    with httpx.Client(base_url=url, timeout=120) as dp, httpx.Client(base_url=server, timeout=120) as one:
        before = [metric(dp, f'flash_dllm_requests_total{{outcome="length",replica="{r}"}}') +
                  metric(dp, f'flash_dllm_requests_total{{outcome="stop",replica="{r}"}}') for r in (0, 1)]
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: dp.post(*b[:1], json=b[1]), bodies))
        for (path, body), answer in zip(bodies, answers):
            assert answer.status_code == 200, answer.text
            expected = one.post(path, json=body).json()["choices"]
            assert answer.json()["choices"] == expected
        after = [metric(dp, f'flash_dllm_requests_total{{outcome="length",replica="{r}"}}') +
                 metric(dp, f'flash_dllm_requests_total{{outcome="stop",replica="{r}"}}') for r in (0, 1)]
    served = [a - b for a, b in zip(after, before)]
    assert sum(served) == 9 and min(served) >= 3
    # Streaming: the final prefixes come back from the replicas as they grow.
    body = {"prompt": [QUESTION, PROGRAM], "max_tokens": 64}
    with httpx.Client(base_url=url, timeout=120) as dp:
        full = [c["text"] for c in dp.post("/v1/completions", json=body).json()["choices"]]
        chunks = stream_events(dp, "/v1/completions", body)
    assert ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in (0, 1)] == full


def test_an_abort_reaches_the_replica_that_holds_the_request(dp_server):
    url, _ = dp_server
    with httpx.Client(base_url=url, timeout=30) as client:
        aborted = [f'flash_dllm_requests_total{{outcome="abort",replica="{r}"}}' for r in (0, 1)]
        before = [metric(client, name) for name in aborted]
        with pytest.raises(httpx.ReadTimeout):  # an idle server: replica 0 takes it
            client.post("/v1/completions", json={"prompt": QUESTION, **SLOW}, timeout=1.0)
        until(lambda: metric(client, aborted[0]) == before[0] + 1)
        assert metric(client, aborted[1]) == before[1]
        assert in_flight(url) == [0, 0] and metric(client, 'flash_dllm_requests_running{replica="0"}') == 0


def test_a_killed_replica_fails_its_requests_and_the_other_serves_on(dp_server):
    url, _ = dp_server
    with concurrent.futures.ThreadPoolExecutor(2) as pool, httpx.Client(base_url=url, timeout=120) as client:
        post = lambda: httpx.post(url + "/v1/completions", json={"prompt": QUESTION, **RUNNING}, timeout=120)
        first = pool.submit(post)
        until(lambda: in_flight(url) == [1, 0])
        second = pool.submit(post)
        until(lambda: in_flight(url) == [1, 1])
        os.kill(pids(url)[0], signal.SIGKILL)
        failed = first.result()
        assert failed.status_code == 503
        assert failed.json()["error"]["message"] == "replica 0 stopped (killed by SIGKILL) while this request ran there"
        assert second.result().status_code == 200 and second.result().json()["choices"][0]["finish_reason"]
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        dead, live = health.json()["replicas"]
        assert (dead["status"], dead["error"], live["status"]) == ("dead", "killed by SIGKILL", "ok")
        assert metric(client, 'flash_dllm_replica_up{replica="0"}') == 0
        assert metric(client, 'flash_dllm_replica_up{replica="1"}') == 1
        for _ in range(2):  # new requests go to the live replica only
            assert client.post("/v1/completions", json={"prompt": PROGRAM, **FIELDS}).status_code == 200


def test_sigint_stops_the_server_and_its_replicas(dp_server):
    url, process = dp_server
    live = [replica["pid"] for replica in httpx.get(url + "/health").json()["replicas"] if replica["status"] == "ok"]
    assert live
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 0
    for pid in live:  # joined by the server: gone, not orphaned
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_replica_that_fails_to_start_stops_the_server(capsys):
    assert main(["serve", "--device", "cpu", "--port", str(free_port()), "--data-parallel-size", "2",
                 "--kv-cache-bytes", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("flash-dllm: error: replica ") and "failed to start: ValueError: kv_cache_bytes" in err


def test_data_parallel_size_is_checked_in_one_line(capsys, monkeypatch):
    assert main(["serve", "--device", "cpu", "--data-parallel-size", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--data-parallel-size" in err and "at least 1" in err

    assert replica_devices(3, "cpu") == [None] * 3
    monkeypatch.setattr(replicas_module, "resolve_device", lambda device: __import__("torch").device(device or "cuda"))
    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert replica_devices(2, None, tensor_parallel_size=2) == ["0,1", "2,3"]
    assert replica_devices(4, "cuda") == ["0", "1", "2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert replica_devices(2, "cuda", tensor_parallel_size=2) == ["4,5", "6,7"]
    with pytest.raises(ValueError, match=r"^--data-parallel-size must be between 1 and 2 here: 3 replicas x 2 GPU"):
        replica_devices(3, "cuda", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"^--data-parallel-size cannot be met: 2 replicas x 8 GPU\(s\) each need 16"):
        replica_devices(2, "cuda", tensor_parallel_size=8)
    with pytest.raises(ValueError, match="--device cuda:1 names one GPU"):
        replica_devices(2, "cuda:1")
    assert replica_devices(1, "cuda:1") == ["5"]  # --engine-process on a named GPU: the visible one it names


def test_engine_process_serves_from_a_process_of_its_own(server):
    """`serve --engine-process`: one replica whose engine loop runs in a process of its own answers as the
    in-process server does, and stops with the server."""
    process, url = serve_process("--engine-process", "--max-batch", "8", "--kv-cache-bytes", str(2**27),
                                 "--max-tokens", "32", "--block-length", "8", polls=1200)
    try:
        (replica,) = httpx.get(url + "/health").json()["replicas"]
        assert replica["status"] == "ok" and replica["pid"] != process.pid
        body = {"prompt": [QUESTION, PROGRAM], "seed": 7, "temperature": 0.8, **FIELDS}
        with httpx.Client(timeout=120) as client:
            answer = client.post(url + "/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"] == client.post(server + "/v1/completions", json=body).json()["choices"]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        with pytest.raises(ProcessLookupError):
            os.kill(replica["pid"], 0)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_routing_takes_the_fewest_in_flight_and_skips_stopped_replicas():
    pool = ReplicaPool(lambda: None, None, [None] * 3, max_batch_size=4)
    assert pool.max_batch_size == 12
    for replica, status, load in zip(pool.replicas, ["ok", "ok", "ok"], [2, 1, 1]):
        replica.status, replica.requests = status, dict.fromkeys(range(load))
    assert pool._route().index == 1  # ties: the lowest index
    pool.replicas[1].status = "dead"
    assert pool._route().index == 2
    for replica in pool.replicas:
        replica.status = "dead"
    assert pool.health()["status"] == "stopped" and not pool.is_alive()

    async def submit():
        request = Request([5, 6], SamplingParams(max_tokens=8, block_length=8), stream=False)
        return await pool.submit([request])

    assert asyncio.run(submit()) == [Failed("no replica is alive", 503)]


def test_replica_trace_paths():
    assert replica_trace_path(None, 0, 2) is None
    assert replica_trace_path("out/steps.jsonl", 0, 1) == "out/steps.jsonl"
    assert replica_trace_path("out/steps.jsonl", 1, 2) == "out/steps.replica1.jsonl"
