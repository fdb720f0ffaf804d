"""Stand-in servers for tests: real HTTP servers on 127.0.0.1 that speak a rollout server's API
(SGLang, vLLM) with deterministic fake tokens. They run no model and are not part of the package."""
