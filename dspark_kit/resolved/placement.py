"""Placement: where each part runs and in which dtype, and whether the verifier fits (a mixin of `Resolved`).

Holds `Placement`: train/serve/eval devices (train_device_here, vllm_on_cpu), the one dtype
rule (`_dtype_on`) and the dtypes it decides (hidden states, their files, serve, eval), and the
verifier's fit (eval_fit, verifier_fit, eval_mode). `Resolved` (resolved/__init__.py) composes
it; the methods read the resolver's recipe, engine and verifier config through `self`.

Layer 3 like its package: may import core, data/, specdec/, compat/ and resolved/rules.py;
never the resolver itself, engines/, measure/, stages/ or cli/.
"""

from __future__ import annotations

from functools import cached_property

from dspark_kit.recipe import RecipeError
from dspark_kit.resolved.rules import Decision, eval_fit, eval_mode


class Placement:
    """Devices, dtypes and fit for one `Resolved`."""

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
