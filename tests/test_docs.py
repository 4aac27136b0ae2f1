"""The docs stand on their own: every docs/ link in README, docs/*.md (docs/TOUR.md included), the package's help strings and
comments, scripts and recipes resolves to a file in the repository and, with an #anchor, to a heading
there (GitHub's anchor rules); nothing points at a document outside the repository. README is a front
door: at most 150 lines, and every `make` target and `dspark-kit` command it names exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO / "docs").glob("*.md"))
MARKDOWN = [REPO / "README.md", *DOCS]
SOURCES = [*(REPO / "dspark_kit").rglob("*.py"), *(REPO / "scripts").iterdir(), *(REPO / "recipes").glob("*.yaml"),
           REPO / "Makefile"]
# a docs/ path anywhere in text: docs/CONCEPTS.md#layer-ids, (docs/PITFALLS.md), `docs/ASCEND.md`
REPO_DOC_REF = re.compile(r"docs/([A-Za-z0-9_.-]+\.md)(#[A-Za-z0-9_-]+)?")
# a relative markdown link target: [text](CONCEPTS.md#x), [text](#x), [text](docs/X.md)
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
OUTSIDE = ("REFERENCE", "seed §", "Seed §", "../shared", "seed guide", "seed article", "seed FAQ")


def slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped (word characters, spaces and
    hyphens kept), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m and not fenced:
            base = slug(m.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def check(target: Path, anchor: str | None, where: str) -> str | None:
    if not target.is_file():
        return f"{where}: {target.relative_to(REPO)} does not exist"
    if anchor and anchor not in anchors(target):
        return f"{where}: #{anchor} is not a heading of {target.relative_to(REPO)}"
    return None


def test_slug_follows_github():
    assert slug("vLLM's CPU build") == "vllms-cpu-build"
    assert slug("speculators on CPU and NPU") == "speculators-on-cpu-and-npu"
    assert slug("K (`num_speculative_tokens`)") == "k-num_speculative_tokens"
    assert slug("11. Multi-node: only one machine can reach it") == "11-multi-node-only-one-machine-can-reach-it"


def test_every_docs_reference_resolves():
    problems = []
    for f in [*MARKDOWN, *SOURCES]:
        if not f.is_file():
            continue
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for m in REPO_DOC_REF.finditer(line):
                anchor = m.group(2)[1:] if m.group(2) else None
                problems.append(check(REPO / "docs" / m.group(1), anchor, f"{f.relative_to(REPO)}:{i}"))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


def test_every_markdown_link_resolves():
    problems = []
    for f in MARKDOWN:
        for i, line in enumerate(f.read_text().splitlines(), 1):
            for m in MD_LINK.finditer(line):
                target = m.group(1)
                if re.match(r"[a-z]+://|mailto:", target):
                    continue
                path, _, anchor = target.partition("#")
                problems.append(check((f.parent / path).resolve() if path else f, anchor or None,
                                      f"{f.relative_to(REPO)}:{i}"))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


def test_the_concepts_anchors_the_code_uses_exist():
    """The sections the package points at by name, so a renamed heading fails here first."""
    wanted = {"layer-ids", "speculators-on-cpu-and-npu", "the-hidden-state-server", "k-and-the-draft-window",
              "acceptance-figures", "long-context", "dspark-at-inference", "vllms-cpu-build", "the-mask-token"}
    assert wanted <= anchors(REPO / "docs" / "CONCEPTS.md")


def test_nothing_points_outside_the_repository():
    hits = [f"{f.relative_to(REPO)}:{i}: {line.strip()[:100]}"
            for f in [*MARKDOWN, *SOURCES, *(REPO / "tests").glob("*.py")] if f.is_file() and f.name != "test_docs.py"
            for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
            if any(word in line for word in OUTSIDE)]
    assert not hits, "\n".join(hits)


# --- README is a front door: short, and every command it names exists ---------------------------

README = REPO / "README.md"
README_MAX_LINES = 150
# `make demo`, `make test-fast`
MAKE_TARGET = re.compile(r"\bmake ([a-z][\w-]*)")
# `dspark-kit recipe show`, `$K init` (README's K=.venv/bin/dspark-kit): the command and, for a
# command group, its subcommand
CLI_COMMAND = re.compile(r"(?:\bdspark-kit|\$K) ([a-z][\w-]*)(?: ([a-z][\w-]*))?")


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", (REPO / "Makefile").read_text(), flags=re.MULTILINE))


def test_the_tour_is_checked_with_the_docs():
    """docs/TOUR.md holds what the README used to: its links are checked like every doc's."""
    assert REPO / "docs" / "TOUR.md" in DOCS


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"
    text = README.read_text()
    two = text.index("## Two commands")
    assert text.index("make demo") > two and text.index("make test") > two
    assert re.findall(r"^## (.*)", text, flags=re.MULTILINE)[0] == "Two commands", "the two commands come first"


def test_every_make_target_the_readme_names_exists():
    named = set(MAKE_TARGET.findall(README.read_text()))
    assert {"demo", "test", "test-fast"} <= named
    missing = sorted(named - makefile_targets())
    assert not missing, f"README names make targets the Makefile lacks: {missing}"


def test_every_cli_command_the_readme_names_exists():
    import typer.main

    from dspark_kit.cli import app

    root = typer.main.get_command(app)
    named = CLI_COMMAND.findall(README.read_text())
    assert named, "README names no dspark-kit command"
    problems = []
    for command, sub in named:
        found = root.commands.get(command)
        if found is None:
            problems.append(f"dspark-kit {command}")
        elif sub and hasattr(found, "commands") and sub not in found.commands:
            problems.append(f"dspark-kit {command} {sub}")
    assert not problems, f"README names commands the CLI lacks: {problems}"


def test_the_command_check_sees_a_wrong_command():
    """The patterns catch what they should: a misspelt command or subcommand would be found."""
    assert CLI_COMMAND.findall("run `dspark-kit recipe shwo` then `$K evaluate`") == [("recipe", "shwo"),
                                                                                     ("evaluate", "")]
    assert MAKE_TARGET.findall("`make demo`, then `make test-fast`") == ["demo", "test-fast"]
    assert "demo" in makefile_targets() and "VENV" not in makefile_targets()
