"""The folders are layers: imports (module- or function-level) only point down, never in a cycle.

    0 core     recipe, rundir, atomic, jsonl, jsonl_sink, logs, processes, progress, devices, ...
    1 data     data/ (conversation model, chat rendering, template rows, sources, the tiny verifier)
    2 specdec  specdec/ (window math, verifier, draft, decoder, checkpoints), compat/ (speculators fixes)
    3 resolve  resolved/ (every derived value), distributed/ (multi-node launch, hidden-state transport)
    4 engines  engines/ (plans, the local engine, lifecycle)
    5 measure  measure/ (what the measuring stages share: prompt sets, timed requests, tables, charts)
    6 stages   stages/, itself in floors (STAGE_FLOORS): the plan types and the run's manifest,
               preflight/, the checked server plan, then the stage folders (each its own room: none
               imports another), then the registry and the pipeline over them
  6.5 launch   launchers/ (a run handed to a scheduler: the Slurm batch script, submit and follow)
    7 cli      cli/
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "dspark_kit"
LAYERS = {"recipe": 0, "rundir": 0, "findings": 0, "redact": 0, "atomic": 0, "jsonl": 0, "jsonl_sink": 0, "logs": 0, "processes": 0, "progress": 0, "output_capture": 0, "devices": 0, "data": 1, "specdec": 2, "compat": 2,
          "resolved": 3, "distributed": 3, "engines": 4, "measure": 5, "stages": 6, "launchers": 6.5, "cli": 7, "__main__": 7}


def module_of(path: Path) -> str:
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    return ".".join(p for p in parts if p != "__init__")


def layer(module: str) -> int | None:
    top = module.split(".")[0] if module else ""
    return LAYERS.get(top)


def _is_module(name: str) -> bool:
    """`cli.serve` is a module of the package (a file or a folder), not a name defined in one."""
    where = PKG.joinpath(*name.split("."))
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def imported(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dspark_kit"):
            base = node.module.removeprefix("dspark_kit").lstrip(".")
            for a in node.names:  # `from dspark_kit import atomic`, `from dspark_kit.cli import serve` name a module
                sub = f"{base}.{a.name}".lstrip(".")
                out.add(sub if not base or _is_module(sub) else base)
        elif isinstance(node, ast.Import):
            out |= {a.name.removeprefix("dspark_kit.") for a in node.names if a.name.startswith("dspark_kit.")}
    return out


def _leading_text(node: ast.expr) -> str:
    """The literal text an expression's string starts with: "a", f"a{x}", "a" + x."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        return _leading_text(node.values[0])
    if isinstance(node, ast.BinOp):
        return _leading_text(node.left)
    return ""


def hidden_imports(source: str) -> list[str]:
    """The package's own modules imported through a string (importlib.import_module, __import__):
    arrows that an editor, a reader and the rules of this file cannot see."""
    return [f"line {n.lineno}: imports {_leading_text(n.args[0])}... by a string; import it by name"
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call) and n.args
            and (getattr(n.func, "attr", None) == "import_module" or getattr(n.func, "id", None) in {"import_module", "__import__"})
            and _leading_text(n.args[0]).startswith(("dspark_kit", "."))]


def test_every_import_of_the_package_is_by_name():
    """The CLI's command modules (and every other module of the package) are imported by name, so the
    layer and cycle rules below see every arrow."""
    found = {module_of(f): b for f in PKG.rglob("*.py") if (b := hidden_imports(f.read_text()))}
    assert not found, found


@pytest.mark.parametrize("planted", [
    "import importlib\nfor n in ['serve']:\n    importlib.import_module(f'dspark_kit.cli.{n}').register(app)\n",
    "from importlib import import_module\nimport_module('dspark_kit.cli.' + name)\n",
    "__import__('dspark_kit.stages.steps')\n",
])
def test_the_hidden_import_rule_sees_a_string(planted):
    assert len(hidden_imports(planted)) == 1, hidden_imports(planted)
    assert hidden_imports("import importlib\nimportlib.import_module('speculators.train.cli')\n") == []


