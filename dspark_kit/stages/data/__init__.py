"""Regen (on-policy replies from the verifier) and prepare (chat template, loss mask, speculators' Arrow rows)."""
