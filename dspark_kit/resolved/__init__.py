"""Resolved: the one place every derived value is decided.

A recipe says what the user wants ("auto", a served name or none, a window or
"off"); serving and training need concrete values that also depend on the
run folder (a trained checkpoint, a tune result), the engine and its
installed version, and the machine. Each such value is decided here by one
function, with a note saying where it came from; engines, stages, preflight,
bench and the CLI ask a `Resolved` instead of re-deriving it.

    verifier_path      recipe verifier.path, builtin:tiny-qwen3 built/cached
    served_name        verifier.served_name, else the resolved verifier path
    served_names       per role: hidden-states answers to the verifier path first (what
                       speculators' trainer and generate-offline-data check), then served_name
    num_hidden_layers  the verifier's config, else verifier.num_hidden_layers
    hidden_size        the verifier's config, else verifier.hidden_size (or unknown)
    memory_plan        training memory per device (resolved/memory_plan.py)
    storage_plan       the bytes offline hidden states take, and the room where they go
                       (resolved/storage_plan.py)
    prepare_input      the rows prepare reads: DIR/regen.jsonl when regen runs, else
                       data.source (resolved/prepare_input.py; eval's held-out split and
                       the storage estimate read the same rows)
    checkpoint         serve.checkpoint under DIR/checkpoints (or a path)
    k                  serve.num_speculative_tokens: int, or auto = the newest tune's K
                       (in-process window_tune.json or served served_tune.json),
                       else the checkpoint's trained slots, else draft.block_size;
                       then the engine version's rule (vLLM 0.26.x)
    window             serve.draft_window_size (or the command's --draft-window-size):
                       int, off, or auto = the tune's window (null = none), else the
                       training window; then what the engine can apply (CUDA vLLM:
                       none at run time)
    train/serve/eval   devices: train.device (auto = detected here); the engine's own
    _device            for vllm / vllm-ascend
    *_dtype            one rule: float32 on CPU, verifier.dtype on accelerators
    device_env         the device layer's env, the user's own values winning

A command builds one `Resolved` at its entry point and passes it down; the
pipeline builds one for the whole run (training re-reads the checkpoint
decisions through `checkpoints_changed`). `planning=True` never builds or
trains anything: the tiny verifier is named by its cache path, not built.

Layer 3 (beside distributed/): may import core, data/, specdec/, compat/ and distributed/; never
engines/, measure/, stages/ or cli/. Besides this module: rules.py (the decisions' rules),
memory_plan.py, storage_plan.py, prepare_input.py and draft_topk.py.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from dspark_kit.compat import versions
from dspark_kit.recipe import ENGINES, Recipe, RecipeError, parse_window
from dspark_kit.resolved.rules import (  # noqa: F401 - re-exported: callers import them from here
    TUNED,
    Decision,
    ResolveError,
    Tune,
    check_eval_device,
    device_env,
    eval_fit,
    eval_mode,
    is_deepseek_v4,
    long_context_note,
)
from dspark_kit.rundir import RunDir
from dspark_kit.specdec.verifier_facts import language_model_config

# ---- the resolver --------------------------------------------------------------


class Resolved:
    """Derived values for one recipe, run folder and engine; each decided once, lazily.

    A command's flags enter here, not beside it: `engine` (--engine), `checkpoint`
    (--checkpoint), `window` (--draft-window-size N|auto|off, in place of
    serve.draft_window_size), `eval_device` (eval's and tune's --eval-device). `planning=True` (dry runs) builds nothing and tolerates what
    a laptop lacks: no checkpoint yet (K falls back to the recipe), no verifier config
    (verifier.num_hidden_layers, or the tiny verifier's planned config).
    """

    def __init__(self, recipe: Recipe, run: RunDir | str | Path | None = None, *, engine: str | None = None,
                 checkpoint: str | Path | None = None, window: int | str | None = None,
                 eval_device: str | None = None, planning: bool = False,
                 installed: dict[str, str | None] | None = None,
                 window_support: versions.Support | None = None):
        self.recipe = recipe
        self.run = run if isinstance(run, RunDir) else RunDir.at(recipe.workdir_path(run))
        self.engine = engine or recipe.serve.engine
        if self.engine not in ENGINES:
            raise ResolveError(f"--engine {self.engine!r}: expected one of {', '.join(ENGINES)}")
        if window is not None:
            try:
                parse_window(window)
            except ValueError as e:
                raise ResolveError(f"--draft-window-size: {e}") from None
        self.checkpoint_choice = checkpoint
        self.window_choice = window
        self.eval_device_choice = check_eval_device(eval_device) if eval_device else None
        self.planning = planning
        self._installed = installed
        self._window_support = window_support

    # ---- verifier -----------------------------------------------------------
    @cached_property
    def verifier_path(self) -> str:
        """The verifier's loadable path; the builtin tiny verifier is built on first use, except
        when planning (its cache path then, built or not)."""
        from dspark_kit.data.tiny_verifier import planned_verifier_path, resolve_verifier_path

        path = self.recipe.verifier.path
        return planned_verifier_path(path) if self.planning else resolve_verifier_path(path)

    @cached_property
    def served_name(self) -> str:
        """The model id clients ask for (regen, bench, serve): verifier.served_name, else the
        resolved verifier path."""
        return self.recipe.verifier.served_name or self.verifier_path

    def served_names(self, role: str) -> list[str]:
        """The model ids a server of `role` answers to, in the order /v1/models lists them.

        speculators' online trainer and generate-offline-data take the first id /v1/models
        lists and refuse it unless it equals the model they were given (the trainer's
        --verifier-name-or-path is the resolved verifier path), so a hidden-states server
        answers to that path first and to served_name too; the other roles answer to served_name.
        """
        if role == "hidden-states":
            return list(dict.fromkeys([self.verifier_path, self.served_name]))
        return [self.served_name]

    @cached_property
    def verifier_config(self) -> dict | None:
        """config.json of the verifier (a local dir or the HF cache); a plan before the tiny
        verifier is built gets the config its build will write."""
        from dspark_kit.specdec.verifier_facts import verifier_config

        found = verifier_config(self.verifier_path)
        if found is None and self.planning:
            from dspark_kit.data.families import family_of_builtin
            from dspark_kit.data.tiny_verifier import planned_config

            family = family_of_builtin(self.recipe.verifier.path)
            return planned_config(family=family) if family else None
        return found

    @cached_property
    def num_hidden_layers(self) -> int:
        from dspark_kit.specdec.verifier_facts import num_layers_of

        found, declared = num_layers_of(self.verifier_config), self.recipe.verifier.num_hidden_layers
        if found is None and declared is None:
            raise RecipeError(f"verifier.num_hidden_layers: no config.json for {self.verifier_path} on this machine "
                              "(local dir or HF cache); run where the verifier is, or set "
                              "verifier.num_hidden_layers to plan")
        if found is not None and declared is not None and found != declared:
            raise RecipeError(f"verifier.num_hidden_layers: recipe says {declared} but {self.verifier_path} "
                              f"has {found}")
        return found if found is not None else declared

    @cached_property
    def hidden_size(self) -> int | None:
        """The verifier's hidden size: its config, else verifier.hidden_size; None when neither
        says (a plan then leaves the bytes open)."""
        cfg = self.verifier_config or {}
        found, declared = language_model_config(cfg).get("hidden_size"), self.recipe.verifier.hidden_size
        if isinstance(found, int) and declared is not None and found != declared:
            raise RecipeError(f"verifier.hidden_size: recipe says {declared} but {self.verifier_path} has {found}")
        return found if isinstance(found, int) else declared

    @property
    def target_layer_ids(self) -> list[int]:
        return self.recipe.target_layer_ids(self.num_hidden_layers)

    @property
    def exported_layer_ids(self) -> list[int]:
        return self.recipe.exported_layer_ids(self.num_hidden_layers)

    # ---- hidden-state transport -----------------------------------------------
    @cached_property
    def mooncake(self):
        """The Mooncake store hidden states travel through (hidden_states.transport mooncake), else None."""
        from dspark_kit.distributed.hs_transport import mooncake_for

        return mooncake_for(self.recipe)

    # ---- checkpoint ---------------------------------------------------------
    @cached_property
    def checkpoint(self) -> Path:
        """The checkpoint to serve/evaluate. Planning (dry runs) in a run folder that has not
        trained yet gets the path training will write (`checkpoint_exists` is then False)."""
        from dspark_kit.specdec.checkpoints import CheckpointError, resolve_checkpoint

        which = self.checkpoint_choice if self.checkpoint_choice is not None else self.recipe.serve.checkpoint
        try:
            return resolve_checkpoint(self.run.checkpoints, which)
        except CheckpointError:
            if not self.planning or self.run.checkpoints.exists():
                raise
            which = str(which)
            return Path(which).expanduser().resolve() if "/" in which else self.run.checkpoints / which

    @property
    def checkpoint_exists(self) -> bool:
        return (self.checkpoint / "config.json").is_file()

    def checkpoints_changed(self) -> None:
        """Training wrote new checkpoints: forget the decisions read from the old ones."""
        for name in ("checkpoint", "checkpoint_config", "trained_slots", "k", "adaptive_verification", "engine_gate"):
            self.__dict__.pop(name, None)

    @cached_property
    def checkpoint_config(self) -> dict | None:
        from dspark_kit.specdec.checkpoints import read_config

        return read_config(self.checkpoint) if self.checkpoint_exists else None

    @cached_property
    def trained_slots(self) -> int | None:
        from dspark_kit.specdec.checkpoints import trained_slots

        return trained_slots(self.checkpoint_config) if self.checkpoint_config else None

    def checkpoint_findings(self, path: Path | None = None) -> list:
        """Everything wrong with the checkpoint for this recipe: the one check serve, bench and
        preflight share (layer ids compared with the recipe's verifier.num_hidden_layers when the
        verifier's config is not on this machine)."""
        from dspark_kit.specdec.checkpoints import validate_checkpoint

        path = path or self.checkpoint
        try:
            n = self.num_hidden_layers
        except RecipeError:
            n = None
        vocab = language_model_config(self.verifier_config or {}).get("vocab_size")
        return validate_checkpoint(path, self.recipe, n, self.verifier_path, self.k.value, vocab)

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
        if self.engine == "vllm":
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
        from dspark_kit.resolved import draft_topk

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

    # the decided values, by name: the one list dry runs, `recipe show`, plans and the manifest read
    SPEC = ("k", "window", "adaptive_verification")  # what a spec server is started with
    SERVED = (*SPEC, "serve_device", "serve_dtype")  # ... and where and how it serves
    SUMMARY = (*SPEC, "train_device", "serve_device", "eval_device", "hidden_states_dtype",
               "hidden_states_out_dtype", "serve_dtype", "eval_dtype")

    def summary(self, names: tuple[str, ...] | None = None) -> dict:
        """The decided values and their sources, for dry runs, bench and the manifest (`names`: only
        those, e.g. the ones a stage's plan runs with)."""
        out: dict = {"engine": self.engine}
        for name in self.SUMMARY if names is None else names:
            try:
                d = getattr(self, name)
                out[name] = {"value": d.value, "source": d.source}
            except (ResolveError, RecipeError, ValueError) as e:  # CheckpointError: not trained yet
                out[name] = {"error": str(e)}
        return out

    def spec_decision_lines(self) -> list[str]:
        """K and the draft window as a spec server gets them, one informational line each (both engines)."""
        k, window = self.k, self.window
        return [f"num_speculative_tokens {k.value}: {k.source}",
                f"draft_window_size {window.value}: {window.source}" if window.value is not None
                else f"draft_window_size: {window.source}"]

    def summary_lines(self) -> list[str]:
        """summary() as comment lines for dry runs."""
        return [f"# {name}: " + (f"{d['value']} ({d['source']})" if "error" not in d else f"unknown ({d['error']})")
                for name, d in self.summary().items() if name != "engine"]

    @cached_property
    def memory_plan(self):
        """Training memory per device (resolved/memory_plan.py); raises RecipeError when the
        verifier's shape is unknown here."""
        from dspark_kit.resolved.memory_plan import plan_for

        return plan_for(self)

    # ---- placement: where each part runs, in which dtype --------------------------

    @cached_property
    def train_device(self) -> Decision[str]:
        """Where training, in-process hidden states, the local engine and eval run. An explicit
        train.device is kept as written (an Ascend command planned on a laptop); the process that
        runs on it fails with one line when this machine lacks it."""
        wanted = self.recipe.train.device
        if wanted != "auto":
            return Decision(wanted, "train.device")
        from dspark_kit.devices import detect_device

        found = detect_device("auto")
        return Decision(found, f"train.device auto: detected {found} here")

    @cached_property
    def train_device_here(self) -> bool:
        """This machine has the training device (False: a plan for another machine, e.g. an Ascend
        recipe checked on a laptop, whose files are checked where it runs)."""
        device = self.train_device.value
        if device == "cpu":
            return True
        from dspark_kit.devices import detect_device

        try:
            detect_device(device)
        except (RuntimeError, ValueError):
            return False
        return True

    @cached_property
    def vllm_on_cpu(self) -> bool:
        """Engine vllm with no accelerator (train.device cpu, or auto on a machine without GPU/NPU):
        the plan is vLLM's CPU build. A recipe naming cuda/npu keeps the accelerator command."""
        return self.engine == "vllm" and self.train_device.value == "cpu"

    @cached_property
    def serve_device(self) -> Decision[str]:
        if self.engine == "vllm-ascend":
            return Decision("npu", "engine vllm-ascend")
        if self.engine == "vllm":
            if self.vllm_on_cpu:
                return Decision("cpu", f"engine vllm without GPU/NPU: vLLM's CPU build; {self.train_device.source}")
            return Decision("cuda", "engine vllm")
        return Decision(self.train_device.value, f"engine local runs where training does; {self.train_device.source}")

    @cached_property
    def eval_device(self) -> Decision[str]:
        choice = self.eval_device_choice
        if choice == "auto":
            from dspark_kit.devices import detect_device

            found = detect_device("auto")
            return Decision(found, f"--eval-device auto: detected {found} here")
        if choice:
            return Decision(choice, "--eval-device")
        return Decision(self.train_device.value, f"eval decodes in-process where training runs; {self.train_device.source}")

    @cached_property
    def eval_fit(self) -> Decision[bool | None]:
        """Whether the verifier fits the eval device (its config's size x eval_dtype vs the device's
        memory); False sends eval through the serving engine (`tune --served`, `run`'s served eval)."""
        return self.verifier_fit(self.eval_device.value)

    def verifier_fit(self, device: str) -> Decision[bool | None]:
        """Whether the verifier fits `device`'s memory at the dtype it runs with there (the one rule:
        eval_fit asks it for the eval device, preflight for a CPU run's machine)."""
        from dspark_kit.devices import device_memory_bytes
        from dspark_kit.specdec.verifier_facts import param_count

        dtype = self._dtype_on(Decision(device, "")).value
        return eval_fit(param_count(self.verifier_config), dtype, device, device_memory_bytes(device),
                        self.recipe.verifier.path)

    @cached_property
    def eval_mode(self) -> Decision[str]:
        """`run`'s eval: "in-process" when the verifier fits the eval device, else "served"."""
        return eval_mode(self.eval_fit, self.eval_device.value)

    def _dtype_on(self, device: Decision[str]) -> Decision[str]:
        """The one dtype rule for a verifier forward (hidden states, local engine, eval)."""
        if device.value.partition(":")[0] == "cpu":
            return Decision("float32", "float32 on cpu (bf16 matmuls there are slow and change greedy text)")
        return Decision(self.recipe.verifier.dtype, f"verifier.dtype on {device.value}")

    @cached_property
    def hidden_states_dtype(self) -> Decision[str]:
        """The verifier's compute dtype for in-process hidden states (the local engine's
        hidden-states role runs on the same device with serve_dtype: the same value)."""
        return self._dtype_on(self.train_device)

    @property
    def hidden_states_out_dtype(self) -> Decision[str]:
        """The hidden-state files' dtype; fp8 only where the installed hs-connectors has its fp8
        connector (specdec/hidden_state_files.py), else one line naming the key and the fix."""
        dtype = self.recipe.hidden_states.dtype
        if dtype == "fp8":
            from dspark_kit.specdec.hidden_state_files import fp8_unavailable

            if why := fp8_unavailable():
                raise RecipeError(f"hidden_states.dtype: fp8 needs hs-connectors' fp8 connector, but {why}: "
                                  "pip install hs-connectors>=0.9.0 or set hidden_states.dtype: bfloat16")
        return Decision(dtype, "hidden_states.dtype")

    @cached_property
    def serve_dtype(self) -> Decision[str]:
        if self.engine == "local" or self.vllm_on_cpu:
            return self._dtype_on(self.serve_device)
        return Decision("auto", f"engine {self.engine}: vLLM's --dtype auto (the verifier's torch_dtype)")

    @cached_property
    def eval_dtype(self) -> Decision[str]:
        return self._dtype_on(self.eval_device)
