"""Offline eval and window tuning on a briefly trained tiny draft."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from fixtures_decoder import fresh_draft, save_draft, train_draft

from dspark_kit.cli import app
from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.specdec.decoder import SpecResult
from dspark_kit.stages.evaluation.evaluate import EvalError, aggregate, evaluate_checkpoint
from dspark_kit.stages.evaluation.sweep_rules import candidate_windows, pick_window
from dspark_kit.stages.evaluation.window_tune import tune_window

RECIPE = Path(__file__).parents[1] / "recipes" / "tiny-cpu.yaml"
MARGIN = 1.8  # trained / untrained AL floor in the direction test (measured 2.235 / 1.000 = 2.24x)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_verifier) -> Path:
    """speculators' save_path layout: checkpoints/0 plus a checkpoint_best symlink."""
    wd = tmp_path_factory.mktemp("run")
    vp = tiny_verifier
    save_draft(train_draft(fresh_draft(vp), vp, steps=150), wd / "checkpoints" / "0")
    (wd / "checkpoints" / "checkpoint_best").symlink_to("0")
    return wd


def recipe(workdir: Path, *sets: str):
    return load_recipe(RECIPE, [f"workdir={workdir}", "eval.num_prompts=3", "eval.max_new_tokens=16",
                                "data.limit=24", *sets])


def test_aggregate_matches_vllm_formulas():
    a = SpecResult([1, 2, 3, 4, 5], "stop", num_drafts=2, num_draft_tokens=6, num_accepted_tokens=3,
                   accepted_per_pos=[2, 1, 0], verifier_forwards=3)
    b = SpecResult([6, 7], "length", num_drafts=2, num_draft_tokens=6, num_accepted_tokens=1,
                   accepted_per_pos=[1, 0, 0], verifier_forwards=3)
    s = aggregate([a, b], 3)
    assert s["acceptance_length"] == 2.0  # 1 + 4 accepted / 4 drafts
    assert s["per_position_acceptance"] == [0.75, 0.25, 0.0]
    assert s["acceptance_rate"] == round(4 / 12, 4)
    assert s["tokens_per_verifier_forward"] == round(7 / 6, 4)


def test_pick_window_rules():
    table = {"off": {"0": 3.0, "512": 1.5, "1024": 1.2},
             "256": {"0": 2.5, "512": 2.9, "1024": 2.8},  # loses short-context AL
             "512": {"0": 3.0, "512": 1.5, "1024": 2.4},
             "1024": {"0": 3.0, "512": 1.5, "1024": 1.2}}
    assert pick_window(table, [512, 1024], 0.02) == 512
    flat = {k: {"0": 3.0, "512": 3.0, "1024": 3.0} for k in ("off", "512")}
    assert pick_window(flat, [512, 1024], 0.02) is None  # no gain: leave the window unset


def test_candidate_windows_respect_training_window():
    assert candidate_windows(256, 1024, 16) == [256, 512]
    assert min(candidate_windows(256, 1024, 16, allow_below=True)) < 256
    assert all(w % 16 == 0 for w in candidate_windows(100, 2000, 16))


@pytest.mark.parametrize("engine", ["local", "vllm", "vllm-ascend"])
def test_eval_window_flag_is_resolveds_window(tmp_path, engine):
    """One window rule: --draft-window-size enters Resolved, so `auto` and no flag (recipe auto)
    give the window serving applies on every engine."""
    from dspark_kit.resolved import ResolveError

    r = recipe(tmp_path, f"serve.engine={engine}")

    def window(flag):
        return Resolved(r, tmp_path, window=flag, planning=True, window_support="no").window.value

    applies = engine != "vllm" and engine != "vllm-ascend"  # CUDA vLLM, or vllm-ascend without PR 14596
    assert window("off") is None and window("96") == (96 if applies else None)
    assert window("auto") == window(None) == (r.training_window if applies else None)
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "window_tune.json").write_text(json.dumps({"recommended_window": 48}))
    assert window("auto") == window(None) == (48 if applies else None)
    (tmp_path / "eval" / "window_tune.json").write_text(json.dumps({"recommended_window": None}))
    assert window("auto") is None and window(None) is None  # the tune found windows do not help
    with pytest.raises(ResolveError, match="--draft-window-size"):
        window("big")


