"""Per-row mixtures (issue 31, point 2): the one choice function and the recipe keys that take weights."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from dspark_kit.recipe import RecipeError, dump_recipe, load_recipe, recipe_from_dict
from dspark_kit.recipe.mixture import TEMPERATURE, THINKING, choose, most_likely, support

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny-cpu.yaml"
IDS = range(4000)  # a fixed sample of row ids: every figure below is the same on every run


def test_a_plain_value_is_every_rows_value():
    assert {choose(True, 42, THINKING, i) for i in range(50)} == {True}
    assert {choose(0.7, 42, TEMPERATURE, i) for i in range(50)} == {0.7}


def test_a_rows_choice_depends_on_its_id_and_seed_only():
    weights = {True: 0.5, False: 0.5}
    first = [choose(weights, 42, THINKING, i) for i in IDS]
    assert first == [choose(weights, 42, THINKING, i) for i in IDS]  # the same again (a resumed run)
    assert first == [choose({False: 0.5, True: 0.5}, 42, THINKING, i) for i in IDS]  # key order does not matter
    assert first != [choose(weights, 7, THINKING, i) for i in IDS]  # another seed draws anew
    assert set(first[:16]) == {True, False}  # rows draw apart: not one draw per run


@pytest.mark.parametrize("weights", [{True: 0.7, False: 0.3}, {True: 1, False: 3}, {True: 0.5, False: 0.5}])
def test_proportions_follow_the_weights(weights):
    got = Counter(choose(weights, 42, THINKING, i) for i in IDS)
    share = weights[True] / sum(weights.values())
    assert abs(got[True] / len(IDS) - share) < 0.03, got  # ~4 standard deviations at 4000 ids


def test_temperature_weights_and_independence_from_the_thinking_draw():
    temps = {0.0: 0.5, 0.7: 0.3, 1.0: 0.2}
    got = Counter(choose(temps, 42, TEMPERATURE, i) for i in IDS)
    assert set(got) == set(temps)
    for t, w in temps.items():
        assert abs(got[t] / len(IDS) - w) < 0.03, got
    # the two mixtures draw apart: thinking rows get each temperature in the mixture's proportions
    both = Counter((choose({True: 0.5, False: 0.5}, 42, THINKING, i), choose(temps, 42, TEMPERATURE, i)) for i in IDS)
    thinking_rows = both[True, 0.0] + both[True, 0.7] + both[True, 1.0]
    assert abs(both[True, 0.0] / thinking_rows - 0.5) < 0.04, both


def test_a_zero_weight_is_never_drawn():
    assert {choose({True: 1.0, False: 0.0}, 42, THINKING, i) for i in IDS} == {True}
    assert support({True: 1.0, False: 0.0}) == [True] and support({True: 1, False: 2}) == [False, True]


def test_most_likely_and_a_tie_goes_to_thinking():
    assert most_likely({True: 0.3, False: 0.7}) is False
    assert most_likely({True: 0.5, False: 0.5}) is True
    assert most_likely(False) is False


@pytest.mark.slow  # two interpreters
def test_the_draw_is_no_python_hash():
    """Python's str hash changes per process (PYTHONHASHSEED): a draw built on it would not resume."""
    code = ("from dspark_kit.recipe.mixture import choose; "
            "print(''.join('1' if choose({True: 0.5, False: 0.5}, 42, 'thinking', i) else '0' for i in range(300)))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                           env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}).stdout
            for seed in ("1", "2", "3")}
    assert len(outs) == 1 and outs.pop().strip() == "".join(
        "1" if choose({True: 0.5, False: 0.5}, 42, THINKING, i) else "0" for i in range(300))


# ---- the recipe --------------------------------------------------------------


