"""measure: what the measuring stages (eval, tune, bench, report) share.

- eval_prompts.py: the prompt sets acceptance is measured on (held-out rows of the tiny corpus or
  of speculators' validation split, a user's file, named categories) and the record of which;
- served_load.py: timed requests against a serving engine (one streamed request, a load at a
  concurrency, vLLM's bench figures);
- served_gate.py: served acceptance against the in-process eval of the same checkpoint;
- vllm_bench.py: a `vllm bench serve --save-result` JSON read into the kit's bench result schema;
- bench_tables.py and charts.py: the tables and PNG charts of their results.

Layer 5 (above engines/, below stages/): may import core, data/, specdec/, compat/, distributed/
and engines/; never the resolver package (a stage asks it and passes plain values or a small
frozen record, such as eval_prompts.PromptSource), stages/ or cli/. Each stage folder imports what
it measures with from here, so no stage folder imports another.
"""
