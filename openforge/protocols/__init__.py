"""The wire protocols, written once: endpoints and path prefixes, SSE, and one module per protocol.

Standard library only: the mitmproxy addon imports this package beside nothing but mitmproxy and msgpack,
and reconstruct and replay read the same bytes through the same functions.

`endpoints` which protocol a path speaks and what its `/e/`, `/r/`, `/k/` prefixes say · `sse` one
incremental server-sent-events reader · `errors` error bodies in each client's shape · `chat` the Chat
Completions pieces the others build and the engine's answer read back · `anthropic`, `responses` a request as
Chat Completions messages and the engine's answer rendered back · `engine_ids` where vLLM, SGLang and llama.cpp
put token ids and logprobs · `reward_keys` a verifier's per-episode reward key · `client_keys` an agent's
per-episode API key · `control` the proxy's own `/openforge/v1` endpoints and their one client.
"""
