"""Reference decoder: training/inference consistency, losslessness, acceptance."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fixtures_decoder import fresh_draft, save_draft, train_draft, training_rows

from dspark_kit.data.chat import prompt_ids
from dspark_kit.specdec import draft_model
from dspark_kit.specdec.decoder import SpecGenerator, Verifier
from dspark_kit.specdec.draft_model import DSparkDraft, confident_prefix

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def verifier_path(tiny_verifier) -> Path:
    return tiny_verifier


@pytest.fixture(scope="module")
def tokenizer(verifier_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(verifier_path))


@pytest.fixture(scope="module")
def checkpoints(verifier_path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    fresh = save_draft(fresh_draft(verifier_path, seed=0), root / "fresh")
    trained = save_draft(train_draft(fresh_draft(verifier_path, seed=0), verifier_path, steps=150), root / "trained")
    return {"fresh": fresh, "trained": trained}


@pytest.fixture(scope="module")
def prompts(verifier_path, tokenizer) -> list[list[int]]:
    rows = training_rows(verifier_path, 6, seed=7)  # other seed than training
    return [prompt_ids(tokenizer, r["messages"][:1], thinking=False) for r in rows]


def _greedy_reference(verifier_path, prompt, max_new, eos) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(verifier_path), dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos)[0, len(prompt):].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


# ---- training forward vs inference block logits ----------------------------

def _training_block_logits(draft: DSparkDraft, aux, last, ids: list[int], anchor_pos: int, monkeypatch):
    """speculators' own training forward, with the anchor pinned to anchor_pos."""
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core

    captured = {}

    def one_anchor(loss_mask, num_anchors, block_size):
        return torch.tensor([anchor_pos]), torch.tensor([True])

    def capture(logits, *args, **kwargs):
        captured["logits"] = logits.detach().clone()
        return torch.zeros(()), {}

    monkeypatch.setattr(dflash_core, "select_anchors", one_anchor)
    monkeypatch.setattr(dspark_core, "compute_metrics", capture)
    n = len(ids)
    with torch.no_grad():
        draft.model(hidden_states=aux[None], input_ids=torch.tensor([ids]), loss_mask=torch.ones(1, n),
                    verifier_last_hidden_states=last[None], document_ids=torch.zeros(1, n, dtype=torch.long),
                    max_anchors=1)
    return captured["logits"][0]


def _consistency_gap(verifier_path, ckpt, prompt, monkeypatch) -> float:
    draft = DSparkDraft.load(ckpt, verifier_path)
    verifier = Verifier(verifier_path, [*draft.target_layer_ids, 4])
    k = draft.block_size
    p = len(prompt) - 1  # anchor = last prompt token
    _, aux = verifier.forward(prompt, verifier.new_cache(), 0)
    h = verifier.model.config.hidden_size
    ctx = draft.context_features(aux[:p, :-h])
    block = draft.draft(ctx, torch.arange(p), prompt[p], p, k)
    # The training sample continues with the decoder's own chain, so the
    # teacher-forced Markov inputs (block tokens) are the tokens it chose.
    ids = [*prompt, *block.tokens[: k - 1]]
    _, full = verifier.forward(ids, verifier.new_cache(), 0)
    train_logits = _training_block_logits(draft, full[:, :-h], full[:, -h:], ids, p, monkeypatch)
    return float((train_logits - block.logits).abs().max())


@pytest.mark.slow
def test_block_logits_match_training_forward(verifier_path, checkpoints, prompts, monkeypatch):
    for prompt in prompts[:2]:
        assert _consistency_gap(verifier_path, checkpoints["trained"], prompt, monkeypatch) < 1e-4


@pytest.mark.slow
def test_shifted_markov_chain_is_detected(verifier_path, checkpoints, prompts, monkeypatch):
    # The old bug: slot i conditioned on the token at p+i-1 instead of p+i.
    monkeypatch.setattr(draft_model, "chain_prev_tokens", lambda anchor, chosen: [anchor, anchor, *chosen])
    gaps = [_consistency_gap(verifier_path, checkpoints["trained"], pr, monkeypatch) for pr in prompts[:2]]
    assert max(gaps) > 1e-4


BLOCK = 4  # the fixture drafts' block size = their trained slots (K auto)


# ---- lossless greedy decoding ------------------------------------------------

