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
def test_tokens_are_handed_out_as_decided(verifier_path, checkpoints, prompts):
    """Streaming: on_tokens gets each accepted run (anchor + accepted drafts) in order."""
    g = SpecGenerator.from_checkpoint(verifier_path, checkpoints["trained"], BLOCK)
    runs: list[list[int]] = []
    res = g.generate(prompts[0], 20, on_tokens=runs.append)
    assert [t for run in runs for t in run] == res.token_ids
    assert len(runs) == res.num_drafts + 1 and max(map(len, runs)) > 1  # the first anchor, then one run per step


@pytest.mark.slow
def test_temperature_drafts_and_a_seed_reproduces(verifier_path, checkpoints, prompts):
    g = SpecGenerator.from_checkpoint(verifier_path, checkpoints["trained"], BLOCK)
    a, b = (g.generate(prompts[0], 16, temperature=0.8, seed=1) for _ in range(2))
    assert a.num_drafts > 0 and not a.notes and len(a.token_ids) <= 16  # sampled speculation, no fallback
    assert a.token_ids == b.token_ids and a.num_accepted_tokens == b.num_accepted_tokens


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


# ---- the draft KV cache ------------------------------------------------------------

def _long_prompt(prompts: list[list[int]], n: int) -> list[int]:
    """n tokens of several chats one after another (history the draft has never seen this long)."""
    ids: list[int] = []
    while len(ids) < n:
        ids += [t for p in prompts for t in p]
    return ids[-n:]


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 32, 2])  # 2 < K: the block still attends to itself
def test_cached_draft_equals_recomputed_draft(verifier_path, checkpoints, prompts, window):
    """The draft's context K/V cached across steps give the logits and tokens of recomputing them,
    at several context lengths, with and without a window, however the context was appended."""
    draft = DSparkDraft.load(checkpoints["trained"], verifier_path)
    verifier = Verifier(verifier_path, draft.target_layer_ids)
    ids = _long_prompt(prompts, 400)
    _, aux = verifier.forward(ids, verifier.new_cache(), 0)
    feats = draft.context_features(aux)
    cache, step = draft.new_cache(), 0
    for n in (3, 40, 120, 399):
        while cache.context_len < n:  # uneven appends, as accepted runs of 1..K+1 tokens arrive
            step += 1
            draft.extend_cache(cache, feats[cache.context_len: min(n, cache.context_len + step % 5 + 1)])
        for k in (1, BLOCK):
            ref = draft.draft(feats[:n], torch.arange(n), ids[n], n, k, window=window, kv_block_size=16)
            got = draft.draft_cached(cache, ids[n], k, window=window, kv_block_size=16)
            assert got.tokens == ref.tokens, (n, k)
            assert torch.allclose(got.logits, ref.logits, atol=1e-4, rtol=0), (n, k)
            assert cache.length == n  # drafting never commits the block's scratch K/V


@pytest.mark.slow
def test_cached_decoder_equals_uncached_at_long_contexts(verifier_path, checkpoints, prompts, tokenizer):
    draft = DSparkDraft.load(checkpoints["trained"], verifier_path)
    verifier = Verifier(verifier_path, draft.target_layer_ids)
    eos = frozenset([tokenizer.eos_token_id])
    for n in (60, 250, 500):
        prompt = _long_prompt(prompts, n)
        for window in (None, 48):
            runs = [SpecGenerator(verifier, draft, BLOCK, window, draft_kv_cache=c).generate(prompt, 20, stop_ids=eos)
                    for c in (False, True)]
            assert runs[0].token_ids == runs[1].token_ids, (n, window)
            assert runs[0].accepted_per_pos == runs[1].accepted_per_pos, (n, window)
            assert runs[0].num_drafts == runs[1].num_drafts


@pytest.mark.slow
def test_draft_projects_each_context_token_once(verifier_path, checkpoints, prompts):
    """The draft's cost no longer grows with the context: over a whole generation, each draft layer's
    K projection sees each verified token once plus each drafted block, not the whole context per step."""
    draft = DSparkDraft.load(checkpoints["trained"], verifier_path)
    gen = SpecGenerator(Verifier(verifier_path, draft.target_layer_ids), draft, BLOCK)
    rows = []
    hook = draft.model.layers[0].self_attn.k_proj.register_forward_hook(
        lambda _m, inputs, _out: rows.append(inputs[0].shape[-2]))
    try:
        prompt = _long_prompt(prompts, 300)
        res = gen.generate(prompt, 24)
    finally:
        hook.remove()
    verified = len(prompt) + len(res.token_ids)
    assert res.num_drafts >= 5
    assert sum(rows) <= verified + res.num_drafts * BLOCK  # old code: about num_drafts x 300 rows