@pytest.mark.slow
def test_run_eval_outputs_and_context_sweep(workdir):
    r = recipe(workdir)
    s = evaluate_checkpoint(Resolved(r, workdir, window="32"), context_lengths=[160])
    assert s["acceptance_length"] > 1.0
    assert abs(1 + sum(s["per_position_acceptance"]) - s["acceptance_length"]) < 1e-3
    assert s["num_speculative_tokens"] == 4 and "trained slots" in s["num_speculative_tokens_source"]
    long_runs = [x for x in s["runs"] if x["context_length"] == 160]
    assert sorted(x["window"] or 0 for x in long_runs) == [0, 32]
    assert all(150 <= x["mean_prompt_tokens"] <= 200 for x in long_runs)
    # the recipe's eval.categories [tiny]: one row per task template, each of its own prompts
    from dspark_kit.data.tiny_corpus import TASK_KINDS

    cats = s["categories"]
    assert [c["category"] for c in cats] == [f"tiny/{k}" for k in TASK_KINDS]
    for c in cats:
        assert c["count"] == r.eval.num_prompts == c["num_requests"] and c["num_drafts"] > 0
        assert c["acceptance_length"] == pytest.approx(1 + sum(c["per_position_acceptance"]), abs=1e-3)
    assert len({c["acceptance_length"] for c in cats}) > 1  # the templates differ, and so does acceptance
    md = (workdir / "eval" / "eval.md").read_text()
    assert "## Acceptance per category" in md and f"| tiny/count | {r.eval.num_prompts} |" in md
    assert (workdir / "eval" / "eval_categories.png").stat().st_size > 1000
    files = {k: Path(v) for k, v in s["files"].items()}
    assert {"json", "markdown", "positions_png", "context_png"} <= files.keys()
    assert all(f.is_file() and f.stat().st_size > 0 for f in files.values())
    assert json.loads(files["json"].read_text())["acceptance_length"] == s["acceptance_length"]
    assert Path(s["checkpoint"]) == (workdir / "checkpoints" / "0").resolve()


@pytest.mark.slow
def test_tune_writes_recommendation(workdir):
    r = recipe(workdir, "data.seq_length=64")  # training window 64 so the tiny contexts exceed it
    with pytest.raises(EvalError, match="--allow-below"):
        tune_window(Resolved(r, workdir), candidates=[32, 64], context_lengths=[160])
    res = tune_window(Resolved(r, workdir), candidates=[64, 128], context_lengths=[160], num_prompts=2, max_new_tokens=12)
    saved = json.loads((workdir / "eval" / "window_tune.json").read_text())
    assert "recommended_window" in saved and saved["recommended_window"] in (None, 64, 128)
    assert set(saved["acceptance_length"]) == {"off", "64", "128"}
    # the extensible shape: one measurement per (window, K, context)
    assert {(m["k"], m["window"], m["context_length"]) for m in saved["measurements"]} == {
        (k, w, c) for k in (3, 4) for w in (None, 64, 128) for c in (0, 160)}
    assert res["recommended_window"] == saved["recommended_window"]
    # K is swept too (block - 1 and block) and serving's auto K follows the tune
    assert saved["ks"] == [3, 4] and saved["recommended_k"] in (3, 4)
    assert set(saved["acceptance_length_by_k"]) == {"3", "4"}
    assert len(saved["measurements"]) == 2 * 3 * 2  # K x (off + 2 windows) x (short + 160)
    assert Resolved(r, workdir).k.value == saved["recommended_k"]
    # what calibration buys: acceptance and tokens/s per confidence threshold, the recommendation read off it
    curve = saved["threshold_curve"]
    assert [p["threshold"] for p in curve["points"]] == [None, 0.1, 0.3, 0.5, 0.7, 0.9]
    assert all(p["tokens_per_s"] > 0 and p["acceptance_length"] >= 1 for p in curve["points"])
    fastest = max(p["tokens_per_s"] for p in curve["points"])
    chosen = next(p for p in curve["points"] if p["threshold"] == curve["recommended_threshold"])
    assert chosen["tokens_per_s"] >= fastest * (1 - curve["tolerance"])


