"""Bad request fields the server shares with the CLI and the API (issue 37): a 400 naming the field, and the other
requests still finishing."""
from __future__ import annotations

import httpx


def test_blank_prompts_and_stray_budgets_are_400s(llm, start_server):
    with start_server(llm) as url, httpx.Client(base_url=url, timeout=120) as client:
        response = client.post("/v1/completions", json={"model": "embedded", "prompt": "  \n"})
        assert response.status_code == 400 and "the prompt is only whitespace" in response.text
        response = client.post("/v1/chat/completions", json={"model": "embedded", "kv_budget": 0.5,
                                                             "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 400 and "kv_budget (0.5) applies only with kv_routing" in response.text
        response = client.post("/v1/completions", json={"model": "embedded", "prompt": "What is 3 + 4?",
                                                        "max_tokens": 8})
        assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("stop", "length")
