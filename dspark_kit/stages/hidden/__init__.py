"""Verifier hidden states: in-process extraction, speculators generate-offline-data against a server, storage.

Stage folder (layer 5): may import the layers below (core, data/, specdec/, compat/, resolved/,
engines/) and stages/plan.py; not another stage folder (today it still imports stages/data and
stages/training, issue 37).
"""
