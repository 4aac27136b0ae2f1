"""RunDir: every path under a run folder, spelled once.

Stages, preflight, report and the CLI ask a RunDir for a path instead of
joining folder names themselves, so the layout README documents is the
layout the code writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def hidden_states_dir(prepared: Path) -> Path:
    """Where speculators looks for `hs_{i}.safetensors` next to a prepared dataset."""
    return Path(prepared) / "hidden_states"


@dataclass(frozen=True)
class RunDir:
    root: Path

    @classmethod
    def at(cls, path: str | Path) -> RunDir:
        return cls(Path(path).expanduser().resolve())

    # ---- inputs and stage outputs, in pipeline order -----------------------
    @property
    def regen_jsonl(self) -> Path:
        return self.root / "regen.jsonl"

    @property
    def prepared(self) -> Path:
        return self.root / "prepared"

    @property
    def prepare_meta(self) -> Path:
        return self.prepared / "prepare_meta.json"

    @property
    def hidden_states(self) -> Path:
        return hidden_states_dir(self.prepared)

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def eval_json(self) -> Path:
        return self.eval / "eval.json"

    @property
    def tune_file(self) -> Path:
        """`dspark-kit tune` result: the window and K serving uses when the recipe says auto."""
        return self.eval / "window_tune.json"

    @property
    def serve(self) -> Path:
        return self.root / "serve"

    @property
    def serve_command(self) -> Path:
        return self.serve / "serve_command.txt"

    @property
    def bench(self) -> Path:
        return self.root / "bench"

    @property
    def report(self) -> Path:
        return self.root / "report"

    @property
    def report_md(self) -> Path:
        return self.report / "report.md"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    def log(self, name: str) -> Path:
        """A named log under logs/ (train.log, stage-eval.log, spec-server.log, ...)."""
        return self.logs / name

    def bench_file(self, label: str) -> Path:
        return self.bench / f"bench_{label}.json"
