"""Check a recipe and its run directory against the ten silent acceptance killers (+ multi-node reachability).

Each pitfall of docs/PITFALLS.md loads, trains and serves without an error and
only shows up as a low acceptance length much later. `run_preflight` looks at
the recipe and whatever artifacts already exist in the work dir (regen jsonl,
prepared data, hidden states, checkpoints) and reports one Finding per
problem, tagged with the pitfall number. Missing artifacts are not faults:
preflight runs before, between and after the stages.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from dspark_kit.data import mask_emitted, mode_rule
from dspark_kit.data.mode_rule import ModeCounts
from dspark_kit.findings import (
    PITFALLS,  # noqa: F401 - the pitfall titles, re-exported
    Finding,
)
from dspark_kit.recipe import Recipe, RecipeError
from dspark_kit.recipe.mixture import parse_weights, support, thinking_key
from dspark_kit.resolved import Resolved
from dspark_kit.rundir import RunDir, hidden_state_file
from dspark_kit.specdec import checkpoints as ckpt
from dspark_kit.specdec.verifier_facts import has_tokenizer_files

NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")
# checkpoints.validate_checkpoint finding codes -> pitfall number
_CHECKPOINT_CODES = {
    "k-above-slots": 6, "slots-unknown": 6, "block-size": 6,
    "mask-missing": 7, "mask-mismatch": 7,
    "layer-ids": 5, "layers-unchecked": 5,
    "verifier-mismatch": 3, "verifier-unrecorded": 3, "verifier-relative": 3,
}  # fmt: skip


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def label(f: Finding) -> str:
    """What a finding is, for one line: its pitfall number, else its code."""
    return f"pitfall {f.pitfall}" if f.pitfall is not None else f.code


def pitfall(number: int, level: str, message: str) -> Finding:
    """A preflight finding: the shared Finding tagged with its pitfall number."""
    return Finding(level, f"pitfall-{number}", message, number)


@dataclass
class _Context:
    res: Resolved
    checkpoint: Path | None = None
    checkpoint_config: dict | None = None

    @property
    def recipe(self) -> Recipe:
        return self.res.recipe

    @property
    def run(self) -> RunDir:
        return self.res.run

    @property
    def verifier_path(self) -> str:
        return self.res.verifier_path

    @property
    def verifier_config(self) -> dict | None:
        """Resolved's: a local config.json or the HF cache (a verifier that lives only in a
        model cache keeps the hidden-size check)."""
        return self.res.verifier_config

    @property
    def num_layers(self) -> int | None:
        """The resolver's N: the verifier's config, else the recipe's verifier.num_hidden_layers."""
        try:
            return self.res.num_hidden_layers
        except RecipeError:
            return None


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _regen_rows(path: Path, limit: int = 2000) -> list[dict]:
    from dspark_kit.jsonl import BadLine, read_jsonl

    if not path.is_file():
        return []
    return list(itertools.islice((r for r in read_jsonl(path) if not isinstance(r, BadLine)), limit))


# ---- the checks: each returns findings for one pitfall ---------------------


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


def check_models(ctx: _Context) -> list[Finding]:
    """Regen side here; the checkpoint's stored verifier is compared in check_checkpoint."""
    recipe, out = ctx.recipe, []
    served = ctx.res.served_name
    names = {served, recipe.verifier.path, ctx.verifier_path}
    metas = [r["metadata"] for r in _regen_rows(ctx.run.regen_jsonl) if isinstance(r.get("metadata"), dict)]
    models = {m["model"] for m in metas if m.get("model")}
    endpoints = {m["endpoint"].rstrip("/") for m in metas if m.get("endpoint")}
    configured = {e.rstrip("/") for e in recipe.regen.endpoints}
    strangers = sorted(e for e in endpoints
                       if configured and not any(e.startswith(c) or c.startswith(e) for c in configured))
    if strangers:
        out.append(pitfall(3, "warning", f"regen.jsonl rows came from {strangers}, not regen.endpoints "
                                         f"{sorted(configured)}; make sure those servers ran the recipe verifier"))  # fmt: skip
    for model in sorted(models - names):
        out.append(pitfall(3, "error", f"regen.jsonl was generated by model {model!r}, not the recipe verifier "
                                       f"{served!r}; regenerate with the verifier"))  # fmt: skip
    return out


