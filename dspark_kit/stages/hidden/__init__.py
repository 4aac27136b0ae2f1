"""Verifier hidden states: in-process extraction, speculators generate-offline-data against a server, storage."""
