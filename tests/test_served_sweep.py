"""The served tune's plan, saved points and recommendation (no server: served_sweep.py)."""

from __future__ import annotations

from dspark_kit.stages.evaluation import served_sweep as sweep
from dspark_kit.stages.evaluation.served_sweep import ServerPoint


def test_plan_windows_per_engine():
    local, notes = sweep.plan_servers("local", [3, 4], [256, 512])
    assert local[0] == ServerPoint(0, None) and local[-1] == ServerPoint(0, None, repeat=True)
    assert local[1:-1] == [ServerPoint(k, w) for k in (3, 4) for w in (None, 256, 512)] and notes == []
    assert sweep.plan_servers("vllm-ascend", [4], [256])[0][1:-1] == [ServerPoint(4, None), ServerPoint(4, 256)]
    cuda, notes = sweep.plan_servers("vllm", [3, 4], [256, 512])
    assert cuda[1:-1] == [ServerPoint(3, None), ServerPoint(4, None)]  # K only
    assert len(notes) == 1 and "no window points" in notes[0] and "runtime draft window" in notes[0]


def _pt(k, w, n, tput, al=None, repeat=False, **kw):
    return {"k": k, "window": w, "context_length": n, "output_throughput": tput, "acceptance_length": al,
            "completed": 4, "failed": 0, "repeat": repeat, **kw}


CTX = [0, 512]


def _sweep(spec: dict, alone=(100.0, 100.0), again=(100.0, 100.0)) -> list[dict]:
    pts = [_pt(0, None, n, t) for n, t in zip(CTX, alone, strict=True)]
    pts += [_pt(0, None, n, t, repeat=True) for n, t in zip(CTX, again, strict=True)]
    for (k, w), rows in spec.items():
        pts += [_pt(k, w, n, t, al) for n, (t, al) in zip(CTX, rows, strict=True)]
    return pts


def test_recommend_by_throughput_and_acceptance():
    pts = _sweep({(4, None): [(200, 3.5), (90, 1.8)], (4, 64): [(195, 3.5), (150, 3.0)],
                  (3, 64): [(230, 3.0), (140, 2.6)]})
    spread = sweep.baseline_spread(pts)
    assert spread == 0.0
    out = sweep.recommend(pts, CTX, spread)
    assert out["recommended"] == {"k": 3, "window": 64}  # mean 185 tok/s beats 172.5
    assert out["recommended_by_acceptance"] == {"k": 4, "window": 64}  # mean AL 3.25


def test_ties_within_the_spread_go_to_the_higher_acceptance():
    spec = {(4, 64): [(195, 3.5), (150, 3.0)], (3, 64): [(230, 3.0), (140, 2.6)]}
    pts = _sweep(spec, alone=(100, 100), again=(110, 100))  # the machine moved 10 % between the alone runs
    spread = sweep.baseline_spread(pts)
    assert abs(spread - 10 / 105) < 1e-3
    assert sweep.recommend(pts, CTX, spread)["recommended"] == {"k": 4, "window": 64}  # 172.5 >= 185 * (1 - 0.095)


def test_no_speculation_can_win_and_failed_points_do_not():
    pts = _sweep({(4, None): [(80, 3.0), (60, 1.5)]}, alone=(150, 120), again=(150, 120))
    out = sweep.recommend(pts, CTX, sweep.baseline_spread(pts))
    assert out["recommended"] == {"k": 0, "window": None}
    assert out["recommended_by_acceptance"] == {"k": 4, "window": None}
    pts = _sweep({(4, None): [(500, 3.0), (400, 2.0)], (3, None): [(200, 2.5), (150, 2.0)]})
    pts = [p | ({"failed": 1, "error": "server died"} if p["k"] == 4 and p["context_length"] == 512 else {})
           for p in pts]
    assert sweep.recommend(pts, CTX, 0.0)["recommended"] == {"k": 3, "window": None}


def test_speedup_and_markdown_name_every_point():
    pts = _sweep({(4, 64): [(200, 3.5), (150, 3.0)]})
    result = {"engine": "local", "concurrency": 4, "spread": 0.0, "notes": ["a note"], "points": pts,
              **sweep.recommend(pts, CTX, 0.0)}
    md = sweep.markdown(result)
    assert "Recommended by output throughput: **K 4, window 64**" in md and "a note" in md
    assert sum(line.startswith("|") for line in md.splitlines()) == 2 + len(pts)  # header, rule, a row per point


def test_saved_points_resume_only_with_the_same_settings(tmp_path):
    path = tmp_path / "served_tune.json"
    settings = {"engine": "local", "num_prompts": 4, "prompts": "abc"}
    assert sweep.load_saved(path, settings) == ([], None)
    done, failed = _pt(4, None, 0, 100.0, 3.0), _pt(4, None, 512, None, failed=4, error="boom")
    sweep.write(path, {"engine": "local", "concurrency": 4, "settings": settings, "points": [done, failed]})
    assert (tmp_path / "served_tune.md").is_file()
    kept, why = sweep.load_saved(path, settings)
    assert kept == [done] and why is None  # a failed point is measured again
    assert sweep.server_done(ServerPoint(4, None), kept, [0]) and not sweep.server_done(ServerPoint(4, None), kept, CTX)
    kept, why = sweep.load_saved(path, {**settings, "num_prompts": 8})
    assert kept == [] and "num_prompts" in why
    path.write_text("{not json")
    assert sweep.load_saved(path, settings)[0] == []