def _undecided_mode_counts(rows: list[dict], thinking, mixture_seed) -> ModeCounts:
    """What prepare will decide for the rows nobody decided yet (no regen metadata.mode_check): the
    same rule and budget (data/mode_rule.py), applied ahead of the hours before it; recorded
    decisions are never judged again."""
    from dspark_kit.data.conversations import ConversationError, has_reasoning, normalize
    from dspark_kit.data.template_rows import row_thinking

    counts = ModeCounts()
    for r in rows:
        if mode_rule.recorded(r) is not None:
            continue
        try:
            msgs, mode = normalize(r), row_thinking(r, thinking, mixture_seed)
        except ConversationError:
            continue
        counts.add(mode, has_reasoning(msgs), mode_rule.decide(msgs, mode))
    return counts


def _recorded_thinking(value: object) -> object:
    """A mode (or mixture) as prepare_meta.json records it, comparable with verifier.thinking."""
    try:
        return parse_weights(value, thinking_key, "")
    except ValueError:
        return value


def check_thinking(ctx: _Context) -> list[Finding]:
    want, out = ctx.recipe.verifier.thinking, []
    modes = support(want)  # [False], [True], or both for a mixture
    shown = str(want).lower() if isinstance(want, bool) else f"the mixture {want}"
    data = ctx.run.regen_jsonl
    if not data.is_file() and not ctx.recipe.regen.enabled and ctx.recipe.data.source.endswith((".jsonl", ".ndjson")):
        data = Path(ctx.recipe.data.source).expanduser()  # prepare reads the raw data then
    if not ctx.run.prepare_meta.is_file():  # once prepared, its recorded decision stands
        counts = _undecided_mode_counts(_regen_rows(data), want, ctx.recipe.mixture_seed)
        if verdict := counts.verdict(ctx.recipe.data.max_mode_mismatch_fraction, f"prepare would fail on {data.name}"):
            out.append(pitfall(4, "error", verdict))
    recorded = {r["metadata"]["thinking"] for r in _regen_rows(ctx.run.regen_jsonl)
                if isinstance(r.get("metadata"), dict) and "thinking" in r["metadata"]}  # fmt: skip
    if recorded - set(modes):
        out.append(pitfall(4, "error", f"regen ran with enable_thinking={sorted(recorded)} but verifier.thinking "
                                       f"is {shown}; regenerate with the same mode"))  # fmt: skip
    meta = _read_json(ctx.run.prepare_meta) or {}
    if "thinking" in meta and _recorded_thinking(meta["thinking"]) != want:
        out.append(pitfall(4, "error", f"prepared data was rendered with thinking={meta['thinking']} but "
                                       f"verifier.thinking is {shown}; re-run prepare"))  # fmt: skip
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
    hidden = (ctx.verifier_config or {}).get("hidden_size")
    if len(shape) != 3 or shape[1] != len(exported) or (hidden and shape[2] != hidden):
        out.append(pitfall(5, "error", f"{hs} holds hidden_states {shape}; the trainer expects "
                                       f"[seq, {len(exported)}, {hidden}] for layer ids {exported}; "
                                       "regenerate hidden states with the recipe's target_layer_ids"))  # fmt: skip
    return out


