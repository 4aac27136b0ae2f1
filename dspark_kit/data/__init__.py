"""data: the conversation model and the tiny world every stage shares.

- conversations.py (chat rows in, OpenAI-style messages out), chat.py (chat-template rendering),
  mode_rule.py (a reply against its row's thinking mode), template_rows.py (a conversation's
  training rows and loss mask, and the thinking mode a row is rendered in), piece_encoder.py,
  lengths.py (token lengths as prepare renders them);
- sources.py (chat datasets: builtin corpus, local files, hub presets), categories.py (named
  prompt sets eval and bench measure), speculators_dataset.py (speculators' prepared rows);
- tiny_corpus.py, tiny_tools.py and tiny_verifier.py: the embedded corpus, tool-calling corpus and
  tiny verifier; assets/ holds its shipped weights and word list.

Layer 1: may import the core modules (layer 0: recipe/, jsonl, progress, atomic, ...) only; never
specdec/, compat/, the resolver package, engines/, stages/ or cli/.
"""