@pytest.mark.slow
@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_markov_bias_per_slot_equals_the_whole_chain(verifier_path, tmp_path, head_type):
    """The decoder computes slot i's Markov bias alone (vanilla/gated are per position; rnn runs
    the prefix): it equals slot i of the head's bias over the whole chain, as training computes it."""
    draft = DSparkDraft.load(save_draft(fresh_draft(verifier_path, markov_head_type=head_type, seed=3), tmp_path),
                             verifier_path)
    torch.manual_seed(0)
    for p in draft.model.markov_head.parameters():  # away from init, so every input matters
        p.data.normal_(0, 0.5)
    hidden = torch.randn(BLOCK, draft.hidden_size)
    chain = [11, 250, 37, 602]
    whole = draft.model.markov_head.block_bias(prev_token_ids=torch.tensor([chain]), hidden_states=hidden[None])[0]
    for i in range(BLOCK):
        assert torch.allclose(draft.markov_bias(chain[: i + 1], hidden), whole[i], atol=1e-5)


# ---- lossless speculative sampling -------------------------------------------
# The first N generated tokens of a prompt are sampled M times with speculation and M times by the
# verifier alone (ReferenceDecoder); the two empirical laws of the N-token sequence must be within
# the total-variation distance that sampling noise alone reaches at M draws. The bound is the
# 99.9th percentile of TV between two M-draw samples of one law (the pooled counts), drawn B times
# with a fixed seed: a fair test fails about once in a thousand seeds, a deterministic one (these
# seeds) never flips. The prompt is a held-out chat cut where the verifier is sure of the next
# token and unsure of the one after, the first drafted slot: greedy-like prefixes (most of the tiny
# corpus) would make every sampler look lossless.

SAMPLES, FIRST_N, BOOTSTRAP = 300, 3, 2000


def _uncertain_prefix(verifier: Verifier, verifier_path) -> list[int]:
    for row in training_rows(verifier_path, 12, seed=7):
        ids, start = row["input_ids"], row["loss_mask"].index(1)
        logits, _ = verifier.forward(ids, verifier.new_cache(), 0, aux=False)
        p = torch.softmax(logits, -1)
        ppl = torch.exp(-(p * torch.log(p.clamp_min(1e-30))).sum(-1))  # next-token perplexity at T=1
        for t in range(start, len(ids) - 2):
            if ppl[t] < 1.3 and 1.5 < ppl[t + 1] < 6:
                return ids[: t + 1]
    pytest.fail("no held-out prefix with an uncertain first drafted slot")


def _tv_and_bound(a: list[tuple], b: list[tuple]) -> tuple[float, float]:
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    keys = sorted(set(ca) | set(cb))
    pa = torch.tensor([ca[k] for k in keys], dtype=torch.float64) / len(a)
    pb = torch.tensor([cb[k] for k in keys], dtype=torch.float64) / len(b)
    pooled = (pa + pb) / 2
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(pooled.expand(2 * BOOTSTRAP, -1), len(a), replacement=True, generator=gen)
    freq = torch.zeros(2 * BOOTSTRAP, len(keys), dtype=torch.float64).scatter_add_(
        1, draws, torch.ones_like(draws, dtype=torch.float64)) / len(a)
    null = 0.5 * (freq[:BOOTSTRAP] - freq[BOOTSTRAP:]).abs().sum(-1)
    return 0.5 * float((pa - pb).abs().sum()), float(torch.quantile(null, 0.999))


@pytest.fixture(scope="module")
def sampled_setup(verifier_path, checkpoints):
    from dspark_kit.specdec.decoder import ReferenceDecoder

    g = SpecGenerator.from_checkpoint(verifier_path, checkpoints["trained"], BLOCK)
    prefix = _uncertain_prefix(g.verifier, verifier_path)
    alone = {t: [tuple(ReferenceDecoder(g.verifier).generate(prefix, FIRST_N, t, seed=10**6 + i).token_ids)
                 for i in range(SAMPLES)] for t in (0.7, 1.0)}
    return g, prefix, alone