@pytest.mark.parametrize("sets, thinking, temperature", [
    ([], False, 0.0),  # the plain forms as before
    (["verifier.thinking=true", "regen.temperature=0.7"], True, 0.7),
    (["verifier.thinking=off", "regen.temperature=1"], False, 1.0),
    (["verifier.thinking={true: 0.7, false: 0.3}"], {True: 0.7, False: 0.3}, 0.0),
    (["regen.temperature={0.0: 0.5, 0.7: 0.5}"], False, {0.0: 0.5, 0.7: 0.5}),
    (["verifier.thinking={'true': 1, 'false': 0}"], {True: 1.0, False: 0.0}, 0.0),  # a recorded recipe's JSON keys
])
def test_set_takes_plain_values_and_weights(sets, thinking, temperature):
    r = load_recipe(TINY, sets)
    assert r.verifier.thinking == thinking and r.regen.temperature == temperature
    assert type(r.regen.temperature) is type(temperature)


def test_yaml_weights_and_a_dumped_recipe_reads_back(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text(TINY.read_text().replace("  thinking: false", "  thinking: {true: 0.7, false: 0.3}")
                 .replace("  temperature: 0.0", "  temperature: {0.0: 0.5, 0.7: 0.5}"))
    r = load_recipe(f)
    assert r.verifier.thinking == {True: 0.7, False: 0.3} and r.regen.temperature == {0.0: 0.5, 0.7: 0.5}
    again = recipe_from_dict(yaml.safe_load(dump_recipe(r)))  # JSON turned the keys into strings
    assert again == r


@pytest.mark.parametrize("item, says", [
    ("verifier.thinking={true: -0.2, false: 1}", "verifier.thinking: weight -0.2 for true is negative"),
    ("verifier.thinking={true: 0, false: 0}", "verifier.thinking: the weights are all zero"),
    ("verifier.thinking={}", "verifier.thinking: the weights are all zero"),
    ("verifier.thinking={maybe: 1}", "verifier.thinking: unknown mode 'maybe'"),
    ("verifier.thinking={true: lots}", "verifier.thinking: weight 'lots' for true is not a number"),
    ("verifier.thinking={true: 1, 'true': 1}", "verifier.thinking: the weights name true twice"),
    ("verifier.thinking=maybe", "verifier.thinking: unknown mode 'maybe'"),
    ("regen.temperature={-1: 1}", "regen.temperature: unknown temperature -1"),
    ("regen.temperature={hot: 1}", "regen.temperature: unknown temperature 'hot'"),
    ("regen.temperature={0.0: .nan}", "regen.temperature: weight nan for 0.0 is not a number"),
    ("regen.temperature=-1", "regen.temperature: unknown temperature -1"),
])
def test_bad_weights_are_one_line_naming_the_key_and_the_fix(item, says):
    with pytest.raises(RecipeError) as e:
        load_recipe(TINY, [item])
    msg = str(e.value)
    assert says in msg and "\n" not in msg and "e.g. {" in msg, msg


def test_eval_and_bench_measure_one_mode():
    assert load_recipe(TINY).measured_thinking is False
    assert load_recipe(TINY, ["verifier.thinking=true"]).measured_thinking is True
    assert load_recipe(TINY, ["verifier.thinking={true: 0.3, false: 0.7}"]).measured_thinking is False
    assert load_recipe(TINY, ["verifier.thinking={true: 0.5, false: 0.5}"]).measured_thinking is True  # the tie
    picked = load_recipe(TINY, ["verifier.thinking={true: 0.5, false: 0.5}", "eval.thinking=false"])
    assert picked.measured_thinking is False


def test_row_thinking_is_the_choice_function_with_the_recipe_seed():
    r = load_recipe(TINY, ["verifier.thinking={true: 0.5, false: 0.5}", "regen.seed=3"])
    assert [r.row_thinking(i) for i in range(200)] == [choose({True: 0.5, False: 0.5}, 3, THINKING, i)
                                                         for i in range(200)]
    assert r.may_think and not load_recipe(TINY, ["verifier.thinking={true: 0, false: 1}"]).may_think
