"""The published figures (measure.suite_metrics) against hand computations on planted cases, and
ECE / ROC-AUC on synthetic heads with known answers."""

from __future__ import annotations

import random

import pytest

from dspark_kit.measure.suite_metrics import (
    RequestRecord,
    bootstrap,
    ece,
    figures,
    paired_difference,
    reliability,
    roc_auc,
    tau,
    with_intervals,
)


def planted() -> list[RequestRecord]:
    # steps (drafted, accepted): (3,3) (3,1) | (3,0) (2,2)
    return [RequestRecord("p1", [3, 3], [3, 1], [[0.9, 0.8, 0.7], [0.9, 0.75, 0.2]], output_tokens=7),
            RequestRecord("p2", [3, 2], [0, 2], [[0.3, 0.5, 0.5], [0.8, 0.6]], output_tokens=5)]


def test_each_figure_against_a_hand_computation():
    f = figures(planted(), k=3)
    assert f["num_drafts"] == 4 and f["num_draft_tokens"] == 11 and f["num_accepted_tokens"] == 6
    assert f["tau"] == pytest.approx(1 + 6 / 4)  # the bonus token counted
    assert f["acceptance_rate"] == pytest.approx(6 / 11)
    assert f["per_position_unconditional"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    # position 1: drafted with position 0 accepted in steps (3,3) (3,1) (2,2), accepted in two;
    # position 2: drafted with 0..1 accepted only in (3,3) (the (2,2) step drafted two)
    assert f["per_position_conditional"] == pytest.approx([3 / 4, 2 / 3, 1.0])
    assert f["drafts_per_request"] == 2.0 and f["requests"] == 2 and f["prompts"] == 2
    cal = f["calibration"]
    # judged slots: (.9,1)(.8,1)(.7,1) | (.9,1)(.75,0) | (.3,0) | (.8,1)(.6,1)
    assert cal["slots"] == 8
    # bins: 9: two at .9 all accepted -> .1; 8: two at .8 -> .2; 7: .7 and .75 -> |.725 - .5|;
    # 6: .6 accepted -> .4; 3: .3 rejected -> .3
    assert cal["ece"] == pytest.approx(2 / 8 * .1 + 2 / 8 * .2 + 2 / 8 * .225 + 1 / 8 * .4 + 1 / 8 * .3)
    # 6 accepted x 2 rejected pairs; .75 (rejected) is above .7 and .6: 10 of 12 pairs ordered right
    assert cal["auc"] == pytest.approx(10 / 12)
    assert [r["count"] for r in cal["reliability"]] == [1, 1, 2, 2, 2]
    assert cal["cumulative"]["slots"] == 11  # every drafted slot, against prod of its confidences


def test_a_draft_without_confidence_head_has_no_calibration():
    recs = [RequestRecord("p", [2], [1], None)]
    assert figures(recs, 2)["calibration"] is None


def test_perfectly_calibrated_head():
    conf = [0.25] * 4 + [0.75] * 4
    labels = [1, 0, 0, 0] + [1, 1, 1, 0]
    assert ece(conf, labels) == pytest.approx(0.0)
    assert roc_auc(conf, labels) == pytest.approx(12 / 16)  # 9 wins + 6 ties of 16 pairs
    rng = random.Random(0)
    c = [rng.random() for _ in range(20000)]
    y = [int(rng.random() < x) for x in c]
    assert ece(c, y) < 0.03
    assert roc_auc(c, y) == pytest.approx(5 / 6, abs=0.02)  # E[AUC] of Bernoulli(c), c ~ U(0,1)


def test_inverted_and_perfect_heads():
    labels = [1] * 5 + [0] * 5
    inverted = [0.1] * 5 + [0.9] * 5
    assert roc_auc(inverted, labels) == 0.0
    assert ece(inverted, labels) == pytest.approx(0.9)
    assert roc_auc([0.9] * 5 + [0.1] * 5, labels) == 1.0
    assert roc_auc([0.5] * 10, labels) == 0.5
    assert roc_auc([0.5, 0.6], [1, 1]) is None and ece([], []) is None
    assert reliability([1.0, 0.0], [1, 0])[-1]["bin"] == [0.9, 1.0]  # 1.0 falls in the last bin


def test_bootstrap_interval_brackets_tau_and_is_seeded():
    rng = random.Random(1)
    recs = [RequestRecord(f"p{i}", [4] * 5, [rng.randint(0, 4) for _ in range(5)]) for i in range(30)]
    ci = bootstrap(recs, tau, 300, seed=0)
    assert ci[0] <= tau(recs) <= ci[1] and ci[0] < ci[1]
    assert bootstrap(recs, tau, 300, seed=0) == ci
    assert with_intervals(recs, 4, 50)["tau_interval"] is not None


def test_paired_difference_sees_a_planted_gap():
    rng = random.Random(2)
    a = [RequestRecord(f"p{i}", [4] * 6, [rng.randint(0, 3) for _ in range(6)]) for i in range(24)]
    # B accepts one more token in every step of the even prompts: tau gains 12 * 6 / (24 * 6) = 0.5
    b = [RequestRecord(r.prompt, r.drafted, [x + 1 for x in r.accepted] if i % 2 == 0 else r.accepted)
         for i, r in enumerate(a)]
    d = paired_difference(a, b, tau, 500, seed=0)
    assert d["difference"] == pytest.approx(0.5) and d["prompts"] == 24
    lo, hi = d["interval"]
    assert 0 < lo <= 0.5 <= hi
    same = paired_difference(a, a, tau, 100)
    assert same["difference"] == 0 and same["interval"] == [0, 0]
    with pytest.raises(ValueError, match="share no prompt"):
        paired_difference(a, [RequestRecord("other", [1], [1])])
