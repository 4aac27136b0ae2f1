"""The serve stage of a run: pick + check the checkpoint, record the command, smoke-test it.

On the recipe's engine the exact serve command is written to
`DIR/serve/serve_command.txt` (what you run on the Ascend/CUDA box). With the
local engine the stage also starts the server, waits for /health, sends one
chat request and stops it, so a broken checkpoint fails here rather than in
bench.
"""

from __future__ import annotations

from pathlib import Path

from dspark_kit.recipe import Recipe


def resolve_and_validate(recipe: Recipe, workdir: Path, which: str | None) -> tuple[Path, list]:
    """The checkpoint to serve (absolute) and what is wrong with it for this recipe."""
    from dspark_kit.spec.checkpoints import resolve_checkpoint, validate_checkpoint
    from dspark_kit.data.tiny import resolve_verifier_path
    from dspark_kit.spec.verifier import num_hidden_layers

    which = which or recipe.serve.checkpoint
    path = resolve_checkpoint(Path(workdir) / "checkpoints", which)
    verifier = resolve_verifier_path(recipe.verifier.path)
    findings = validate_checkpoint(path, recipe, num_hidden_layers(recipe), verifier)
    return path, findings


def stage_serve_check(recipe: Recipe, workdir: Path) -> dict:
    import httpx

    from dspark_kit.spec.checkpoints import errors
    from dspark_kit.engines.lifecycle import free_port
    from dspark_kit.stages.preflight import enforce
    from dspark_kit.engines.servers import running_server, server_plan

    workdir = Path(workdir)
    enforce(recipe, workdir, "serve")
    ckpt, findings = resolve_and_validate(recipe, workdir, None)
    bad = errors(findings)
    if bad:
        raise ValueError("checkpoint check failed: " + "; ".join(f.message for f in bad))
    plan = server_plan(recipe, "spec", checkpoint=ckpt, workdir=workdir)
    out = workdir / "serve"
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_command.txt").write_text(plan.shell_line() + "\n")
    result = {"engine": recipe.serve.engine, "checkpoint": str(ckpt), "command_file": str(out / "serve_command.txt"),
              "warnings": [f.message for f in findings] + plan.notes}
    if recipe.serve.engine == "local":
        with running_server(recipe, "spec", workdir, port=free_port(), checkpoint=ckpt) as url:
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
                "model": model, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "Count from 1 to 5."}]})
            r.raise_for_status()
            result["smoke_reply"] = r.json()["choices"][0]["message"]["content"]
    return result
