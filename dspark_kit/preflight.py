"""Check a recipe and its run directory against the ten silent acceptance killers (+ multi-node reachability).

Each pitfall of REFERENCE §8 loads, trains and serves without an error and
only shows up as a low acceptance length much later. `run_preflight` looks at
the recipe and whatever artifacts already exist in the work dir (regen jsonl,
prepared data, hidden states, checkpoints) and reports one Finding per
problem, tagged with the pitfall number. Missing artifacts are not faults:
preflight runs before, between and after the stages.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from dspark_kit import checkpoints as ckpt
from dspark_kit.recipe import Recipe

PITFALLS = {
    1: "Markov prev_token off by one",
    2: "draft layers left on sliding window",
    3: "regen model, train verifier and served verifier differ",
    4: "thinking mode differs between regen, prepare and bench",
    5: "hidden-state layer ids differ from the trainer's",
    6: "num_speculative_tokens above the trained slots",
    7: "wrong or missing mask token id",
    8: "serving the wrong or an incomplete checkpoint",
    9: "draft window below the training window / window with mtp",
    10: "serving context far above the training window with no window",
    11: "multi-node: only one machine can reach it",
}
NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")
# checkpoints.validate_checkpoint finding codes -> pitfall number
_CHECKPOINT_CODES = {
    "k-above-slots": 6, "slots-unknown": 6, "block-size": 6,
    "mask-missing": 7, "mask-mismatch": 7,
    "layer-ids": 5, "layers-unchecked": 5,
    "verifier-mismatch": 3, "verifier-unrecorded": 3, "verifier-relative": 3,
}  # fmt: skip
_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


@dataclass(frozen=True)
class Finding:
    pitfall: int
    level: Literal["error", "warning"]
    message: str

    def as_dict(self) -> dict:
        return {**asdict(self), "title": PITFALLS[self.pitfall]}


@dataclass
class _Context:
    recipe: Recipe
    workdir: Path
    verifier_path: str | None = None
    verifier_config: dict | None = None
    checkpoint: Path | None = None
    checkpoint_config: dict | None = None

    @property
    def num_layers(self) -> int | None:
        cfg = self.verifier_config or {}
        cfg = cfg.get("text_config", cfg)
        return cfg.get("num_hidden_layers")


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _regen_rows(path: Path, limit: int = 2000) -> list[dict]:
    rows = []
    if path.is_file():
        with path.open() as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
                if len(rows) >= limit:
                    break
    return rows


# ---- the checks: each returns findings for one pitfall ---------------------


def check_markov(ctx: _Context) -> list[Finding]:
    from dspark_kit import patches

    result = patches.probe("markov-prev-token", "cpu")
    if result.ok:
        return []
    return [Finding(1, "warning", f"installed speculators fails the Markov prev_token probe ({result.detail}); "
                                  "dspark-kit train patches it, but drafts trained without dspark-kit must be retrained")]  # fmt: skip


def check_sliding(ctx: _Context) -> list[Finding]:
    d, out = ctx.recipe.draft, []
    indices = ctx.recipe.full_attention_indices
    bad = [i for i in indices if not 0 <= i < d.num_layers]
    if bad:
        out.append(Finding(2, "error", f"draft.full_attention_indices {bad} >= draft.num_layers {d.num_layers}; "
                                       f"list 0..{d.num_layers - 1}"))  # fmt: skip
    sliding = [i for i in range(d.num_layers) if i not in indices]
    if d.attention == "sliding" and sliding:
        out.append(Finding(2, "warning", f"draft layers {sliding} use sliding window {d.sliding_window} "
                                         "(training only; inference attends fully); list every layer in "
                                         "draft.full_attention_indices if full attention is intended"))  # fmt: skip
    tl = (ctx.checkpoint_config or {}).get("transformer_layer_config") or {}
    ckpt_sliding = [
        i for i, t in enumerate(tl.get("layer_types") or []) if t == "sliding_attention"
    ]
    if ckpt_sliding and d.attention == "full":
        out.append(Finding(2, "error", f"checkpoint {ctx.checkpoint} has sliding-window layers {ckpt_sliding} "
                                       "but the recipe says draft.attention: full; retrain with "
                                       "--full-attention-indices covering every layer"))  # fmt: skip
    return out


def check_models(ctx: _Context) -> list[Finding]:
    """Regen side here; the checkpoint's stored verifier is compared in check_checkpoint."""
    recipe, out = ctx.recipe, []
    names = {recipe.served_model_name, recipe.verifier.path, ctx.verifier_path}
    metas = [
        r["metadata"]
        for r in _regen_rows(ctx.workdir / "regen.jsonl")
        if isinstance(r.get("metadata"), dict)
    ]
    models = {m["model"] for m in metas if m.get("model")}
    endpoints = {m["endpoint"].rstrip("/") for m in metas if m.get("endpoint")}
    configured = {e.rstrip("/") for e in recipe.regen.endpoints}
    strangers = sorted(
        e
        for e in endpoints
        if configured and not any(e.startswith(c) or c.startswith(e) for c in configured)
    )
    if strangers:
        out.append(Finding(3, "warning", f"regen.jsonl rows came from {strangers}, not regen.endpoints "
                                         f"{sorted(configured)}; make sure those servers ran the recipe verifier"))  # fmt: skip
    for model in sorted(models - names):
        out.append(Finding(3, "error", f"regen.jsonl was generated by model {model!r}, not the recipe verifier "
                                       f"{recipe.served_model_name!r}; regenerate with the verifier"))  # fmt: skip
    return out


