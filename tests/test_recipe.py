from pathlib import Path

import pytest

from dspark_kit.recipe import Recipe, RecipeError, apply_overrides, load_recipe, recipe_from_dict

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path):
    r = load_recipe(path)
    assert r.num_speculative_tokens <= r.draft.block_size
    assert all(0 <= i < r.draft.num_layers for i in r.full_attention_indices)


def test_unknown_key_is_named(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("draft:\n  blok_size: 8\n")
    with pytest.raises(RecipeError, match=r"draft\.blok_size: unknown key"):
        load_recipe(f)


def test_overrides_are_typed_and_nested():
    data = apply_overrides({}, ["train.epochs=3", "draft.attention=sliding", "hidden_states.target_layer_ids=[1, 5]"])
    r = recipe_from_dict(data)
    assert r.train.epochs == 3 and r.hidden_states.target_layer_ids == [1, 5]


def test_bad_override_syntax():
    with pytest.raises(RecipeError, match="expected section.key=value"):
        apply_overrides({}, ["train.epochs"])


@pytest.mark.parametrize(
    "data, field",
    [
        ({"data": {"seq_length": 0}}, "data.seq_length"),
        ({"draft": {"attention": "sliding", "num_layers": 2, "full_attention_indices": [2]}}, "full_attention_indices"),
        ({"draft": {"full_attention_indices": [0]}}, "full_attention_indices"),
        ({"serve": {"num_speculative_tokens": 9}, "draft": {"block_size": 8}}, "num_speculative_tokens"),
        ({"hidden_states": {"target_layer_ids": [1, 1]}}, "target_layer_ids"),
        ({"train": {"nnodes": 2, "node_rank": 2}}, "node_rank"),
    ],
)
def test_invalid_values_name_the_field(data, field):
    with pytest.raises(RecipeError, match=field):
        recipe_from_dict(data)


def test_derived_values():
    r = Recipe.model_validate({"draft": {"block_size": 8, "num_layers": 5}, "data": {"seq_length": 8192}})
    assert r.full_attention_indices == [0, 1, 2, 3, 4]
    assert r.num_speculative_tokens == 7
    assert r.training_window == 8192
    s = Recipe.model_validate({"draft": {"attention": "sliding", "num_layers": 3, "sliding_window": 512,
                                         "full_attention_indices": [0]}, "data": {"seq_length": 4096}})
    assert s.full_attention_indices == [0] and s.training_window == 512


def test_layer_ids_checked_against_the_verifier():
    r = Recipe.model_validate({"hidden_states": {"target_layer_ids": [1, 12, 23, 34, 45]}})
    assert r.exported_layer_ids(48) == [1, 12, 23, 34, 45, 48]
    with pytest.raises(RecipeError, match=r"target_layer_ids: \[45\] >= verifier num_hidden_layers 40"):
        r.target_layer_ids(40)
    assert Recipe().target_layer_ids(48) == [2, 24, 45]


def test_recipe_reference_doc_is_in_sync():
    from dspark_kit.recipe import reference_markdown

    doc = (REPO / "docs" / "RECIPES.md").read_text()
    assert reference_markdown() in doc, "regenerate docs/RECIPES.md with `dspark-kit recipe reference`"
