"""Verifier hidden states.

- hidden_states.py: the hidden-states stage (`plan`, `run`) and in-process extraction
  (`generate_offline`);
- hidden_states_vllm.py: backend vllm: speculators' generate-offline-data against the engine's
  extraction server, one command per node;
- reuse.py: an earlier run's files linked in for rows with the same token ids (hidden_states.reuse_from).

Stage folder (a floor of stages/ above stages/plan.py, manifest.py, preflight/ and server_plan.py):
may import those and the layers below (core, data/, specdec/, compat/, resolved/, distributed/,
engines/, measure/); never another stage folder (tests/test_layers.py), steps.py or pipeline.py.
"""
