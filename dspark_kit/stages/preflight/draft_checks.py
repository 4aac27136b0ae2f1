"""Preflight checks on the draft itself: the trainer's Markov fix (pitfall 1), sliding-window
layers (2), the verifier layer ids it reads (5), the mask token (7), and the trained checkpoint
against the recipe (8; the checkpoint validator's codes mapped to their pitfalls).

A floor of stages/ like its package: may import stages/preflight/context.py, stages/plan.py and
the layers below (findings, recipe, resolved/, specdec/, data/, compat/); never a stage folder or
checks.py (the registry imports this).
"""

from __future__ import annotations

from pathlib import Path

from dspark_kit.data import mask_emitted
from dspark_kit.findings import Finding
from dspark_kit.recipe import RecipeError
from dspark_kit.rundir import hidden_state_file
from dspark_kit.specdec.verifier_facts import has_tokenizer_files, language_model_config
from dspark_kit.stages.preflight.context import _Context, pitfall

# checkpoints.validate_checkpoint finding codes -> pitfall number
_CHECKPOINT_CODES = {
    "k-above-slots": 6, "slots-unknown": 6, "block-size": 6,
    "mask-missing": 7, "mask-mismatch": 7,
    "layer-ids": 5, "layers-unchecked": 5,
    "verifier-mismatch": 3, "verifier-unrecorded": 3, "verifier-relative": 3,
}  # fmt: skip


def check_markov(ctx: _Context) -> list[Finding]:
    from dspark_kit.compat import patches

    result = patches.cached_probe("markov-prev-token", "cpu")
    if result.ok:
        return []
    return [pitfall(1, "warning", f"installed speculators fails the Markov prev_token probe ({result.detail}); "
                                  "dspark-kit train patches it, but drafts trained without dspark-kit must be retrained")]  # fmt: skip


def check_sliding(ctx: _Context) -> list[Finding]:
    # (indices outside the draft are rejected by the recipe validator already)
    d, out = ctx.recipe.draft, []
    indices = ctx.recipe.full_attention_indices
    sliding = [i for i in range(d.num_layers) if i not in indices]
    if d.attention == "sliding" and sliding:
        out.append(pitfall(2, "warning", f"draft layers {sliding} use sliding window {d.sliding_window} "
                                         "(training only; inference attends fully); list every layer in "
                                         "draft.full_attention_indices if full attention is intended"))  # fmt: skip
    tl = (ctx.checkpoint_config or {}).get("transformer_layer_config") or {}
    ckpt_sliding = [i for i, t in enumerate(tl.get("layer_types") or []) if t == "sliding_attention"]
    if ckpt_sliding and d.attention == "full":
        out.append(pitfall(2, "error", f"checkpoint {ctx.checkpoint} has sliding-window layers {ckpt_sliding} "
                                       "but the recipe says draft.attention: full; retrain with "
                                       "--full-attention-indices covering every layer"))  # fmt: skip
    return out


def check_layers(ctx: _Context) -> list[Finding]:
    n, out = ctx.num_layers, []
    if n is not None:
        try:  # the rule every stage's plan applies: a dry run refuses the same ids
            ctx.recipe.target_layer_ids(n)
        except RecipeError as e:
            return [pitfall(5, "error", str(e))]
    hs = hidden_state_file(ctx.run.hidden_states, 0)
    if n is None or not hs.is_file():
        return out
    from safetensors import safe_open

    try:
        with safe_open(str(hs), framework="pt") as f:
            shape = list(f.get_slice("hidden_states").get_shape())
    except Exception as e:  # noqa: BLE001 - an unreadable file is itself the finding
        return [pitfall(5, "error", f"{hs} unreadable ({type(e).__name__}); regenerate hidden states")]
    exported = ctx.recipe.exported_layer_ids(n)
    hidden = language_model_config(ctx.verifier_config or {}).get("hidden_size")
    if len(shape) != 3 or shape[1] != len(exported) or (hidden and shape[2] != hidden):
        out.append(pitfall(5, "error", f"{hs} holds hidden_states {shape}; the trainer expects "
                                       f"[seq, {len(exported)}, {hidden}] for layer ids {exported}; "
                                       "regenerate hidden states with the recipe's target_layer_ids"))  # fmt: skip
    return out


