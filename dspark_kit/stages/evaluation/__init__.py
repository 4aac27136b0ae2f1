"""Acceptance: measured in-process and through the serving engine.

- evaluate.py: the eval stage (`plan`, `run`) and the in-process eval of a checkpoint
  (`evaluate_checkpoint`, its `EvalSession`);
- window_tune.py: `window tune`'s in-process sweep (`tune_window`);
- sweep_rules.py: the one rule for a sweep's K values, windows and contexts (`sweep_inputs`,
  in-process and served alike) and the window pick;
- eval_outputs.py: eval.json, eval.md and their charts;
- served_tune.py and served_sweep.py: `tune --served` (`served_tune`: its inputs, defaults and
  run) and a served eval (K x window points through the engine).

Stage folder (a floor of stages/ above stages/plan.py, manifest.py, preflight/ and server_plan.py):
may import those and the layers below (core, data/, specdec/, compat/, resolved/, distributed/,
engines/, measure/); never another stage folder (tests/test_layers.py), steps.py or pipeline.py.
"""
