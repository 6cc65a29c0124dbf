"""What a request may be before the server reads or tokenises it (issue 54): the body's size (413, never read whole),
its Content-Type (415), a prompt's length in characters (400 without tokenising), and tokenising off the event loop."""
from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import threading
from urllib.parse import urlsplit

import httpx
import pytest

from flash_dllm import SamplingParams
from flash_dllm.serve.api_server import MAX_REQUEST_BYTES, ServeConfig, max_prompt_chars
from flash_dllm.serve.protocol import ServerDefaults

BODY = json.dumps({"prompt": "What is 3 + 4?", "max_tokens": 8}).encode()
MESSAGES = [{"role": "user", "content": "What is 3 + 4?"}]


def raw_request(url: str, head: str) -> socket.socket:
    """A connection that has sent a POST's request line and headers (`head`), and no body yet."""
    where = urlsplit(url)
    sock = socket.create_connection((where.hostname, where.port), timeout=10)  # the answer may not wait for the body
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {where.netloc}\r\n"
                 f"Content-Type: application/json\r\n{head}\r\n".encode())
    return sock


def response_of(sock: socket.socket) -> tuple[int, str]:
    """The status and error message of the response the server sends on `sock`."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or pytest.fail(f"the server closed the connection: {data!r}")
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
    while len(body) < length:
        body += sock.recv(65536) or pytest.fail("the server closed the connection mid-response")
    return int(head.split()[1]), json.loads(body)["error"]["message"]


def test_a_body_over_the_default_limit_is_413_before_it_is_sent(llm, start_server):
    """The issue's 20 MB body: refused from its Content-Length, not after reading (and tokenising) it."""
    with start_server(llm) as url:
        with raw_request(url, "Content-Length: 20000000\r\n") as sock:
            status, message = response_of(sock)
            assert httpx.get(url + "/health", timeout=1).json() == {"status": "ok"}
        assert status == 413 and message == (f"the request body of 20000000 bytes is over the server's limit of "
                                              f"{MAX_REQUEST_BYTES} bytes (--max-request-bytes)")


def test_a_chunked_body_over_the_limit_is_413_before_it_ends(llm, start_server):
    with start_server(llm, max_request_bytes=1000) as url:
        with raw_request(url, "Transfer-Encoding: chunked\r\n") as sock:
            chunk = b"%x\r\n%s\r\n" % (600, b" " * 600)
            sock.sendall(chunk)  # the server waits for the rest, and serves others meanwhile
            assert httpx.get(url + "/health", timeout=1).json() == {"status": "ok"}
            sock.sendall(chunk)  # 1,200 bytes, and no last chunk: the body never ends
            status, message = response_of(sock)
        assert status == 413 and message == "the request body is over the server's limit of 1000 bytes " \
                                            "(--max-request-bytes)"


def test_a_body_at_the_limit_is_served_and_a_byte_more_is_413(llm, start_server):
    json_type = {"content-type": "application/json"}
    with start_server(llm, max_request_bytes=len(BODY)) as url, httpx.Client(base_url=url, timeout=120) as client:
        for send in (lambda body: body, lambda body: iter([body[:10], body[10:]])):  # Content-Length, then chunked
            served = client.post("/v1/completions", content=send(BODY), headers=json_type)
            assert served.status_code == 200 and served.json()["choices"][0]["finish_reason"] in ("stop", "length")
            refused = client.post("/v1/completions", content=send(BODY + b" "), headers=json_type)
            assert refused.status_code == 413 and f"limit of {len(BODY)} bytes" in refused.json()["error"]["message"]
        assert client.get("/health").json() == {"status": "ok"}
    with pytest.raises(ValueError, match="max_request_bytes must be >= 1, got 0"):
        ServeConfig(model_name="embedded", defaults=ServerDefaults(SamplingParams()), max_request_bytes=0)