def check_thinking(ctx: _Context) -> list[Finding]:
    want, out = ctx.recipe.verifier.thinking, []
    replies = [turn.get("value", "") for r in _regen_rows(ctx.workdir / "regen.jsonl")
               for turn in r.get("conversations", []) if turn.get("from") in ("gpt", "assistant")]  # fmt: skip
    thought = sum(1 for text in replies if any(m.strip() for m in _THINK.findall(text)))
    if replies and thought and not want:
        out.append(Finding(4, "error", f"{thought}/{len(replies)} regenerated replies carry <think> reasoning "
                                       "but verifier.thinking is false; regen, prepare and bench must agree"))  # fmt: skip
    if replies and want and not thought:
        out.append(Finding(4, "warning", "verifier.thinking is true but no regenerated reply has <think> "
                                         "reasoning (regen ran without thinking or a reasoning parser dropped it)"))  # fmt: skip
    recorded = {r["metadata"]["thinking"] for r in _regen_rows(ctx.workdir / "regen.jsonl")
                if isinstance(r.get("metadata"), dict) and "thinking" in r["metadata"]}  # fmt: skip
    if recorded - {want}:
        out.append(Finding(4, "error", f"regen ran with enable_thinking={sorted(recorded)} but verifier.thinking "
                                       f"is {want}; regenerate with the same mode"))  # fmt: skip
    meta = _read_json(ctx.workdir / "prepared" / "prepare_meta.json") or {}
    if "thinking" in meta and bool(meta["thinking"]) != want:
        out.append(Finding(4, "error", f"prepared data was rendered with thinking={meta['thinking']} but "
                                       f"verifier.thinking is {want}; re-run prepare"))  # fmt: skip
    return out


def check_layers(ctx: _Context) -> list[Finding]:
    n, out = ctx.num_layers, []
    hs = ctx.workdir / "prepared" / "hidden_states" / "hs_0.safetensors"
    if n is None or not hs.is_file():
        return out
    from safetensors import safe_open

    try:
        with safe_open(str(hs), framework="pt") as f:
            shape = list(f.get_slice("hidden_states").get_shape())
    except Exception as e:  # noqa: BLE001 - an unreadable file is itself the finding
        return [
            Finding(5, "error", f"{hs} unreadable ({type(e).__name__}); regenerate hidden states")
        ]
    exported = ctx.recipe.exported_layer_ids(n)
    hidden = (ctx.verifier_config or {}).get("hidden_size")
    if len(shape) != 3 or shape[1] != len(exported) or (hidden and shape[2] != hidden):
        out.append(Finding(5, "error", f"{hs} holds hidden_states {shape}; the trainer expects "
                                       f"[seq, {len(exported)}, {hidden}] for layer ids {exported}; "
                                       "regenerate hidden states with the recipe's target_layer_ids"))  # fmt: skip
    return out


def check_slots(ctx: _Context) -> list[Finding]:
    k, block = ctx.recipe.num_speculative_tokens, ctx.recipe.draft.block_size
    if k > block:
        return [Finding(6, "error", f"serve.num_speculative_tokens {k} > draft.block_size {block}; "
                                    f"set it <= {block}")]  # fmt: skip
    return []


