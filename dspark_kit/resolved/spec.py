"""Spec decisions: what a spec server is started with, each decided once (a mixin of `Resolved`).

Holds `SpecDecisions`: the tune read from the run folder, K (num_speculative_tokens), the
draft window (wanted, then what the engine applies, and its acceptance risks), the engine's
KV block, adaptive verification and the draft's top-k, plus what the serving engine supports
(engine_support, engine_gate). `Resolved` (resolved/__init__.py) composes it; the methods read
the resolver's recipe, engine, run folder, checkpoint and verifier facts through `self`.

Layer 3 like its package: may import core, data/, specdec/, compat/ and resolved/rules.py and
resolved/draft_topk.py; never the resolver itself, engines/, measure/, stages/ or cli/.
"""

from __future__ import annotations

from functools import cached_property

import dspark_kit.resolved.draft_topk as draft_topk  # noqa: PLR0402 - the submodule, not the package (no cycle)
from dspark_kit.compat import versions
from dspark_kit.recipe import parse_window
from dspark_kit.resolved.rules import (
    TUNED,
    Decision,
    ResolveError,
    Tune,
    is_deepseek_v4,
    long_context_note,
)
from dspark_kit.specdec.verifier_facts import language_model_config


class SpecDecisions:
    """K, window, KV block, adaptive verification and top-k for one `Resolved`."""

    # ---- tune, K, window ----------------------------------------------------
    @cached_property
    def tune(self) -> Tune | None:
        """The most recent tune of either kind (in-process or served) that recommends something."""
        return Tune.latest(self.run.tune_file, self.run.served_tune_file)

    def installed_version(self) -> str | None:
        name = "vllm-ascend" if self.engine == "vllm-ascend" else "vllm"
        if self._installed is not None:
            return self._installed.get(name)
        return versions.installed(name)

    @cached_property
    def k(self) -> Decision[int]:
        """num_speculative_tokens the server gets (and eval, bench and the manifest record)."""
        setting, block = self.recipe.serve.num_speculative_tokens, self.recipe.draft.block_size
        slots = self.trained_slots
        if isinstance(setting, int):
            k, source = setting, "serve.num_speculative_tokens"
        elif self.tune is not None and self.tune.k is not None:
            k, source = self.tune.k, f"{TUNED} ({self.tune.kind}, {self.tune.path})"
        elif slots is not None:
            k, source = slots, f"auto: the checkpoint's {slots} trained slots ({self.checkpoint}/config.json)"
        else:
            k, source = block, f"auto: draft.block_size {block} (no checkpoint yet; a DSpark draft trains block_size slots)"
        notes: list[str] = []  # K above the trained slots is a checkpoint finding (serve refuses it)
        if source.startswith(TUNED) and self.tune.note:
            notes.append(self.tune.note)
        rule = versions.k_rule(self.engine_support) if self.engine in ("vllm", "vllm-ascend") else None
        if rule is not None:
            chosen, note = rule.choose(k, slots or block)
            if note:
                notes.append(note)
            if chosen != k:
                k, source = chosen, f"{source}, then {self.engine}'s rule"
        return Decision(k, source, tuple(notes))

    @cached_property
    def engine_gate(self) -> versions.Gate:
        """Does the serving engine serve this checkpoint in its trained layout? Judged on the
        layout the checkpoint was trained in (specdec/anchor.py; None: unknown), or, before training, on what the
        kit's trainer writes. serve's plan, preflight and the served-acceptance gate all read this."""
        try:
            cfg = self.checkpoint_config
        except ValueError:  # CheckpointError: nothing trained to read yet
            cfg = None
        from dspark_kit.specdec.anchor import anchor_layout

        anchor = anchor_layout(cfg).sample_from_anchor if cfg else versions.KIT_SAMPLE_FROM_ANCHOR
        return self.engine_support.serves(anchor)

    @cached_property
    def engine_support(self) -> versions.EngineSupport:
        """What the serving engine does with a DSpark draft: the installed engine's own source, or
        the surveyed releases (docs/COMPAT.md) for the version given; vllm-ascend only on the vllm engines."""
        name = "vllm-ascend" if self.engine == "vllm-ascend" else "vllm"
        return versions.engine_support(name, self.installed_version())

    @cached_property
    def wanted_window(self) -> Decision[int | None]:
        """The draft window asked for (--draft-window-size, else the recipe), before asking what
        the engine can do."""
        flag = self.window_choice is not None
        setting = parse_window(self.window_choice if flag else self.recipe.serve.draft_window_size)
        name = "--draft-window-size" if flag else "serve.draft_window_size"
        train_w = self.recipe.training_window
        if setting == "off":
            return Decision(None, f"{name} off")
        if isinstance(setting, int):
            return Decision(setting, name)
        if self.tune is not None:
            how = f"{self.tune.window}" if self.tune.window else "none (windows did not help)"
            return Decision(self.tune.window, f"{TUNED} {how} ({self.tune.kind}, {self.tune.path})")
        return Decision(train_w, f"auto: the draft's training window {train_w}")

    @cached_property
    def window(self) -> Decision[int | None]:
        """draft_window_size the engine applies (None: no window), with a note per rule that fired.

        Rules (docs/CONCEPTS.md#k-and-the-draft-window): upstream vLLM has no runtime window (on CUDA it is trained in);
        vllm-ascend needs PR 14596 for DSpark and warns for DeepSeek-V4-native drafts; our
        local engine and eval apply it exactly like vllm-ascend (context + K window start).
        """
        wanted = self.wanted_window
        window, source, notes = wanted.value, wanted.source, []
        max_len = self.recipe.serve.max_model_len
        if self.engine == "llama.cpp":  # the plan's note names the window asked (engines/llamacpp.py)
            window, source = None, "engine llama.cpp: no draft window"
        elif self.engine == "vllm":
            if window is not None and not source.startswith("auto"):
                notes.append(f"{source} {window} ignored: CUDA vLLM has no runtime draft window "
                             "(train sliding-window draft layers instead)")
            window, source = None, "engine vllm: no runtime draft window"
        elif window is not None and max_len is not None and window >= max_len:
            # a window at or above the longest context never drops a block: sending it only adds a
            # dependency on an engine release that reads it
            window, source = None, (f"none: window {window} ({source}) >= serve.max_model_len {max_len}, "
                                    "so it could never apply")
        elif self.engine == "vllm-ascend" and window is not None:
            support = self._window_support or self.engine_support.has("window")
            first = self.engine_support.first_with("window")
            if is_deepseek_v4(self.verifier_config):
                notes.append("draft_window_size on a DSpark draft trained natively with a DeepSeek-V4 target: "
                             "vllm-ascend warns that windowing lowers its acceptance")
            if support == "no":
                notes.append(f"draft_window_size {window} omitted: vllm-ascend {self.installed_version()} does not "
                             f"apply a window to DSpark drafts; vllm-ascend >= {first} does (docs/COMPAT.md)")
                window, source = None, f"none: vllm-ascend {self.installed_version()} has no DSpark window"
            elif support == "unknown" and self.recipe.serve.assume_window_support:
                source = f"{source}; serve.assume_window_support: true (vllm-ascend >= {first} on the serving host)"
            elif support == "unknown":
                where = (f"vllm-ascend {self.installed_version()}" if self.installed_version()
                         else "vllm-ascend is not installed here")
                notes.append(f"draft_window_size {window} omitted: {where}, so the kit cannot confirm the "
                             f"DSpark window (vllm-ascend >= {first}); set serve.assume_window_support: true "
                             "if the serving host has it")
                window, source = None, f"none: {where} (window support unconfirmed)"
        block = self.kv_block_size
        if window is not None and block.value is not None and window < block.value:
            raise ResolveError(f"draft window {window} ({source}) < the KV block {block.value} ({block.source}): "
                               "a window starts on a block boundary, so the draft would see only part of one "
                               f"block; set serve.draft_window_size >= {block.value}, or off")
        return Decision(window, source, (*notes, *self._window_risks(window, source).values()))

    @property
    def conf_min(self) -> float:
        """llama.cpp's --spec-draft-p-min when adaptive verification is on: eval.confidence_threshold
        (the cut-off eval measures offline), else 0.5."""
        t = self.recipe.eval.confidence_threshold
        return t if t is not None else 0.5

    @cached_property
    def kv_block_size(self) -> Decision[int | None]:
        """The serving engine's KV-cache block: a draft window starts on one of its boundaries."""
        from dspark_kit.specdec.window import ASCEND_KV_BLOCK_SIZE, LOCAL_KV_BLOCK_SIZE

        if self.engine == "local":
            return Decision(LOCAL_KV_BLOCK_SIZE, "the local engine's KV block")
        if self.engine == "vllm-ascend":
            args = list(self.recipe.serve.extra_args)
            if "--block-size" in args[:-1]:
                return Decision(int(args[args.index("--block-size") + 1]), "--block-size in serve.extra_args")
            return Decision(ASCEND_KV_BLOCK_SIZE, "vllm-ascend's default KV block (no --block-size in serve.extra_args)")
        return Decision(None, "engine vllm: no runtime draft window")

    @cached_property
    def adaptive_verification(self) -> Decision[bool]:
        """Whether the server sizes the verify budget from the draft's confidence head (vLLM's
        enable_adaptive_verification, vllm-ascend's dynamic_spec_config). `on` that cannot work
        is a ResolveError with one line; `auto` is on only where everything it needs is there."""
        setting, s = self.recipe.serve.adaptive_verification, self.recipe.serve
        name = f"serve.adaptive_verification {setting}"
        if setting == "off":
            return Decision(False, name)
        if self.engine == "local":
            return Decision(False, f"{name}: the local engine verifies a fixed K "
                                   "(eval.confidence_threshold measures the budget offline)")
        if self.engine == "llama.cpp":  # --spec-draft-p-min: asked for, never on by itself
            try:
                cfg = self.checkpoint_config
            except ValueError:
                cfg = None
            head = bool(cfg.get("enable_confidence_head")) if cfg else self.recipe.draft.confidence_head
            if setting == "auto":
                return Decision(False, f"{name}: llama.cpp cuts blocks by confidence only when asked "
                                       "(serve.adaptive_verification on)")
            if not head:
                raise ResolveError("serve.adaptive_verification on: the draft has no confidence head; set "
                                   "serve.adaptive_verification: off")
            return Decision(True, f"{name}: llama.cpp --spec-draft-p-min {self.conf_min}")
        support, first = self.engine_support.has("adaptive"), self.engine_support.first_with("adaptive")
        try:
            cfg = self.checkpoint_config
        except ValueError:  # CheckpointError: nothing to read yet
            cfg = None
        head = bool(cfg.get("enable_confidence_head")) if cfg else self.recipe.draft.confidence_head
        where = "the checkpoint" if cfg else "draft.confidence_head"
        version = self.installed_version()
        reasons = []
        if not head:
            reasons.append(f"{where} has no confidence head")
        if support == "no":
            reasons.append(f"{self.engine} {version} has no adaptive verification ({self.engine} >= {first} has)")
        if self.engine == "vllm" and s.enforce_eager:
            reasons.append("vLLM's adaptive verification captures CUDA graphs and serve.enforce_eager is true")
        if setting == "on" and reasons:
            raise ResolveError(f"serve.adaptive_verification on: {'; '.join(reasons)}; fix that or set "
                               "serve.adaptive_verification: off")
        if reasons:
            return Decision(False, f"{name}: " + "; ".join(reasons))
        if support == "unknown":
            known = f"{self.engine} {version}" if version else f"{self.engine} not installed here"
            if setting == "auto":
                return Decision(False, f"{name}: {known} (adaptive verification from {self.engine} >= {first}; "
                                       "set on if the serving host has it)")
            return Decision(True, f"{name} ({known}: needs {self.engine} >= {first} on the serving host)")
        return Decision(True, f"{name} ({self.engine} {version} has it, {where} has a confidence head)")

    @cached_property
    def draft_topk(self) -> Decision[int | None]:
        """dspark_draft_topk the spec server gets (serve.draft_topk; None: greedy drafting)."""
        try:
            cfg = self.checkpoint_config
        except ValueError:  # CheckpointError: nothing trained to read yet
            cfg = None
        vocab = draft_topk.draft_vocab(cfg, self.recipe.draft.draft_vocab_size,
                                       language_model_config(self.verifier_config or {}).get("vocab_size"))
        vllm = self.engine in ("vllm", "vllm-ascend")
        return draft_topk.decide(self.recipe.serve.draft_topk, self.engine, self.engine_support if vllm else None,
                                 vocab, self.engine_support.first_with("draft_topk") if vllm else None)

    @property
    def window_risks(self) -> dict[int, str]:
        """The window decision's acceptance risks by pitfall number (9: below the training window,
        10: long contexts with nothing to bridge them); also among `window.notes`, same words."""
        return self._window_risks(self.window.value, self.window.source)

    def _window_risks(self, window: int | None, source: str) -> dict[int, str]:
        train_w, out = self.recipe.training_window, {}
        if window is not None and window < train_w:
            if source.startswith(TUNED):  # measured on this draft: say so, keep the rule visible
                out[9] = (f"draft_window_size {window} < training window {train_w}: the tune measured it best "
                          "on this draft (pitfall 9's rule of thumb is >= the training window; re-tune on "
                          "the real verifier)")
            else:
                out[9] = (f"draft_window_size {window} < training window {train_w}: the draft saw longer "
                          "contexts in training; acceptance usually drops (set >= training window)")
        risk = long_context_note(self.recipe, window)
        if risk:
            out[10] = risk
        return out
