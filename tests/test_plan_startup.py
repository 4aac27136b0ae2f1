"""Plan-only commands import no torch, speculators or vLLM (their start-up is `bench_startup.py`'s row):
they plan from configs, the tokenizer (without torch) and the remembered fix probe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_kit.specdec.verifier_facts import plan_tokenizer

REPO = Path(__file__).resolve().parent.parent
FIXTURE_TOKENIZER = REPO / "tests" / "fixtures" / "tiny_tokenizer"
HEAVY = ("torch", "speculators", "vllm")
PROBE = ("import atexit, json, sys\nout = sys.argv.pop(1)\n"
         f"atexit.register(lambda: open(out, 'w').write(json.dumps([m for m in {HEAVY!r} if m in sys.modules])))\n"
         "from dspark_kit.cli import main\nsys.argv[0] = 'dspark-kit'\nmain()\n")


def test_the_plan_tokenizer_is_the_one_autotokenizer_builds():
    from transformers import AutoTokenizer

    light, auto = plan_tokenizer(FIXTURE_TOKENIZER), AutoTokenizer.from_pretrained(str(FIXTURE_TOKENIZER))
    assert type(light) is type(auto)
    assert (len(light), light.all_special_ids, light.mask_token_id) == (len(auto), auto.all_special_ids, auto.mask_token_id)
    assert {i: t.special for i, t in light.added_tokens_decoder.items()} == \
        {i: t.special for i, t in auto.added_tokens_decoder.items()}
    msgs = [{"role": "user", "content": "describe a cat"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nit purrs"}]
    for thinking in (True, False):
        text = auto.apply_chat_template(msgs, tokenize=False, enable_thinking=thinking)
        assert light.apply_chat_template(msgs, tokenize=False, enable_thinking=thinking) == text
        assert light(text, add_special_tokens=False)["input_ids"] == auto(text, add_special_tokens=False)["input_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ["preflight", "-r", "recipes/tiny-cpu.yaml"],
    ["run", "recipes/tiny-cpu.yaml", "--dry-run"],
    ["serve", "--role", "spec", "--dry-run", "-r", "recipes/tiny-cpu.yaml"],
], ids=["preflight", "run-dry-run", "serve-dry-run"])
def test_plan_only_commands_import_no_torch(argv, tmp_path, tiny_verifier):
    out = tmp_path / "imported.json"
    cmd = [sys.executable, "-c", PROBE, str(out), *argv, "-w", str(tmp_path / "run")]
    for _ in range(2):  # the first run remembers speculators' fix probe (preflight): the second plans only
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode in (0, 1), proc.stderr[-2000:]  # preflight exits 1 on an error finding
    assert json.loads(out.read_text()) == [], proc.stderr[-2000:]
