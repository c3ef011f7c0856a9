"""Verifiers a policy cannot game (docs/tasks.md, The verifier contract): `pytest`, the verifier of every task
with tests (`python -m openforge.verifiers.pytest`); `plugin`, what it loads into the test process; `hacks`,
the known ways an agent games a verifier, which `openforge tasks check` tries on a task.

They run inside the episode's sandbox with a bare Python: the standard library, pytest and this package only.
"""
