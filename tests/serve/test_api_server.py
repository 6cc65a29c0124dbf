"""The OpenAI-compatible server, tested over a loopback port with httpx and the official openai client."""
from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import openai
import pytest

from flash_dllm import LLM, SamplingParams
from flash_dllm.cache import KVCache

# Completion prompts are raw text: the embedded model's chat template written out.
TEMPLATE = ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")
QUESTION_TEXT = "Tom has 3 apples. Anna has 4 more apples than Tom. How many apples does Anna have?"
QUESTION = TEMPLATE.format(QUESTION_TEXT)
PROGRAM = TEMPLATE.format("What does this program print?\na = 2\na = a * 3\nfor x in range(3):\n"
                          "    a = a + x\nprint(a)")
# A request that runs for seconds: one token per step in random order, and done only when every position
# before the first eos is decoded.
SLOW = {"method": "reference", "remasking": "random", "max_tokens": 512, "block_length": 512, "steps": 512}
MESSAGES = [{"role": "user", "content": QUESTION_TEXT}]


@pytest.fixture(scope="module")
def offline():
    """A second LLM for expected outputs: the server's engine belongs to its own thread."""
    return LLM(device="cpu", dtype="float32")


def expected(offline: LLM, prompt, **fields) -> str:
    params = SamplingParams(**{"method": "parallel", "max_tokens": 32, "block_length": 8, **fields})
    ids = offline.tokenizer.encode(prompt) if isinstance(prompt, str) else offline.encode(prompt)
    return offline.generate([ids], params, use_tqdm=False)[0].text


def stream_events(client: httpx.Client, path: str, body: dict) -> list:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_completion_equals_offline_generate(client, offline):
    body = client.post("/v1/completions", json={"model": "embedded", "prompt": QUESTION}).json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and choice["finish_reason"] in ("stop", "length")
    assert choice["text"] == expected(offline, QUESTION)
    assert body["usage"]["prompt_tokens"] == len(offline.tokenizer.encode(QUESTION))


def test_chat_uses_the_chat_template(client, offline):
    body = client.post("/v1/chat/completions", json={"messages": MESSAGES}).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected(offline, MESSAGES)}
    assert body["usage"]["prompt_tokens"] == len(offline.tokenizer.encode(QUESTION))


def test_method_and_knobs_are_request_fields(client, offline):
    fields = {"method": "flash-cache", "tracking_budget": 4, "mask_window": 8, "threshold": 0.7}
    body = client.post("/v1/completions", json={"prompt": PROGRAM, **fields}).json()
    assert body["choices"][0]["text"] == expected(offline, PROGRAM, **fields)
    error = client.post("/v1/completions", json={"prompt": PROGRAM, "method": "parallel", "tracking_budget": 4})
    assert error.status_code == 400 and "tracking_budget applies to method" in error.json()["error"]["message"]


