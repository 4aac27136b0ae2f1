"""Acceptance in-process and served, the K x window sweeps, held-out prompts, the served-acceptance gate."""
