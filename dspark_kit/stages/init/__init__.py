"""`dspark-kit init`: a commented recipe for your own verifier.

Stage folder (layer 5): may import the layers below (core, data/, specdec/, compat/, resolved/,
engines/) and stages/plan.py and stages/preflight; not another stage folder.
"""
