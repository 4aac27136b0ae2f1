"""`dspark-kit init`: a complete, commented recipe from a verifier's config.json, tokenizer and chat
template; every bad input is one line and writes nothing.

Fast tests use config-only verifier directories (a config.json plus the tiny verifier's tokenizer
from tests/fixtures); the slow test runs init on the real tiny verifier and the CLI's preflight
and run --dry-run on what it wrote."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.recipe import load_recipe

REPO = Path(__file__).resolve().parent.parent
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 48,
    "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 151936,
    "max_position_embeddings": 40960, "torch_dtype": "bfloat16",
}  # fmt: skip
QWEN3_0_6B = {  # small enough for a laptop's memory in float32
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 28, "hidden_size": 1024,
    "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "torch_dtype": "bfloat16", "tie_word_embeddings": True,
}  # fmt: skip


# The tiny verifier's tokenizer as Qwen3's tokenizers come: no mask token. Written once by
# build_tokenizer (test_the_tokenizer_fixture_is_the_tiny_verifiers keeps it in step), so fast
# tests need no build.
TOKENIZER_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "tiny_tokenizer"


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    return TOKENIZER_FIXTURE


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def verifier_dir(root: Path, tokenizer_dir: Path, config: dict | None, template: bool = True,
                 weights: bool = True) -> Path:
    """A config-only verifier (plus the fixture's tokenizer); `weights`: an index and its one empty
    shard, as a downloaded model has (preflight checks the files are there, nothing reads them)."""
    root.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if template or f.name != "chat_template.jinja":
            shutil.copy(f, root / f.name)
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    if weights:
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-1.safetensors"}}))
        (root / "model-1.safetensors").write_bytes(b"")
    return root


def init(*args: str):
    return CliRunner().invoke(app, ["init", *args])


def comment_of(text: str, key: str) -> str:
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(f"{key}:"))
    assert "  # " in line, f"{key} has no comment: {line}"
    return line.split("  # ", 1)[1]


def test_init_on_a_qwen3_30b_a3b_shaped_verifier(tmp_path, tokenizer_dir, tokenizer):
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.pipeline import pipeline_dry_run
    from dspark_kit.stages.preflight.checks import run_preflight

    verifier = verifier_dir(tmp_path / "Qwen3-30B-A3B", tokenizer_dir, QWEN3_30B_A3B, weights=False)
    out = tmp_path / "recipes" / "q30b.yaml"
    r = init("--verifier", str(verifier), "--target-device", "npu", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert "[1, 12, 23, 34, 45]" in r.output and "wrote" in r.output
    text = out.read_text()
    data = yaml.safe_load(text)
    assert data["hidden_states"]["target_layer_ids"] == [1, 12, 23, 34, 45]
    assert data["draft"]["mask_token_id"] == len(tokenizer)  # the first spare embedding row
    assert (data["draft"]["block_size"], data["draft"]["num_layers"]) == (8, 5)
    assert data["verifier"]["num_hidden_layers"] == 48 and data["verifier"]["thinking"] is True
    assert data["train"]["devices"] == "0,1" and data["train"]["nproc"] == 2
    assert data["serve"]["devices"] == "2,3" and data["serve"]["tensor_parallel_size"] == 2
    assert data["serve"]["engine"] == "vllm-ascend" and data["train"]["device"] == "npu"
    assert data["serve"]["num_speculative_tokens"] == "auto" and data["serve"]["draft_window_size"] == "auto"
    assert "N-3" in comment_of(text, "target_layer_ids") and "48 layers" in comment_of(text, "target_layer_ids")
    assert f"len(tokenizer) {len(tokenizer)} < vocab_size 151936" in comment_of(text, "mask_token_id")
    for key in ("thinking", "num_hidden_layers", "seq_length", "devices", "engine", "tensor_parallel_size"):
        comment_of(text, key)

    recipe = load_recipe(out, require_run_keys=True)  # every key is a real recipe key
    wd = tmp_path / "run"
    # the Markov probe: the slow test's (CLI). The verifier here is config.json alone: preflight says
    # its weights are missing, as a warning since the recipe runs on an accelerator this machine lacks
    findings = run_preflight(Resolved(recipe, wd), probes=False)
    assert [(f.level, f.code) for f in findings] == [("warning", "verifier-weights")], findings
    plan = "\n".join(pipeline_dry_run(Resolved(recipe, wd, planning=True)))
    assert "--target-layer-ids 1 12 23 34 45" in plan and f"--mask-token-id {len(tokenizer)}" in plan
    assert "eagle_aux_hidden_state_layer_ids\":[1,12,23,34,45,48]" in plan
    assert "ASCEND_RT_VISIBLE_DEVICES=0,1" in plan and "ASCEND_RT_VISIBLE_DEVICES=2,3" in plan
    assert "--tensor-parallel-size 2" in plan and '"method":"dspark"' in plan


def test_init_with_data_sets_seq_length_from_the_token_lengths(tmp_path, tokenizer_dir, tokenizer):
    from dspark_kit.data.chat import encode, render

    # short prompts, long replies: the lengths vary, and every prompt leaves regen room in a 300 context
    chats = [[{"role": "user", "content": "Describe the cat. " * (1 + i % 3)},
              {"role": "assistant", "content": "The cat is calm. " * (3 * i + 1)}] for i in range(60)]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    lengths = sorted(len(encode(tokenizer, render(tokenizer, c, True))) for c in chats)
    p99 = lengths[math.ceil(0.99 * len(lengths)) - 1]
    assert p99 > 256  # so the rounding is visible
    verifier = verifier_dir(tmp_path / "v", tokenizer_dir, QWEN3_30B_A3B)
    out = tmp_path / "r.yaml"
    assert init("--verifier", str(verifier), "--target-device", "cuda", "--num-devices", "8", "--data", str(data),
                "-o", str(out)).exit_code == 0
    got = yaml.safe_load(out.read_text())
    assert got["data"]["seq_length"] == math.ceil(p99 / 256) * 256
    assert got["data"]["source"] == str(data.resolve())
    assert f"= {p99} tokens" in comment_of(out.read_text(), "seq_length")
    assert got["serve"]["engine"] == "vllm" and got["serve"]["devices"] == "4,5,6,7"
    assert got["train"]["devices"] == "0,1,2,3" and got["serve"]["tensor_parallel_size"] == 4

    # capped by the verifier's context
    short = verifier_dir(tmp_path / "short", tokenizer_dir, {**QWEN3_30B_A3B, "max_position_embeddings": 300})
    r = init("--verifier", str(short), "--target-device", "cuda", "--data", str(data), "-o", str(out), "--overwrite")
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(out.read_text())["data"]["seq_length"] == 300
    # prompts longer than that context leave regen no room: init refuses the recipe, naming it
    long_prompts = tmp_path / "long.jsonl"
    long_prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "Describe the cat. " * 80},
                                                            {"role": "assistant", "content": "Calm."}]}) + "\n"
                                    for _ in range(8)))
    r = init("--verifier", str(short), "--target-device", "cuda", "--data", str(long_prompts), "-o", str(out),
             "--overwrite")
    assert r.exit_code == 2 and "(prompt-room)" in r.output and "raise serve.max_model_len to" in r.output


def test_init_cpu_profile_of_a_real_model_is_the_smollm2_recipe(tmp_path, tokenizer_dir):
    """--target-device cpu on a real model writes the real-model profile (recipes/smollm2-135m-cpu.yaml's
    choices: the kit's instructions, replies an instruct model needs, three verifier layers); they must
    not drift. The tiny demo's profile is for the builtin tiny verifiers only."""
    verifier = verifier_dir(tmp_path / "v", tokenizer_dir, QWEN3_0_6B)
    out = tmp_path / "cpu.yaml"
    assert init("--verifier", str(verifier), "--target-device", "cpu", "-o", str(out)).exit_code == 0
    got, real = load_recipe(out), load_recipe(REPO / "recipes" / "smollm2-135m-cpu.yaml")
    for section, keys in {"draft": ("block_size", "num_layers", "markov_rank", "attention", "draft_vocab_size"),
                          "data": ("source", "limit", "keep_truncated"),
                          "regen": ("concurrency", "max_tokens", "temperature", "engine", "repeated_prompts"),
                          "train": ("epochs", "lr", "optimizer", "loss", "max_anchors", "train_data_ratio"),
                          "hidden_states": ("mode", "backend"), "bench": ("num_prompts", "concurrency", "max_tokens"),
                          "eval": ("num_prompts", "max_new_tokens", "categories"),
                          "serve": ("engine", "port", "hidden_states_port")}.items():
        for key in keys:
            assert getattr(getattr(got, section), key) == getattr(getattr(real, section), key), f"{section}.{key}"
    assert got.train.device == "cpu" and got.verifier.dtype == "float32"
    assert got.hidden_states.target_layer_ids == [1, 13, 25]  # three of 28 layers, from 1 to N-3
    text = out.read_text()
    assert "p99 of" in comment_of(text, "seq_length") and "regen.max_tokens 256" in comment_of(text, "seq_length")
    assert got.data.seq_length % 256 == 0 and got.data.seq_length > got.regen.max_tokens


def test_the_tiny_profile_is_for_the_builtin_tiny_verifiers():
    from dspark_kit.stages.init.init_recipe import _tiny

    assert _tiny("builtin:tiny-qwen3") and _tiny("builtin:tiny-llama3")
    assert not _tiny("builtin:smollm2-135m-instruct") and not _tiny("/models/Qwen3-0.6B")


def test_init_multinode_writes_the_rendezvous_keys(tmp_path, tokenizer_dir):
    verifier = verifier_dir(tmp_path / "v", tokenizer_dir, QWEN3_30B_A3B)
    out = tmp_path / "mn.yaml"
    r = init("--verifier", str(verifier), "--target-device", "npu", "--nodes", "2", "--master-addr", "10.0.0.1",
             "-o", str(out))
    assert r.exit_code == 0, r.output
    recipe = load_recipe(out)
    assert (recipe.train.nnodes, recipe.train.master_addr, recipe.train.rdzv_backend) == (2, "10.0.0.1", "auto")
    assert "every node" in comment_of(out.read_text(), "workdir")


def test_layer_id_rule():
    from dspark_kit.specdec.verifier_facts import dflash_layer_ids

    assert dflash_layer_ids(48, 5)[0] == [1, 12, 23, 34, 45]
    assert dflash_layer_ids(36, 5)[0] == [1, 9, 17, 25, 33]
    assert dflash_layer_ids(48, 1)[0] == [24]
    assert dflash_layer_ids(4, 3)[0] == [1, 2, 3]  # too shallow for 1..N-3: spread over 1..N-1
    assert dflash_layer_ids(4, 5)[0] == [1, 2, 3]  # never more ids than layers


def test_mask_token_rule():
    from dspark_kit.specdec.verifier_facts import VerifierFactsError, mask_token_choice

    assert mask_token_choice(151936, 151669, None)[0] == 151669
    assert mask_token_choice(950, 950, (5, "<|MASK|>"))[0] == 5
    with pytest.raises(VerifierFactsError, match="no spare row"):
        mask_token_choice(950, 950, None)


class _Added:
    def __init__(self, content: str, special: bool = True):
        self.content, self.special = content, special


class _Tok:
    """A tokenizer's special-token surface, as SmolLM2's: StarCoder's added tokens, three of them named."""

    def __init__(self, added: dict[int, str], named: dict[str, str]):
        self.added_tokens_decoder = {i: _Added(t) for i, t in added.items()}
        self.special_tokens_map, self.all_special_tokens = named, list(named.values())


STARCODER = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>", 3: "<repo_name>", 4: "<reponame>",
             5: "<file_sep>", 14: "<jupyter_output>", 15: "<jupyter_script>", 16: "<empty_output>"}
CHATML = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"


def test_mask_token_rule_for_a_full_vocabulary_without_reserved_tokens():
    """No spare row, no mask token, no reserved token (SmolLM2): the last added token the chat template
    never writes and none of the tokenizer's named roles, said so; one the verifier emitted is passed
    over; with none left, refused naming --mask-token-id."""
    from dspark_kit.specdec.verifier_facts import (
        VerifierFactsError,
        mask_token_choice,
        unused_specials,
    )

    tok = _Tok(STARCODER, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"})
    unused = unused_specials(tok, CHATML)
    assert [i for i, _ in unused] == [3, 4, 5, 14, 15, 16]  # not 0-2: named roles and written by the template
    mask, why = mask_token_choice(49152, 49152, None, (), unused)
    assert mask == 16 and "<empty_output>" in why and "never writes" in why
    mask, why = mask_token_choice(49152, 49152, None, (), unused, emitted={16, 15})
    assert mask == 14 and "never emit" in why
    with pytest.raises(VerifierFactsError, match="--mask-token-id"):
        mask_token_choice(49152, 49152, None, (), unused, emitted={3, 4, 5, 14, 15, 16})
    reserved = ((7, "<|reserved_special_token_0|>"),)
    assert mask_token_choice(49152, 49152, None, reserved, unused)[0] == 7  # a reserved token comes first


# ---- bad input: one line, exit 2, nothing written ----------------------------


def refused(result, out: Path, *needles: str) -> None:
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for n in needles:
        assert n in lines[0], lines[0]
    assert not out.exists()


def test_refuses_a_directory_without_config_json(tmp_path, tokenizer_dir):
    verifier, out = verifier_dir(tmp_path / "v", tokenizer_dir, None), tmp_path / "r.yaml"
    refused(init("--verifier", str(verifier), "-o", str(out)), out, "--verifier", "no config.json")
    refused(init("--verifier", str(tmp_path / "missing"), "-o", str(out)), out, "no config.json")


def test_refuses_a_config_that_is_not_a_causal_lm(tmp_path, tokenizer_dir):
    bert = {"architectures": ["BertForMaskedLM"], "model_type": "bert", "num_hidden_layers": 12,
            "hidden_size": 768, "vocab_size": 30522}
    verifier, out = verifier_dir(tmp_path / "v", tokenizer_dir, bert), tmp_path / "r.yaml"
    refused(init("--verifier", str(verifier), "-o", str(out)), out, "BertForMaskedLM", "not a causal LM")


def test_refuses_a_tokenizer_without_chat_template(tmp_path, tokenizer_dir):
    verifier = verifier_dir(tmp_path / "v", tokenizer_dir, QWEN3_30B_A3B, template=False)
    out = tmp_path / "r.yaml"
    refused(init("--verifier", str(verifier), "-o", str(out)), out, "no chat template")


def test_a_full_embedding_takes_an_added_token_the_template_never_writes(tmp_path, tokenizer_dir, tokenizer):
    """No spare row and no mask token: the fixture's <|MASK|> (added, never registered as the mask
    token, never in the chat template) is the one, and the comment says why."""
    verifier = verifier_dir(tmp_path / "v", tokenizer_dir, {**QWEN3_30B_A3B, "vocab_size": len(tokenizer)})
    out = tmp_path / "r.yaml"
    r = init("--verifier", str(verifier), "-o", str(out))
    assert r.exit_code == 0, r.output
    assert load_recipe(out).draft.mask_token_id == tokenizer.convert_tokens_to_ids("<|MASK|>")
    assert "<|MASK|>" in comment_of(out.read_text(), "mask_token_id")


def test_refuses_unreadable_data(tmp_path, tokenizer_dir):
    verifier, out = verifier_dir(tmp_path / "v", tokenizer_dir, QWEN3_30B_A3B), tmp_path / "r.yaml"
    refused(init("--verifier", str(verifier), "--data", str(tmp_path / "nope.jsonl"), "-o", str(out)),
            out, "--data", "not found")
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"text": "no chat here"}\nnot json\n')
    refused(init("--verifier", str(verifier), "--data", str(junk), "-o", str(out)), out, "--data", "no usable chat")
    # usable rows and broken ones: the recipe is written, and says what it skipped (it was silent)
    mixed = tmp_path / "mixed.jsonl"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    mixed.write_text(json.dumps({"messages": chat}) + "\n{broken\n")
    r = init("--verifier", str(verifier), "--data", str(mixed), "-o", str(out))
    assert r.exit_code == 0, r.output
    assert "unusable rows skipped" in r.output
    assert "skipped 1 unusable row(s) (1: invalid JSON line" in comment_of(out.read_text(), "seq_length")


def test_refuses_an_existing_output_without_force(tmp_path, tokenizer_dir):
    verifier, out = verifier_dir(tmp_path / "v", tokenizer_dir, QWEN3_30B_A3B), tmp_path / "r.yaml"
    out.write_text("# mine\n")
    r = init("--verifier", str(verifier), "-o", str(out))
    assert r.exit_code == 2 and "exists; pass --overwrite" in r.output
    assert out.read_text() == "# mine\n"
    assert init("--verifier", str(verifier), "-o", str(out), "--overwrite").exit_code == 0
    assert load_recipe(out).verifier.num_hidden_layers == 48


def test_refuses_an_unknown_device(tmp_path, tokenizer_dir):
    verifier, out = verifier_dir(tmp_path / "v", tokenizer_dir, QWEN3_30B_A3B), tmp_path / "r.yaml"
    refused(init("--verifier", str(verifier), "--target-device", "tpu", "-o", str(out)), out, "--target-device", "tpu")


# ---- init -> preflight over verifier shapes, devices, device counts and data ----------

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 36,
            "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}
LLAMA_3_1_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32,
                "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
SHAPES = {"qwen3-8b": QWEN3_8B, "qwen3-30b-a3b": {**QWEN3_30B_A3B, "moe_intermediate_size": 768, "num_experts": 128,
                                                  "num_experts_per_tok": 8, "head_dim": 128},
          "llama-3.1-8b": LLAMA_3_1_8B}  # fmt: skip
LAPTOP_RAM = 16 * 2**30  # the CPU cells' memory, fixed: whether an 8B fits must not depend on the test host


@pytest.fixture()
def laptop_memory(monkeypatch):
    from dspark_kit import devices

    real = devices.device_memory_bytes
    monkeypatch.setattr(devices, "device_memory_bytes", lambda d: LAPTOP_RAM if d.startswith("cpu") else real(d))


def _init_then_preflight(tmp_path, verifier: Path, out: Path, args: list[str]) -> tuple[str | None, list]:
    """(init's one-line refusal or None, then the written recipe's preflight errors)."""
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.preflight.checks import run_preflight

    r = init("--verifier", str(verifier), "-o", str(out), *args)
    if r.exit_code:
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), r.output
        assert not out.exists()
        return lines[0], []
    findings = run_preflight(Resolved(load_recipe(out), planning=True), probes=False)  # the probe: installed code
    return None, [f for f in findings if f.level == "error"]