def check_mask(ctx: _Context) -> list[Finding]:
    if not Path(ctx.verifier_path).is_dir():
        return [pitfall(7, "warning", f"verifier {ctx.verifier_path} is not a local directory here (a hub id, "
                                      "or the tiny verifier not built yet); mask token not checked")]  # fmt: skip
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
    vocab = (ctx.verifier_config or {}).get("vocab_size") or len(tok)
    if mask_id is None and len(tok) < vocab:  # speculators' resolve_mask_token_id adds one there
        return [pitfall(7, "warning", f"no mask token set: speculators will add <|MASK|> as id {len(tok)} "
                                      "(an unused embedding row); set draft.mask_token_id to pin it")]  # fmt: skip
    if mask_id is None:
        return [pitfall(7, "error", "the tokenizer has no mask token, no unused vocabulary row, and "
                                    "draft.mask_token_id is unset; set it to a reserved special id")]  # fmt: skip
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


def check_windows(ctx: _Context) -> list[Finding]:
    """Pitfalls 9 and 10 from the resolver's window decision (the one serving uses), in its words."""
    try:
        window, risks = ctx.res.window.value, ctx.res.window_risks
    except ValueError as e:  # an unreadable tune result
        return [pitfall(9, "error", str(e))]
    out = [pitfall(n, "warning", message) for n, message in risks.items()]
    if window is not None and any("mtp" in a for a in ctx.recipe.serve.extra_args):
        out.append(pitfall(9, "warning", "serve.draft_window_size with method mtp: vllm-ascend ignores "
                                         "the window for mtp; unset it"))  # fmt: skip
    return out


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


def _node_local(path: str | Path) -> bool:
    p = str(Path(path).resolve()) if Path(path).is_absolute() else str(path)
    return any(p == d or p.startswith(d + "/") for d in NODE_LOCAL_DIRS)


def check_multinode(ctx: _Context) -> list[Finding]:
    """Across nodes: the rendezvous must be reachable from every node, storage shared by all."""
    from dspark_kit.distributed.rendezvous import rendezvous_for

    recipe, out = ctx.recipe, []
    t, hs = recipe.train, recipe.hidden_states
    rdzv = rendezvous_for(recipe, ctx.res.train_device.value)  # an explicit device: as written
    out += [pitfall(11, "error", e) for e in rdzv.errors]
    out += [pitfall(11, "warning", w) for w in rdzv.warnings]
    if t.nnodes == 1 or t.nodes_same_host:
        return out
    # One extraction server for every node (hidden_states.endpoint): it writes files on its own
    # machine that trainers / generate-offline-data on the other nodes read by path. (Without an
    # endpoint every node starts its own server, which reads and writes on the same machine.)
    served = hs.mode == "online" or hs.backend == "vllm"
    if served and hs.endpoint:
        from urllib.parse import urlparse

        from dspark_kit.distributed.rendezvous import master_is_loopback

        host = urlparse(hs.endpoint if "//" in hs.endpoint else f"http://{hs.endpoint}").hostname or ""
        if master_is_loopback(host):
            out.append(pitfall(11, "error", f"hidden_states.endpoint {hs.endpoint} is loopback with train.nnodes "
                                            f"{t.nnodes}: trainers on other nodes would ask themselves; use the "
                                            "server's address every node can reach, or unset it so each node "
                                            "starts its own server"))  # fmt: skip
    if served and hs.endpoint and hs.transport == "file" and not hs.storage_shared and _node_local(hs.storage_path):
        out.append(pitfall(11, "error", f"hidden_states.storage_path {hs.storage_path} is node-local with train.nnodes "
                                        f"{t.nnodes} and one extraction server ({hs.endpoint}) for every node: a "
                                        "trainer on another node cannot read the files it writes there; use shared "
                                        "storage mounted at the same path on every node (e.g. /mnt/cephfs/...) and "
                                        "set hidden_states.storage_shared: true, or unset hidden_states.endpoint "
                                        "so each node starts its own server"))  # fmt: skip
    if _node_local(ctx.run.root):
        out.append(pitfall(11, "warning", f"work dir {ctx.run.root} is node-local with train.nnodes {t.nnodes}: every "
                                          "node reads prepared/ from it and a restart resumes from its checkpoints; "
                                          "put the run on storage every node mounts at the same path"))  # fmt: skip
    return out


