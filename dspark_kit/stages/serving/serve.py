"""The serve stage of a run: the spec server's command, checked.

The server's plan is stages/server_plan.py's (what `dspark-kit serve` starts too). The
stage records the exact command in `DIR/serve/serve_command.txt` (what you
run on the Ascend/CUDA box); on the local engine it also starts the server,
sends one chat request and stops it, so a broken checkpoint fails here rather
than in bench.
"""

from __future__ import annotations

from dspark_kit import atomic
from dspark_kit.engines import ServerPlan
from dspark_kit.progress import STANDALONE, Reporter
from dspark_kit.resolved import Resolved
from dspark_kit.stages.plan import StagePlan
from dspark_kit.stages.server_plan import (
    CheckedServer,
    ServeError,
    checked_server,
    spec_server_lines,
)


async def smoke_reply(url: str) -> str:
    """One short greedy chat request to a running server: its reply text."""
    from dspark_kit.engines.chat_client import ChatClient, RequestFailed

    async with ChatClient(url, concurrency=1, timeout=300) as client:
        try:
            ids = await client.model_ids()
            out = await client.post_chat({"model": ids[0] if ids else None, "max_tokens": 8, "temperature": 0,
                                          "messages": [{"role": "user", "content": "Count from 1 to 5."}]})
        except RequestFailed as e:
            raise ServeError(f"serve check: the spec server at {url} failed a chat request: {e.reason}") from None
    return out["text"]


def serve_check(res: Resolved, server: ServerPlan | None = None) -> dict:
    """Check the checkpoint serves: write the spec server's command, and with the local engine start
    that server (`server`: the stage plan's) and get one reply from it."""
    import asyncio

    from dspark_kit.stages.server_plan import running_server

    run = res.run
    sp = checked_server(res, "spec")  # its findings, warnings and decisions
    server = server or sp.plan
    atomic.write_text(run.serve_command, server.shell_line() + "\n")
    result = {"engine": res.engine, "checkpoint": str(res.checkpoint), "command_file": str(run.serve_command),
              "num_speculative_tokens": res.k.value, "draft_window_size": res.window.value,
              "adaptive_verification": res.adaptive_verification.value,
              "warnings": sp.warnings, "decisions": sp.decisions}
    if res.engine == "llama.cpp":
        result["gguf"] = export_for_llamacpp(res)
    if res.engine in ("local", "llama.cpp"):
        with running_server(res, "spec", plan=server) as url:
            result["smoke_reply"] = asyncio.run(smoke_reply(url))
    return result


def export_command(res: Resolved) -> list[str]:
    """The `dspark-kit export --layout gguf` the serve check runs for llama.cpp (as a line to print)."""
    from dspark_kit.engines.servers import gguf_export_dir

    argv = ["dspark-kit", "export", str(res.checkpoint), str(gguf_export_dir(res.run.serve, res.checkpoint)), "--layout", "gguf",
            "--verifier", res.verifier_path]
    own = res.verifier_gguf
    return argv + (["--verifier-gguf", own] if own else [])


def export_for_llamacpp(res: Resolved) -> dict:
    """The spec checkpoint as GGUF files for llama.cpp (DIR/serve/gguf-NAME), exported once per checkpoint."""
    from pathlib import Path

    from dspark_kit.engines.servers import gguf_export_dir
    from dspark_kit.specdec.gguf_export import DRAFT_GGUF, GgufExportError, export_gguf
    from dspark_kit.specdec.llamacpp_tree import LlamaCppMissing

    out = gguf_export_dir(res.run.serve, res.checkpoint)
    if (out / DRAFT_GGUF).exists():
        return {"draft": str(out / DRAFT_GGUF), "exported": "earlier"}
    own = res.verifier_gguf
    try:
        return export_gguf(res.checkpoint, out, Path(res.verifier_path), Path(own) if own else None)
    except (GgufExportError, LlamaCppMissing) as e:
        raise ServeError(str(e)) from None


# ---- `dspark-kit serve`: one server kept until Ctrl-C --------------------------------


def keep_serving(res: Resolved, checked: CheckedServer, role: str, *, ready, say=lambda _m: None) -> None:
    """`dspark-kit serve --role ROLE`: the checked server (its mooncake master first, when it needs
    one) kept running until Ctrl-C; its log is DIR/logs/serve-<role>.log. A start failure or a
    server that exits is engines.servers.ServerStopped, one line with its cause."""
    from contextlib import ExitStack

    from dspark_kit.engines import servers

    run, timeout = res.run, res.recipe.serve.startup_timeout
    with ExitStack() as stack:
        if checked.mooncake_master is not None:  # first: the server joins its store at start
            try:
                stack.enter_context(servers.started(checked.mooncake_master, run.mooncake_log, timeout))
            except Exception as e:
                raise servers.ServerStopped(f"mooncake_master did not start ({type(e).__name__}: {e}); "
                                            f"see {run.mooncake_log}") from e
            say(f"mooncake_master started (log: {run.mooncake_log})")
        servers.keep_serving(checked.plan, run.serve_log(role), timeout, ready=ready, say=say)


# ---- the stage ---------------------------------------------------------------


def plan(res: Resolved) -> StagePlan:
    lines, procs = spec_server_lines(res, "serve check")
    if res.engine == "llama.cpp":  # the draft (and verifier) as GGUF first, with llama.cpp's converter
        from dspark_kit.engines import shell_line

        lines.insert(0, shell_line(export_command(res), {}))
        lines.insert(0, "# serve check: the checkpoint as GGUF for llama.cpp (once per checkpoint)")
    elif res.engine != "local":  # nothing starts here: the command is written for the serving host
        lines.append(f"# written to {res.run.serve_command}; a non-local engine is not started by the serve check")
        procs = []
    return StagePlan.of(res, "serve", lines, procs, outputs={"command": str(res.run.serve_command)})


def run(res: Resolved, plan: StagePlan, reporter: Reporter = STANDALONE) -> dict:
    spec = plan.process("spec server")
    with reporter.doing("serve", "starting the spec server and checking that it answers"):
        return serve_check(res, spec.server if spec else None)
