from pathlib import Path

import pytest

from dspark_kit.recipe import Recipe, RecipeError, apply_overrides, load_recipe, recipe_from_dict

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path):
    r = load_recipe(path)
    k = r.serve.num_speculative_tokens
    assert k == "auto" or k <= r.draft.block_size
    assert all(0 <= i < r.draft.num_layers for i in r.full_attention_indices)


def test_unknown_key_is_named(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("draft:\n  blok_size: 8\n")
    with pytest.raises(RecipeError, match=r"draft\.blok_size: unknown key"):
        load_recipe(f)


def test_dead_batch_tokens_key_is_refused(tmp_path):
    """hidden_states.batch_tokens was never read: setting it is the usual unknown-key error."""
    f = tmp_path / "r.yaml"
    f.write_text("hidden_states:\n  batch_tokens: 4096\n")
    with pytest.raises(RecipeError, match=r"hidden_states\.batch_tokens: unknown key"):
        load_recipe(f)
    with pytest.raises(RecipeError, match=r"--set hidden_states\.batch_tokens=4096: hidden_states\.batch_tokens is "
                                          r"not a recipe key"):
        load_recipe(REPO / "recipes" / "tiny-cpu.yaml", ["hidden_states.batch_tokens=4096"])


def test_an_unknown_set_key_names_the_flag_and_the_closest_key():
    """The mistake is in the --set typed at the shell, not in the recipe file (today's main named the
    file): one line naming the flag, with a suggestion."""
    tiny = REPO / "recipes" / "tiny-cpu.yaml"
    for item, closest in (("data.sorce=x", "data.source"), ("sorce=x", "data.source"),
                          ("train.seq_length=512", "data.seq_length"), ("serve.tensor_paralel_size=2",
                                                                         "serve.tensor_parallel_size")):
        with pytest.raises(RecipeError) as e:
            load_recipe(tiny, [item])
        message = str(e.value)
        assert message.startswith(f"--set {item}: ") and f"(did you mean {closest}?)" in message, message
        assert "tiny-cpu.yaml" not in message and "\n" not in message
    assert load_recipe(tiny, ["train.loss.ce=0.5"]).train.loss["ce"] == 0.5  # inside a mapping key: its own
    f = REPO / "recipes" / "tiny-cpu.yaml"
    with pytest.raises(RecipeError, match=r"draft\.blok_size: unknown key \(did you mean draft\.block_size\?\)"):
        from dspark_kit.recipe import recipe_from_dict

        recipe_from_dict({"draft": {"blok_size": 8}}, str(f))


def test_workdir_tilde_is_the_home_directory(tmp_path, monkeypatch):
    """Before: `workdir: ~/runs/x` became ./~/runs/x under the current directory."""
    from dspark_kit.resolved import Resolved

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    r = recipe_from_dict({"workdir": "~/runs/x"})
    assert r.workdir_path() == home.resolve() / "runs" / "x"
    assert r.workdir_path("~/other") == home.resolve() / "other"
    assert Resolved(r).run.root == home.resolve() / "runs" / "x"
    assert recipe_from_dict({"workdir": "runs/y"}).workdir_path() == tmp_path.resolve() / "runs" / "y"


def test_overrides_are_typed_and_nested():
    data = apply_overrides({}, ["train.epochs=3", "draft.attention=sliding", "hidden_states.target_layer_ids=[1, 5]"])
    r = recipe_from_dict(data)
    assert r.train.epochs == 3 and r.hidden_states.target_layer_ids == [1, 5]


def test_bad_override_syntax():
    with pytest.raises(RecipeError, match="expected section.name=value"):
        apply_overrides({}, ["train.epochs"])


def test_bad_override_reads_whole_through_the_redaction():
    """Reproduced: `--set train.epochs` answered `expected section.key=*** e.g.`: the word key=
    looked like a secret to the printed line's redaction."""
    from typer.testing import CliRunner

    from dspark_kit.cli import app

    res = CliRunner().invoke(app, ["recipe", "show", "--set", "train.epochs"])
    assert res.exit_code != 0 and "section.name=value" in res.stderr and "***" not in res.stderr
    unknown = CliRunner().invoke(app, ["recipe", "show", "--set", "train.epochz=3"])
    assert "`dspark-kit recipe reference` lists every key" in unknown.stderr


@pytest.mark.parametrize(
    "data, field",
    [
        ({"data": {"seq_length": 0}}, "data.seq_length"),
        ({"draft": {"attention": "sliding", "num_layers": 2, "full_attention_indices": [2]}}, "full_attention_indices"),
        ({"draft": {"full_attention_indices": [0]}}, "full_attention_indices"),
        ({"serve": {"num_speculative_tokens": 9}, "draft": {"block_size": 8}}, "num_speculative_tokens"),
        ({"hidden_states": {"target_layer_ids": [1, 1]}}, "target_layer_ids"),
        ({"train": {"nnodes": 2, "node_rank": 2}}, "node_rank"),
        ({"bench": {"temperature": 0.7}}, "bench.temperature: 0.7 differs from eval.temperature 0.0"),
        ({"eval": {"temperature": -0.1}}, "eval.temperature"),
    ],
)
def test_invalid_values_name_the_field(data, field):
    with pytest.raises(RecipeError, match=field):
        recipe_from_dict(data)


def test_one_measured_temperature():
    assert recipe_from_dict({}).measured_temperature == 0.0
    r = recipe_from_dict({"eval": {"temperature": 0.7}, "bench": {"temperature": 0.7}})
    assert r.measured_temperature == 0.7 and recipe_from_dict({"eval": {"temperature": 0.6}}).measured_temperature == 0.6


def test_derived_values():
    r = Recipe.model_validate({"draft": {"block_size": 8, "num_layers": 5}, "data": {"seq_length": 8192}})
    assert r.full_attention_indices == [0, 1, 2, 3, 4]
    assert r.serve.num_speculative_tokens == "auto"  # decided by resolved.Resolved.k (tests/test_resolved.py)
    assert r.training_window == 8192 and not r.draft_has_sliding_layers
    s = Recipe.model_validate({"draft": {"attention": "sliding", "num_layers": 3, "sliding_window": 512,
                                         "full_attention_indices": [0]}, "data": {"seq_length": 4096}})
    assert s.full_attention_indices == [0] and s.training_window == 512 and s.draft_has_sliding_layers


# Every documented value of every enum-like key parses (YAML and --set alike).
ENUM_VALUES = {
    "serve.draft_window_size": [("auto", "auto"), ("off", "off"), ("false", "off"), ("'off'", "off"),
                                ("OFF", "off"), ("4096", 4096), ("none", "off")],
    "serve.num_speculative_tokens": [("auto", "auto"), ("7", 7), ("null", "auto")],
    "serve.checkpoint": [("1", "1"), ("checkpoint_best", "checkpoint_best"), ("latest", "latest"),
                         ("epoch1_end", "epoch1_end"), ("/abs/ckpt", "/abs/ckpt")],
    "serve.engine": [("local", "local"), ("vllm", "vllm"), ("vllm-ascend", "vllm-ascend")],
    "hidden_states.mode": [("offline", "offline"), ("online", "online")],
    "hidden_states.backend": [("local", "local"), ("vllm", "vllm")],
    "draft.attention": [("full", "full"), ("sliding", "sliding")],
    "train.device": [(v, v) for v in ("auto", "cpu", "cuda", "npu")],
}


@pytest.mark.parametrize("key,raw,want", [(k, raw, want) for k, vs in ENUM_VALUES.items() for raw, want in vs])
def test_every_documented_value_parses_in_yaml_and_set(tmp_path, key, raw, want):
    section, field = key.split(".")
    f = tmp_path / "r.yaml"
    f.write_text(f"{section}:\n  {field}: {raw}\n")
    assert getattr(getattr(load_recipe(f), section), field) == want
    assert getattr(getattr(load_recipe(f, [f"{key}={raw}"]), section), field) == want


@pytest.mark.parametrize("raw", ["0", "-5", "true", "1.5", "big"])
def test_bad_windows_are_one_line_errors(raw):
    with pytest.raises(RecipeError, match=r"serve.draft_window_size: draft_window_size"):
        recipe_from_dict(apply_overrides({}, [f"serve.draft_window_size={raw}"]))


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


def test_path_keys_expand_tilde_and_read_relative_paths_from_the_recipe_folder(tmp_path, monkeypatch):
    """Before: a relative verifier.path was read from the shell's directory (elsewhere: a hub id), and
    `~` was expanded only in workdir. A --set value is typed at a shell: relative to its directory."""
    home, recipes, shell = tmp_path / "home", tmp_path / "recipes", tmp_path / "shell"
    for d in (home, recipes / "models" / "q", recipes / "ckpts" / "e1", shell):
        d.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(shell)
    f = recipes / "r.yaml"
    f.write_text("workdir: ~/runs/x\nverifier:\n  path: models/q\ndata:\n  source: chats.jsonl\n"
                 "hidden_states:\n  storage_path: ~/hs\nserve:\n  checkpoint: ckpts/e1\n")
    r = load_recipe(f)
    assert r.verifier.path == str(recipes.resolve() / "models" / "q")
    assert r.data.source == str(recipes.resolve() / "chats.jsonl")  # a file need not exist yet
    assert r.serve.checkpoint == str(recipes.resolve() / "ckpts" / "e1")
    assert r.workdir == str(home / "runs" / "x") and r.hidden_states.storage_path == str(home / "hs")

    # names stay names: a hub id not beside the recipe, a data preset, builtins, a checkpoint keyword
    f.write_text("workdir: runs/x\nverifier:\n  path: Qwen/Qwen3-8B\ndata:\n  source: ultrachat\n"
                 "serve:\n  checkpoint: checkpoint_best\n")
    r = load_recipe(f)
    assert (r.verifier.path, r.data.source, r.serve.checkpoint, r.workdir) == (
        "Qwen/Qwen3-8B", "ultrachat", "checkpoint_best", "runs/x")  # outputs: from the shell's directory
    assert load_recipe(recipes.parent / "recipes" / "r.yaml", ["verifier.path=builtin:tiny-qwen3"]).verifier.path == \
        "builtin:tiny-qwen3"

    # --set: from the shell's directory; ~ expanded
    r = load_recipe(f, ["verifier.path=./mine", "data.source=~/d.jsonl", "hidden_states.storage_path=~/s"])
    assert r.verifier.path == str(shell.resolve() / "mine")
    assert r.data.source == str(home / "d.jsonl") and r.hidden_states.storage_path == str(home / "s")


def test_data_presets_are_the_sources_presets():
    """recipe/ tells a preset name from a file by DATA_PRESETS; data/sources.py loads them."""
    from dspark_kit.data.sources import PRESETS
    from dspark_kit.recipe import DATA_PRESETS

    assert set(DATA_PRESETS) == set(PRESETS)