@pytest.mark.slow
def test_speculative_greedy_equals_verifier_greedy(verifier_path, checkpoints, prompts, tokenizer):
    eos = tokenizer.eos_token_id
    gens = [
        SpecGenerator.from_checkpoint(verifier_path, checkpoints["trained"], BLOCK),
        SpecGenerator.from_checkpoint(verifier_path, checkpoints["trained"], num_speculative_tokens=2,
                                      draft_window_size=16, confidence_threshold=0.05),
        SpecGenerator.from_checkpoint(verifier_path, checkpoints["fresh"], BLOCK),
    ]
    for prompt in prompts[:4]:
        want = _greedy_reference(verifier_path, prompt, 24, eos)
        for g in gens:
            res = g.generate(prompt, 24, stop_ids=frozenset([eos]))
            assert res.token_ids == want
            assert res.finish_reason == ("stop" if want[-1] == eos else "length")
            # vLLM counter identities
            assert sum(res.accepted_per_pos) == res.num_accepted_tokens <= res.num_draft_tokens
            assert all(a >= b for a, b in zip(res.accepted_per_pos, res.accepted_per_pos[1:]))


@pytest.mark.slow
def test_counters_and_lengths(verifier_path, checkpoints, prompts):
    g = SpecGenerator.from_checkpoint(verifier_path, checkpoints["trained"], num_speculative_tokens=3)
    res = g.generate(prompts[0], 10)  # no stop ids: must run to the length limit
    assert len(res.token_ids) == 10 and res.finish_reason == "length"
    assert len(res.accepted_per_pos) == 3
    assert res.verifier_forwards == res.num_drafts + 1  # prefill + one verify per draft
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpecGenerator.from_checkpoint(verifier_path, checkpoints["trained"], num_speculative_tokens=9)


@pytest.mark.slow
def test_temperature_falls_back_with_note(verifier_path, checkpoints, prompts):
    g = SpecGenerator.from_checkpoint(verifier_path, checkpoints["fresh"], BLOCK)
    res = g.generate(prompts[0], 5, temperature=0.8, seed=1)
    assert res.num_drafts == 0 and res.notes and len(res.token_ids) <= 5


@pytest.mark.slow
def test_trained_draft_accepts_more_than_fresh(verifier_path, checkpoints, prompts, tokenizer):
    def acceptance_length(ckpt):
        g = SpecGenerator.from_checkpoint(verifier_path, ckpt, BLOCK)
        drafts = accepted = 0
        for prompt in prompts:
            r = g.generate(prompt, 24, stop_ids=frozenset([tokenizer.eos_token_id]))
            drafts, accepted = drafts + r.num_drafts, accepted + r.num_accepted_tokens
        return 1 + accepted / drafts

    assert acceptance_length(checkpoints["trained"]) > acceptance_length(checkpoints["fresh"]) + 0.1


# ---- draft window and confidence ----------------------------------------------

@pytest.mark.slow
def test_window_only_changes_long_contexts(verifier_path, checkpoints, prompts):
    draft = DSparkDraft.load(checkpoints["trained"], verifier_path)
    verifier = Verifier(verifier_path, draft.target_layer_ids)
    prompt = prompts[0]
    p = len(prompt) - 1
    _, aux = verifier.forward(prompt, verifier.new_cache(), 0)
    ctx = draft.context_features(aux[:p])
    full = draft.draft(ctx, torch.arange(p), prompt[p], p, 4)
    wide = draft.draft(ctx, torch.arange(p), prompt[p], p, 4, window=p + 16)
    assert p > 12
    narrow = draft.draft(ctx, torch.arange(p), prompt[p], p, 4, window=4, kv_block_size=4)
    assert torch.equal(full.logits, wide.logits)
    assert (full.logits - narrow.logits).abs().max() > 1e-3


def test_confident_prefix():
    assert confident_prefix(None, 0.5) is None
    assert confident_prefix([0.9, 0.9, 0.9], None) is None
    assert confident_prefix([0.9, 0.8, 0.5, 0.9], 0.5) == 2  # 0.9, 0.72, 0.36 < 0.5
    assert confident_prefix([0.1, 0.9], 0.5) == 1  # always verify one token


@pytest.mark.slow
def test_bad_checkpoint_dir_is_one_line_error(tmp_path, verifier_path):
    with pytest.raises(draft_model.DraftLoadError, match="config.json"):
        DSparkDraft.load(tmp_path, verifier_path)
