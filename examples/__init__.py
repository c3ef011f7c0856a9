"""A small tool-using agent, its tasks and its verifier: the workload of `openforge demo`."""
