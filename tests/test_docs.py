"""The docs stand on their own: every docs/ link in README, docs/*.md, the package's help strings and
comments, scripts and recipes resolves to a file in the repository and, with an #anchor, to a heading
there (GitHub's anchor rules); nothing points at a document outside the repository."""

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
