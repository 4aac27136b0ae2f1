"""Resolved: the one place every derived value is decided.

A recipe says what the user wants ("auto", a served name or none, a window or
"off"); serving and training need concrete values that also depend on the
run folder (a trained checkpoint, a tune result), the engine and its
installed version, and the machine. Each such value is decided here by one
function, with a note saying where it came from; engines, stages, preflight,
bench and the CLI ask a `Resolved` instead of re-deriving it.

    verifier_path      recipe verifier.path, builtin:tiny-qwen3 built/cached
    served_name        verifier.served_name, else the resolved verifier path
    num_hidden_layers  the verifier's config, else verifier.num_hidden_layers
    checkpoint         serve.checkpoint under DIR/checkpoints (or a path)
    k                  serve.num_speculative_tokens: int, or auto = the tune's K,
                       else the checkpoint's trained slots, else draft.block_size;
                       then the engine version's rule (vLLM 0.26.x)
    window             serve.draft_window_size: int, off, or auto = the tune's
                       window (null = none), else the training window; then what
                       the engine can apply (CUDA vLLM: none at run time)
    device_env         the device layer's env, the user's own values winning
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Generic, TypeVar

from dspark_kit.compat import versions
from dspark_kit.devices import npu_env, visible_devices_env
from dspark_kit.recipe import ENGINES, Recipe, RecipeError, parse_window
from dspark_kit.rundir import RunDir

T = TypeVar("T")
# The source of a K or window the tune chose ("auto: tuned ..."); the window warning keys on it.
TUNED = "auto: tuned"


class ResolveError(ValueError):
    """A derived value cannot be decided; one line naming the setting and the fix."""


@dataclass(frozen=True)
class Decision(Generic[T]):
    value: T
    source: str  # where the value came from, shown in dry runs, bench and the manifest
    notes: tuple[str, ...] = field(default=())  # warnings the user should see


# ---- pure rules (also used on their own by the CLI) ----------------------------


def long_context_note(recipe: Recipe, window: int | None) -> str | None:
    """Pitfall 10: served context far (> 2x) above the training window, nothing to bridge it."""
    max_len, train_w = recipe.serve.max_model_len, recipe.training_window
    if window is not None or max_len is None or max_len <= 2 * train_w or recipe.draft_has_sliding_layers:
        return None
    fix = ("set serve.draft_window_size" if recipe.serve.engine in ("vllm-ascend", "local")
           else "train a longer data.seq_length or sliding-window draft layers")
    return (f"serve.max_model_len {max_len} > 2x training window {train_w} with no draft window on engine "
            f"{recipe.serve.engine}: acceptance collapses on long contexts ({fix})")


def is_deepseek_v4(verifier_config: dict | None) -> bool:
    if not verifier_config:
        return False
    kinds = [verifier_config.get("model_type"), (verifier_config.get("text_config") or {}).get("model_type")]
    return any(isinstance(k, str) and k.startswith("deepseek_v4") for k in kinds)


def device_env(device: str, ids: str | None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Env a process on `device` needs (training and serving alike): NPU defaults (HCCL etc.)
    unless the user's environment sets them, plus the visible-device variable the recipe names."""
    env = npu_env(os.environ if environ is None else environ) if device == "npu" else {}
    return {**env, **visible_devices_env(device, ids)}


@dataclass(frozen=True)
class Tune:
    """What `dspark-kit tune` recommended (DIR/eval/window_tune.json)."""

    path: Path
    window: int | None  # None: windows did not help, serve without one
    k: int | None  # None: the tune did not sweep K

    @classmethod
    def read(cls, path: Path) -> Tune | None:
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or "recommended_window" not in data:
                raise ValueError("no recommended_window")
        except (OSError, ValueError) as e:
            raise ResolveError(f"{path}: unreadable tune result ({str(e).splitlines()[0][:80]}); "
                               "re-run `dspark-kit tune` or delete the file") from None
        w, k = data.get("recommended_window"), data.get("recommended_k")
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ResolveError(f"{path}: recommended_window {w!r} is not a positive integer or null; "
                               "re-run `dspark-kit tune`")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ResolveError(f"{path}: recommended_k {k!r} is not a positive integer; re-run `dspark-kit tune`")
        return cls(path, w, k)


