"""The registry: the eight stages in pipeline order, each named by the module that owns it.

Every stage module (`stages/<family>/<stage>.py`) has the same small interface: `plan(res)` returns
the stage's typed plan (stages/plan.py: every process it starts, the paths, the decided values),
which `--dry-run` prints; `run(res, plan, reporter)` executes exactly that plan (showing progress
and notes through `reporter`: `run`'s stage line, or a stage command's console) and returns a
summary dict with one key figure. `execute` does both and records the plan in the run folder.
`res` is the command's one `Resolved` (recipe, run folder and every derived value). `REGISTRY` is
the one list the pipeline, `run --dry-run` and every stage command use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from dspark_kit.progress import STANDALONE, Reporter
from dspark_kit.resolved import Resolved
from dspark_kit.stages.dataset import prepare, regen
from dspark_kit.stages.evaluation import evaluate
from dspark_kit.stages.hidden import hidden_states
from dspark_kit.stages.plan import StagePlan
from dspark_kit.stages.reporting import report
from dspark_kit.stages.serving import bench, serve
from dspark_kit.stages.training import train


@dataclass(frozen=True)
class Stage:
    name: str
    sections: tuple[str, ...]  # recipe sections whose change invalidates the stage
    run: Callable[[Resolved, StagePlan, Reporter], dict]  # execute the plan; a summary dict
    plan: Callable[[Resolved], StagePlan]  # what it will do (dry run, and the plan a run executes)
    key: str  # summary field shown in the final table

    @classmethod
    def of(cls, name: str, module: ModuleType, sections: tuple[str, ...], key: str) -> Stage:
        return cls(name, sections, module.run, module.plan, key)


def execute(stage: Stage, res: Resolved, reporter: Reporter = STANDALONE) -> dict:
    """Plan the stage, record the plan in the run folder, run exactly that plan."""
    plan = stage.plan(res)
    plan.record(res.run.plan_file(stage.name))
    return stage.run(res, plan, reporter)


REGISTRY: dict[str, Stage] = {
    s.name: s
    for s in [
        Stage.of("regen", regen, ("verifier", "data", "regen"), "written"),
        # regen: what prepare reads (regen.enabled) and the seed of a thinking mixture's draw
        Stage.of("prepare", prepare, ("verifier", "data", "regen"), "rows_out"),
        Stage.of("hidden-states", hidden_states, ("verifier", "hidden_states"), "generated"),
        Stage.of("train", train, ("draft", "train", "hidden_states"), "accept_len_epoch"),
        Stage.of("eval", evaluate, ("eval", "serve"), "acceptance_length"),
        Stage.of("serve", serve, ("serve",), "engine"),
        Stage.of("bench", bench, ("bench", "serve", "eval"), "acceptance_length"),  # eval: the mode measured
        Stage.of("report", report, (), "path"),
    ]
}
STAGES = list(REGISTRY)  # pipeline order


def run_stage(name: str, res: Resolved, reporter: Reporter = STANDALONE) -> dict:
    """One stage by name, as `run` and the stage commands do it (plan, record, execute)."""
    return execute(REGISTRY[name], res, reporter)
