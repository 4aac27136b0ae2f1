"""`dspark-kit` command line: thin Typer wrappers over library functions.

Each module in COMMAND_MODULES defines `register(app)`; they are imported by name (an editor,
a reader and tests/test_layers.py see each arrow); keep the tuple in pipeline order so `--help`
reads like the pipeline.

Layer 7, the top: may import every layer; nothing imports cli/. A command module parses its
options, calls one library function (a stage's plan or run, a tool) and prints.
"""

from __future__ import annotations

import typer

from dspark_kit.cli import (
    bench,
    contract,
    doctor,
    drafts,
    eval,
    init_cmd,
    preflight,
    recipe_cmd,
    regen,
    report,
    serve,
    stages,
    vocabulary,
    window,
)

app = typer.Typer(
    name="dspark-kit",
    help=(
        "From a verifier LLM to a served DSpark draft. Stages: regen -> prepare -> "
        "hidden-states -> train -> eval -> serve -> bench -> report. Every stage reads one "
        "recipe (-r recipes/X.yaml, --set section.key=value) and runs on a laptop CPU with "
        "the embedded tiny verifier (recipes/tiny-cpu.yaml)."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

COMMAND_MODULES = (
    init_cmd,  # a recipe for your own verifier
    regen,
    stages,  # prepare, hidden-states, train, run
    eval,
    window,
    serve,
    bench,
    report,
    preflight,
    contract,  # vLLM's own loader judges the checkpoint
    drafts,  # import / export: DSpark's own draft layout <-> speculators'
    doctor,
    recipe_cmd,
)

for _module in COMMAND_MODULES:
    _module.register(app)

# after every command is registered: each one also parses its options' old spellings (hidden, one release)
vocabulary.install(app)


def main() -> None:
    # SIGTERM / SIGHUP (scancel, kill, `timeout`) stop any command as Ctrl-C does: its finally blocks
    # run and a pipeline names the command that resumes. Installed here, not only when the kit
    # starts a process: regen against running servers starts none, and died silently
    from dspark_kit.processes import install_signal_handlers

    install_signal_handlers()
    app()