def check_transport(ctx: _Context) -> list[Finding]:
    """hidden_states.transport mooncake: a combination it serves, and a master someone runs."""
    from dspark_kit.distributed.hs_transport import transport_problems

    return [pitfall(11, "error", p) for p in transport_problems(ctx.recipe, ctx.res.mooncake)]


def check_hidden_dtype(ctx: _Context) -> list[Finding]:
    """hidden_states.dtype fp8 needs hs-connectors' fp8 connector here (Resolved.hidden_states_out_dtype)."""
    try:
        ctx.res.hidden_states_out_dtype  # noqa: B018 - the decision raises its own one line
    except RecipeError as e:
        return [Finding("error", "hidden-states-dtype", str(e))]
    return []


def check_storage(ctx: _Context) -> list[Finding]:
    """Offline hidden states must fit where they go (the plan: resolved/storage_plan.py)."""
    from dspark_kit.resolved.storage_plan import human, plan_storage

    if ctx.recipe.hidden_states.mode != "offline":
        return []
    plan = plan_storage(ctx.res)
    if plan.fits is not False:
        return []
    return [Finding("error", "storage", f"offline hidden states need ~{human(plan.needed)} more in {plan.dest}, "
                                        f"which has {human(plan.free)} free: free space there, lower data.limit, "
                                        "or set hidden_states.mode: online with serve.devices apart from "
                                        "train.devices (the trainer asks a server; nothing is written ahead)")]  # fmt: skip


def check_memory(ctx: _Context) -> list[Finding]:
    """On CPU the verifier sits in this machine's memory for regen's server, hidden states and eval:
    a verifier that does not fit fails the first stage, after minutes of loading."""
    res = ctx.res
    if res.train_device.value != "cpu" or ctx.verifier_config is None:
        return []
    fit = res.verifier_fit("cpu")
    if fit.value is not False:
        return []
    return [Finding("error", "verifier-memory", f"train.device cpu: {fit.source}; on CPU regen, hidden states and "
                                                "eval hold it in memory: run on an accelerator (train.device cuda "
                                                "or npu; `dspark-kit init --target-device cuda|npu` writes such a recipe) "
                                                "or choose a smaller verifier.path")]


def _looks_like_a_path(path: str) -> bool:
    """A local path as typed (absolute, ./, ../, ~); else a hub id (org/name) or a builtin."""
    return path.startswith(("/", "./", "../", "~"))


def check_verifier(ctx: _Context) -> list[Finding]:
    """The verifier can load, told from its files alone (nothing is loaded): the path exists, its
    weights and every shard its index names are there, and a tokenizer sits beside them. On a
    recipe for another machine's accelerator these are warnings: the files are checked there."""
    typed = ctx.recipe.verifier.path
    where = Path(ctx.verifier_path).expanduser()
    if not where.is_dir() and not _looks_like_a_path(typed):
        return []  # a hub id (or the tiny verifier before its build)
    found: list[tuple[str, str]] = []
    relative = not typed.startswith("builtin:") and not Path(typed).is_absolute() and not _looks_like_a_path(typed)
    if relative and where.is_dir():
        # a recipe's relative path found beside the recipe is absolute by now: this one is only in the
        # shell's directory, and would load from another directory as a hub id
        found = [("verifier-relative", (f"verifier.path {typed}: not beside the recipe file, only in the current "
                                        f"directory ({where.resolve()}); a relative path is read from the recipe "
                                        "file's folder: write it absolute or relative to the recipe"))]
    elif not where.is_dir():
        found.append(("verifier-missing", (f"verifier.path {typed}: no such directory here; fix the path "
                                           "(a hub id is written org/name)")))
    else:
        if not (where / "config.json").is_file():
            found.append(("verifier-config", (f"verifier.path {where} has no config.json; point it at the "
                                               "model's directory (the one holding config.json)")))
        present = [name for name in WEIGHT_FILES if (where / name).is_file()]
        if not present and not any(where.glob("*.safetensors")):
            found.append(("verifier-weights", (f"verifier.path {where} holds no weights (config only: no "
                                                f"{' / '.join(WEIGHT_FILES[:2])}); download the full model")))
        for index in (name for name in present if name.endswith(".index.json")):
            shards = set((_read_json(where / index) or {}).get("weight_map", {}).values())
            missing = sorted(sh for sh in shards if not (where / sh).is_file())
            if missing:
                found.append(("verifier-shards", (f"{where / index} names {len(missing)} shard(s) that are not "
                                                   f"there ({', '.join(missing[:3])}); finish the download")))
        if not has_tokenizer_files(where):
            found.append(("verifier-tokenizer", (f"verifier.path {where} has no tokenizer (tokenizer.json / "
                                                  "tokenizer_config.json); copy the model's tokenizer files")))
    if found and not ctx.res.train_device_here:
        device = ctx.res.train_device.value
        return [Finding("warning", code, f"{message} (the recipe runs on {device}, not here: preflight there "
                                         "makes this an error)") for code, message in found]
    return [Finding("error", code, message) for code, message in found]