def test_the_cli_imports_its_command_modules_by_name():
    """Each command module is an arrow from cli/__init__.py the import rules see."""
    arrows = imported(PKG / "cli" / "__init__.py")
    commands = {module_of(f) for f in (PKG / "cli").glob("*.py") if "def register(" in f.read_text()}
    assert commands and commands <= arrows, sorted(commands - arrows)


def test_every_module_has_a_layer():
    missing = [module_of(f) for f in PKG.rglob("*.py") if module_of(f) and layer(module_of(f)) is None]
    assert not missing, f"add these to LAYERS: {missing}"


def test_imports_only_point_down():
    upward = []
    for f in PKG.rglob("*.py"):
        src = module_of(f)
        if not src:
            continue
        for dst in imported(f):
            if layer(dst) is not None and layer(dst) > layer(src):
                upward.append(f"{src} (layer {layer(src)}) imports {dst} (layer {layer(dst)})")
    assert not upward, "\n".join(upward)


# Below stages/, code takes plain values or small frozen records, never the resolver (issue 57): each
# stage asks `Resolved` at its start and passes down what it decided (stages/server_plan.py,
# stages/prompts.py build the records engines/ and measure/ take).
BELOW_STAGES = ("engines", "measure", "specdec", "data")


def resolver_importers() -> set[str]:
    """Modules below stages/ that import dspark_kit.resolved (module- or function-level)."""
    return {module_of(f) for top in BELOW_STAGES for f in (PKG / top).rglob("*.py")
            if any(d == "resolved" or d.startswith("resolved.") for d in imported(f))}


def test_nothing_below_stages_imports_the_resolver():
    found = sorted(resolver_importers())
    assert not found, (f"{found} import dspark_kit.resolved: below stages/ take plain values or a small frozen "
                       "record; the stage asks the resolver and passes them (docs/CONTRIBUTING.md)")


def test_the_resolver_rule_sees_an_import(tmp_path, monkeypatch):
    fake = tmp_path / "dspark_kit"
    (fake / "measure").mkdir(parents=True)
    (fake / "measure" / "gate.py").write_text("def f():\n    from dspark_kit.resolved import Resolved\n")
    (fake / "measure" / "table.py").write_text("from dspark_kit.specdec import window\n")
    monkeypatch.setitem(globals(), "PKG", fake)
    assert resolver_importers() == {"measure.gate"}


def _known_module(name: str, known: set[str]) -> str | None:
    """`specdec.decoder.SpecGenerator` -> `specdec.decoder`: the longest prefix that is a module."""
    while name and name not in known:
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return name or None


# stages/ in floors: a module imports only its own floor's modules or lower floors. The stage
# folders share a floor, and none of them may import another (`test_no_stage_folder_imports_another`).
STAGE_FLOORS = {"plan": 0, "manifest": 0, "preflight": 1, "server_plan": 2, "prompts": 2,
                "dataset": 3, "hidden": 3, "training": 3, "evaluation": 3, "serving": 3, "reporting": 3, "init": 3,
                "steps": 4, "pipeline": 4}
STAGE_FOLDERS = {name for name, floor in STAGE_FLOORS.items() if floor == 3}


def stage_part(module: str) -> str | None:
    """`stages.serving.bench` -> `serving`; None outside stages/."""
    parts = module.split(".")
    return parts[1] if parts[0] == "stages" and len(parts) > 1 else None


def stage_arrows() -> list[tuple[str, str, str, str]]:
    """(module, imported module, its stages part, the imported one's) for each import inside stages/."""
    out = []
    for f in (PKG / "stages").rglob("*.py"):
        src = module_of(f)
        for dst in imported(f):
            a, b = stage_part(src), stage_part(dst)
            if a and b and a != b:
                out.append((src, dst, a, b))
    return out


def test_every_stages_module_has_a_floor():
    parts = {stage_part(module_of(f)) for f in (PKG / "stages").rglob("*.py")} - {None}
    assert parts <= set(STAGE_FLOORS), f"add these to STAGE_FLOORS: {sorted(parts - set(STAGE_FLOORS))}"


