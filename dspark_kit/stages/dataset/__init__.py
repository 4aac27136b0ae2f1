"""Regen and prepare: the training dataset.

- regen.py: the regen stage (`plan`, `run`): on-policy replies from the verifier through chat
  servers, resumable and sharded (`run_regen`, which `dspark-kit regen` calls with its flags);
  regen_turns.py: which source assistant turns get a reply of their own (the rest counted as
  changed); regen_summary.py: the lines its summary prints;
- prepare.py: the prepare stage (`plan`, `run`): rows rendered by data/template_rows.py written
  as speculators' Arrow dataset + token_freq.pt (`prepare`).

Stage folder (a floor of stages/ above stages/plan.py, manifest.py, preflight/ and server_plan.py):
may import those and the layers below (core, data/, specdec/, compat/, resolved/, distributed/,
engines/, measure/); never another stage folder (tests/test_layers.py), steps.py or pipeline.py.
"""
