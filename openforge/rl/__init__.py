"""The RL loop, `openforge rl` (docs/rl.md): rollouts on the current policy, reconstruct, train, publish."""
