"""The task forge (docs/tasks.md): make, check and calibrate RL task files (docs/rollouts.md format).

`mutate` breaks a passing repository one AST mutation at a time, `synth` has a model write tasks through the
proxy, `check` runs the execution checks every task must pass, `calibrate` keeps the tasks the policy solves
sometimes but not always."""
