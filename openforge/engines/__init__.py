"""The inference engines a run serves its policy with, each an HTTP server in a child process: llama.cpp
(`llamacpp`, embedded, CPU) and real vLLM (`vllm`, its own environment), what they share (`process`), how
new weights reach them (`service`), and the GGUF export llama.cpp needs for them (`gguf`).

Importing the package loads none of them: each module is imported where it is used.
"""
