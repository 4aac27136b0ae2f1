"""RunDir: every path under a run folder, spelled once.

Stages, preflight, report and the CLI ask a RunDir for a path instead of
joining folder names themselves, so the layout docs/TOUR.md documents is the
layout the code writes. regen's companions (`<output>.errors.jsonl`,
`<output>.engine.log`) sit beside whatever output regen writes (`-o`), so
regen names them from its output path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def hidden_states_dir(prepared: Path) -> Path:
    """Where speculators looks for `hs_{i}.safetensors` next to a prepared dataset."""
    return Path(prepared) / "hidden_states"


# speculators' file name for prepared row i's hidden states: written by the hidden-states stage
# (ours and speculators' generate-offline-data alike), read by its trainer
HS_PREFIX, HS_SUFFIX = "hs_", ".safetensors"


def hidden_state_file(folder: Path, row: int) -> Path:
    return Path(folder) / f"{HS_PREFIX}{row}{HS_SUFFIX}"


# a bench's result file: `bench_<label>.json` (+ its `.md`); written by the bench stage, read by the
# report and the run's summary
BENCH_PREFIX, BENCH_SUFFIX = "bench_", ".json"


def regen_errors_file(output: Path) -> Path:
    """regen's failed rows, beside its output (`regen.jsonl` -> `regen.jsonl.errors.jsonl`)."""
    output = Path(output)
    return output.with_name(output.name + ".errors.jsonl")


def prepare_errors_file(prepared: Path) -> Path:
    """prepare's dropped and changed rows, one entry each with where it was read and why, beside the
    prepared dataset (`prepared` -> `prepared.errors.jsonl`)."""
    prepared = Path(prepared)
    return prepared.with_name(prepared.name + ".errors.jsonl")


def regen_engine_log(output: Path) -> Path:
    """The chat server regen starts, when not given a log (`regen.jsonl` -> `regen.jsonl.engine.log`)."""
    output = Path(output)
    return output.with_name(output.name + ".engine.log")


def gguf_convert_log(folder: Path) -> Path:
    """llama.cpp's converter output inside a GGUF export folder (`export --layout gguf`)."""
    return folder / "convert.log"


def failed_gguf_convert_log(dest: Path) -> Path:
    """Where a failed GGUF export keeps the converter's output: beside the DEST it did not write."""
    return dest.with_name(dest.name + ".convert.log")


def bench_result_file(folder: Path, label: str) -> Path:
    """A bench's result (`bench --out` may name another folder than the run's bench/)."""
    return Path(folder) / f"{BENCH_PREFIX}{label}{BENCH_SUFFIX}"


def bench_result_files(folder: Path) -> list[Path]:
    """The bench results in `folder`, by name (empty when it does not exist): the kit's
    `bench_<label>.json` and any other result put there (`vllm bench serve --save-result` json)."""
    return sorted(Path(folder).glob(f"*{BENCH_SUFFIX}"))


# speculators' save_path layout: one folder per epoch, named by its number (`0`, `1`, ...), beside
# symlinks (`epochN_end`, `checkpoint_best`) and the kit's set-aside folders (`incomplete-3`, ...)
BEST_CHECKPOINT = "checkpoint_best"


def epoch_of(path: Path) -> int | None:
    """The epoch a save_path entry holds (`3` -> 3); None for a symlink, a file or any other name."""
    path = Path(path)
    return int(path.name) if path.name.isdigit() and path.is_dir() and not path.is_symlink() else None


def epoch_dirs(checkpoints: Path) -> list[Path]:
    """The epoch folders under a save_path, in epoch order (empty when it does not exist)."""
    folder = Path(checkpoints)
    found = [p for p in folder.iterdir() if epoch_of(p) is not None] if folder.is_dir() else []
    return sorted(found, key=lambda p: int(p.name))


def hidden_state_row(name: str) -> int | None:
    """The row index a file name stands for (`hs_12.safetensors` -> 12); None for any other file."""
    if not (name.startswith(HS_PREFIX) and name.endswith(HS_SUFFIX)):
        return None
    middle = name[len(HS_PREFIX):-len(HS_SUFFIX)]
    return int(middle) if middle.isdigit() else None


def hidden_state_rows(folder: Path) -> set[int]:
    """Rows that have a hidden-state file in `folder` (empty when it does not exist)."""
    folder = Path(folder)
    return {r for p in folder.iterdir() if (r := hidden_state_row(p.name)) is not None} if folder.is_dir() else set()


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
    def best_checkpoint(self) -> Path:
        """speculators' symlink to the best epoch (by validation loss)."""
        return self.checkpoints / BEST_CHECKPOINT

    @property
    def init_vocab(self) -> Path:
        """train.init_from's own draft vocabulary mapping (d2t.npy, t2d.npy), from its weights."""
        return self.root / "init-vocab"

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
    def served_tune_file(self) -> Path:
        """`dspark-kit tune --served` result: K and window by served throughput (auto reads the newer tune)."""
        return self.eval / "served_tune.json"

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

    # ---- logs/: every log a run writes is named here ----------------------
    # (speculators also writes its tensorboard events under logs/, in folders it names itself)
    @property
    def train_log(self) -> Path:
        """The trainer's output (speculators / torchrun), appended to across runs."""
        return self.logs / "train.log"

    @property
    def offline_data_log(self) -> Path:
        """speculators generate-offline-data against an extraction server (hidden_states backend vllm)."""
        return self.logs / "generate-offline-data.log"

    @property
    def mooncake_log(self) -> Path:
        """mooncake_master, when `train` starts it (hidden_states.transport mooncake)."""
        return self.logs / "mooncake-master.log"

    def plan_file(self, stage: str) -> Path:
        """The plan a stage's run executed (stages/plan.py), recorded before it starts."""
        return self.root / "plans" / f"{stage}.json"

    def stage_log(self, stage: str) -> Path:
        """`dspark-kit run`: what one stage printed (stage-regen.log ... stage-report.log)."""
        return self.logs / f"stage-{stage}.log"

    def server_log(self, role: str) -> Path:
        """A server a stage starts and stops (chat-server.log, hidden-states-server.log, spec-server.log)."""
        return self.logs / f"{role}-server.log"

    def serve_log(self, role: str) -> Path:
        """The server `dspark-kit serve --role ROLE` keeps running (serve-spec.log, ...)."""
        return self.logs / f"serve-{role}.log"

    def bench_file(self, label: str) -> Path:
        return bench_result_file(self.bench, label)