def test_stages_floors_only_point_down():
    up = [f"{src} imports {dst}" for src, dst, a, b in stage_arrows()
          if STAGE_FLOORS[b] > STAGE_FLOORS[a]]
    assert not up, "\n".join(up)


def test_no_stage_folder_imports_another():
    """Each stage family is its own room: what two of them share moves down a floor (measure/,
    data/, engines/, resolved/, or stages/server_plan.py)."""
    across = [f"{src} imports {dst}" for src, dst, a, b in stage_arrows() if a in STAGE_FOLDERS and b in STAGE_FOLDERS]
    assert not across, "\n".join(across)


def test_the_stage_folder_rule_sees_an_arrow(tmp_path, monkeypatch):
    """The rule can fail: a module in one stage folder importing another is reported."""
    fake = tmp_path / "dspark_kit"
    (fake / "stages" / "serving").mkdir(parents=True)
    (fake / "stages" / "evaluation").mkdir(parents=True)
    (fake / "stages" / "serving" / "bench.py").write_text("from dspark_kit.stages.evaluation import evaluate\n")
    (fake / "stages" / "evaluation" / "evaluate.py").write_text("")
    monkeypatch.setitem(globals(), "PKG", fake)
    assert [(a, b) for _s, _d, a, b in stage_arrows()] == [("serving", "evaluation")]
    with pytest.raises(AssertionError, match="stages.serving.bench imports stages.evaluation"):
        test_no_stage_folder_imports_another()


def test_steps_is_only_the_registry():
    """steps.py names the stages in order; each stage's plan and run live in its own module."""
    tree = ast.parse((PKG / "stages" / "steps.py").read_text())
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert functions == {"execute", "run_stage"}, functions


def test_no_import_cycles():
    """No cycle of any length among the package's modules (module- and function-level imports)."""
    files = {module_of(f): f for f in PKG.rglob("*.py")}
    known = set(files) - {""}
    graph = {m: {d for d in (_known_module(x, known) for x in imported(f)) if d and d != m}
             for m, f in files.items() if m}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            assert state.get(d) != 1, "import cycle: " + " -> ".join(path[path.index(d):] + [d])
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_cli_modules_hold_no_stage_logic():
    """CLI modules parse, call one stage function and print: no loops over data, no file writes."""
    heavy = []
    for f in (PKG / "cli").glob("*.py"):
        text = f.read_text()
        for needle in ("open(", ".write_text(", "subprocess.", "json.loads(", "httpx."):
            if needle in text:
                heavy.append(f"{f.name}: {needle}")
    assert not heavy, heavy


# What a CLI module may import below stages/ and measure/ (the entry points it calls): the core it
# parses and shows with, exception classes (to turn into one line), and these tools, each a command
# of its own that is a function of a lower layer.
CLI_CORE = {"cli", "stages", "launchers", "measure", "recipe", "rundir", "findings", "redact", "progress", "devices"}
CLI_TOOLS = {
    "resolved": "common.resolve builds the command's one Resolved",
    "resolved.derived": "recipe show",
    "resolved.storage_plan": "preflight's storage line",
    "specdec.window": "window plan",
    "specdec.draft_layouts": "drafts import/export/slots",
    "specdec.gguf_export": "export --layout gguf (llama.cpp's converter)",
    "specdec.llamacpp_tree": "export --layout gguf: the one line when llama.cpp is not built",
    "specdec.anchor": "drafts slots: a layout's draft tokens per block",
    "specdec.anchor_measure": "drafts: the layouts measured side by side",
    "specdec.verifier": "drafts import: the verifier's config",
    "specdec.checkpoints": "contract: the checkpoints to judge",
    "engines.vllm_contract": "contract",
    "processes.install_signal_handlers": "main: SIGTERM/SIGHUP stop every command as Ctrl-C does",
    "engines": "serve --api-key's environment variable",
    "compat.patches": "doctor",
    "data.categories": "the --categories parser",
}
RECIPE_SECTIONS = {"verifier", "data", "regen", "hidden_states", "draft", "train", "serve", "bench", "eval", "slurm"}
FILE_CALLS = {"open", "read_text", "read_bytes", "write_text", "write_bytes"}