def _speculated(g: SpecGenerator, prefix, temperature: float, topk: int | None) -> list[tuple]:
    g.draft_topk = topk
    try:
        return [tuple(g.generate(prefix, FIRST_N, temperature, seed=i).token_ids) for i in range(SAMPLES)]
    finally:
        g.draft_topk = None


@pytest.mark.slow
@pytest.mark.parametrize("topk", [None, 1])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_speculative_sampling_is_distributed_as_the_verifier(sampled_setup, temperature, topk):
    g, prefix, alone = sampled_setup
    tv, bound = _tv_and_bound(_speculated(g, prefix, temperature, topk), alone[temperature])
    assert tv <= bound, f"TV {tv:.3f} > noise bound {bound:.3f} at temperature {temperature}, top-k {topk}"


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_a_planted_residual_bug_fails_the_lossless_test(sampled_setup, temperature, monkeypatch):
    """Resampling a rejection from p instead of max(0, p - q) over-weights the drafted token: the same
    statistic must see it (top-k 1: q is one-hot on the draft's pick, the sharpest case)."""
    from dspark_kit.specdec import spec_sampling

    g, prefix, alone = sampled_setup
    monkeypatch.setattr(spec_sampling, "residual", lambda p, q: p)
    tv, bound = _tv_and_bound(_speculated(g, prefix, temperature, 1), alone[temperature])
    assert tv > bound, f"planted bug not seen: TV {tv:.3f} <= noise bound {bound:.3f}"


@pytest.mark.slow
def test_bonus_anchor_block_logits_match_training_forward(verifier_path, prompts, tmp_path, monkeypatch):
    """sample_from_anchor false (DFlash's block layout, SpecForge's drafts): the decoder drafts B - 1
    tokens from block positions 1.. (the anchor is the bonus token), Markov-chained from the anchor,
    and they are the logits speculators' training forward gives those positions (prev = the token before)."""
    model = fresh_draft(verifier_path, seed=3)
    model.config.sample_from_anchor = False
    ckpt = save_draft(model, tmp_path / "bonus")
    draft = DSparkDraft.load(ckpt, verifier_path)
    assert draft.sample_from_anchor is False and draft.slots == draft.block_size - 1
    verifier = Verifier(verifier_path, [*draft.target_layer_ids, 4])
    h = verifier.model.config.hidden_size
    for prompt in prompts[:2]:
        p = len(prompt) - 1  # anchor = last prompt token
        _, aux = verifier.forward(prompt, verifier.new_cache(), 0)
        block = draft.draft(draft.context_features(aux[:p, :-h]), torch.arange(p), prompt[p], p, draft.slots)
        ids = [*prompt, *block.tokens]  # the block: the anchor, then the tokens the decoder chose
        _, full = verifier.forward(ids, verifier.new_cache(), 0)
        train_logits = _training_block_logits(draft, full[:, :-h], full[:, -h:], ids, p, monkeypatch)
        assert float((train_logits[1:] - block.logits).abs().max()) < 1e-4


@pytest.mark.slow
def test_a_sliding_window_verifiers_cache_rolls_back_past_its_window():
    """gpt-oss alternates sliding-window (128) and full layers. Verification rolls the cache back
    after a rejection; a sliding layer's cache had already dropped the states that needs ('crop' raised).
    The decoder's cache keeps every layer's states, and the logits after a rollback past the window are
    a whole-sequence forward's."""
    from dspark_kit.data.families import GPT_OSS
    from dspark_kit.data.tiny_verifier import ensure_tiny_verifier

    v = Verifier(ensure_tiny_verifier(family=GPT_OSS), [1])
    window = v.model.config.sliding_window
    assert "sliding_attention" in v.model.config.layer_types and window < 200
    ids = torch.randint(10, 1000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        whole = v.model(input_ids=torch.tensor([ids])).logits[0].float()
    cache = v.new_cache()
    v.forward(ids[:200], cache, 0)
    v.forward(ids[200:260], cache, 200)  # a drafted block, then its tail rejected
    cache.crop(230 - 260)
    after, _ = v.forward(ids[230:], cache, 230)
    assert torch.allclose(after, whole[230:], atol=1e-3), (after - whole[230:]).abs().max()