def test_init_then_preflight_over_the_matrix(tmp_path, tokenizer_dir, laptop_memory, monkeypatch):
    """Every cell: init writes a recipe its own preflight passes, or refuses with one line naming the
    flag that changes it. Refused: CPU for verifiers past the machine's memory; one accelerator with no
    --data (the trainer and the extraction server cannot share it, and offline states are TiBs)."""
    from dspark_kit.devices import detect_device

    monkeypatch.chdir(tmp_path)  # the recipes' workdir (runs/NAME) is planned here; nothing is created
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                     {"role": "assistant", "content": f"answer {i} " * 8}]}) + "\n"
                            for i in range(20)))
    here = detect_device("auto")
    outcomes = {}
    for shape, config in SHAPES.items():
        verifier = verifier_dir(tmp_path / shape, tokenizer_dir, config)
        for device in ("cuda", "npu", "cpu", None):
            for n in (1, 2, 8):
                for with_data in (False, True):
                    cell = f"{shape}/{device or 'none'}/{n}/{'data' if with_data else 'profile'}"
                    args = ["--num-devices", str(n), *(["--target-device", device] if device else []),
                            *(["--data", str(data)] if with_data else [])]
                    refusal, errors = _init_then_preflight(tmp_path, verifier, tmp_path / f"r{len(outcomes)}.yaml",
                                                           args)
                    assert not errors, f"{cell}: init wrote a recipe its preflight rejects: {errors}"
                    on = device or here
                    if on == "cpu":  # an 8B in float32 is ~35 GiB: not in LAPTOP_RAM
                        assert refusal and "--target-device cuda or npu" in refusal and "GiB" in refusal, cell
                    elif n == 1 and not with_data:
                        assert refusal and "--num-devices 2" in refusal and "TiB" in refusal, cell
                    else:
                        assert refusal is None, f"{cell}: {refusal}"
                    outcomes[cell] = refusal
    assert len(outcomes) == 72


