"""A real server on a loopback port, in a thread of the test process."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from flash_dllm import LLM, SamplingParams
from flash_dllm.serve.api_server import ServeConfig, build_app
from flash_dllm.serve.protocol import ServerDefaults

DEFAULTS = ServerDefaults(SamplingParams(method="parallel", max_tokens=32, block_length=8))


@contextlib.contextmanager
def running_server(llm: LLM, **options):
    """A server for `llm`, as soon as it listens (options: ServeConfig's fields, defaults, start_up)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start_up = options.pop("start_up", None)
    config = ServeConfig(model_name="embedded", defaults=options.pop("defaults", DEFAULTS), **options)
    server = uvicorn.Server(uvicorn.Config(build_app(llm, config, start_up), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="session")
def start_server():
    """running_server, for tests that need a server of their own (a small queue, cache or an API key)."""
    return running_server


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", max_batch_size=8)


@pytest.fixture(scope="module")
def server(llm):
    with running_server(llm) as url:
        yield url


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server, timeout=120) as client:
        yield client