def _not_here_why(ctx: _Context) -> str:
    """Why a verifier folder is missing, in the words of what makes it."""
    if gguf := ctx.res.verifier_gguf:
        return f"{Path(gguf).name} is converted into it by the first stage that reads the verifier"
    if ctx.recipe.verifier.path.startswith("builtin:"):
        return f"{ctx.recipe.verifier.path} is built there by the first stage that needs it"
    return "a hub id"


def check_mask(ctx: _Context) -> list[Finding]:
    if not Path(ctx.verifier_path).is_dir():
        return [pitfall(7, "warning", f"verifier {ctx.verifier_path} is not a local directory here "
                                      f"({_not_here_why(ctx)}); mask token not checked")]  # fmt: skip
    if not has_tokenizer_files(Path(ctx.verifier_path)):
        return []  # check_verifier says the tokenizer is missing
    from dspark_kit.specdec.verifier_facts import plan_tokenizer

    try:
        tok = plan_tokenizer(ctx.verifier_path, trust_remote_code=ctx.recipe.verifier.trust_remote_code)
    except (OSError, ValueError, TypeError) as e:  # check_verifier names missing tokenizer files
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        return [Finding("error", "verifier-tokenizer", f"the tokenizer in {ctx.verifier_path} does not load "
                                                       f"({first}); copy the model's tokenizer files")]
    # the id training resolves: the recipe's, else the tokenizer's; else what a checkpoint recorded
    candidates = (ctx.recipe.draft.mask_token_id, tok.mask_token_id,
                  (ctx.checkpoint_config or {}).get("mask_token_id"))
    mask_id = next((m for m in candidates if m is not None), None)
    vocab = language_model_config(ctx.verifier_config or {}).get("vocab_size") or len(tok)
    if mask_id is None and len(tok) < vocab:  # speculators' resolve_mask_token_id adds one there
        return [pitfall(7, "warning", f"no mask token set: speculators will add <|MASK|> as id {len(tok)} "
                                      "(an unused embedding row); set draft.mask_token_id to pin it")]  # fmt: skip
    if mask_id is None:
        return [pitfall(7, "error", "the tokenizer has no mask token, no unused vocabulary row, and "
                                    f"draft.mask_token_id is unset; {_mask_suggestion(tok, vocab)}")]  # fmt: skip
    if not 0 <= mask_id < vocab:
        return [pitfall(7, "error", f"draft.mask_token_id {mask_id} outside the verifier vocabulary [0, {vocab})")]
    if mask_id < len(tok):
        token = tok.convert_ids_to_tokens(mask_id)
        special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
        if mask_id not in special:
            return [pitfall(7, "error", f"draft.mask_token_id {mask_id} is the normal text token {token!r}; "
                                        "use a special or reserved id the verifier never emits")]  # fmt: skip
    stored = (ctx.checkpoint_config or {}).get("mask_token_id")
    if isinstance(stored, int) and stored != mask_id:
        return [pitfall(7, "error", f"checkpoint mask_token_id {stored} != resolved mask token id {mask_id}")]
    emitted = mask_emitted.refusal(ctx.run.regen_jsonl, mask_id, tok)  # a token the verifier generates
    return [pitfall(7, "error", emitted)] if emitted else []


def _mask_suggestion(tok, vocab: int) -> str:
    """What to set draft.mask_token_id to: init's rule (a reserved special token, else an added token the
    chat template never writes), named with its token and why; or, with none, what to look for."""
    from dspark_kit.specdec import verifier_facts as vf

    template = vf.template_text(tok)
    try:
        mask, why = vf.mask_token_choice(vocab, len(tok), None, vf.reserved_specials(tok, template),
                                         vf.unused_specials(tok, template))
    except vf.VerifierFactsError:
        return "set it to a reserved special id the verifier never emits"
    return f"set draft.mask_token_id: {mask}, {why} (what `dspark-kit init` picks)"


def check_checkpoint(ctx: _Context) -> list[Finding]:
    """Pitfall 8 (resolve + completeness) plus the checkpoint-side checks of 3/5/6/7: the resolver's
    one checkpoint check, the same serve uses."""
    if not ctx.run.checkpoints.exists():
        return []  # not trained yet
    try:
        findings = ctx.res.checkpoint_findings()
    except ValueError as e:  # CheckpointError, or an unreadable tune result
        return [pitfall(8, "error", str(e))]
    out = []
    for f in findings:
        if f.code == "mask-mismatch" and ctx.recipe.draft.mask_token_id is None:
            continue  # check_mask compares against the tokenizer's id
        out.append(Finding(f.level, f.code, f.message, _CHECKPOINT_CODES.get(f.code, 8)))
    return out
