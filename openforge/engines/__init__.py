"""The inference engines a run serves its policy with, each an HTTP server in a child process: llama.cpp
(`llamacpp`, embedded, CPU) and real vLLM (`vllm`, its own environment; `vllm_launcher`, its server behind the
engine key), what they share (`process`: start, health, stop), and the GGUF export llama.cpp is served new
weights by (`gguf`). The RL loop's view of a policy engine (serve weights, reload) is `openforge.rl.services`.

Importing the package loads none of them: each module is imported where it is used.
"""
