"""Engine plans as tests build them: a Resolved for the case, then the engine's plan."""

from __future__ import annotations

from dspark_kit.resolved import Resolved
from dspark_kit.stages.server_plan import server_plan


def resolved(r, engine="vllm", checkpoint=None, installed_versions=None, *, num_hidden_layers=None,
             window_support=None, workdir="/nonexistent/run", cpu=None) -> Resolved:
    """planning=True: checkpoints may be bare dirs; `cpu` pins the CPU-build decision."""
    if num_hidden_layers is not None:
        r = r.model_copy(deep=True)
        r.verifier.num_hidden_layers = num_hidden_layers
    res = Resolved(r, workdir, engine=engine, checkpoint=checkpoint, planning=True,
                   installed=installed_versions, window_support=window_support)
    if cpu is not None:
        res.__dict__["vllm_on_cpu"] = cpu  # cached_property: the decision this test pins
    return res


def plan_vllm(r, role, engine="vllm", port=None, checkpoint=None, installed_versions=None, **kw):
    """The vLLM engine's plan, through the stage that asks the resolver for its inputs."""
    return server_plan(resolved(r, engine, checkpoint, installed_versions, **kw), role, port=port)


def runs_on_cpu(r, engine: str) -> bool:
    return Resolved(r, "/nonexistent/run", engine=engine, planning=True).vllm_on_cpu
