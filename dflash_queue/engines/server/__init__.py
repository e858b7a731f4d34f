"""The generate engine on OpenAI-compatible inference servers (vLLM, SGLang): the engine, its pool of servers, their admission and re-checks, the weights fingerprint, the per-server breaker."""
