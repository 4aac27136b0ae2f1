"""Acceptance: measured in-process and through the serving engine.

- evaluate.py: the eval stage (`plan`, `run`), the in-process eval of a checkpoint
  (`evaluate_checkpoint`) and `window tune`'s sweep;
- eval_outputs.py: eval.json, eval.md and their charts;
- served_tune.py and served_sweep.py: `tune --served` and a served eval (K x window points
  through the engine).

Stage folder (a floor of stages/ above stages/plan.py, manifest.py, preflight/ and server_plan.py):
may import those and the layers below (core, data/, specdec/, compat/, resolved/, distributed/,
engines/, measure/); never another stage folder (tests/test_layers.py), steps.py or pipeline.py.
"""
