"""Resolved: the one place every derived value is decided.

A recipe says what the user wants ("auto", a served name or none, a window or
"off"); serving and training need concrete values that also depend on the
run folder (a trained checkpoint, a tune result), the engine and its
installed version, and the machine. Each such value is decided here by one
function, with a note saying where it came from; engines, stages, preflight,
bench and the CLI ask a `Resolved` instead of re-deriving it.

    verifier_path      recipe verifier.path, builtin:tiny-qwen3 built/cached, a GGUF file converted/cached
    verifier_gguf      the GGUF file verifier.path names (llama.cpp serves it), else None
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
pipeline builds one for the run and, after each stage that ran, resolves afresh
(`afresh()`: a stage that wrote a checkpoint or a tune changes what the next one
reads, with no list of cached names to keep). `planning=True` never builds or
trains anything: the tiny verifier is named by its cache path, not built.

Layer 3 (beside distributed/): may import core, data/, specdec/, compat/ and distributed/; never
engines/, measure/, stages/ or cli/. This module holds the resolver (`Resolved`: verifier facts,
checkpoint reading, the summary); it composes spec.py (K, window, KV block, adaptive
verification, top-k) and placement.py (devices, dtypes, fit). Besides: rules.py (the
decisions' rules), memory_plan.py, storage_plan.py, prepare_input.py and draft_topk.py.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from dspark_kit.compat import versions
from dspark_kit.recipe import ENGINES, Recipe, RecipeError, parse_window
from dspark_kit.resolved.placement import Placement
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
from dspark_kit.resolved.spec import SpecDecisions
from dspark_kit.rundir import RunDir
from dspark_kit.specdec.verifier_facts import language_model_config

# ---- the resolver --------------------------------------------------------------


class Resolved(SpecDecisions, Placement):
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

    def with_engine(self, engine: str) -> Resolved:
        """The same decisions for another engine (regen.engine: regen's server on its own engine)."""
        return Resolved(self.recipe, self.run, engine=engine, checkpoint=self.checkpoint_choice,
                        window=self.window_choice, eval_device=self.eval_device_choice, planning=self.planning,
                        installed=self._installed, window_support=self._window_support)

    # ---- verifier -----------------------------------------------------------
    @cached_property
    def verifier_path(self) -> str:
        """The verifier's loadable path; the builtin tiny verifier is built on first use, except
        when planning (its cache path then, built or not)."""
        from dspark_kit.data.tiny_verifier import planned_verifier_path, resolve_verifier_path

        path = self.recipe.verifier.path
        return planned_verifier_path(path) if self.planning else resolve_verifier_path(path)

    @cached_property
    def verifier_gguf(self) -> str | None:
        """The GGUF file verifier.path names (a path or a builtin such as builtin:smollm2-135m-instruct),
        as given: an engine that serves GGUF itself (llama.cpp) serves this file; every other stage
        reads verifier_path, its converted folder. None for a Hugging Face verifier."""
        from dspark_kit.data.gguf_verifier import gguf_source, is_gguf

        path = self.recipe.verifier.path
        return str(gguf_source(path)) if is_gguf(path) else None

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
        if found is None and self.planning and self.verifier_gguf is not None:  # not converted yet
            from dspark_kit.data.gguf_verifier import planned_config as gguf_config

            return gguf_config(self.recipe.verifier.path)
        if found is None and self.planning:
            from dspark_kit.data.families import family_of_builtin
            from dspark_kit.data.tiny_verifier import planned_config

            family = family_of_builtin(self.recipe.verifier.path)
            return planned_config(family=family) if family else None
        return found

    @cached_property
    def reasoning_format(self):
        """How the verifier writes its reasoning (data/reasoning_formats.py): a builtin family's
        record, else read from the verifier's files (its chat template, its model_type)."""
        from dspark_kit.data import reasoning_formats
        from dspark_kit.data.families import family_of_builtin

        family = family_of_builtin(self.recipe.verifier.path)
        if family is not None:
            return family.reasoning
        found = reasoning_formats.of_files(self.verifier_path, (self.verifier_config or {}).get("model_type"))
        if found is None and not self.planning:  # a hub id: its tokenizer (from the HF cache) has the template
            from dspark_kit.specdec.verifier_facts import plan_tokenizer

            try:
                found = reasoning_formats.of_tokenizer(plan_tokenizer(self.verifier_path,
                                                                      self.recipe.verifier.trust_remote_code))
            except (OSError, ValueError):
                found = None
        if found is None:  # nothing to read it from: Qwen3's <think>, when the recipe thinks (the kit's default)
            return reasoning_formats.THINK if self.recipe.may_think else reasoning_formats.NONE
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

    def afresh(self) -> Resolved:
        """The same recipe, run folder and command choices, decided again from what is there now
        (the pipeline asks for one after each stage: a checkpoint or tune it wrote is read anew)."""
        return Resolved(self.recipe, self.run, engine=self.engine, checkpoint=self.checkpoint_choice,
                        window=self.window_choice, eval_device=self.eval_device_choice, planning=self.planning,
                        installed=self._installed, window_support=self._window_support)

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
