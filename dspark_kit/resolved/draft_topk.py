"""serve.draft_topk -> vLLM's `dspark_draft_topk`: decided once, here (Resolved.draft_topk).

vLLM (0.28.0 on, docs/COMPAT.md column draft_topk) samples each draft position from the draft's
top k tokens when the speculative config carries `dspark_draft_topk`, and refuses it outside
1..the draft vocabulary at start-up. A release without the key refuses the whole speculative
config (unknown keys fail), so the kit refuses the setting in one line instead of emitting it.
"""

from __future__ import annotations

from dspark_kit.compat.versions import EngineSupport
from dspark_kit.resolved.rules import Decision, ResolveError

KEY = "dspark_draft_topk"


def draft_vocab(checkpoint_config: dict | None, recipe_draft_vocab: int | None,
                verifier_vocab: int | None) -> tuple[int | None, str]:
    """The draft's vocabulary as vLLM's DSpark config reads it (draft_vocab_size, else the
    vocab_size), and where it came from."""
    cfg = checkpoint_config or {}
    layer = cfg.get("transformer_layer_config") or {}
    for value, where in ((cfg.get("draft_vocab_size"), "the checkpoint's draft_vocab_size"),
                         (cfg.get("vocab_size") or layer.get("vocab_size"), "the checkpoint's vocab_size")):
        if isinstance(value, int):
            return value, where
    if recipe_draft_vocab:
        return recipe_draft_vocab, "draft.draft_vocab_size"
    if verifier_vocab:
        return verifier_vocab, "the verifier's vocab_size"
    return None, "unknown"


def decide(setting: int | None, engine: str, support: EngineSupport | None, vocab: tuple[int | None, str],
           first: str | None) -> Decision[int | None]:
    """The dspark_draft_topk the spec server gets (None: not sent, greedy drafting)."""
    if setting is None:
        return Decision(None, "serve.draft_topk unset: greedy drafting")
    name = f"serve.draft_topk {setting}"
    if engine == "local":
        raise ResolveError(f"{name}: the local engine drafts greedily; unset serve.draft_topk "
                           "(vLLM >= 0.28.0 has dspark_draft_topk)")
    size, where = vocab
    if size is not None and not 1 <= setting <= size:
        raise ResolveError(f"{name}: outside 1..{size} (the draft vocabulary, {where}); "
                           f"set serve.draft_topk between 1 and {size}")
    has = support.has("draft_topk") if support is not None else "unknown"
    since = f"{engine} >= {first}" if first else f"no surveyed {engine} release"
    version = support.version if support is not None else None
    if has == "no" or (has == "unknown" and first is None):
        which = f"{engine} {version}" if version else engine
        raise ResolveError(f"{name}: {which} has no {KEY} for DSpark (the key fails at start-up or is ignored); "
                           f"{since} has it (docs/COMPAT.md); unset serve.draft_topk")
    if has == "unknown":
        known = f"{engine} {version}" if version else f"{engine} is not installed here"
        return Decision(setting, f"{name} as {KEY} ({known}: needs {since} on the serving host)")
    return Decision(setting, f"{name} as {KEY} ({engine} {version} takes it)")