def test_estimate_uses_the_last_sweep_when_there_is_one():
    s, how = sweep.estimate_seconds("local", 2, 600)
    assert s == 2 * (15 + 600 / 60) and "assumed" in how
    s, how = sweep.estimate_seconds("local", 2, 600, {"server_start_s": 5.0, "output_tokens_per_s": 300.0})
    assert s == 2 * (5 + 2) and "measured" in how


# ---- serve's auto K and window: the newest tune of either kind -------------------------------


def _tunes(run, in_process: dict | None, served: dict | None, served_newer: bool = True):
    import json
    import os

    (run / "eval").mkdir(parents=True, exist_ok=True)
    files = []
    for name, data in (("window_tune.json", in_process), ("served_tune.json", served)):
        if data is not None:
            (run / "eval" / name).write_text(json.dumps(data))
            files.append(run / "eval" / name)
    if len(files) == 2:  # mtimes one second apart, the newer one as asked
        old, new = (files[0], files[1]) if served_newer else (files[1], files[0])
        os.utime(old, (1_000_000, 1_000_000))
        os.utime(new, (1_000_001, 1_000_001))


def _resolved(run):
    from pathlib import Path

    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved

    recipe = load_recipe(Path(__file__).parents[1] / "recipes" / "tiny-cpu.yaml", [f"workdir={run}"])
    return Resolved(recipe, run, planning=True)


IN_PROCESS = {"recommended_window": 256, "recommended_k": 3}
SERVED = {"recommended": {"k": 4, "window": 128}, "recommended_by_acceptance": {"k": 4, "window": 64},
          "concurrency": 4}


def test_auto_follows_the_newest_tune_and_says_which(tmp_path):
    run = tmp_path / "run"
    _tunes(run, IN_PROCESS, SERVED, served_newer=True)
    res = _resolved(run)
    assert (res.k.value, res.window.value) == (4, 128)
    assert "served" in res.k.source and "served_tune.json" in res.window.source
    _tunes(run, IN_PROCESS, SERVED, served_newer=False)
    res = _resolved(run)
    assert (res.k.value, res.window.value) == (3, 256) and "in-process" in res.k.source


def test_no_speculation_fastest_keeps_the_acceptance_choice_with_a_note(tmp_path):
    run = tmp_path / "run"
    _tunes(run, None, {**SERVED, "recommended": {"k": 0, "window": None}})
    res = _resolved(run)
    assert (res.k.value, res.window.value) == (4, 64)
    assert any("verifier alone fastest at concurrency 4" in n for n in res.k.notes), res.k.notes
    # a served sweep that completed nothing recommends nothing: the in-process tune still counts
    _tunes(run, IN_PROCESS, {"recommended": None, "recommended_by_acceptance": None, "concurrency": 4})
    assert _resolved(run).k.value == 3


def test_serve_dry_run_uses_the_served_recommendation(tmp_path):
    from pathlib import Path

    from typer.testing import CliRunner

    from dspark_kit.cli import app

    run = tmp_path / "run"
    _tunes(run, IN_PROCESS, SERVED, served_newer=True)
    recipe = str(Path(__file__).parents[1] / "recipes" / "tiny-cpu.yaml")
    res = CliRunner().invoke(app, ["serve", "-r", recipe, "--role", "spec", "--dry-run", "-w", str(run)])
    assert res.exit_code == 0, res.output
    assert "--num-speculative-tokens 4" in res.stdout and "--draft-window-size 128" in res.stdout
    assert "tuned (served" in res.output


def test_dry_run_drops_contexts_past_the_verifiers_positions(tmp_path, monkeypatch):
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.evaluation.served_tune import run_served_tune

    monkeypatch.setattr(Resolved, "verifier_config", property(lambda self: {"max_position_embeddings": 1024}))
    res = _resolved(tmp_path / "run")
    sets = {0: [[1, 2, 3]], 512: [[1] * 512], 2048: [[1] * 2048]}
    plan = run_served_tune(res, sets, ks=[4], windows=[64], concurrency=2, max_new_tokens=48, dry_run=True)["plan"]
    assert plan["context_lengths"] == [0, 512] and plan["points"] == 4 * 2
    assert any("contexts [2048] dropped" in n and "max_position_embeddings 1024" in n for n in plan["notes"])
    assert plan["servers"] == ["verifier alone", "K 4, window off", "K 4, window 64", "verifier alone (again)"]
    assert not (tmp_path / "run" / "eval" / "served_tune.json").exists()  # a dry run writes nothing


def test_served_tune_dry_run_plans_before_training(tmp_path, monkeypatch):
    """docs/TOUR.md: `tune --served --dry-run` prints the plan before training. It failed on the missing
    checkpoint; it now plans the path training will write, says so, and creates nothing."""
    from pathlib import Path

    from typer.testing import CliRunner

    from dspark_kit.cli import app
    from dspark_kit.engines import lifecycle

    monkeypatch.setattr(lifecycle.ManagedServer, "start", lambda self: (_ for _ in ()).throw(AssertionError("started")))
    repo = Path(__file__).resolve().parent.parent
    tokenizer = repo / "tests" / "fixtures" / "tiny_tokenizer"  # prompts are tokenized; no model is read
    wd = tmp_path / "run"
    r = CliRunner().invoke(app, ["tune", "--served", "-r", str(repo / "recipes" / "tiny-cpu.yaml"), "-w", str(wd),
                                 "--set", f"verifier.path={tokenizer}", "--ks", "3", "--windows", "256",
                                 "--context-lengths", "512", "--num-prompts", "2", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "4 server starts" in r.output and "not trained yet" in r.output  # alone x2, K 3 off and 256
    assert str(wd / "checkpoints" / "checkpoint_best") in r.output
    assert not wd.exists()
