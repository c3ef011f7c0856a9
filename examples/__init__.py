"""A small tool-using agent, its tasks and its verifier: the workload of `openforge demo`; and a GUI example
(screenshot tasks, a click verifier, an agent sending images over Chat Completions or Anthropic Messages)."""