# ---- the resolver --------------------------------------------------------------


class Resolved:
    """Derived values for one recipe, run folder and engine; each decided once, lazily.

    `planning=True` (dry runs) tolerates what a laptop lacks: no checkpoint yet
    (K falls back to the recipe), no verifier config (verifier.num_hidden_layers).
    """

    def __init__(self, recipe: Recipe, run: RunDir | str | Path | None = None, *, engine: str | None = None,
                 checkpoint: str | Path | None = None, planning: bool = False,
                 installed: dict[str, str | None] | None = None,
                 window_support: versions.Support | None = None):
        self.recipe = recipe
        self.run = run if isinstance(run, RunDir) else RunDir.at(recipe.workdir_path(run))
        self.engine = engine or recipe.serve.engine
        if self.engine not in ENGINES:
            raise ResolveError(f"--engine {self.engine!r}: expected one of {', '.join(ENGINES)}")
        self.checkpoint_choice = checkpoint
        self.planning = planning
        self._installed = installed
        self._window_support = window_support

    # ---- verifier -----------------------------------------------------------
    @cached_property
    def verifier_path(self) -> str:
        from dspark_kit.data.tiny_verifier import resolve_verifier_path

        return resolve_verifier_path(self.recipe.verifier.path)

    @cached_property
    def served_name(self) -> str:
        """The model id a server answers to: speculators' online trainer requires it to equal
        the verifier path it was given, so the default is the resolved path."""
        return self.recipe.verifier.served_name or self.verifier_path

    @cached_property
    def verifier_config(self) -> dict | None:
        from dspark_kit.specdec.verifier import verifier_config

        return verifier_config(self.verifier_path)

    @cached_property
    def num_hidden_layers(self) -> int:
        from dspark_kit.specdec.verifier import num_layers_of

        found, declared = num_layers_of(self.verifier_config), self.recipe.verifier.num_hidden_layers
        if found is None and declared is None:
            raise RecipeError(f"verifier.num_hidden_layers: no config.json for {self.verifier_path} on this machine "
                              "(local dir or HF cache); run where the verifier is, or set "
                              "verifier.num_hidden_layers to plan")
        if found is not None and declared is not None and found != declared:
            raise RecipeError(f"verifier.num_hidden_layers: recipe says {declared} but {self.verifier_path} "
                              f"has {found}")
        return found if found is not None else declared

    @property
    def target_layer_ids(self) -> list[int]:
        return self.recipe.target_layer_ids(self.num_hidden_layers)

    @property
    def exported_layer_ids(self) -> list[int]:
        return self.recipe.exported_layer_ids(self.num_hidden_layers)

    @cached_property
    def mooncake(self):
        """The Mooncake store hidden states travel through (hidden_states.transport mooncake), else None."""
        from dspark_kit.hs_transport import mooncake_for

        return mooncake_for(self.recipe)

    @cached_property
    def vllm_on_cpu(self) -> bool:
        """Engine vllm with no accelerator (train.device cpu, or auto on a machine without GPU/NPU):
        the plan is vLLM's CPU build. A recipe naming cuda/npu keeps the accelerator command."""
        device = self.recipe.train.device
        if self.engine != "vllm" or device not in ("auto", "cpu"):
            return False
        if device == "cpu":
            return True
        from dspark_kit.devices import detect_device

        return detect_device("auto") == "cpu"

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
        try:
            verifier = self.verifier_path
        except Exception:  # noqa: BLE001 - an unloadable verifier is reported elsewhere
            verifier = None
        return validate_checkpoint(path, self.recipe, n, verifier, self.k.value)

    # ---- tune, K, window ----------------------------------------------------
    @cached_property
    def tune(self) -> Tune | None:
        return Tune.read(self.run.tune_file)

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
            k, source = self.tune.k, f"{TUNED} ({self.tune.path})"
        elif slots is not None:
            k, source = slots, f"auto: the checkpoint's {slots} trained slots ({self.checkpoint}/config.json)"
        else:
            k, source = block, f"auto: draft.block_size {block} (no checkpoint yet; a DSpark draft trains block_size slots)"
        notes: list[str] = []  # K above the trained slots is a checkpoint finding (serve refuses it)
        if self.engine == "vllm":
            chosen, note = versions.k_rule("vllm", self.installed_version()).choose(k, slots or block)
            if note:
                notes.append(note)
            if chosen != k:
                k, source = chosen, f"{source}, then the installed vLLM's rule"
        return Decision(k, source, tuple(notes))

    @cached_property
    def wanted_window(self) -> Decision[int | None]:
        """The draft window the recipe asks for, before asking what the engine can do."""
        setting = parse_window(self.recipe.serve.draft_window_size)
        train_w = self.recipe.training_window
        if setting == "off":
            return Decision(None, "serve.draft_window_size off")
        if isinstance(setting, int):
            return Decision(setting, "serve.draft_window_size")
        if self.tune is not None:
            how = f"{self.tune.window}" if self.tune.window else "none (windows did not help)"
            return Decision(self.tune.window, f"{TUNED} {how} ({self.tune.path})")
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
        train_w = self.recipe.training_window
        if self.engine == "vllm":
            if window is not None and isinstance(parse_window(self.recipe.serve.draft_window_size), int):
                notes.append(f"serve.draft_window_size {window} ignored: CUDA vLLM has no runtime draft window "
                             "(train sliding-window draft layers instead)")
            window, source = None, "engine vllm: no runtime draft window"
        elif self.engine == "vllm-ascend" and window is not None:
            support = self._window_support
            if support is None:
                support = versions.ascend_dspark_window_support() if self.installed_version() else "unknown"
            if is_deepseek_v4(self._verifier_config_or_none()):
                notes.append("draft_window_size on a DSpark draft trained natively with a DeepSeek-V4 target: "
                             "vllm-ascend warns that windowing lowers its acceptance")
            if support == "no":
                notes.append(f"draft_window_size {window} omitted: the installed vllm-ascend does not apply the "
                             "window to DSpark (needs vllm-ascend PR 14596); upgrade to use it")
                window, source = None, "engine vllm-ascend without PR 14596"
            elif support == "unknown":
                notes.append("draft_window_size needs a vllm-ascend build with PR 14596 (DSpark window apply "
                             "point); could not check here because vllm-ascend is not installed")
        if window is not None and window < train_w:
            if source.startswith(TUNED):  # measured on this draft: say so, keep the rule visible
                notes.append(f"draft_window_size {window} < training window {train_w}: the tune measured it best "
                             "on this draft (pitfall 9's rule of thumb is >= the training window; re-tune on "
                             "the real verifier)")
            else:
                notes.append(f"draft_window_size {window} < training window {train_w}: the draft saw longer "
                             "contexts in training; acceptance usually drops (set >= training window)")
        risk = long_context_note(self.recipe, window)
        if risk:
            notes.append(risk)
        return Decision(window, source, tuple(notes))

    def _verifier_config_or_none(self) -> dict | None:
        try:
            return self.verifier_config
        except Exception:  # noqa: BLE001 - planning without the verifier
            return None

    # ---- device environment -------------------------------------------------
    def summary(self) -> dict:
        """The decided values and their sources, for dry runs, bench and the manifest."""
        out: dict = {"engine": self.engine}
        for name in ("k", "window"):
            try:
                d = getattr(self, name)
                out[name] = {"value": d.value, "source": d.source}
            except (ResolveError, RecipeError, ValueError) as e:
                out[name] = {"error": str(e)}
        return out
