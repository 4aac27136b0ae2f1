"""`dspark-kit doctor`: what this machine has and which speculators patches training will apply."""

from __future__ import annotations

from typing import Annotated

import typer

from dspark_kit.cli import common
from dspark_kit.cli.vocabulary import option


def doctor(
    probe_device: Annotated[str, option("probe_device")] = "auto",
    json_out: common.JsonOpt = False,
) -> None:
    """Show the device, package versions and each speculators fix probe.

    Every probe runs the installed speculators code on a tiny input (Markov
    prev_token, slot-0 loss weight, slot-0 metrics, no cuda assumptions on
    this device), with torch.compile off, in seconds. A probe whose check
    fails is not an error: `dspark-kit train` applies the named patch in
    every training process. A probe that crashes is "probe failed: <reason>":
    whether the fix is needed is unknown, train refuses to start, and doctor
    exits 1 (else 0).
    """
    from rich.console import Console
    from rich.table import Table

    from dspark_kit import devices
    from dspark_kit.compat import patches

    try:
        info = devices.describe(probe_device)
    except (ValueError, RuntimeError) as e:
        common.fail(str(e))
    results = patches.probe_all(info["device"])
    summaries = {f.name: f.summary for f in patches.FIXES}

    def action(r) -> str:
        if r.failed:
            return "train refuses to start (probe failed)"
        return "none" if r.ok else f"train applies patch {r.name}"

    rows = [
        {
            "name": r.name,
            "ok": r.ok,
            "failed": r.failed,
            "detail": r.detail,
            "fix": summaries[r.name],
            "action": action(r),
        }
        for r in results
    ]
    failed = [r for r in results if r.failed]
    if json_out:
        common.emit_json({**info, "probes": rows})
        if failed:
            raise typer.Exit(1)
        return
    out = Console()
    out.print(
        f"device: [bold]{info['device']}[/] x{info['count']} ({', '.join(info['names'])})"
    )
    versions = Table(title="versions")
    versions.add_column("package")
    versions.add_column("version")
    for name, version in info["versions"].items():
        versions.add_row(name, version or "[dim]not installed[/]")
    out.print(versions)
    probes = Table(title=f"speculators probes on {info['device']}")
    for col in ("probe", "state", "detail"):
        probes.add_column(col, overflow="fold")
    for row in rows:
        state = (
            "[red]probe failed[/]" if row["failed"]
            else "[green]ok[/]" if row["ok"] else "[yellow]patched by train[/]"
        )  # fmt: skip
        probes.add_row(row["name"], state, f"{row['fix']}: {row['detail']}")
    out.print(probes)
    pending = [r["name"] for r in rows if not r["ok"] and not r["failed"]]
    if pending:
        out.print(f"dspark-kit train will apply patches: {', '.join(pending)}")
    for r in failed:
        out.print(f"{r.name}: {r.detail}", soft_wrap=True, highlight=False, markup=False)
    if failed:
        out.print("dspark-kit train will refuse to start until every probe runs")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
