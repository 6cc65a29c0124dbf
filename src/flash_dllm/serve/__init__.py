"""The OpenAI-compatible HTTP server (`flash-dllm serve`)."""