def test_init_on_cpu_writes_what_fits_and_a_relative_verifier_absolute(tmp_path, tokenizer_dir, laptop_memory,
                                                                       monkeypatch):
    """A verifier that fits the laptop gets the demo's recipe, passing preflight; a relative --verifier is
    written absolute (a relative one, used from another directory, became a hub id)."""
    verifier_dir(tmp_path / "models" / "q06", tokenizer_dir, QWEN3_0_6B)
    monkeypatch.chdir(tmp_path / "models")
    refusal, errors = _init_then_preflight(tmp_path, Path("q06"), tmp_path / "r.yaml", ["--target-device", "cpu"])
    assert refusal is None and not errors, (refusal, errors)
    assert yaml.safe_load((tmp_path / "r.yaml").read_text())["verifier"]["path"] == str((tmp_path / "models" /
                                                                                            "q06").resolve())


# ---- the real tiny verifier, and the CLI's preflight + run --dry-run ----------


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark_kit", *args], capture_output=True, text=True,
                          timeout=600, check=False)


@pytest.mark.slow
def test_init_on_the_tiny_verifier_then_preflight_and_dry_run(tmp_path, tiny_verifier, tokenizer_dir):
    from transformers import AutoTokenizer

    tiny_len = len(AutoTokenizer.from_pretrained(tiny_verifier))
    tiny = tmp_path / "tiny.yaml"
    r = cli("init", "--verifier", "builtin:tiny-qwen3", "--target-device", "cpu", "-o", str(tiny))
    assert r.returncode == 0, r.stderr
    got = yaml.safe_load(tiny.read_text())
    assert got["verifier"]["path"] == "builtin:tiny-qwen3" and got["verifier"]["num_hidden_layers"] == 4
    assert got["hidden_states"]["target_layer_ids"] == [2]  # one draft layer: the middle layer
    assert got["draft"]["mask_token_id"] == tiny_len  # 950 < the embedding's 960 rows
    assert got["serve"]["engine"] == "local"

    qwen = tmp_path / "q30b.yaml"
    verifier = verifier_dir(tmp_path / "Qwen3-30B-A3B", tokenizer_dir, QWEN3_30B_A3B)
    assert cli("init", "--verifier", str(verifier), "--target-device", "npu", "-o", str(qwen)).returncode == 0
    for recipe in (tiny, qwen):
        wd = tmp_path / f"run-{recipe.stem}"
        pre = cli("preflight", "-r", str(recipe), "-w", str(wd))
        assert pre.returncode == 0 and "0 error(s)" in pre.stderr, pre.stderr
        dry = cli("run", str(recipe), "-w", str(wd), "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert "# ==> train" in dry.stdout and "--mask-token-id" in dry.stdout


@pytest.mark.slow
def test_the_tokenizer_fixture_is_the_tiny_verifiers(tmp_path):
    """tests/fixtures/tiny_tokenizer is build_tokenizer's output minus the mask token; regenerate it
    with build_tokenizer(TinySpec()).save_pretrained(...) when the tiny verifier changes."""
    from dspark_kit.data.tiny_builder import TinySpec, build_tokenizer

    build_tokenizer(TinySpec()).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / name).read_text() == (TOKENIZER_FIXTURE / name).read_text(), name
    built = json.loads((tmp_path / "tokenizer_config.json").read_text())
    built.pop("mask_token")
    assert built == json.loads((TOKENIZER_FIXTURE / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("change,needles", [
    (lambda c: c.pop("num_hidden_layers") and c.update(n_layer=48), ["names it n_layer (48)", '"num_hidden_layers": 48']),
    (lambda c: c.update(num_hidden_layers="48"), ["num_hidden_layers is the string '48'", "as a number"]),
])
def test_unusual_configs_get_the_key_and_the_fix(tmp_path, tokenizer_dir, change, needles):
    """Reproduced: n_layer got no fix, and a string layer count was blamed on the tokenizer."""
    cfg = dict(QWEN3_30B_A3B)
    change(cfg)
    verifier, out = verifier_dir(tmp_path / "v", tokenizer_dir, cfg), tmp_path / "r.yaml"
    refused(init("--verifier", str(verifier), "-o", str(out)), out, *needles)


def test_a_directory_without_a_tokenizer_is_not_called_templateless(tmp_path):
    verifier, out = tmp_path / "v", tmp_path / "r.yaml"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    refused(init("--verifier", str(verifier), "-o", str(out)), out, "has no tokenizer")


def test_an_unknown_model_type_and_a_small_tokenizer_are_said(tmp_path, tokenizer_dir):
    """Reproduced: an unknown model_type silently became a qwen3 draft, and a 950-token tokenizer
    against a 151,936-row embedding passed without a word."""
    verifier = verifier_dir(tmp_path / "v", tokenizer_dir, {**QWEN3_30B_A3B, "model_type": "mystery_lm"})
    out = tmp_path / "r.yaml"
    res = init("--verifier", str(verifier), "-o", str(out))
    assert res.exit_code == 0, res.output
    assert "no draft architecture of its own" in comment_of(out.read_text(), "arch")
    assert "warning: the tokenizer has 950 tokens against the embedding's vocab_size 151,936" in res.stderr


def test_hybrid_attention_targets_the_states_leaving_full_attention_layers(tmp_path, tokenizer_dir):
    """Qwen3-Next's layer_types (3 linear-attention layers, then a full one): init's ids are the streams
    leaving full-attention layers (docs/CONCEPTS.md#layer-ids), not linear-attention layers' inputs."""
    from dspark_kit.specdec.verifier_facts import dflash_layer_ids

    types = (["linear_attention"] * 3 + ["full_attention"]) * 12
    ids, why = dflash_layer_ids(48, 5, types)
    assert ids == [4, 12, 24, 36, 44] and "hybrid attention" in why
    assert all(types[i - 1] == "full_attention" for i in ids)
    assert dflash_layer_ids(48, 5, ["sliding_attention", "full_attention"] * 24)[0] == [1, 12, 23, 34, 45]
    config = {**QWEN3_30B_A3B, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
              "layer_types": types, "full_attention_interval": 4}
    out = tmp_path / "r.yaml"
    r = init("--verifier", str(verifier_dir(tmp_path / "next", tokenizer_dir, config)), "-o", str(out),
             "--target-device", "cuda")
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(out.read_text())["hidden_states"]["target_layer_ids"] == [4, 12, 24, 36, 44]
    assert "hybrid attention" in comment_of(out.read_text(), "target_layer_ids")
