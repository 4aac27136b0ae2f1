"""Load generator for an OpenAI-compatible chat server (vLLM, vLLM-Ascend, local).

Streams responses so TTFT and TPOT are real, counts output tokens from the
final usage chunk, and reads speculative-decoding acceptance from `/metrics`
deltas (scraped before and after the run). A server that ignores `stream`
and answers with one JSON body still works: TTFT is then the full latency.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dspark_kit import atomic
from dspark_kit.data.conversations import ConversationError, normalize
from dspark_kit.engines import ServerPlan
from dspark_kit.engines.prom import MetricsError
from dspark_kit.jsonl import BadLine, read_jsonl
from dspark_kit.measure.eval_prompts import EvalError, served_concurrency
from dspark_kit.measure.served_load import LoadError, run_load, summarize
from dspark_kit.progress import STANDALONE, Reporter
from dspark_kit.resolved import Resolved
from dspark_kit.rundir import bench_result_file
from dspark_kit.stages.plan import StagePlan
from dspark_kit.stages.prompts import prompt_source
from dspark_kit.stages.server_plan import spec_server_lines

SCHEMA = "dspark-kit.bench/1"
BUILTIN_DATASET = "builtin"  # eval's default prompts (prompt_set)


class BenchError(RuntimeError):
    """One line naming the flag / server problem and the fix."""


@dataclass(frozen=True)
class BenchLoad:
    """What one bench sends, and where: each an option given to the command, else the recipe's."""

    base_url: str
    label: str
    num_prompts: int
    concurrency: int
    max_tokens: int


def bench_load(res: Resolved, base_url: str | None = None, label: str | None = None, num_prompts: int | None = None,
               concurrency: int | None = None, max_tokens: int | None = None) -> BenchLoad:
    """The one rule for a bench's server, label and load (the run and its --dry-run both ask it)."""
    r, b = res.recipe, res.recipe.bench
    label = label or r.name
    if not label.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise BenchError(f"--label {label!r}: use letters, digits, '-', '_' or '.' (it names the output file)")
    return BenchLoad(base_url=(base_url or f"http://{r.serve.host}:{r.serve.port}").rstrip("/"), label=label,
                     num_prompts=num_prompts or b.num_prompts, concurrency=served_concurrency(res.recipe, concurrency),
                     max_tokens=max_tokens or b.max_tokens)


# ---- prompts ---------------------------------------------------------------


