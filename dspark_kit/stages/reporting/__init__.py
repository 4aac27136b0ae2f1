"""Report.md and its plots.

Stage folder (layer 5): may import the layers below (core, data/, specdec/, compat/, resolved/,
engines/) and stages/plan.py; not another stage folder.
"""
