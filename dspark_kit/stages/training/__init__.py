"""Training.

- train.py: the train stage (`plan`, `run`): the speculators trainer's command line, its launch
  (one process, torchrun, or one per node), progress, resume and failures.

Stage folder (a floor of stages/ above stages/plan.py, manifest.py, preflight/ and server_plan.py):
may import those and the layers below (core, data/, specdec/, compat/, resolved/, distributed/,
engines/, measure/); never another stage folder (tests/test_layers.py), steps.py or pipeline.py.
"""
