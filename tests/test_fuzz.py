"""Fuzzing: garbage rows never crash prepare; garbage recipes always give a one-line RecipeError."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_kit.data.conversations import ConversationError, normalize

REPO = Path(__file__).resolve().parent.parent
FAST = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))

# ---- conversation rows ----------------------------------------------------------

text = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=40),  # any unicode, incl. RTL, emoji, NUL
    st.sampled_from(["", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "{{ raise }}", "{% if %}", "\n\n", "<|MASK|>"]),
    st.builds(lambda s, n: s * n, st.sampled_from(["word ", "é🙂", "1, "]), st.integers(1000, 6000)),  # enormous
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), text)
garbage = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                       max_leaves=8)
roles = st.one_of(st.sampled_from(["user", "assistant", "system", "human", "gpt", "tool", "USER", "Model"]),
                  st.sampled_from(["wizard", "", "assistant ", "bot"]), garbage)
turn = st.one_of(
    st.fixed_dictionaries({"role": roles, "content": st.one_of(text, garbage)}),
    st.fixed_dictionaries({"from": roles, "value": st.one_of(text, garbage)}),
    st.fixed_dictionaries({"role": roles}),  # missing content
    st.fixed_dictionaries({"content": text}),  # missing role
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": text}), garbage), max_size=3)}),
    garbage,
)
plausible = st.lists(st.sampled_from(["user", "assistant"]), min_size=1, max_size=5).flatmap(
    lambda rs: st.tuples(*[st.fixed_dictionaries({"role": st.just(r), "content": text}) for r in rs]).map(list))
row = st.one_of(
    st.fixed_dictionaries({"messages": st.one_of(plausible, st.lists(turn, max_size=5), garbage)}),
    st.fixed_dictionaries({"conversations": st.lists(turn, max_size=5)}),
    st.fixed_dictionaries({"prompt": st.one_of(text, garbage)}, optional={"response": st.one_of(text, garbage)}),
    garbage,  # non-dict rows, nested garbage, rows without any known field
)


@FAST
@given(row)
def test_normalize_converts_or_rejects_with_a_reason(r):
    try:
        msgs = normalize(r)
    except ConversationError as e:
        assert str(e).strip()
        return
    # role + content always; assistant turns may add the reasoning split, the "unclosed" marker
    # (cut off while thinking) and a finish reason; nothing else
    optional = {"reasoning_content": str, "unclosed": bool, "finish_reason": str}
    assert msgs and all({"role", "content"} <= set(m) and isinstance(m["content"], str) for m in msgs)
    for m in msgs:
        extra = set(m) - {"role", "content"}
        assert not extra or m["role"] == "assistant", m
        assert all(k in optional and isinstance(m[k], optional[k]) for k in extra), m
    assert any(m["role"] == "user" for m in msgs)


@pytest.fixture(scope="module")
def tokenizer_ready(tiny_verifier):
    from dspark_kit.stages.dataset import prepare as P

    P._init_worker(str(tiny_verifier), False)
    return P


@FAST
@given(st.lists(row, min_size=1, max_size=6), st.booleans())
@pytest.mark.slow
def test_every_row_of_a_chunk_is_converted_or_rejected(tokenizer_ready, rows, thinking):
    results = tokenizer_ready._work((rows, thinking, 64, False, None, "train"))
    assert len(results) == len(rows)
    for res in results:
        if "error" in res:
            assert res["error"].strip() and "\n" not in res["error"]  # the reason prepare counts under
            continue
        assert res["rows"]
        for r in res["rows"]:
            assert len(r["input_ids"]) == len(r["loss_mask"]) <= 64
            assert set(r["loss_mask"]) <= {0, 1}


@pytest.mark.slow
@SLOW
@given(st.lists(row, min_size=1, max_size=8))
def test_prepare_counts_every_row(tmp_path_factory, tiny_verifier, rows):
    from dspark_kit.stages.dataset.prepare import prepare

    good = {"messages": [{"role": "user", "content": "Count from 1 to 3."}, {"role": "assistant", "content": "1, 2, 3."}]}
    out = tmp_path_factory.mktemp("fuzz") / "prepared"
    s = prepare([*rows, good], str(tiny_verifier), out, seq_length=64, thinking=False)
    assert s.conversations_in == len(rows) + 1
    converted = s.conversations_in - sum(s.rejected.values())
    assert converted >= 1 and s.rows_out + s.no_trainable_tokens >= converted
    assert all(reason.strip() for reason in s.rejected)
    assert (out / "token_freq.pt").exists()


# ---- recipes ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_recipe() -> dict:
    return yaml.safe_load((REPO / "recipes" / "tiny-cpu.yaml").read_text())


def _section_fields() -> dict[str, list[str]]:
    from dspark_kit.recipe import Recipe

    out = {}
    for name, f in Recipe.model_fields.items():
        ann = f.annotation
        out[name] = list(ann.model_fields) if hasattr(ann, "model_fields") else []
    return out


SECTIONS = _section_fields()
bad_values = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                       st.booleans(), st.none(), st.lists(st.integers(), max_size=3),
                       st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))
field_key = st.sampled_from(sorted(SECTIONS)).flatmap(
    lambda sec: st.tuples(st.just(sec), st.one_of(st.sampled_from(SECTIONS[sec] or ["x"]), st.text(min_size=1, max_size=10))))


@FAST
@given(st.lists(st.tuples(field_key, bad_values), min_size=1, max_size=3))
def test_recipe_from_dict_gives_a_recipe_error_naming_the_field(base_recipe, edits):
    from dspark_kit.recipe import Recipe, RecipeError, recipe_from_dict, shown_key

    data = copy.deepcopy(base_recipe)
    for (section, key), value in edits:
        if isinstance(data.get(section), dict):
            data[section][key] = value
        else:
            data[section] = value
    try:
        assert isinstance(recipe_from_dict(data, "fuzz.yaml"), Recipe)
    except RecipeError as e:
        msg = str(e)
        assert "\n" not in msg.strip() and msg.startswith("fuzz.yaml: ")
        assert any(sec in msg or shown_key(key) in msg for (sec, key), _ in edits), msg


@pytest.mark.parametrize("key", ["epo\nchs", "a\rb", "tab\tkey", "nul\x00", "\u2028sep"])
def test_a_key_with_control_characters_is_shown_escaped_in_one_line(base_recipe, key):
    """Regression: hypothesis found `train.epo\nchs`, whose error spanned two lines."""
    from dspark_kit.recipe import RecipeError, recipe_from_dict

    data = copy.deepcopy(base_recipe)
    data["train"][key] = 1
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(data, "fuzz.yaml")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and msg.isprintable(), repr(msg)
    assert "train." + key.encode("unicode_escape").decode() in msg


@FAST
@given(st.lists(st.one_of(
    st.text(max_size=30),
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from([f"{s}.{f}" for s, fs in SECTIONS.items() for f in fs] + ["a.b", "train", ".", "x..y"]),
              st.one_of(st.text(max_size=12), st.sampled_from(["[", "{a", "!!python/object:os.system", "'", "- -", "1e400", ": :"]))),
), min_size=1, max_size=3))
def test_overrides_give_a_recipe_or_a_recipe_error(base_recipe, overrides):
    from dspark_kit.recipe import RecipeError, apply_overrides, recipe_from_dict

    try:
        recipe_from_dict(apply_overrides(copy.deepcopy(base_recipe), overrides), "fuzz.yaml")
    except RecipeError as e:
        assert str(e).strip() and "\n" not in str(e).strip()


BAD_RECIPES = {
    "unknown_key": "train:\n  epocs: 3\n",
    "wrong_type": "train:\n  lr: fast\n",
    "not_yaml": "train: [1, 2\n  lr: : :\n",
    "top_level_list": "- 1\n- 2\n",
    "section_is_scalar": "draft: 7\n",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BAD_RECIPES))
def test_cli_rejects_a_bad_recipe_in_one_line(tmp_path, name):
    bad = tmp_path / f"{name}.yaml"
    bad.write_text(BAD_RECIPES[name])
    proc = subprocess.run([sys.executable, "-m", "dspark_kit", "recipe", "show", "-r", str(bad)],
                          check=False, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
