"""Preflight: the checks of a plan against the silent acceptance killers (docs/PITFALLS.md).

- checks.py: `run_preflight` over the recipe and whatever the run folder already holds, and
  `enforce` (the stages that refuse to start on an error);
- endpoints.py: servers the kit did not start, against the names its clients send;
- prompt_room.py: regen's prompts plus max_tokens against serve.max_model_len;
- memory.py: the training memory plan against the device's memory.

A floor of stages/ below the stage folders: the stages call `enforce`, so preflight may import
stages/plan.py and the layers below, never a stage folder (what it needs of one moves down).
"""
