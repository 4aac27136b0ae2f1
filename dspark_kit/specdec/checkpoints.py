"""Find and check the DSpark checkpoint a server will load.

speculators' save_path layout: `<save_path>/<epoch>/{model.safetensors,
config.json}` per epoch, plus symlinks `epochN_end` and `checkpoint_best`.
Serving the wrong directory, a K above the trained slots, other layer ids or
another verifier all load fine and silently ruin acceptance (docs/PITFALLS.md), so
`validate_checkpoint` names each mismatch with both values.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark_kit.findings import Finding, errors  # noqa: F401 - errors: re-exported for callers
from dspark_kit.recipe import Recipe
from dspark_kit.rundir import BEST_CHECKPOINT, epoch_dirs

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


class CheckpointError(ValueError):
    """One line naming the checkpoint setting and the fix."""


def is_complete(path: Path) -> bool:
    return (path / CONFIG).is_file() and (path / WEIGHTS).is_file()


TRAINING_STATE = "training_state.json"  # speculators writes it last into an epoch dir: epoch, local_step, global_step
INTERRUPTED = "interrupted"  # speculators' save on SIGINT/SIGTERM


def training_state(path: Path) -> dict | None:
    try:
        state = json.loads((Path(path) / TRAINING_STATE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) else None


def mid_epoch(path: Path) -> bool:
    """A save from inside an epoch (speculators' checkpoint_freq < 1, or an adopted `interrupted`):
    its training state counts the epoch's steps done so far; an epoch's end records 0."""
    state = training_state(path) or {}
    return isinstance(state.get("local_step"), int) and state["local_step"] > 0


def complete_epochs(save_path: Path) -> list[int]:
    """Whole epochs: epoch directories that hold config.json and model.safetensors and were not
    saved mid-epoch (what `latest` and the report count)."""
    if not save_path.is_dir():
        return []
    return [int(p.name) for p in epoch_dirs(save_path) if is_complete(p) and not mid_epoch(p)]


def _available(save_path: Path) -> str:
    epochs = complete_epochs(save_path)
    names = sorted(p.name for p in save_path.iterdir() if p.is_symlink()) if save_path.is_dir() else []
    listed = [str(e) for e in epochs] + names
    return ", ".join(listed) if listed else "none"


def resolve_checkpoint(checkpoints: str | Path, which: str | int | Path = BEST_CHECKPOINT) -> Path:
    """Absolute checkpoint directory (symlinks followed) for a serve.checkpoint value.

    `which`: "checkpoint_best" / "epochN_end" (speculators symlinks), "latest"
    (highest complete epoch), an epoch number, or a path. `checkpoints` is the
    save_path or a checkpoint directory itself.
    """
    base = Path(checkpoints).expanduser()
    if isinstance(which, Path) or (isinstance(which, str) and ("/" in which or which.startswith("~"))):
        target = Path(which).expanduser()
    elif is_complete(base) and which == BEST_CHECKPOINT:
        target = base  # already a checkpoint directory
    elif which == "latest":
        epochs = complete_epochs(base)
        if not epochs:
            raise CheckpointError(
                f"serve.checkpoint latest: no complete epoch (config.json + {WEIGHTS}) under {base}; "
                "train first or pass --checkpoint PATH")
        target = base / str(epochs[-1])
    elif isinstance(which, int) or (isinstance(which, str) and which.isdigit()):
        target = base / str(int(which))
    else:
        target = base / str(which)
    if not target.exists():
        if not base.is_dir():
            raise CheckpointError(f"serve.checkpoint {which}: {base} does not exist; train first "
                                  "(dspark-kit train) or pass --checkpoint PATH")
        raise CheckpointError(
            f"serve.checkpoint {which}: {target} not found; available in {base}: "
            f"{_available(base)} (pass --checkpoint NAME|EPOCH|latest|PATH)")
    target = target.resolve()
    if not (target / CONFIG).is_file():
        raise CheckpointError(f"serve.checkpoint {which}: {target} has no {CONFIG}; "
                              "point at an epoch directory of speculators' save_path")
    return target


def read_config(path: Path) -> dict:
    try:
        return json.loads((Path(path) / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read {CONFIG} ({e})") from None


def trained_slots(cfg: dict) -> int | None:
    """Draft positions the checkpoint was trained to propose (specdec/anchor.py decides)."""
    from dspark_kit.specdec.anchor import anchor_layout

    return anchor_layout(cfg).slots


def ks_outside_slots(ks, slots: int) -> list[int]:
    """The K values a draft with `slots` trained slots cannot propose (K is 1..slots): the one rule
    serve, eval, both tunes, the decoder and the engine gates apply."""
    return [k for k in ks if not 1 <= k <= slots]


def slots_error(what: str, bad: list[int], slots: int) -> str:
    return f"{what} {bad if len(bad) > 1 else bad[0]}: outside 1..{slots} (the checkpoint's trained slots)"


def stored_verifier(cfg: dict) -> str | None:
    return ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")


def _same_path(a: str, b: str) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a.rstrip("/") == b.rstrip("/")


def _check_weights(path: Path) -> Finding | list[str]:
    """A finding when model.safetensors is missing or unreadable, else its tensor names."""
    weights = path / WEIGHTS
    if not weights.is_file():
        return Finding("error", "weights-missing", f"{weights} missing: the epoch did not finish saving; "
                                                   "serve another epoch (--checkpoint latest)")
    try:
        from safetensors import safe_open

        # opening validates the header against the file size: a truncated save fails here
        with safe_open(str(weights), framework="pt") as f:
            keys = list(f.keys())
    except Exception as e:  # noqa: BLE001 - any read failure means a broken file
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        return Finding("error", "weights-unreadable", f"{weights} unreadable ({msg}); re-save or pick another epoch")
    if not keys:
        return Finding("error", "weights-empty", f"{weights} holds no tensors")
    return keys


def validate_checkpoint(path: str | Path, recipe: Recipe, verifier_num_layers: int | None,
                        verifier_path: str | None, k: int, target_vocab_size: int | None = None) -> list[Finding]:
    """Everything that makes this checkpoint wrong for this recipe; [] = fine.

    Called through `Resolved.checkpoint_findings`, which supplies the loadable
    verifier path, layer count, K and vocabulary; `verifier_num_layers` None skips the
    layer-id check with a warning; `target_vocab_size` None judges a reduced vocabulary
    against the draft's own input vocabulary and skips the expanded-vocabulary check.
    """
    path = Path(path)
    out: list[Finding] = []
    try:
        cfg = read_config(path)
    except CheckpointError as e:
        return [Finding("error", "config-missing", str(e))]

    kind = cfg.get("speculators_model_type")
    if kind != "dspark":
        out.append(Finding("error", "not-dspark", f"{path}/{CONFIG}: speculators_model_type is {kind!r}, "
                                                  "expected 'dspark' (serve a DSpark checkpoint)"))

    block = cfg.get("block_size")
    if isinstance(block, int) and block != recipe.draft.block_size:
        out.append(Finding("warning", "block-size", f"checkpoint block_size {block} != recipe "
                                                    f"draft.block_size {recipe.draft.block_size}"))
    slots = trained_slots(cfg)
    if slots is None:
        out.append(Finding("warning", "slots-unknown", f"{CONFIG} records neither speculative_tokens nor "
                                                       f"block_size; cannot check num_speculative_tokens {k}"))
    elif ks_outside_slots([k], slots):
        out.append(Finding("error", "k-above-slots", f"serve.num_speculative_tokens {k} > trained slots {slots} "
                                                     f"(checkpoint); set serve.num_speculative_tokens <= {slots}"))

    mask = cfg.get("mask_token_id")
    if not isinstance(mask, int):
        out.append(Finding("error", "mask-missing", f"{CONFIG} has no mask_token_id ({mask!r}); "
                                                    "retrain with draft.mask_token_id set"))
    elif recipe.draft.mask_token_id is not None and mask != recipe.draft.mask_token_id:
        out.append(Finding("error", "mask-mismatch", f"checkpoint mask_token_id {mask} != recipe "
                                                     f"draft.mask_token_id {recipe.draft.mask_token_id}"))

    ids = cfg.get("aux_hidden_state_layer_ids", cfg.get("target_layer_ids"))
    if verifier_num_layers is None:
        out.append(Finding("warning", "layers-unchecked", f"verifier num_hidden_layers unknown; checkpoint "
                                                          f"layer ids {ids} not compared with the recipe"))
    else:
        want = recipe.target_layer_ids(verifier_num_layers)
        if ids is None or list(ids) != want:
            out.append(Finding("error", "layer-ids", f"checkpoint aux_hidden_state_layer_ids {ids} != recipe "
                                                     f"target layer ids {want}; the draft reads other layers"))

    stored = stored_verifier(cfg)
    if verifier_path is not None:
        if not stored:
            out.append(Finding("warning", "verifier-unrecorded", f"{CONFIG} records no verifier name_or_path; "
                                                                 f"cannot confirm it was trained on {verifier_path}"))
        elif not _same_path(stored, verifier_path):
            out.append(Finding("error", "verifier-mismatch", f"checkpoint verifier {stored} != recipe verifier "
                                                             f"{verifier_path}; serve the verifier it was trained on"))
        elif not Path(stored).is_absolute() and Path(stored).exists():
            out.append(Finding("warning", "verifier-relative", f"checkpoint stores a relative verifier path "
                                                               f"{stored}; it breaks when loaded from elsewhere"))

    from dspark_kit.specdec.anchor import anchor_layout

    anchor = anchor_layout(cfg)
    problem = anchor.problem()
    if problem:  # a missing key (each loader reads it its own way) or a layout the import measured wrong
        code = "anchor-measured" if anchor.known else "anchor-missing"
        out.append(Finding("error", code, problem))
    weights = _check_weights(path)
    if isinstance(weights, Finding):
        out.append(weights)
    else:
        out += draft_weight_findings(cfg, weights, target_vocab_size)
    return out


def init_from_problem(path: str | Path, recipe: Recipe, target_layer_ids: list[int]) -> str | None:
    """Why train.init_from cannot start this recipe's training (None: it can): a speculators DSpark
    draft with weights, trained on the same verifier layers, block and anchor layout."""
    path, name = Path(path), f"train.init_from {path}"
    try:
        cfg = read_config(path)
    except CheckpointError as e:
        return f"{name}: {e}"
    if cfg.get("speculators_model_type") != "dspark":
        return (f"{name}: not a speculators DSpark checkpoint (speculators_model_type "
                f"{cfg.get('speculators_model_type')!r}); a released DSpark draft: `dspark-kit import` it first")
    if not (path / WEIGHTS).is_file():
        return f"{name}: no {WEIGHTS}; point at an epoch folder or an imported draft"
    from dspark_kit.specdec.anchor import anchor_layout

    problem = anchor_layout(cfg).problem()
    if problem:
        return f"{name}: {problem}"
    block = cfg.get("block_size")
    if block != recipe.draft.block_size:
        return f"{name}: block_size {block} != draft.block_size {recipe.draft.block_size}; set draft.block_size: {block}"
    ids = cfg.get("aux_hidden_state_layer_ids")
    if ids != target_layer_ids:
        return (f"{name}: aux_hidden_state_layer_ids {ids} != the recipe's target layer ids {target_layer_ids}; "
                f"set hidden_states.target_layer_ids: {ids}")
    mask = recipe.draft.mask_token_id
    if mask is not None and cfg.get("mask_token_id") != mask:
        return f"{name}: mask_token_id {cfg.get('mask_token_id')} != draft.mask_token_id {mask}"
    vocab, wanted = cfg.get("draft_vocab_size"), recipe.draft.draft_vocab_size
    if init_vocab_mapping(path) and wanted is not None and vocab != wanted:
        return (f"{name}: its draft vocabulary has {vocab} tokens != draft.draft_vocab_size {wanted}; "
                f"set draft.draft_vocab_size: {vocab}")
    return None


VOCAB_MAPPING = ("d2t", "t2d")  # a reduced-vocabulary draft's token maps, in its weights


def init_vocab_mapping(path: str | Path) -> bool:
    """Whether a draft's weights hold a reduced vocabulary's mapping (d2t, t2d). speculators'
    --from-pretrained loads them, then replaces them with the training data's mapping
    (`load_vocab_mappings` after the weights, speculators 0.9.0 model.py): the draft's lm_head rows
    would then stand for other tokens. The kit passes the draft's own mapping instead."""
    names = _check_weights(Path(path))  # its tensor names, or a finding (missing, unreadable)
    return isinstance(names, list) and all(k in names for k in VOCAB_MAPPING)


def init_vocab_files(out: Path) -> dict[str, Path]:
    """{d2t, t2d: the .npy file in `out`}: where write_init_vocab writes them and the trainer's
    --d2t-path/--t2d-path read them, named here once."""
    return {name: out / f"{name}.npy" for name in VOCAB_MAPPING}


def write_init_vocab(path: str | Path, out: Path) -> dict[str, Path]:
    """The draft's own d2t and t2d as .npy files in `out` (speculators' --d2t-path/--t2d-path),
    each written to a temp name and renamed; {name: file}."""
    import numpy as np
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    files = init_vocab_files(out)
    with safe_open(str(Path(path) / WEIGHTS), "pt") as f:
        for name, dest in files.items():
            tmp = out / f".{name}.npy.tmp"
            with open(tmp, "wb") as fh:
                np.save(fh, f.get_tensor(name).numpy())
            tmp.replace(dest)
    return files


# the findings of draft_weight_findings: `contract` adds them to vLLM's own judgement
WEIGHT_CODES = ("reduced-vocab-weights", "expanded-vocab-weights", "confidence-head-missing", "confidence-head-unused")


def _has(names: list[str], part: str) -> bool:
    return any(part in name.split(".") for name in names)


def draft_weight_findings(cfg: dict, names: list[str], target_vocab_size: int | None) -> list[Finding]:
    """What vLLM's DSpark model stopped checking at load (0.34.0, docs/COMPAT.md "checks draft
    weights"), judged as its load_weights reads the config and tensor names: a draft that breaks
    these loads silently there and drafts garbage or runs a random head."""
    out = []
    layer = cfg.get("transformer_layer_config") or {}
    vocab = cfg.get("vocab_size") or layer.get("vocab_size")  # the draft's input vocabulary
    draft_vocab = cfg.get("draft_vocab_size") or vocab
    target = target_vocab_size or vocab
    if isinstance(draft_vocab, int) and isinstance(target, int) and draft_vocab < target:
        lacking = [n for n, part in (("lm_head", "lm_head"), ("d2t", "d2t")) if not _has(names, part)]
        if lacking:
            out.append(Finding("error", "reduced-vocab-weights",
                               f"draft_vocab_size {draft_vocab} < the verifier's {target} (a reduced vocabulary) but "
                               f"{WEIGHTS} has no {' or '.join(lacking)}: vLLM would draft with the verifier's head "
                               "and unmapped ids; re-save from the trainer with the draft's lm_head and d2t"))
    if isinstance(vocab, int) and target_vocab_size and vocab > target_vocab_size and not _has(names, "embed_tokens"):
        out.append(Finding("error", "expanded-vocab-weights",
                           f"the draft's vocab_size {vocab} > the verifier's {target_vocab_size} (an expanded input "
                           f"vocabulary) but {WEIGHTS} has no embed_tokens; re-save the draft with its embed_tokens"))
    enabled, present = cfg.get("enable_confidence_head") is True, _has(names, "confidence_head")
    if enabled and not present:
        out.append(Finding("error", "confidence-head-missing",
                           f"{CONFIG} sets enable_confidence_head but {WEIGHTS} has no confidence_head weights "
                           "(vLLM >= 0.34.0 would serve an untrained head); set \"enable_confidence_head\": false "
                           "in config.json or re-save from the trainer"))
    elif present and not enabled:
        out.append(Finding("error", "confidence-head-unused",
                           f"{WEIGHTS} holds confidence_head weights but {CONFIG}'s enable_confidence_head is "
                           f"{cfg.get('enable_confidence_head')!r} (vLLM drops them; adaptive verification has no "
                           "head); set \"enable_confidence_head\": true in config.json"))
    return out


def set_aside_incomplete_checkpoints(checkpoints: Path) -> list[Path]:
    """Rename epoch dirs a killed run left half-written, so speculators resumes from a whole one.

    speculators writes an epoch's model, optimizer and scheduler state in place
    and `training_state.json` last; an epoch dir without it was cut off mid-save
    and would crash the resume (a truncated optimizer file). It is kept, renamed
    `incomplete-<epoch>`, which speculators' epoch scan ignores.
    """
    moved = []
    for d in epoch_dirs(checkpoints):
        if not (d / TRAINING_STATE).exists():
            target = d.with_name(f"incomplete-{d.name}")
            n = 1
            while target.exists():
                target, n = d.with_name(f"incomplete-{d.name}-{n}"), n + 1
            d.rename(target)
            moved.append(target)
    return moved


def _aside(d: Path, prefix: str) -> Path:
    """`d` renamed `<prefix>-<name>` (numbered when taken): kept for a look, ignored by speculators'
    epoch scan, `latest` and the report (not a number, not `interrupted`)."""
    target, n = d.with_name(f"{prefix}-{d.name}"), 1
    while target.exists():
        target, n = d.with_name(f"{prefix}-{d.name}-{n}"), n + 1
    d.rename(target)
    return target


def _scheduler_steps(path: Path) -> int | None:
    """Optimizer steps a save had taken: its LR scheduler's step count (torch's LRScheduler
    `last_epoch`, one per training step; saved unrounded, unlike the optimizer's bf16 state)."""
    f = path / "scheduler_state_dict.pt"
    if not f.is_file():
        return None
    import torch

    try:
        state = torch.load(f, weights_only=True)
    except Exception:  # noqa: BLE001 - any unreadable file: not adoptable
        return None
    first = state[0] if isinstance(state, list) and state else state
    steps = first.get("last_epoch") if isinstance(first, dict) else None
    return steps if isinstance(steps, int) else None


def adopt_interrupted(checkpoints: Path) -> str | None:
    """Make speculators resume from the `interrupted` save a SIGINT/SIGTERM left; one line saying
    what was done, or why the run resumes from the last whole epoch instead (None: none there).

    speculators 0.9.0 saves `interrupted` (model, optimizer, scheduler) without the
    training_state.json it writes into numbered saves, and its resume scan skips that name with a
    warning. Its own mid-epoch saves (checkpoint_freq < 1) are numbered dirs whose state records the
    steps done in that epoch, and it resumes those exactly (fast-skipping the done batches). So the
    kit numbers `interrupted` as the epoch it stopped in and writes the state speculators would
    have: the steps come from the scheduler's step count minus the last numbered save's.
    """
    src = Path(checkpoints) / INTERRUPTED
    if not src.is_dir() or src.is_symlink():
        return None
    numbered = epoch_dirs(checkpoints)
    last = numbered[-1] if numbered else None
    state = training_state(last) if last is not None else {"epoch": -1, "local_step": 0, "global_step": 0}
    steps = _scheduler_steps(src) if is_complete(src) else None
    why = None
    if steps is None:
        why = ("it records no scheduler step count (speculators' --scheduler-type none, or a save cut off), so the step "
               "it stopped at is unknown")
    elif state is None or not all(isinstance(state.get(k), int) for k in ("epoch", "local_step", "global_step")):
        why = f"{last.name}/{TRAINING_STATE} is unreadable, so the epoch it stopped in is unknown"
    elif steps <= state["global_step"]:
        why = (f"it is no later than {last.name} (step {steps} <= {state['global_step']}): it stopped at an "
               "epoch's end or is left from an earlier run")
    if why:
        kept = _aside(src, "unused")
        return f"{src.name} not resumed from (kept as {kept.name}): {why}; resuming from the last whole epoch"
    mid = state["local_step"] > 0  # the last save is itself inside its epoch: the same epoch continues
    epoch = state["epoch"] if mid else state["epoch"] + 1
    local = (state["local_step"] if mid else 0) + steps - state["global_step"]
    target = Path(checkpoints) / str(epoch)
    if target.exists():  # an older save of the same epoch (a mid-epoch one): the interrupted one is later
        _aside(target, "superseded")
    src.rename(target)
    tmp = target / f".{TRAINING_STATE}.tmp"
    tmp.write_text(json.dumps({"epoch": epoch, "local_step": local, "global_step": steps}))
    tmp.rename(target / TRAINING_STATE)
    link = Path(checkpoints) / f"epoch{epoch}_step{local}"  # as speculators names its mid-epoch saves
    if not link.exists() and not link.is_symlink():
        link.symlink_to(str(epoch))
    return (f"{INTERRUPTED} resumed from: renamed {epoch} (epoch {epoch}, {local} steps into it, global step "
            f"{steps}), a mid-epoch save speculators continues from")
