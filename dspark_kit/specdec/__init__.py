"""specdec: speculative-decoding semantics, independent of any server or stage.

- window.py: the draft KV window arithmetic as vLLM-Ascend computes it;
- verifier.py (the verifier under transformers, its aux hidden-state tap), verifier_facts.py
  (what a new recipe needs to know about a verifier);
- draft_model.py, draft_cache.py, draft_layouts.py: a DSpark draft run the way vLLM drafts with
  it, its KV cache, the published layouts (DeepSeek's, speculators', SpecForge's, SGLang's);
- anchor.py: THE rule for a draft's anchor layout and slots (every reader asks it),
  anchor_measure.py: measuring it by decoding when a config does not say it;
- decoder.py (the reference lossless DSpark decoder), acceptance.py (the acceptance figures),
  checkpoints.py (find and check a checkpoint), hidden_state_files.py (what a hidden-state file
  holds and costs).

Layer 2: may import the core modules (layer 0), data/ and compat/ (its floor-mate); never the
resolver package, engines/, stages/ or cli/.
"""
