"""Serving: the spec server checked, then benchmarked.

- serve.py: the serve stage (`plan`, `run`): the spec server's command written and, on the local
  engine, started and asked one chat;
- bench.py: the bench stage (`plan`, `run`) and `bench_endpoint`, a benchmark of a running
  server (what `dspark-kit bench` calls).

Stage folder (a floor of stages/ above stages/plan.py, manifest.py, preflight/ and server_plan.py):
may import those and the layers below (core, data/, specdec/, compat/, resolved/, distributed/,
engines/, measure/); never another stage folder (tests/test_layers.py), steps.py or pipeline.py.
"""
