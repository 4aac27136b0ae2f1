"""The replies-vs-thinking-mode rule through the stages, with replies planted by a proxy in front of
the real local engine (tests/planting_proxy.py): the first stage that sees a row decides, records it,
and no later stage judges the row again."""

from __future__ import annotations

import json

import pytest
from planting_proxy import PlantingProxy, stray_reasoning

from dspark_kit.data import mode_rule
from dspark_kit.engines.lifecycle import ManagedServer
from dspark_kit.recipe import Recipe
from dspark_kit.resolved import Resolved
from dspark_kit.stages.dataset.regen import failure_verdict, mode_line, run_regen
from dspark_kit.stages.server_plan import server_plan

pytestmark = pytest.mark.slow
RECIPE = {"regen": {"max_tokens": 24, "concurrency": 4, "request_timeout": 60},
          "data": {"source": "builtin:tiny-chat", "seq_length": 256}, "serve": {"port": 0}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_verifier):
    server = ManagedServer(server_plan(Resolved(Recipe.model_validate(RECIPE)), "chat"),
                           tmp_path_factory.mktemp("logs") / "chat.log")
    server.start()
    try:
        server.wait_healthy(120)
        yield server.base_url
    finally:
        server.stop()


def _regen_planted(engine: str, wd, when, limit: int):
    """regen of `limit` rows through a proxy planting a stray reasoning block in the replies `when`
    picks: (recipe, its Resolved, regen's summary, the proxy, stopped)."""
    proxy = PlantingProxy(engine, stray_reasoning(when))
    try:
        recipe = Recipe.model_validate(RECIPE)
        res = Resolved(recipe, wd)
        return recipe, res, run_regen(res, res.run.regen_jsonl, endpoints=[proxy.url], limit=limit), proxy
    finally:
        proxy.stop()


def test_a_systematic_mismatch_fails_regen_in_one_line_and_prepare_follows_its_decision(engine, tmp_path):
    recipe, res, s, proxy = _regen_planted(engine, tmp_path, lambda n, _planted: n % 10 < 3, 40)  # 30%
    rows = [json.loads(line) for line in res.run.regen_jsonl.read_text().splitlines()]
    dropped = [r for r in rows if r["metadata"][mode_rule.RECORD] != mode_rule.AGREES]
    assert s["written"] == 40 and len(dropped) >= 10, (s["mode"], proxy.planted)  # >= 30% of 40 replies
    assert s["mode"] == {"rows": 40, "dropped": len(dropped), "thinking_rows": 0, "thinking_with_reasoning": 0,
                         "always_reasons": False}
    verdict = failure_verdict(s, recipe.regen.max_failed_fraction, recipe.data.max_mode_mismatch_fraction)
    assert verdict is not None and "\n" not in verdict
    assert verdict.startswith(f"regen: {len(dropped)} of 40 rows") and "data.max_mode_mismatch_fraction" in verdict
    assert mode_line(s) == f"dropped {len(dropped)} of 40 rows: {mode_rule.REASONING_WITH_THINKING_OFF}"

    # later stages read regen's decision: preflight finds nothing to judge, prepare skips exactly
    # those rows as decided and does not fail, whatever its own budget
    from dspark_kit.stages.preflight.checks import run_preflight
    from dspark_kit.stages.steps import run_stage

    assert [f for f in run_preflight(res, probes=False) if f.pitfall == 4] == []
    recipe.data.max_mode_mismatch_fraction = 0.0
    summary = run_stage("prepare", Resolved(recipe, tmp_path))
    skipped = {k: n for k, n in summary["rejected"].items() if k.endswith("(decided by regen: metadata.mode_check)")}
    assert sum(skipped.values()) == len(dropped) == summary["mode_dropped_by_regen"]
    assert summary["mode_rule"]["rows"] == 0  # prepare decided none of them itself
    meta = json.loads(res.run.prepare_meta.read_text())
    assert meta["summary"]["mode_dropped_by_regen"] == len(dropped)


def test_one_stray_reply_in_a_regen_is_dropped_and_counted_in_one_line(engine, tmp_path):
    _recipe, res, s, proxy = _regen_planted(engine, tmp_path, lambda _n, planted: planted < 1, 60)
    assert proxy.planted == 1 and s["mode"]["dropped"] == 1 and s["mode"]["rows"] == 60
    assert failure_verdict(s, 0.05, 0.02) is None
    assert mode_line(s) == f"dropped 1 of 60 rows: {mode_rule.REASONING_WITH_THINKING_OFF}"
    # a resumed run judges the whole output: the earlier rows' decisions still count
    again = run_regen(res, res.run.regen_jsonl, endpoints=[engine], limit=60)
    assert again["written"] == 0 and again["mode"] == s["mode"]