@pytest.mark.slow
def test_cli_eval_json_and_errors(workdir):
    runner = CliRunner()
    base = ["eval", "-r", str(RECIPE), "--set", f"workdir={workdir}", "--set", "data.limit=24",
            "--num-prompts", "2", "--max-new-tokens", "8", "--draft-window-size", "off"]
    res = runner.invoke(app, [*base, "--json", "--out", str(workdir / "cli_eval")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["draft_window_size"] is None
    assert (workdir / "cli_eval" / "eval.md").is_file()
    bad = runner.invoke(app, [*base, "--checkpoint", "7"])
    assert bad.exit_code == 2 and "checkpoint" in bad.output
    # --categories: the flag wins over eval.categories ([tiny] in the recipe); a misspelt name is one line
    gsm = workdir / "gsm8k_test.jsonl"
    gsm.write_text(json.dumps({"question": "Count from 3 to 9.", "answer": "#### 3, 4, 5, 6, 7, 8, 9"}) + "\n")
    mt = workdir / "mt_bench.jsonl"  # MT-Bench: the second turn is asked after the verifier's own reply
    mt.write_text(json.dumps({"prompt": ["describe the red fox.", "count from 2 to 5."]}) + "\n")
    res = runner.invoke(app, [*base, "--json", "--out", str(workdir / "cli_cat"), "--categories",
                              f"gsm8k={gsm},mt-bench={mt}"])
    assert res.exit_code == 0, res.output
    row, two = json.loads(res.stdout)["categories"]
    assert row["category"] == "gsm8k" and row["count"] == 1 and row["acceptance_length"] >= 1.0
    assert row["num_requests"] == 1 and "turns" not in row
    assert two["category"] == "mt-bench" and two["count"] == 1 and two["turns"] == 2 and two["num_requests"] == 2
    assert two["acceptance_length"] >= 1.0
    bad = runner.invoke(app, [*base, "--categories", "gsm9k"])
    assert bad.exit_code != 0 and "--categories: category 'gsm9k': unknown" in bad.output


@pytest.mark.slow
def test_cli_eval_at_a_temperature_drafts_and_says_so(workdir, tmp_path):
    """--temperature: lossless speculative sampling, the draft proposing (no verifier-only fallback),
    the temperature recorded in eval.json and named over the per-category table; seeded, so a rerun
    gives the same figures."""
    runner = CliRunner()
    base = ["eval", "-r", str(RECIPE), "--set", f"workdir={workdir}", "--set", "data.limit=24", "--num-prompts", "2",
            "--max-new-tokens", "12", "--categories", "tiny", "--temperature", "0.7", "--json"]
    runs = [runner.invoke(app, [*base, "--out", str(tmp_path / name)]) for name in ("a", "b")]
    assert all(r.exit_code == 0 for r in runs), runs[0].output
    a, b = (json.loads(r.stdout) for r in runs)
    assert a["temperature"] == 0.7 and a["num_drafts"] > 0 and a["acceptance_length"] > 1.0
    def figures(s):  # the measured figures, not the wall time
        return [(s["acceptance_length"], s["per_position_acceptance"]), *(
            (c["category"], c["acceptance_length"], c["per_position_acceptance"], c["output_tokens"])
            for c in s["categories"])]

    assert figures(a) == figures(b)
    md = (tmp_path / "a" / "eval.md").read_text()
    assert "## Acceptance per category, temperature 0.7 (speculative sampling)" in md


@pytest.mark.slow
def test_cli_eval_window_flag_auto_equals_no_flag(workdir, tmp_path):
    """Reproduced: eval kept its own window rule, so with serve.draft_window_size auto,
    `--draft-window-size auto` measured the training window while no flag measured what the engine
    applies (none on CUDA vLLM). One rule now: the flag enters Resolved."""
    runner = CliRunner()
    sets = [f"workdir={workdir}", "data.limit=24", "serve.engine=vllm"]
    base = ["eval", "-r", str(RECIPE), *(a for s in sets for a in ("--set", s)), "--num-prompts", "1",
            "--max-new-tokens", "4", "--json"]
    auto = runner.invoke(app, [*base, "--draft-window-size", "auto", "--out", str(tmp_path / "auto")])
    plain = runner.invoke(app, [*base, "--out", str(tmp_path / "plain")])
    assert auto.exit_code == plain.exit_code == 0, auto.output + plain.output
    windows = [json.loads(r.stdout)["draft_window_size"] for r in (auto, plain)]
    assert windows[0] == windows[1] == Resolved(load_recipe(RECIPE, sets)).window.value


@pytest.mark.slow
def test_trained_draft_beats_untrained_by_a_wide_margin(workdir, tmp_path, tiny_verifier):
    """Training works (a direction, not a timing): on held-out prompts, at K = block size, the
    briefly trained draft's acceptance is far above a freshly initialised draft's. AL is
    deterministic under greedy decoding, so machine load cannot flip this."""
    from dspark_kit.data.tiny_corpus import write_eval_prompts

    prompts = write_eval_prompts(tmp_path / "prompts.jsonl", 8)
    untrained = save_draft(fresh_draft(tiny_verifier), tmp_path / "untrained")
    r = recipe(workdir, "serve.num_speculative_tokens=4")
    kw = {"prompts_file": prompts, "context_lengths": [], "num_prompts": 4, "max_new_tokens": 24, "categories": [],
          "budget_thresholds": ()}  # the fixed K alone: the confidence cut-offs compare nothing here
    trained_al = evaluate_checkpoint(Resolved(r, workdir, window="off"), out_dir=tmp_path / "t", **kw)["acceptance_length"]
    untrained = Resolved(r, workdir, checkpoint=untrained, window="off")
    untrained_al = evaluate_checkpoint(untrained, out_dir=tmp_path / "u", **kw)["acceptance_length"]
    assert trained_al >= MARGIN * untrained_al, (trained_al, untrained_al)