def test_health_answers_while_a_prompt_is_tokenised(llm, start_server, monkeypatch):
    """Tokenising runs on a worker thread: an encode that blocks until released leaves /health answering."""
    entered, release = threading.Event(), threading.Event()
    encode = llm.encode

    def blocked_encode(*args, **kwargs):
        entered.set()
        release.wait(timeout=60)
        return encode(*args, **kwargs)

    monkeypatch.setattr(llm, "encode", blocked_encode)
    with start_server(llm) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
        for path, body in [("/v1/completions", {"prompt": "What is 3 + 4?", "max_tokens": 8}),
                           ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8})]:
            entered.clear()
            release.clear()
            answer = pool.submit(httpx.post, url + path, json=body, timeout=120)
            try:
                assert entered.wait(timeout=60), "the request never reached encode"
                assert httpx.get(url + "/health", timeout=1).json() == {"status": "ok"}
            finally:
                release.set()
            assert answer.result().status_code == 200


def test_echo_decodes_a_token_id_prompt_off_the_event_loop_too(llm, start_server):
    ids = llm.encode("What is 3 + 4?", chat_template=False)
    with start_server(llm) as url, httpx.Client(base_url=url, timeout=120) as client:
        for prompt, text in ((ids, llm.decode(ids)), ("What is 3 + 4?", "What is 3 + 4?")):
            body = client.post("/v1/completions", json={"prompt": prompt, "echo": True, "max_tokens": 8}).json()
            assert body["choices"][0]["text"].startswith(text)


def test_a_prompt_longer_than_the_context_can_hold_is_400_without_tokenising(llm, start_server, monkeypatch):
    most = max_prompt_chars(llm.tokenizer, llm.config.max_position)
    assert most == 8192 * 19 * 4  # the embedded tokenizer's longest entry: "<|start_header_id|>"
    encoded = []
    monkeypatch.setattr(llm, "encode", lambda *args, **kwargs: encoded.append(args) or [5, 6])
    expected = (f"the prompt is {most + 1} characters: more than the model's context of 8192 tokens can hold "
                f"(at most {most} characters)")
    long = "a" * (most + 1)
    with start_server(llm) as url, httpx.Client(base_url=url, timeout=120) as client:
        for path, body, where, encodes in [
                ("/v1/completions", {"prompt": long}, "", []),
                ("/v1/completions", {"prompt": ["What is 3 + 4?", long]}, "prompt 1: ", ["What is 3 + 4?"]),
                ("/v1/chat/completions", {"messages": [{"role": "system", "content": long[:10]},
                                                       {"role": "user", "content": long[10:]}]}, "", [])]:
            encoded.clear()
            response = client.post(path, json=body)
            assert response.status_code == 400 and response.json()["error"]["message"] == where + expected
            assert [args[0] for args in encoded] == encodes


def not_json(body: bytes) -> list[tuple[dict, str]]:
    """httpx.post's arguments that send `body` (or a form) as something other than JSON, and the error's end."""
    return [({"content": body, "headers": {"content-type": "text/plain; charset=utf-8"}}, "got 'text/plain'"),
            ({"data": {"prompt": "What is 3 + 4?"}}, "got 'application/x-www-form-urlencoded'"),
            ({"files": {"prompt": b"What is 3 + 4?"}}, "got 'multipart/form-data'"),
            ({"content": body}, "the request has none")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_that_is_not_json_is_415_naming_its_content_type(llm, start_server, path):
    body = BODY if path == "/v1/completions" else json.dumps({"messages": MESSAGES, "max_tokens": 8}).encode()
    with start_server(llm) as url, httpx.Client(base_url=url, timeout=120) as client:
        for send, sent in not_json(body):
            response = client.post(path, **send)
            assert response.status_code == 415, response.text
            assert response.json()["error"]["message"] == "Content-Type must be application/json; " + sent
        served = client.post(path, content=body, headers={"content-type": "Application/JSON; charset=utf-8"})
        assert served.status_code == 200, served.text


def test_a_blank_chat_message_is_400_naming_it(llm, start_server):
    """The rule of LLM.encode (an empty or whitespace prompt fails alone) holds for each chat message."""
    with start_server(llm) as url, httpx.Client(base_url=url, timeout=120) as client:
        blank = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "   "}]})
        assert blank.status_code == 400
        assert "message 0" in blank.json()["error"]["message"] and "whitespace" in blank.json()["error"]["message"]
        empty = client.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "Be brief."},
                                                                       {"role": "user", "content": ""}]})
        assert empty.status_code == 400
        assert "message 1" in empty.json()["error"]["message"] and "empty" in empty.json()["error"]["message"]
