"""Preflight: the checks of a plan against the silent acceptance killers (docs/PITFALLS.md).

- checks.py: the one check registry (CHECKS), `run_preflight` over the recipe and whatever the
  run folder already holds, and `enforce` (the stages that refuse to start on an error);
- context.py: what every check reads (`_Context`) and the pitfall-tagged finding;
- draft_checks.py, data_checks.py, serving_checks.py, machine_checks.py: the checks, by pitfall
  group (the draft and its checkpoint; regen's data; K, window and the engine; the machines);
- endpoints.py: servers the kit did not start, against the names its clients send;
- prompt_room.py: regen's prompts plus max_tokens against serve.max_model_len;
- memory.py: the training memory plan against the device's memory.

A floor of stages/ below the stage folders: the stages call `enforce`, so preflight may import
stages/plan.py and the layers below, never a stage folder (what it needs of one moves down).
"""