def check_parallel(ctx: _Context) -> list[Finding]:
    """serve.tensor_parallel_size fits the listed devices and divides the attention heads."""
    from dspark_kit.specdec.verifier_facts import language_model_config

    s, out = ctx.recipe.serve, []
    tp = s.tensor_parallel_size
    listed = [d for d in (s.devices or "").split(",") if d.strip()]
    if listed and tp > len(listed):
        out.append(Finding("error", "tensor-parallel", f"serve.tensor_parallel_size {tp} > the {len(listed)} "
                                                       f"device(s) in serve.devices {s.devices}; list {tp} or lower it"))
    heads = language_model_config(ctx.verifier_config or {}).get("num_attention_heads")
    if isinstance(heads, int) and heads % tp:
        out.append(Finding("error", "tensor-parallel", f"serve.tensor_parallel_size {tp} does not divide the "
                                                       f"verifier's {heads} attention heads; use a divisor of {heads}"))
    return out


def check_lengths(ctx: _Context) -> list[Finding]:
    """Every regen and bench request fits serve.max_model_len (a prompt plus max_tokens beyond it is a 400)."""
    r, out = ctx.recipe, []
    limit = r.serve.max_model_len
    if limit is None:
        return out
    asks = [("bench.max_tokens", r.bench.max_tokens)]
    if r.regen.enabled:
        asks.insert(0, ("regen.max_tokens", r.regen.max_tokens))
    for key, n in asks:
        if n >= limit:
            out.append(Finding("error", "max-model-len", f"{key} {n} >= serve.max_model_len {limit}: no prompt leaves "
                                                         f"room, so every request is refused; lower {key} or raise "
                                                         "serve.max_model_len"))
    return out


def check_prompt_room(ctx: _Context) -> list[Finding]:
    """regen.max_tokens plus the longest prompt regen will send fits serve.max_model_len (preflight_requests)."""
    from dspark_kit.stages.preflight.prompt_room import prompt_room

    return prompt_room(ctx.res)


def check_engine(ctx: _Context) -> list[Finding]:
    """The serving engine against the checkpoint (docs/COMPAT.md): DSpark at all, the anchor layout it
    serves the checkpoint in, and adaptive verification that was asked for but cannot work."""
    res = ctx.res
    if res.engine not in ("vllm", "vllm-ascend"):
        return []
    # checkpoints ignored (before train: they are its own output): judge what the trainer will write
    gate = res.engine_gate if ctx.checkpoint_config is not None else res.engine_support.serves()
    out = [Finding("error", "engine", gate.message)] if gate.ok is False else []
    try:
        _ = res.adaptive_verification  # decided on first use; `on` that cannot work raises
    except ValueError as e:  # ResolveError: on, where it cannot work
        out.append(Finding("error", "adaptive-verification", str(e)))
    return out