def cli_breaches(source: str) -> list[str]:
    """What a CLI module does that is a stage's work: reads a recipe field (`res.recipe`, `r.serve`),
    opens or reads a file, parses JSON/YAML, or calls into a lower layer that is not an entry point."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Attribute) and (n.attr == "recipe" or (
                isinstance(n.value, ast.Name) and n.value.id in {"r", "recipe"} and n.attr in RECIPE_SECTIONS)):
            out.append(f"line {n.lineno}: reads the recipe (.{n.attr}); ask the stage")
        elif isinstance(n, ast.Call):
            fn = n.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            if name in FILE_CALLS:
                out.append(f"line {n.lineno}: opens a file ({name}); the stage reads and writes")
            elif isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id in {"json", "yaml"} \
                    and fn.attr.startswith(("load", "safe_load")):
                out.append(f"line {n.lineno}: parses {fn.value.id}; the stage reads its files")
        elif isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("dspark_kit"):
            module = n.module.removeprefix("dspark_kit").lstrip(".")
            for a in n.names:
                target = module or a.name
                if (target.split(".")[0] in CLI_CORE or {target, f"{target}.{a.name}"} & set(CLI_TOOLS)
                        or a.name.endswith(("Error", "Stopped", "Exists"))):
                    continue
                out.append(f"line {n.lineno}: calls {target}.{a.name}, not a stage, measure or tool entry point")
    return out


def test_cli_modules_only_parse_and_call():
    """A CLI module reads no recipe field, opens no file and only calls stage, measure or tool entry
    points (CLI_TOOLS names each tool and why)."""
    found = {f.name: b for f in sorted((PKG / "cli").glob("*.py")) if (b := cli_breaches(f.read_text()))}
    assert not found, found


@pytest.mark.parametrize("planted", [
    "def f(res):\n    return res.recipe.eval.num_prompts\n",
    "def f(r):\n    return r.bench.concurrency\n",
    "def f(p):\n    return p.read_text()\n",
    "import json\ndef f(s):\n    return json.loads(s)\n",
    "def f():\n    from dspark_kit.engines.lifecycle import ManagedServer\n    return ManagedServer\n",
])
def test_the_cli_rule_sees_stage_work(planted):
    assert len(cli_breaches(planted)) == 1, cli_breaches(planted)
    assert cli_breaches("def f(res):\n    from dspark_kit.stages.steps import REGISTRY\n    return res.run.eval\n") == []


def nested_in_register(source: str) -> list[str]:
    """Functions (and classes) defined inside a module's `register`: commands as closures."""
    return [f"{node.name} (line {node.lineno})" for reg in ast.parse(source).body
            if isinstance(reg, ast.FunctionDef) and reg.name == "register"
            for node in ast.walk(reg) if node is not reg
            and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def test_cli_commands_are_module_functions():
    """One module-level function per command; `register(app)` only registers them."""
    nested = {f.name: found for f in (PKG / "cli").glob("*.py") if (found := nested_in_register(f.read_text()))}
    assert not nested, f"commands defined inside register (make them module-level functions): {nested}"
    # the check can fail: a closure command is seen
    closure = "def register(app):\n    @app.command()\n    def prepare():\n        pass\n"
    assert nested_in_register(closure) == ["prepare (line 3)"]
    assert nested_in_register("def prepare():\n    pass\n\n\ndef register(app):\n    app.command()(prepare)\n") == []


MAX_MODULE_LINES = 600


def test_no_module_is_over_600_lines():
    """A smell, not a rule: modules hold one idea each, and a module this long likely holds two.
    Split by what the parts decide, never only to get under the number."""
    long = {str(f.relative_to(PKG)): n for f in PKG.rglob("*.py")
            if (n := len(f.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_every_package_says_what_it_holds_and_may_import():
    """Each package's docstring names what lives there and what it may import (what `look` shows)."""
    silent = []
    for f in PKG.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(f.read_text())) or ""
        if len(doc.splitlines()) < 2 or "import" not in doc.lower():
            silent.append(str(f.relative_to(PKG)))
    assert not silent, f"packages whose docstring does not say what they hold and may import: {silent}"
