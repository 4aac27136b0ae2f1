"""dspark-kit: from a verifier LLM to a served DSpark speculative-decoding draft.

The package is layered; imports only point down (tests/test_layers.py checks it):

    0 core     recipe/, rundir, atomic, jsonl, jsonl_sink, logs, processes, progress, devices,
               findings, redact
    1 data     data/ (conversation model, chat rendering, template rows, sources, the tiny verifier)
    2 specdec  specdec/ (speculative-decoding semantics), compat/ (speculators fixes, engine gates)
    3 resolve  resolved/ (every derived value), distributed/ (multi-node launch, hidden-state transport)
    4 engines  engines/ (server plans, the local engine, lifecycle)
    5 measure  measure/ (what eval, tune, bench and report share: prompt sets, timed requests,
               the served gate, tables, charts)
    6 stages   stages/ (preflight, the checked server plan, one folder per stage family, the
               registry and the pipeline)
    7 cli      cli/ (the `dspark-kit` command line)
"""
__version__ = "0.1.0"
