"""A stage's plan: what it will do, built from `Resolved` alone (plan/apply).

`--dry-run` prints a plan (`--json`: `as_dict()`), the run executes the same plan object and
records it in DIR/plans/<stage>.json first. A plan holds every process the stage starts here
(argv, environment, host and port), the paths it reads and writes, and the decided values it
runs with (K, window, devices, dtypes) with where each came from. Ports taken when the plan is
made (a recipe port 0) say so; `comparable()` sets them aside, so a dry run and the run it
previews compare equal everywhere else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark_kit import atomic
from dspark_kit.resolved import Resolved

if TYPE_CHECKING:
    from dspark_kit.engines import LaunchPlan, ServerPlan

CHOSEN = "<chosen at start>"

# the decided values each stage runs with (Resolved.SUMMARY names), recorded in its plan
SERVED = Resolved.SERVED
DECIDED: dict[str, tuple[str, ...]] = {
    "regen": ("serve_device", "serve_dtype"), "prepare": (),
    "hidden-states": ("train_device", "hidden_states_dtype", "hidden_states_out_dtype"),
    "train": ("train_device", "hidden_states_out_dtype"), "eval": ("k", "window", "eval_device", "eval_dtype"),
    "serve": SERVED, "bench": SERVED, "report": (),
}


@dataclass
class Process:
    """One process the stage starts on this machine (node: the training node it belongs to)."""

    role: str  # e.g. "chat server", "hidden-state server", "trainer", "mooncake master"
    launch: ServerPlan | LaunchPlan  # what is executed: argv + env (+ host/port for a server)
    node: int | None = None

    @property
    def server(self) -> ServerPlan:
        from dspark_kit.engines import ServerPlan

        assert isinstance(self.launch, ServerPlan), f"{self.role} is not a server"
        return self.launch

    def as_dict(self) -> dict[str, Any]:
        from dspark_kit.engines import ServerPlan
        from dspark_kit.redact import redact_argv, redact_env

        out: dict[str, Any] = {"role": self.role, "argv": redact_argv(self.launch.argv),
                               "env": redact_env(self.launch.env), "node": self.node}
        if isinstance(self.launch, ServerPlan):
            port = self.launch.port_decision
            out.update(host=self.launch.host, port=self.launch.port,
                       port_source=port.source if port else "given",
                       port_chosen_at_start=bool(port and port.chosen_at_start))
        return out


@dataclass
class StagePlan:
    stage: str
    lines: list[str]  # what `--dry-run` prints: commands and `# ` notes
    processes: list[Process] = field(default_factory=list)
    inputs: dict[str, str] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    decisions: dict[str, Any] = field(default_factory=dict)  # Resolved.summary(): value + source each
    details: dict[str, Any] = field(default_factory=dict)  # the stage's own facts (e.g. regen's endpoints)

    @classmethod
    def of(cls, res: Resolved, stage: str, lines: list[str], processes: list[Process] | None = None,
           inputs: dict | None = None, outputs: dict | None = None) -> StagePlan:
        """A stage's plan with the decided values it runs with (DECIDED[stage]) taken from `res`."""
        return cls(stage, lines, processes or [], inputs or {}, outputs or {}, decisions=res.summary(DECIDED[stage]))

    def process(self, role: str) -> Process | None:
        return next((p for p in self.processes if p.role == role), None)

    def as_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "processes": [p.as_dict() for p in self.processes],
                "inputs": self.inputs, "outputs": self.outputs, "decisions": self.decisions, "details": self.details, "lines": self.lines}

    def comparable(self) -> dict[str, Any]:
        return comparable(self.as_dict())

    def record(self, path: Path) -> None:
        """Write the plan the run executes (temp file, then rename)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(path, json.dumps(self.as_dict(), indent=2, default=str) + "\n")


def comparable(plan: dict[str, Any]) -> dict[str, Any]:
    """A plan (as_dict(), or a recorded plan file) without its printed lines, every port taken at
    start shown as CHOSEN wherever it appears (its server's argv, another process's endpoint)."""
    d = {k: v for k, v in plan.items() if k != "lines"}
    blob = json.dumps(d, sort_keys=True)
    for p in d["processes"]:
        if p.get("port_chosen_at_start"):
            n = str(p["port"])
            blob = blob.replace(f'"{n}"', f'"{CHOSEN}"').replace(f":{n}", f":{CHOSEN}")
            blob = blob.replace(f'"port": {n}', f'"port": "{CHOSEN}"')
    return json.loads(blob)

