"""`dspark-kit preflight`: the silent acceptance killers (findings.PITFALLS), checked before you spend GPU hours."""

from __future__ import annotations

import typer

from dspark_kit.cli import common


def preflight(
    recipe: common.RecipeOpt = common.DEFAULT_RECIPE_PATH,
    set_: common.SetOpt = None,
    workdir: common.WorkdirOpt = None,
    json_out: common.JsonOpt = False,
) -> None:
    """Check the recipe and the run's artifacts against the pitfalls of docs/PITFALLS.md.

    Looks at whatever exists in the work dir: regen.jsonl (model, thinking),
    prepared/prepare_meta.json, prepared/hidden_states/hs_0.safetensors
    (layer count), checkpoints/<serve.checkpoint> (complete, verifier, slots,
    mask and layer ids), plus the recipe's window and K settings. Missing
    artifacts are skipped. It prints the bytes offline hidden states will take next to the
    free space where they go, and each training device's planned memory (a peak past the device's
    memory is an error naming the cheapest fixes). Exit 1 on any error; warnings only print.
    """
    from rich.console import Console

    from dspark_kit.resolved.storage_plan import plan_storage
    from dspark_kit.stages.preflight.checks import PITFALLS, has_errors, run_preflight

    # planning: preflight checks what exists; it builds nothing and plans an explicit device as written
    res = common.resolve(common.load(recipe, set_), workdir, planning=True)
    findings = run_preflight(res)
    storage = plan_storage(res)
    from dspark_kit.recipe import RecipeError

    try:
        memory, memory_lines = res.memory_plan, res.memory_plan.lines()
    except (RecipeError, OSError, ValueError) as e:
        memory, memory_lines = None, [f"memory: not planned ({e})"]
    if json_out:
        common.emit_json({"ok": not has_errors(findings), "findings": [f.as_dict() for f in findings],
                   "storage": storage.as_dict(), "memory": memory.as_dict() if memory else None})
    else:
        from rich.markup import escape

        out = Console(stderr=True)
        out.print(storage.line(), highlight=False, soft_wrap=True)
        for line in memory_lines:
            out.print(escape(line), highlight=False, soft_wrap=True)
        for f in findings:  # one line each, also in a pipe; the message's brackets are text
            color = "red" if f.level == "error" else "yellow"
            about = f"pitfall {f.pitfall} ({PITFALLS[f.pitfall]})" if f.pitfall is not None else f.code
            out.print(f"[{color}]{f.level}[/] {escape(about)}: {escape(f.message)}", highlight=False,
                      soft_wrap=True)
        errors = sum(f.level == "error" for f in findings)
        out.print(
            f"preflight: {errors} error(s), {len(findings) - errors} warning(s)"
            + (" - ok" if not errors else "")
        )
    if has_errors(findings):
        raise typer.Exit(1)


def preflight_help() -> str:
    """The command's help: its docstring, with the registry's pitfall count in the first line."""
    from dspark_kit.findings import pitfall_count

    return preflight.__doc__.replace("against the pitfalls", f"against the {pitfall_count()} silent pitfalls", 1)


def register(app: typer.Typer) -> None:
    app.command("preflight", help=preflight_help())(preflight)
