"""stages: the work. Each stage builds a typed plan from a `Resolved` and runs it.

stages/ is in floors; imports only point down them (tests/test_layers.py):
- plan.py (a stage's typed plan: its processes, paths and decided values) and manifest.py
  (`DIR/manifest.json`);
- preflight/: the silent-pitfall checks of a plan, and `enforce` for the stages that refuse to start;
- server_plan.py: a server's plan for a role, checked first (serve, bench and a served eval start it);
- one folder per stage family, each its own room (none imports another): dataset/ (regen,
  prepare), hidden/ (hidden states), training/, evaluation/ (eval, tune), serving/ (serve check,
  bench), reporting/, init/ (`dspark-kit init`). Each stage is one module with `plan(res)` and
  `run(res, plan, reporter)`;
- steps.py (the registry: the eight stages in order) and pipeline.py (`run`: the resumable
  pipeline over them).

Layer 6: may import every layer below (core, data/, specdec/, compat/, resolved/, distributed/,
engines/, measure/); never cli/. What two stage folders share belongs a floor lower.
"""