def test_several_prompts_in_one_completion(client, offline):
    body = client.post("/v1/completions", json={"prompt": [QUESTION, PROGRAM], "seed": 3}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == [expected(offline, QUESTION, seed=3),
                                                    expected(offline, PROGRAM, seed=3)]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_is_in_order_and_equals_the_full_text(client, path):
    body = {"prompt": QUESTION} if path == "/v1/completions" else {"messages": MESSAGES}
    body["max_tokens"] = 64
    full = client.post(path, json=body).json()["choices"][0]
    chunks = stream_events(client, path, body)
    if path == "/v1/completions":
        pieces = [c["choices"][0]["text"] for c in chunks]
        text = full["text"]
    else:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
        text = full["message"]["content"]
    assert "".join(pieces) == text
    assert sum(bool(p) for p in pieces) >= 2, "the text should arrive in several chunks"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == full["finish_reason"]


def test_stop_strings_cut_streamed_and_full_text_alike(client):
    body = {"prompt": QUESTION, "max_tokens": 64}
    text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = text.split()[2]
    cut = client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == text[:text.index(stop)] and cut["finish_reason"] == "stop"
    chunks = stream_events(client, "/v1/completions", {**body, "stop": stop})
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut["text"]


def test_stream_usage_and_token_ids(client):
    chunks = stream_events(client, "/v1/completions", {"prompt": QUESTION, "return_token_ids": True,
                                                       "stream_options": {"include_usage": True}})
    usage = chunks[-1]["usage"]
    ids = [i for c in chunks[:-1] for i in c["choices"][0]["token_ids"]]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == len(ids) and usage["nfe"] > 0


def test_openai_client(server, offline):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["embedded"]
    completion = client.completions.create(model="embedded", prompt=QUESTION, max_tokens=32)
    assert completion.choices[0].text == expected(offline, QUESTION)
    messages = MESSAGES
    chat = client.chat.completions.create(model="embedded", messages=messages, max_tokens=32,
                                          extra_body={"method": "dual-cache"})
    assert chat.choices[0].message.content == expected(offline, messages, method="dual-cache")
    stream = client.chat.completions.create(model="embedded", messages=messages, max_tokens=32, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == expected(offline, messages)
    with pytest.raises(openai.BadRequestError, match="threshold"):
        client.completions.create(model="embedded", prompt=QUESTION, extra_body={"threshold": float("-1")})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=QUESTION)


def test_max_tokens_need_not_be_a_multiple_of_block_length(server, offline):
    """An OpenAI client's max_tokens=50 with blocks of 32: the last block holds the remaining 18."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    completion = client.completions.create(model="embedded", prompt=QUESTION, max_tokens=50,
                                           extra_body={"block_length": 32})
    assert completion.choices[0].text == expected(offline, QUESTION, max_tokens=50, block_length=32)
    assert completion.usage.completion_tokens <= 50


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", "not valid JSON"),
    ("/v1/completions", {"prompt": QUESTION, "max_tokens": "32"}, "max_tokens"),
    ("/v1/completions", {"prompt": QUESTION, "max_tokens": 32.0}, "max_tokens"),
    ("/v1/completions", {"prompt": QUESTION, "max_tokens": -8}, "max_tokens must be positive"),
    ("/v1/completions", {"prompt": QUESTION, "temperature": -1.0}, "temperature"),
    ("/v1/completions", {"prompt": QUESTION, "seed": 2 ** 64}, "seed"),
    ("/v1/completions", {"prompt": QUESTION, "threshold": "high"}, "threshold"),
    ("/v1/completions", {"prompt": QUESTION, "method": "nope"}, "unknown method 'nope'"),
    ("/v1/completions", {"prompt": QUESTION, "typical_p": 0.5}, "unknown field 'typical_p'"),
    ("/v1/completions", {"prompt": QUESTION, "top_k": 5}, "top_k applies to method dream, not 'parallel'"),
    ("/v1/completions", {"prompt": QUESTION, "top_p": 0.5}, "top_p applies to method dream, not 'parallel'"),
    ("/v1/completions", {"prompt": QUESTION, "method": "dream", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": QUESTION, "n": 2}, "n=2 is not supported"),
    ("/v1/completions", {"prompt": QUESTION, "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"prompt": ""}, "the prompt is empty"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [5, 10 ** 9]}, "outside the vocabulary"),
    ("/v1/completions", {"prompt": [QUESTION, ""]}, "prompt 1: the prompt is empty"),
    ("/v1/completions", {"prompt": 42}, "prompt"),
    ("/v1/completions", b'{"prompt": "\\ud800"}', "not valid UTF-8"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "not valid UTF-8"),
    ("/v1/completions", {"max_tokens": 32}, "prompt"),
    ("/v1/completions", {"prompt": [5] * 9000}, "exceed the model's context"),  # context: 8,192
    ("/v1/chat/completions", {"messages": []}, "messages is empty"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "content"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
]


def test_bad_requests_are_400_while_a_good_one_completes(server, offline):
    """Every bad input is a 400 naming the culprit; a streaming request running meanwhile is undisturbed."""
    good: dict = {}

    def run_good():
        with httpx.Client(base_url=server, timeout=120) as client:
            good["chunks"] = stream_events(client, "/v1/completions", {"prompt": PROGRAM, "max_tokens": 64})

    thread = threading.Thread(target=run_good)
    thread.start()
    with httpx.Client(base_url=server, timeout=120) as client:
        for path, body, message in BAD_REQUESTS:
            response = (client.post(path, content=body, headers={"content-type": "application/json"})
                        if isinstance(body, bytes) else client.post(path, json=body))
            assert response.status_code == 400, (body, response.text)
            assert message in response.json()["error"]["message"], (body, response.text)
        assert client.get("/health").json() == {"status": "ok"}
    thread.join()
    text = "".join(c["choices"][0]["text"] for c in good["chunks"])
    assert text == expected(offline, PROGRAM, max_tokens=64)


ABORTED = 'flash_dllm_requests_total{outcome="abort"}'


def metric(client: httpx.Client, line: str) -> float:
    return float(next(row for row in client.get("/metrics").text.splitlines() if row.startswith(line + " ")).split()[1])


def aborted_after(client: httpx.Client, before: float) -> float:
    """The abort count once it has moved past `before` (within 5 s)."""
    for _ in range(100):
        if metric(client, ABORTED) > before:
            break
        threading.Event().wait(0.05)
    return metric(client, ABORTED)


def test_disconnect_mid_stream_frees_the_rows(server, client, offline):
    before = metric(client, ABORTED)
    with httpx.Client(base_url=server, timeout=120) as first:
        with first.stream("POST", "/v1/completions", json={"prompt": QUESTION, **SLOW, "stream": True}):
            pass  # the headers arrived, so the request runs; then the client goes away
    # The abandoned request is aborted rather than run to its end, and the next one completes normally.
    assert aborted_after(client, before) == before + 1
    assert client.post("/v1/completions", json={"prompt": PROGRAM}).json()["choices"][0]["text"] == \
        expected(offline, PROGRAM)
    assert metric(client, "flash_dllm_requests_running") == 0


def test_metrics(client):
    client.post("/v1/completions", json={"prompt": QUESTION, "method": "flash-cache"})
    text = client.get("/metrics").text
    for name in ("requests_total", "requests_waiting", "tokens_per_second", "nfe_total", "tokens_per_step",
                 "kv_cache_usage_ratio", "kv_cache_compactions_total", "kv_cache_rows_moved_total",
                 "generated_tokens_total", "start_up_seconds",
                 "kernel_compiles_after_ready_total", "kernel_compile_seconds_after_ready_total",
                 "graph_captures_after_ready_total", "graph_capture_seconds_after_ready_total",
                 "gc_collections_after_ready_total", "gc_collection_seconds_after_ready_total", "step_seconds_max",
                 "step_seconds_max_ratio", "step_seconds_max_ratio_steps"):
        assert f"# TYPE flash_dllm_{name} " in text
    # the CPU's PyTorch path compiles and captures nothing; its steps were timed
    assert metric(client, "flash_dllm_graph_captures_after_ready_total") == 0
    assert metric(client, "flash_dllm_kv_cache_compactions_total") == 0  # one request: no holes
    assert metric(client, "flash_dllm_step_seconds_max") > 0 and metric(client, "flash_dllm_step_seconds_max_ratio") >= 1
    assert metric(client, "flash_dllm_step_seconds_max_ratio_steps") >= 1
    rows = next(line for line in text.splitlines() if line.startswith("flash_dllm_kv_cache_rows "))
    assert float(rows.split()[1]) > 0


def test_queue_bound_answers_429(start_server):
    llm = LLM(device="cpu", dtype="float32", max_batch_size=1)
    with start_server(llm, max_queue=1) as url:
        body = {"prompt": QUESTION, **SLOW}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            with httpx.Client(base_url=url, timeout=120) as client:
                with client.stream("POST", "/v1/completions", json={**body, "stream": True}):  # accepted: it runs
                    queued = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": PROGRAM}, timeout=120)
                    for _ in range(100):  # until the second request holds the queue's one place
                        metrics = client.get("/metrics").text
                        if "flash_dllm_requests_running 1" in metrics and "flash_dllm_requests_waiting 1" in metrics:
                            break
                        threading.Event().wait(0.05)
                    refused = client.post("/v1/completions", json={"prompt": PROGRAM})
                    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
                    assert "capacity" in refused.json()["error"]["message"]
            assert queued.result().status_code == 200


def test_request_that_can_never_fit_the_cache_is_400(start_server, offline):
    rows = 64
    llm = LLM(device="cpu", dtype="float32", kv_cache_bytes=rows * KVCache.bytes_per_row(offline.config, offline.dtype))
    with start_server(llm) as url, httpx.Client(base_url=url, timeout=120) as client:
        response = client.post("/v1/completions", json={"prompt": QUESTION, "method": "dual-cache", "max_tokens": 64})
        assert response.status_code == 400 and "can never fit in a KV cache" in response.json()["error"]["message"]
        small = client.post("/v1/completions", json={"prompt": [5, 6], "method": "dual-cache", "max_tokens": 32})
        assert small.status_code == 200


def test_api_key(start_server, offline):
    with start_server(offline.__class__(device="cpu", dtype="float32"), api_key="sesame") as url:
        assert httpx.post(url + "/v1/completions", json={"prompt": QUESTION}).status_code == 401
        wrong = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="sesame")
        assert client.completions.create(model="embedded", prompt=QUESTION, max_tokens=32).choices[0].text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong").models.list()


def test_a_server_of_some_methods_refuses_the_others_and_keeps_the_cache_for_them(start_server, offline):
    """`serve --methods`: a request for a method the server does not run gets a 400 naming those it runs; without
    Elastic-Cache among them the KV cache keeps no room for hidden states (more rows in the same bytes)."""
    from flash_dllm.serve.api_server import start_up
    from flash_dllm.serve.protocol import ServerDefaults

    budget = 200 * KVCache.bytes_per_row(offline.config, offline.dtype, with_hidden=True)
    llm = LLM(device="cpu", dtype="float32", kv_cache_bytes=budget)
    defaults = ServerDefaults(SamplingParams(method="flash-cache", max_tokens=8, block_length=8),
                              methods=("flash-cache", "dual-cache"))
    with start_server(llm, defaults=defaults, start_up=lambda: start_up(llm, defaults)) as url, \
            httpx.Client(base_url=url, timeout=120) as client:
        while client.get("/health").status_code != 200:
            time.sleep(0.05)
        assert client.post("/v1/completions", json={"prompt": QUESTION, "method": "dual-cache"}).status_code == 200
        refused = client.post("/v1/completions", json={"prompt": QUESTION, "method": "elastic"})
        assert refused.status_code == 400 and refused.json()["error"]["message"] == \
            "method 'elastic' is not served here; this server runs flash-cache, dual-cache"
    assert llm.runner.cache.num_rows == budget // KVCache.bytes_per_row(offline.config, offline.dtype) > 200
    with pytest.raises(ValueError, match="the default method 'flash-cache' is not among the served methods"):
        ServerDefaults(SamplingParams(method="flash-cache"), methods=("dual-cache",))


def test_client_that_gives_up_on_a_full_response_is_aborted(server, client):
    before = metric(client, ABORTED)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json={"prompt": QUESTION, **SLOW}, timeout=1.0)
    assert aborted_after(client, before) == before + 1


def test_an_engine_failure_fails_the_running_requests_only(start_server):
    """A failing step answers 500 to the requests it ran; the server keeps serving."""
    llm = LLM(device="cpu", dtype="float32")
    step, calls = llm.engine.step, []

    def fail_once():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated device fault")
        return step()

    llm.engine.step = fail_once
    with start_server(llm) as url, httpx.Client(base_url=url, timeout=120) as client:
        failed = client.post("/v1/completions", json={"prompt": QUESTION, "max_tokens": 64, "threshold": 1.0})
        assert failed.status_code == 500 and "simulated device fault" in failed.json()["error"]["message"]
        assert client.post("/v1/completions", json={"prompt": PROGRAM}).status_code == 200
        assert metric(client, 'flash_dllm_requests_total{outcome="error"}') == 1


def test_prompts_of_one_request_join_the_same_step(client):
    """The prompts of a completion reach the engine together: the request takes the steps of one of them."""
    before = metric(client, "flash_dllm_engine_iterations_total")
    body = client.post("/v1/completions", json={"prompt": [PROGRAM] * 4, "threshold": 1.0}).json()
    steps = body["usage"]["steps"]
    assert steps % 4 == 0 and metric(client, "flash_dllm_engine_iterations_total") - before == steps // 4


def test_streaming_several_prompts(client):
    body = {"prompt": [QUESTION, PROGRAM], "max_tokens": 64}
    full = [c["text"] for c in client.post("/v1/completions", json=body).json()["choices"]]
    chunks = stream_events(client, "/v1/completions", body)
    texts = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in (0, 1)]
    assert texts == full
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]) == [0, 1]


def test_stop_string_cuts_token_ids_and_counts_the_work(client, offline):
    body = {"prompt": QUESTION, "max_tokens": 64, "return_token_ids": True}
    text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    cut = client.post("/v1/completions", json={**body, "stop": text.split()[3]}).json()
    choice = cut["choices"][0]
    assert offline.decode(choice["token_ids"]).startswith(choice["text"])
    assert len(offline.decode(choice["token_ids"][:-1])) < len(choice["text"])  # no token past the cut
    assert cut["usage"]["completion_tokens"] == len(choice["token_ids"]) and cut["usage"]["nfe"] > 0


def test_top_p_is_a_knob_of_the_methods_that_read_it(client, offline):
    fields = {"method": "dream", "alg": "entropy", "temperature": 0.8, "top_p": 0.9, "seed": 5}
    body = client.post("/v1/completions", json={"prompt": PROGRAM, **fields}).json()
    assert body["choices"][0]["text"] == expected(offline, PROGRAM, **fields)


def test_openai_nulls_and_the_developer_role(client, offline):
    nulls = {"n": None, "top_p": None, "presence_penalty": None, "frequency_penalty": None, "stream": None,
             "logprobs": None, "stop": None, "seed": None, "temperature": None, "max_tokens": None}
    messages = [{"role": "developer", "content": "Be brief."}, *MESSAGES]
    body = client.post("/v1/chat/completions", json={"messages": messages, **nulls}).json()
    system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    assert body["choices"][0]["message"]["content"] == expected(offline, system)


def test_too_many_prompts_for_the_server_is_400_not_429(client):
    response = client.post("/v1/completions", json={"prompt": [[5, 6]] * 300})
    assert response.status_code == 400 and "exceed the server's capacity" in response.json()["error"]["message"]


def test_errors_outside_the_api_keep_openais_shape(client):
    missing = client.get("/v1/nothing")
    assert missing.status_code == 404 and "message" in missing.json()["error"]
    garbled = client.post("/v1/completions", content=b'{"prompt": "\xff"}',
                          headers={"content-type": "application/json"})
    assert garbled.status_code == 400 and "message" in garbled.json()["error"]


def test_disconnect_is_noticed_while_the_final_prefix_grows(server, client):
    """A stop string makes the engine report the prefix every step; a gone client is still noticed."""
    before = metric(client, ABORTED)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json={"prompt": QUESTION, **SLOW, "remasking": "low_confidence",
                                                      "stop": "never appears"}, timeout=1.0)
    assert aborted_after(client, before) == before + 1


def test_a_request_that_fails_to_start_fails_alone(start_server):
    """An unexpected error while admitting (e.g. out of memory for the KV cache) is a 500 for that request."""
    llm = LLM(device="cpu", dtype="float32")
    allocate, calls = llm.runner.allocate_cache, []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated out of memory")
        return allocate(*args, **kwargs)

    llm.runner.allocate_cache = fail_once
    with start_server(llm) as url, httpx.Client(base_url=url, timeout=120) as client:
        failed = client.post("/v1/completions", json={"prompt": QUESTION, "method": "dual-cache"})
        assert failed.status_code == 500 and "simulated out of memory" in failed.json()["error"]["message"]
        assert client.post("/v1/completions", json={"prompt": QUESTION, "method": "dual-cache"}).status_code == 200
        assert client.get("/health").status_code == 200


def test_a_dead_engine_answers_instead_of_hanging(start_server):
    """A device that fails every step ends the engine loop: requests get 500 or 503, never a hang."""
    llm = LLM(device="cpu", dtype="float32")

    def broken():
        raise RuntimeError("sticky device error")

    llm.engine.step = broken
    with start_server(llm) as url, httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(4):
            assert client.post("/v1/completions", json={"prompt": QUESTION}).status_code == 500
        assert client.get("/health").status_code == 503


def test_bench_serve_mix_reads_ttft_and_the_counters(server):
    from flash_dllm.bench.mix import MixServeConfig, MixSpec, bench_serve_mix

    spec = MixSpec(num_requests=3, rate=20.0, prompt_lengths=(8, 16), max_tokens=(8,), methods=("parallel", "dual-cache"),
                   routings=(None,), block_length=8, max_token_id=300)
    result = bench_serve_mix(MixServeConfig(url=server, spec=spec, metrics_every_s=0.05))
    assert [a.ok for a in result.answers] == [True] * 3, [a.error for a in result.answers]
    assert all(0 < a.ttft_s <= a.e2e_s for a in result.answers)
    assert result.load and all(0 <= sample.running <= 3 and 0 <= sample.waiting <= 3 and 0 <= sample.kv_cache_use < 1
                               for sample in result.load)
    assert result.compiles == (0, 0.0) and result.captures == (0, 0.0) and result.longest_step[0] > 0
    assert result.longest_step[1] >= 1 and result.longest_step[2] >= 1  # the ratio, and the steps behind it


def test_the_start_up_freezes_what_it_leaves_out_of_later_collections():
    """A full garbage collection mid-step traverses every object alive: after the start-up, only newer ones."""
    import gc

    from flash_dllm.serve.api_server import start_up
    from flash_dllm.serve.protocol import ServerDefaults

    llm = LLM(device="cpu", dtype="float32")
    try:
        start_up(llm, ServerDefaults(SamplingParams(max_tokens=8, block_length=8)))
        assert gc.get_freeze_count() > 0 and not any(o is llm.engine for o in gc.get_objects())
    finally:
        gc.unfreeze()


def test_step_trace_writes_every_step(llm, start_server, tmp_path):
    trace = tmp_path / "steps.jsonl"
    with start_server(llm, step_trace=str(trace)) as url, httpx.Client(base_url=url, timeout=120) as client:
        for prompt in (QUESTION, PROGRAM):
            assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16}).status_code == 200
        iterations = metric(client, "flash_dllm_engine_iterations_total")
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(steps) == iterations > 0
    assert [step["t"] for step in steps] == sorted(step["t"] for step in steps) and steps[0]["t"] == 0
    for step in steps:
        assert step["method"] == "parallel" and step["batch_size"] == 1 and step["query_rows"] >= 1
        assert 0 <= step["cpu_seconds"] and 0 < step["seconds"] and step["routed_rows"] == 0
        assert step["running"] <= 1 and step["waiting"] == 0 and step["positions"] > 0 and step["collections"] >= 0


def test_a_block_causal_moe_model_serves_its_methods(start_server, tmp_path):
    """A LLaDA2-format checkpoint behind the API (its start-up included): chat with Draft-and-Edit, a stream of
    LLaDA2.0's sampler equal to its full text, and a method its attention refuses as a 400 naming the field."""
    from moe_checkpoints import llada2_config, write_moe_checkpoint

    from flash_dllm.serve.api_server import start_up
    from flash_dllm.serve.protocol import ServerDefaults

    path = str(write_moe_checkpoint(tmp_path, llada2_config(), num_shards=1))
    llm = LLM(path, device="cpu", dtype="float32")
    defaults = ServerDefaults(SamplingParams(method="parallel", max_tokens=24, threshold=0.5))
    with start_server(llm, defaults=defaults, start_up=lambda: start_up(llm, defaults)) as url, \
            httpx.Client(base_url=url, timeout=120) as client:
        while client.get("/health").status_code != 200:
            time.sleep(0.05)
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "What is 3 + 4?"}], "method": "edit", "threshold": 0.7,
            "edit_threshold": 0.5})
        assert chat.status_code == 200, chat.text
        # an LLM of its own: the server's engine thread steps `llm`'s engine, and would step this request too
        offline = LLM(path, device="cpu", dtype="float32").generate(
            [[{"role": "user", "content": "What is 3 + 4?"}]],
            SamplingParams(method="edit", max_tokens=24, threshold=0.7, edit_threshold=0.5))[0]
        assert chat.json()["choices"][0]["message"]["content"] == offline.text
        full = client.post("/v1/completions", json={"prompt": "The passkey is"}).json()["choices"][0]["text"]
        streamed = "".join(event["choices"][0]["text"] for event in
                           stream_events(client, "/v1/completions", {"prompt": "The passkey is", "stream": True}))
        assert streamed == full
        refused = client.post("/v1/completions", json={"prompt": "hi", "method": "dual-cache"})
        assert refused.status_code == 400 and "does not support this model's block-causal" in \
            refused.json()["error"]["message"]
