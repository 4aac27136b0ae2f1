"""stages: the work. Each stage builds a typed plan from a `Resolved` and runs it.

- plan.py (a stage's typed plan), steps.py (the eight stages in order: plan + run each),
  pipeline.py (`run`: the resumable pipeline over them), manifest.py (`DIR/manifest.json`);
- preflight.py with preflight_endpoints.py, preflight_requests.py and preflight_memory.py: the
  silent-pitfall checks of a plan;
- one folder per stage family: data/ (regen, prepare), hidden/ (hidden states), training/,
  evaluation/, serving/ (serve check, bench), reporting/, init/ (`dspark-kit init`).

Layer 5: may import every layer below (core, data/, specdec/, compat/, resolved/, engines/);
never cli/. A stage folder should not import another stage folder: what two share belongs a
floor lower.
"""
