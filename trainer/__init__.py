"""Policy-gradient (GRPO/PPO) and SFT training on OpenForge samples read from DuckDB.

Read in this order: `config` (every knob), `data` (samples -> global batches), `packing` (rows),
`loss` (the objectives), `train` (the loop), `checkpoint` (save / resume).
"""