def check_mask(ctx: _Context) -> list[Finding]:
    if ctx.verifier_path is None or not Path(ctx.verifier_path).is_dir():
        return [Finding(7, "warning", f"verifier {ctx.recipe.verifier.path} is not a local directory; "
                                      "mask token not checked")]  # fmt: skip
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        ctx.verifier_path, trust_remote_code=ctx.recipe.verifier.trust_remote_code
    )
    # the id training resolves: the recipe's, else the tokenizer's; else what a checkpoint recorded
    candidates = (ctx.recipe.draft.mask_token_id, tok.mask_token_id,
                  (ctx.checkpoint_config or {}).get("mask_token_id"))
    mask_id = next((m for m in candidates if m is not None), None)
    vocab = (ctx.verifier_config or {}).get("vocab_size") or len(tok)
    if mask_id is None and len(tok) < vocab:  # speculators' resolve_mask_token_id adds one there
        return [Finding(7, "warning", f"no mask token set: speculators will add <|MASK|> as id {len(tok)} "
                                      "(an unused embedding row); set draft.mask_token_id to pin it")]  # fmt: skip
    if mask_id is None:
        return [Finding(7, "error", "the tokenizer has no mask token, no unused vocabulary row, and "
                                    "draft.mask_token_id is unset; set it to a reserved special id")]  # fmt: skip
    if not 0 <= mask_id < vocab:
        return [
            Finding(
                7,
                "error",
                f"draft.mask_token_id {mask_id} outside the verifier vocabulary [0, {vocab})",
            )
        ]
    if mask_id < len(tok):
        token = tok.convert_ids_to_tokens(mask_id)
        special = set(tok.all_special_ids) | {
            i for i, t in tok.added_tokens_decoder.items() if t.special
        }
        if mask_id not in special:
            return [Finding(7, "error", f"draft.mask_token_id {mask_id} is the normal text token {token!r}; "
                                        "use a special or reserved id the verifier never emits")]  # fmt: skip
    stored = (ctx.checkpoint_config or {}).get("mask_token_id")
    if isinstance(stored, int) and stored != mask_id:
        return [
            Finding(
                7, "error", f"checkpoint mask_token_id {stored} != resolved mask token id {mask_id}"
            )
        ]
    return []


def check_windows(ctx: _Context) -> list[Finding]:
    s, out = ctx.recipe.serve, []
    window, train_w = s.draft_window_size, ctx.recipe.training_window
    mtp = any("mtp" in a for a in s.extra_args)
    if isinstance(window, int):
        if window <= 0:
            out.append(
                Finding(
                    9, "error", f"serve.draft_window_size {window} must be positive (or auto/off)"
                )
            )
        elif window < train_w:
            out.append(Finding(9, "warning", f"serve.draft_window_size {window} < training window {train_w}; "
                                             "acceptance drops (set >= the training window or auto)"))  # fmt: skip
        if mtp:
            out.append(Finding(9, "warning", "serve.draft_window_size with method mtp: vllm-ascend ignores "
                                             "the window for mtp; unset it"))  # fmt: skip
    windowed = (s.engine == "vllm-ascend" and window != "off") or (
        s.engine == "local" and isinstance(window, int)
    )
    sliding = len(ctx.recipe.full_attention_indices) < ctx.recipe.draft.num_layers
    if s.max_model_len and s.max_model_len > 2 * train_w and not windowed and not sliding:
        out.append(Finding(10, "warning", f"serve.max_model_len {s.max_model_len} > 2x training window {train_w} "
                                          f"with no draft window on engine {s.engine}: acceptance collapses on "
                                          "long contexts (set serve.draft_window_size, train a longer "
                                          "data.seq_length, or use sliding-window draft layers)"))  # fmt: skip
    return out


def check_checkpoint(ctx: _Context) -> list[Finding]:
    """Pitfall 8 (resolve + completeness) plus the checkpoint-side checks of 3/5/6/7."""
    base = ctx.workdir / "checkpoints"
    if not base.exists():
        return []  # not trained yet
    try:
        path = ckpt.resolve_checkpoint(base, ctx.recipe.serve.checkpoint)
    except ckpt.CheckpointError as e:
        return [Finding(8, "error", str(e))]
    out = []
    for f in ckpt.validate_checkpoint(path, ctx.recipe, ctx.num_layers, ctx.verifier_path):
        if f.code == "mask-mismatch" and ctx.recipe.draft.mask_token_id is None:
            continue  # check_mask compares against the tokenizer's id
        out.append(Finding(_CHECKPOINT_CODES.get(f.code, 8), f.level, f.message))
    return out


def _node_local(path: str | Path) -> bool:
    p = str(Path(path).resolve()) if Path(path).is_absolute() else str(path)
    return any(p == d or p.startswith(d + "/") for d in NODE_LOCAL_DIRS)


