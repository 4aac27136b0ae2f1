"""dspark-kit: from a verifier LLM to a served DSpark speculative-decoding draft.

The package is layered; imports only point down (tests/test_layers.py checks it):

    0 core     recipe/, rundir, atomic, jsonl, jsonl_sink, logs, processes, progress, devices,
               findings, redact
    1 data     data/ (conversation model, chat rendering, sources, the tiny verifier)
    2 specdec  specdec/ (speculative-decoding semantics), compat/ (speculators fixes, engine gates)
    3 resolve  resolved/ (every derived value), rendezvous, hs_transport
    4 engines  engines/ (server plans, local engine, lifecycle)
    5 stages   stages/ (regen ... report, pipeline, preflight, init)
    6 cli      cli/ (the `dspark-kit` command line)
"""
__version__ = "0.1.0"
