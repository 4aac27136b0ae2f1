"""Regen (on-policy replies from the verifier) and prepare (chat template, loss mask, speculators' Arrow rows).

Stage folder (layer 5): may import the layers below (core, dspark_kit.data, specdec/, compat/,
resolved/, engines/) and stages/plan.py; not another stage folder.
"""
