"""compat: what the kit needs from the libraries and engines it runs, checked and fixed.

- patches.py: the list of speculators fixes DSpark training depends on, each with its behavioural
  probe, upstream PR and release; dspark_fixes.py (training semantics) and device_fixes.py
  (speculators' device assumptions on CPU and NPU) hold the fixes; train_entry.py is the entry
  point every training process runs with them applied.
- versions.py: installed-package versions and the engine gates that depend on them;
  engine_table.py (+ engine_table.json) is the surveyed table of engine releases every gate reads,
  built by engine_sources.py (released source packages) and engine_features.py (what a release
  does with a DSpark draft), `make compat`.

Layer 2 (beside specdec/): may import the core modules (layer 0), data/ and specdec/; never
resolved/, engines/, stages/ or cli/.
"""
