"""`dspark-kit preflight`: the ten silent acceptance killers, checked before you spend GPU hours."""

from __future__ import annotations

import typer

from dspark_kit.cli.common import (
    DEFAULT_RECIPE_PATH,
    JsonOpt,
    RecipeOpt,
    SetOpt,
    WorkdirOpt,
    emit_json,
    load,
    resolve,
)


def register(app: typer.Typer) -> None:
    @app.command("preflight")
    def preflight(
        recipe: RecipeOpt = DEFAULT_RECIPE_PATH,
        set_: SetOpt = None,
        workdir: WorkdirOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Check the recipe and the run's artifacts against docs/PITFALLS.md's pitfalls.

        Looks at whatever exists in the work dir: regen.jsonl (model, thinking),
        prepared/prepare_meta.json, prepared/hidden_states/hs_0.safetensors
        (layer count), checkpoints/<serve.checkpoint> (complete, verifier, slots,
        mask and layer ids), plus the recipe's window and K settings. Missing
        artifacts are skipped. Exit 1 on any error; warnings only print.
        """
        from rich.console import Console

        from dspark_kit.stages.preflight import PITFALLS, has_errors, run_preflight

        # planning: preflight checks what exists; it builds nothing and plans an explicit device as written
        findings = run_preflight(resolve(load(recipe, set_), workdir, planning=True))
        if json_out:
            emit_json({"ok": not has_errors(findings), "findings": [f.as_dict() for f in findings]})
        else:
            out = Console(stderr=True)
            for f in findings:
                color = "red" if f.level == "error" else "yellow"
                out.print(
                    f"[{color}]{f.level}[/] pitfall {f.pitfall} ({PITFALLS[f.pitfall]}): {f.message}",
                    highlight=False,
                )
            errors = sum(f.level == "error" for f in findings)
            out.print(
                f"preflight: {errors} error(s), {len(findings) - errors} warning(s)"
                + (" - ok" if not errors else "")
            )
        if has_errors(findings):
            raise typer.Exit(1)
