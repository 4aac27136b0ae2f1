"""The confidence-threshold curve (measure.threshold_curve): its recommendation is read off the
measured points, whatever engine measured them."""

from __future__ import annotations

from dspark_kit.measure.threshold_curve import recommend, threshold_curve


def test_recommends_the_fastest_measured_threshold():
    # a planted curve: a cut at 0.5 saves verify work and wins; 0.9 cuts too much
    planted = {None: (3.0, 100.0), 0.1: (3.0, 101.0), 0.3: (2.9, 110.0), 0.5: (2.8, 120.0), 0.7: (2.4, 104.0),
               0.9: (1.8, 80.0)}
    asked = []

    def measure(t):
        asked.append(t)
        al, tps = planted[t]
        return {"acceptance_length": al, "output_tokens": tps * 2, "wall_s": 2.0, "mean_verified_per_step": 4.0}

    curve = threshold_curve(measure, list(planted), engine="test")
    assert asked == list(planted)
    assert curve["recommended_threshold"] == 0.5
    assert [p["tokens_per_s"] for p in curve["points"]] == [100.0, 101.0, 110.0, 120.0, 104.0, 80.0]


def test_near_ties_go_to_the_higher_acceptance_and_fixed_k_can_win():
    pts = [{"threshold": None, "acceptance_length": 3.0, "tokens_per_s": 99.0},
           {"threshold": 0.5, "acceptance_length": 2.5, "tokens_per_s": 100.0}]
    assert recommend(pts, tolerance=0.02) is None  # within 2 %: the fixed K keeps more acceptance
    assert recommend(pts, tolerance=0.0) == 0.5
    assert recommend([{"threshold": 0.3, "acceptance_length": 2.0, "tokens_per_s": None}]) is None
