"""Where each part of a command runs and in which dtype: the devices and dtypes `Resolved` decides.

A mixin of `Resolved` (it reads `recipe`, `engine`, `eval_device_choice` and `verifier_config`
from it), kept apart so the resolver stays readable; callers ask a `Resolved` as before.

    train_device   train.device as written; auto = detected on this machine
    serve_device   the engine's own for vllm (cuda, or cpu for its CPU build) and vllm-ascend (npu);
                   the local engine runs where training does
    eval_device    eval's and tune's --eval-device, else where training runs
    *_dtype        one rule: float32 on CPU, verifier.dtype on accelerators
"""

from __future__ import annotations

from functools import cached_property

from dspark_kit.resolved.rules import Decision, eval_fit, eval_mode


class Placement:
    """Devices and dtypes of a `Resolved`; each decided once, lazily, with where it came from."""

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
        from dspark_kit.devices import device_memory_bytes
        from dspark_kit.specdec.verifier import param_count

        device = self.eval_device.value
        return eval_fit(param_count(self.verifier_config), self.eval_dtype.value, device,
                        device_memory_bytes(device), self.recipe.verifier.path)

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
        return Decision(self.recipe.hidden_states.dtype, "hidden_states.dtype")

    @cached_property
    def serve_dtype(self) -> Decision[str]:
        if self.engine == "local" or self.vllm_on_cpu:
            return self._dtype_on(self.serve_device)
        return Decision("auto", f"engine {self.engine}: vLLM's --dtype auto (the verifier's torch_dtype)")

    @cached_property
    def eval_dtype(self) -> Decision[str]:
        return self._dtype_on(self.eval_device)