def check_multinode(ctx: _Context) -> list[Finding]:
    """Across nodes: the rendezvous must be reachable from every node, storage shared by all."""
    from dspark_kit.rendezvous import rendezvous_for

    recipe, out = ctx.recipe, []
    t, hs = recipe.train, recipe.hidden_states
    if t.device == "auto":
        from dspark_kit.devices import detect_device

        device = detect_device("auto")
    else:
        device = t.device  # planned as written, even on a machine without it
    rdzv = rendezvous_for(recipe, device)
    out += [Finding(11, "error", e) for e in rdzv.errors]
    out += [Finding(11, "warning", w) for w in rdzv.warnings]
    if t.nnodes == 1 or t.nodes_same_host:
        return out
    # One extraction server for every node (hidden_states.endpoint): it writes files on its own
    # machine that trainers / generate-offline-data on the other nodes read by path. (Without an
    # endpoint every node starts its own server, which reads and writes on the same machine.)
    served = hs.mode == "online" or hs.backend == "vllm"
    if served and hs.endpoint:
        from urllib.parse import urlparse

        from dspark_kit.rendezvous import master_is_loopback

        host = urlparse(hs.endpoint if "//" in hs.endpoint else f"http://{hs.endpoint}").hostname or ""
        if master_is_loopback(host):
            out.append(Finding(11, "error", f"hidden_states.endpoint {hs.endpoint} is loopback with train.nnodes "
                                            f"{t.nnodes}: trainers on other nodes would ask themselves; use the "
                                            "server's address every node can reach, or unset it so each node "
                                            "starts its own server"))  # fmt: skip
    if served and hs.endpoint and not hs.storage_shared and _node_local(hs.storage_path):
        out.append(Finding(11, "error", f"hidden_states.storage_path {hs.storage_path} is node-local with train.nnodes "
                                        f"{t.nnodes} and one extraction server ({hs.endpoint}) for every node: a "
                                        "trainer on another node cannot read the files it writes there; use shared "
                                        "storage mounted at the same path on every node (e.g. /mnt/cephfs/...) and "
                                        "set hidden_states.storage_shared: true, or unset hidden_states.endpoint "
                                        "so each node starts its own server"))  # fmt: skip
    if _node_local(ctx.workdir):
        out.append(Finding(11, "warning", f"work dir {ctx.workdir} is node-local with train.nnodes {t.nnodes}: every "
                                          "node reads prepared/ from it and a restart resumes from its checkpoints; "
                                          "put the run on storage every node mounts at the same path"))  # fmt: skip
    return out


CHECKS = [check_markov, check_sliding, check_models, check_thinking, check_layers,
          check_slots, check_mask, check_windows, check_checkpoint, check_multinode]  # fmt: skip


def _context(recipe: Recipe, workdir: Path, checkpoints: bool = True) -> _Context:
    from dspark_kit.tiny import resolve_verifier_path

    ctx = _Context(recipe, workdir)
    try:
        ctx.verifier_path = resolve_verifier_path(recipe.verifier.path)
    except Exception:  # noqa: BLE001 - an unresolvable verifier is reported by check_mask
        ctx.verifier_path = None
    if ctx.verifier_path and Path(ctx.verifier_path).is_dir():
        ctx.verifier_config = _read_json(Path(ctx.verifier_path) / "config.json")
    if not checkpoints:
        return ctx
    try:
        ctx.checkpoint = ckpt.resolve_checkpoint(workdir / "checkpoints", recipe.serve.checkpoint)
        ctx.checkpoint_config = ckpt.read_config(ctx.checkpoint)
    except ckpt.CheckpointError:
        pass  # check_checkpoint reports it when a checkpoints dir exists
    return ctx


def run_preflight(
    recipe: Recipe, workdir: str | Path | None = None, *, probes: bool = True, checkpoints: bool = True
) -> list[Finding]:
    """All findings for `recipe` and the artifacts in `workdir` (default: recipe.workdir).

    `checkpoints=False` ignores DIR/checkpoints: before training they are the
    stage's own output (an interrupted run leaves them partial), not an input.
    """
    ctx = _context(recipe, recipe.workdir_path(workdir), checkpoints)
    findings: list[Finding] = []
    for check in CHECKS:
        if (check is check_markov and not probes) or (check is check_checkpoint and not checkpoints):
            continue
        findings.extend(check(ctx))
    return sorted(findings, key=lambda f: (f.pitfall, f.level != "error"))


def has_errors(findings: list[Finding]) -> bool:
    return any(f.level == "error" for f in findings)


class PreflightError(ValueError):
    """Preflight found errors; the message lists each with its pitfall number."""


def enforce(recipe: Recipe, workdir: str | Path | None, stage: str, log=None) -> list[Finding]:
    """Run before train and serve: warnings are printed, errors stop the stage.

    Probes are skipped here: the training process applies the speculators fixes itself.
    """
    from dspark_kit.progress import note

    findings = run_preflight(recipe, workdir, probes=False, checkpoints=stage != "train")
    for f in findings:
        if f.level == "warning":
            (log or note)(f"preflight warning (pitfall {f.pitfall}): {f.message}")
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise PreflightError(f"preflight stopped {stage}: " + "; ".join(
            f"[pitfall {f.pitfall}] {f.message}" for f in errors) + " (see `dspark-kit preflight`)")
    return findings