def _first_turn(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """System turns + the first user turn: what the verifier answers from scratch."""
    out = []
    for m in messages:
        out.append(m)
        if m["role"] == "user":
            return out
    return out


def load_prompts(dataset: str, num_prompts: int, res: Resolved, seed: int = 0) -> list[list[dict[str, str]]]:
    """The prompts bench sends (prompt_set's, without where they came from)."""
    return prompt_set(dataset, num_prompts, res, seed)[0]


def prompt_set(dataset: str, num_prompts: int, res: Resolved, seed: int = 0) -> tuple[list[list[dict[str, str]]], str]:
    """(prompts, where they came from). `builtin`: the first `num_prompts` of eval's default prompts,
    in eval's order, each up to its user turn as eval sends it, so the served gate compares acceptance
    on the prompts eval measured it on: the builtin data's held-out set, else the conversations of
    speculators' validation split of DIR/prepared (the tiny corpus's held-out set when there is no
    DIR/prepared yet to read them from, said in the result). Else a jsonl of chat rows (regen
    output, OpenAI messages), shuffled by `seed`."""
    if dataset == BUILTIN_DATASET:
        from dspark_kit.measure.eval_prompts import (
            HELD_OUT_SETS,
            has_prepared,
            load_eval_prompts,
            tiny_held_out,
            until_last_user,
        )

        src = prompt_source(res)
        if res.recipe.data.source not in HELD_OUT_SETS and not has_prepared(src):
            found = tiny_held_out(src, num_prompts)  # eval would refuse: nothing to take its prompts from yet
            source = f"{found.source} (no {res.run.prepared} to take eval's validation prompts from)"
        else:
            try:  # eval's own choice (its tokenizer loaded only where a prompt must be compared with rows)
                found = load_eval_prompts(src, None, limit=num_prompts)
            except EvalError as e:
                raise BenchError(str(e)) from None
            source = found.source
        return [until_last_user(c) for c in found.chats[:num_prompts]], source
    path = Path(dataset)
    if not path.is_file():
        raise BenchError(f"--prompts {dataset}: file not found (pass a regen .jsonl or 'builtin')")
    prompts = []
    for row in read_jsonl(path):
        try:
            if not isinstance(row, BadLine):
                prompts.append(_first_turn(normalize(row)))
        except ConversationError:
            continue  # unusable rows are skipped, as in prepare
    if not prompts:
        raise BenchError(f"--prompts {dataset}: no usable chat rows (need conversations/messages/prompt)")
    random.Random(seed).shuffle(prompts)
    return prompts[:num_prompts], f"{dataset}, shuffled (seed {seed})"


def bench_endpoint(res: Resolved, base_url: str | None = None, label: str | None = None,
              out_dir: str | Path | None = None, *, num_prompts: int | None = None,
              concurrency: int | None = None, max_tokens: int | None = None,
              dataset: str = BUILTIN_DATASET, model: str | None = None, write: bool = True,
              categories: str | list[str] | None = None) -> dict[str, Any]:
    """Benchmark a running server; writes `<out_dir>/bench_<label>.json` + `.md` (unless `write` is
    False: the caller adds to the result and writes it once), returns the result.

    `res` names the model to ask for (served_name) and the K to record without spec metrics.
    `categories` (default bench.categories): prompt sets benchmarked one after another after the
    main load, each with its own /metrics window, so each gets its own acceptance figures."""
    recipe = res.recipe
    b = recipe.bench
    load = bench_load(res, base_url, label, num_prompts, concurrency, max_tokens)
    base_url, label, n, conc, max_tok = load.base_url, load.label, load.num_prompts, load.concurrency, load.max_tokens
    prompts, prompts_from = prompt_set(dataset, n, res)
    sets = _category_sets(res, b.categories if categories is None else categories, n,
                          "--categories" if categories is not None else "bench.categories")

    def send(msgs: list[list[dict[str, str]]], name: str | None, follow_ups=None) -> dict[str, Any]:
        try:
            return asyncio.run(run_load(base_url, name, msgs, concurrency=conc, max_tokens=max_tok,
                                        temperature=recipe.measured_temperature, thinking=recipe.measured_thinking,
                                        preferred_model="" if name else res.served_name, follow_ups=follow_ups))
        except (MetricsError, LoadError) as e:
            raise BenchError(str(e)) from None

    load = send(prompts, model)
    result: dict[str, Any] = {
        "schema": SCHEMA, "source": "dspark-kit", "label": label, "base_url": base_url,
        "model": load["model"], "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "dataset": dataset, "prompts_from": prompts_from, "num_prompts": len(prompts), "concurrency": conc,
        "max_tokens": max_tok, "temperature": recipe.measured_temperature, "thinking": recipe.measured_thinking,
        "metrics_available": load["metrics_available"], "spec_decode": load["spec_decode"],
        # the server's own view from /metrics (vLLM: tokens, TTFT, TPOT histograms); None without
        "server_metrics": load["server_metrics"],
    }
    result |= served_k(load["spec_decode"], res)
    result |= summarize(load["records"], load["duration_s"])
    if result["completed"] == 0:
        raise BenchError(f"bench: all {len(prompts)} requests failed ({'; '.join(result['errors'])}); "
                         "check the server log and the model name")
    if sets:
        result["categories"] = [category_row(found, send(found.chats, load["model"], found.follow_ups))
                                for found in sets]
    if write:
        write_result(result, Path(out_dir) if out_dir else res.run.bench)
    return result


def _category_sets(res: Resolved, specs: str | list[str], n: int, where: str) -> list:
    from dspark_kit.data.categories import CategoryError, parse_categories
    from dspark_kit.measure.eval_prompts import category_prompts

    try:
        return category_prompts(prompt_source(res), parse_categories(specs), n, where=where)
    except CategoryError as e:
        raise BenchError(str(e)) from None


def category_row(found, load: dict[str, Any]) -> dict[str, Any]:
    """One category's figures: its /metrics window's acceptance (None without drafts) and latency."""
    spec = load["spec_decode"] or {}
    s = summarize(load["records"], load["duration_s"])
    return {**found.record(), "acceptance_length": spec.get("acceptance_length"),
            "per_position_acceptance": spec.get("per_position_acceptance") or [], "spec_decode": load["spec_decode"],
            **{k: s[k] for k in ("completed", "failed", "output_throughput", "mean_tpot_ms", "mean_ttft_ms")}}


def served_k(spec_decode: dict | None, res: Resolved) -> dict[str, Any]:
    """The K the server really ran: vLLM (and our engine) export one per-position acceptance
    series per drafted slot, so their count is K; without spec metrics, what the resolver
    decided for the recipe's engine."""
    rates = (spec_decode or {}).get("per_position_acceptance") or []
    if rates:
        return {"num_speculative_tokens": len(rates),
                "num_speculative_tokens_source": "server /metrics (per-position series)"}
    if not spec_decode:
        return {"num_speculative_tokens": None, "num_speculative_tokens_source": "no spec-decode metrics"}
    try:
        k = res.k
        return {"num_speculative_tokens": k.value, "num_speculative_tokens_source": f"resolver: {k.source}"}
    except ValueError as e:
        return {"num_speculative_tokens": None, "num_speculative_tokens_source": f"unknown ({e})"}


def write_result(result: dict[str, Any], out_dir: Path) -> Path:
    """`bench_<label>.json` + `.md` in out_dir (temp file then rename)."""
    from dspark_kit.measure.bench_tables import bench_markdown

    out_dir.mkdir(parents=True, exist_ok=True)
    path = bench_result_file(out_dir, result["label"])
    atomic.write_text(path, json.dumps(result, indent=2) + "\n")
    atomic.write_text(path.with_suffix(".md"), bench_markdown([result]) + "\n")
    return path


def served_as_decided(res: Resolved):
    """What the spec server served, as the resolver decided it: the served gate's diagnosis reads it."""
    from dspark_kit.measure.served_gate import Served

    vllm = res.engine in ("vllm", "vllm-ascend")
    return Served(res.checkpoint, res.window.value, res.window.source,
                  tuple(f"{f.level} {f.code}: {f.message}" for f in res.checkpoint_findings()),
                  res.engine_gate.message if vllm else None)


def bench_spec_server(res: Resolved, server: ServerPlan | None = None) -> dict[str, Any]:
    """Serve verifier + draft (role spec; `server`: the stage plan's), benchmark it, stop it."""
    import re

    from dspark_kit.measure.served_gate import ServedGateError, enforce, side_by_side
    from dspark_kit.stages.server_plan import running_server

    label = re.sub(r"[^A-Za-z0-9._-]", "_", Path(res.recipe.serve.checkpoint).name) or "spec"
    with running_server(res, "spec", plan=server) as url:
        r = bench_endpoint(res, url, label=f"spec-{label}", write=False)  # written once, with the gate's verdict
    try:
        verdict = enforce(r, res.run.eval_json, res.recipe.bench.min_served_fraction, lambda: served_as_decided(res))
    except ServedGateError as e:
        write_result(r | {"in_process": {"passed": False, "error": str(e)}}, res.run.bench)
        raise BenchError(f"bench: {e}") from None
    write_result(r | {"in_process": verdict}, res.run.bench)  # served and in-process side by side
    spec = r["spec_decode"] or {}
    return {"acceptance_length": spec.get("acceptance_length"), "output_throughput": r["output_throughput"],
            "mean_tpot_ms": r["mean_tpot_ms"], "num_speculative_tokens": r["num_speculative_tokens"],
            "in_process": verdict, "served_vs_in_process": side_by_side(verdict),
            "path": str(res.run.bench_file(r["label"]))}


# ---- the stage ---------------------------------------------------------------


def plan(res: Resolved) -> StagePlan:
    lines, procs = spec_server_lines(res, "bench")
    at = f"temperature {res.recipe.measured_temperature:g}"
    return StagePlan.of(res, "bench", [*lines, f"# in-process: benchmark that server at {at} -> {res.run.bench}"], procs,
                        outputs={"bench": str(res.run.bench)})


def run(res: Resolved, plan: StagePlan, reporter: Reporter = STANDALONE) -> dict:
    spec = plan.process("spec server")
    with reporter.doing("bench", "starting the spec server, then benchmarking it"):
        return bench_spec_server(res, spec.server if spec else None)


def endpoint_plan(res: Resolved, base_url: str | None, label: str | None, out_dir: Path, num_prompts: int | None,
                  concurrency: int | None, max_tokens: int | None, dataset: str, categories: list[str]) -> StagePlan:
    """The bench stage's plan as this command runs it. The pipeline's bench starts a spec server and
    stops it after; this command starts none: it measures the server at --endpoint, else at the
    recipe's serve.host:port."""
    r = res.recipe
    staged = plan(res)  # the stage's own plan, then this command's choices
    load = bench_load(res, base_url, label, num_prompts, concurrency, max_tokens)
    url, n, conc, new = load.base_url, load.num_prompts, load.concurrency, load.max_tokens
    result = bench_result_file(out_dir, load.label)
    staged.processes, staged.inputs, staged.outputs = [], {"server": url}, {"bench": str(result)}
    staged.details.update(base_url=url, num_prompts=n, concurrency=conc, max_tokens=new, prompts=dataset,
                        categories=categories)
    where = "--endpoint" if base_url else "serve.host:port"
    staged.lines = [(f"# no server started: bench measures the running server at {url} ({where}; start one "
                   "with `dspark-kit serve --role spec`)")]
    if not base_url and r.serve.port == 0:  # the port a recipe server takes is known only once it starts
        staged.lines.append("# serve.port is 0 (a free port at start): pass --endpoint with the URL `dspark-kit "
                          "serve` printed")
    staged.lines.append(f"# in-process: {n} prompts ({dataset}), {conc} in flight, up to {new} new tokens each, "
                      f"temperature {r.measured_temperature:g} -> {result} (and .md)")
    if categories:
        staged.lines.append(f"# then per category: {', '.join(categories)} ({n} prompts each)")
    return staged
