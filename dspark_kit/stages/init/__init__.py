"""`dspark-kit init`: a commented recipe for your own verifier (no stage of the pipeline).

- init_recipe.py: the recipe's values from the verifier, the machine and the data;
- commented_yaml.py: the YAML with a comment per key.

Stage folder (a floor of stages/ above stages/plan.py, manifest.py, preflight/ and server_plan.py):
may import those and the layers below (core, data/, specdec/, compat/, resolved/, distributed/,
engines/, measure/); never another stage folder (tests/test_layers.py), steps.py or pipeline.py.
"""