def check_ports(ctx: _Context) -> list[Finding]:
    """A configured port the kit's servers will listen on that something holds now. A warning: the
    run itself refuses it before any model loads (engines/ports.py), and preflight may run on
    another machine than the servers."""
    from dspark_kit.engines.ports import busy_message, decide_port, port_in_use

    r = ctx.recipe
    hs = r.hidden_states
    roles = ["spec"]  # serve and bench start the spec server
    if hs.mode == "online" or hs.backend != "local":
        roles += [] if hs.endpoint else ["hidden-states"]
    out = []
    for port in (decide_port(ctx.res, role) for role in roles):  # spec: serve.port; hidden-states: its own key
        why = None if port.chosen_at_start else port_in_use(r.serve.host, port.number)
        if why:
            out.append(Finding("warning", "port", busy_message(port, r.serve.host, why)))
    return out


def check_endpoints(ctx: _Context) -> list[Finding]:
    """External servers' /v1/models against the names the trainer and regen will send (preflight_endpoints)."""
    from dspark_kit.stages.preflight.endpoints import endpoint_findings

    return endpoint_findings(ctx.res)


def check_train_memory(ctx: _Context) -> list[Finding]:
    """The training memory plan against each device's memory (preflight_memory)."""
    from dspark_kit.stages.preflight.memory import memory_findings

    return memory_findings(ctx.res)


CHECKS = [check_verifier, check_memory, check_markov, check_sliding, check_models, check_thinking, check_layers, check_mask,
          check_windows, check_checkpoint, check_engine, check_parallel, check_lengths, check_prompt_room, check_ports,
          check_multinode, check_transport, check_hidden_dtype, check_storage, check_endpoints,
          check_train_memory]  # fmt: skip


def _context(res: Resolved, checkpoints: bool = True) -> _Context:
    ctx = _Context(res)
    if not checkpoints:
        return ctx
    try:
        ctx.checkpoint = res.checkpoint
        ctx.checkpoint_config = res.checkpoint_config
    except ckpt.CheckpointError:
        pass  # check_checkpoint reports it when a checkpoints dir exists
    return ctx


def run_preflight(res: Resolved, *, probes: bool = True, checkpoints: bool = True,
                  checkpoint_checked: bool = False, storage: bool = True, training: bool = True) -> list[Finding]:
    """All findings for the caller's resolution (recipe, run folder, --engine, --checkpoint) and
    the artifacts in its run folder.

    `checkpoints=False` ignores DIR/checkpoints: before training they are the
    stage's own output (an interrupted run leaves them partial), not an input.
    `checkpoint_checked`: the caller already judged the checkpoint (serve): not again.
    `storage=False`: past the hidden-states stage (train, serve) their room is no question.
    `training=False`: past training (serve) its memory is no question.
    """
    ctx = _context(res, checkpoints)
    skip = {check_markov} if not probes else set()
    if not checkpoints or checkpoint_checked:
        skip.add(check_checkpoint)
    if not storage:
        skip.add(check_storage)
    if not training:
        skip.add(check_train_memory)
    findings = [f for check in CHECKS if check not in skip for f in check(ctx)]
    return sorted(findings, key=lambda f: (f.pitfall or 99, f.level != "error"))  # no pitfall (storage): last


def has_errors(findings: list[Finding]) -> bool:
    return any(f.level == "error" for f in findings)


class PreflightError(ValueError):
    """Preflight found errors; the message lists each with its pitfall number."""


def enforce(res: Resolved, stage: str, log=None, checkpoint_checked: bool = False) -> list[Finding]:
    """Run before train and serve: warnings are printed, errors stop the stage.

    Probes are skipped here: the training process applies the speculators fixes itself.
    """
    from dspark_kit.progress import note

    findings = run_preflight(res, probes=False, checkpoints=stage != "train", checkpoint_checked=checkpoint_checked,
                             storage=False, training=stage == "train")
    for f in findings:
        if f.level == "warning":
            (log or note)(f"preflight warning ({label(f)}): {f.message}")
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise PreflightError(f"preflight stopped {stage}: " + "; ".join(
            f"[{label(f)}] {f.message}" for f in errors) + " (see `dspark-kit preflight`)")
    return findings
