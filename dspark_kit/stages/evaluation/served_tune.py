"""`dspark-kit tune --served`: K and the draft window chosen by served throughput.

For each (K, window) of the sweep (served_sweep.py plans it) the recipe's serving
engine starts with that K and window (role spec; the verifier alone for K 0),
and the eval prompts go to it as token ids (`/v1/completions`, streamed) at the
recipe's bench concurrency: the short prompts and each long-context set, the same
ids in-process eval decodes. Each prompt set is one point: acceptance length and
per-position acceptance from the engine's /metrics (delta over the point's
requests), output tokens/s, TTFT and TPOT from the client, completed / failed.
Every point is saved as it completes (a rerun resumes); a server that fails to
start or dies makes its points failed, with its log's tail, and the sweep goes on.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from dspark_kit.measure.eval_prompts import (
    EvalError,
    EvalPrompts,
    build_prompts,
    eval_sizes,
    load_eval_prompts,
    served_concurrency,
)
from dspark_kit.recipe import Recipe, apply_overrides, recipe_from_dict
from dspark_kit.resolved import Resolved
from dspark_kit.specdec.verifier_facts import language_model_config
from dspark_kit.stages.evaluation import served_sweep as sweep
from dspark_kit.stages.prompts import prompt_source

REQUEST_TIMEOUT_S = 600.0  # one streamed request's wait for its next bytes: a hang, not a slow machine


def point_recipe(recipe: Recipe, checkpoint: Path, k: int, window: int | None, max_model_len: int) -> Recipe:
    """The recipe the point's server is planned from: its K and window, the tuned checkpoint, room for
    the longest prompt (Resolved then decides everything else, as for `serve`)."""
    sets = [f"serve.checkpoint={checkpoint}", f"serve.max_model_len={max_model_len}"]
    if k:
        sets += [f"serve.num_speculative_tokens={k}", f"serve.draft_window_size={window or 'off'}"]
    return recipe_from_dict(apply_overrides(recipe.model_dump(mode="json"), sets), "served tune point")


async def measure(url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
                  temperature: float = 0.0) -> dict:
    """Stream every prompt (token ids) at `concurrency` and `temperature` (eval.temperature); the point's figures."""
    from dspark_kit.engines.chat_client import ChatClient
    from dspark_kit.engines.prom import spec_decode_delta
    from dspark_kit.measure.served_load import chat_request, summarize

    async with ChatClient(url, concurrency=concurrency + 2, timeout=REQUEST_TIMEOUT_S, streaming=True) as client:
        before = await client.get_text("/metrics")
        sem = asyncio.Semaphore(concurrency)

        async def one(ids: list[int]):
            body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": temperature,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with sem:
                return await chat_request(client, body, completion=True)

        t0 = time.perf_counter()
        records = await asyncio.gather(*(one(p) for p in prompts))
        duration = time.perf_counter() - t0
        after = await client.get_text("/metrics")
    s = summarize(records, duration)
    spec = spec_decode_delta(before, after) if before is not None and after is not None else None
    return {"acceptance_length": round(spec["acceptance_length"], 4) if spec else None,
            "per_position_acceptance": [round(x, 4) for x in spec["per_position_acceptance"]] if spec else [],
            "output_throughput": round(s["output_throughput"], 3) if s["completed"] else None,
            "ttft_ms": round(s["mean_ttft_ms"], 2) if s["mean_ttft_ms"] is not None else None,
            "tpot_ms": round(s["mean_tpot_ms"], 2) if s["mean_tpot_ms"] is not None else None,
            "completed": s["completed"], "failed": s["failed"], "duration_s": round(duration, 3),
            "output_tokens": s["total_output_tokens"], "streamed": s["streamed"],
            **({"error": "; ".join(s["errors"])[:300]} if s["failed"] else {})}


def _failed(server: sweep.ServerPoint, n: int | str, count: int, error: str) -> dict:
    where = {"context_length": n} if isinstance(n, int) else {"context_length": 0, "category": n}
    return {"k": server.k, "window": server.window, **where, "repeat": server.repeat,
            "acceptance_length": None, "per_position_acceptance": [], "output_throughput": None, "ttft_ms": None,
            "tpot_ms": None, "completed": 0, "failed": count, "error": error}


def run_server_point(res: Resolved, server: sweep.ServerPoint, prompt_sets: dict[int | str, list[list[int]]],
                     concurrency: int, max_tokens: int, max_model_len: int, log, save) -> float | None:
    """Start one server, measure every prompt set on it (saving each point), stop it. A set's key is
    its context length, or a category name (served eval: short prompts, the point names it).
    Returns the seconds the server took to become healthy (None: it did not)."""
    from dspark_kit.engines.lifecycle import ManagedServer, ServerStartError
    from dspark_kit.engines.prom import MetricsError
    from dspark_kit.engines.servers import start_checks
    from dspark_kit.logs import quoted_tail
    from dspark_kit.stages.server_plan import server_plan

    recipe = point_recipe(res.recipe, res.checkpoint, server.k, server.window, max_model_len)
    point_res = Resolved(recipe, res.run, engine=res.engine)
    role = "spec" if server.k else "chat"
    tag = "alone" if not server.k else f"k{server.k}-w{server.window or 'off'}"
    log_path = res.run.server_log(f"served-tune-{tag}")
    try:
        plan = server_plan(point_res, role)  # serve.port (0: a free one), as every server the kit starts
        start_checks(plan)  # a taken serve.port (PortBusy) stops the sweep: it is no point's fault
    except ValueError as e:  # the engine cannot serve this point at all (one line, from the plan)
        for n, prompts in prompt_sets.items():
            save(_failed(server, n, len(prompts), f"not planned: {e}"))
        return None
    log(f"tune --served: {server.label}: starting {res.engine} ({plan.shell_line()[:160]})")
    with ManagedServer(plan, log_path) as srv:
        t0 = time.monotonic()
        try:
            srv.wait_healthy(recipe.serve.startup_timeout)
        except ServerStartError as e:
            for n, prompts in prompt_sets.items():
                save(_failed(server, n, len(prompts), str(e).splitlines()[0][:300]) | {"log_tail": quoted_tail(log_path, 15)})
            return None
        started = time.monotonic() - t0
        for n, prompts in prompt_sets.items():
            if not srv.alive():
                save(_failed(server, n, len(prompts), "server died during the sweep") | {"log_tail": quoted_tail(log_path, 15)})
                continue
            try:
                point = asyncio.run(measure(plan.base_url, point_res.served_name, prompts, concurrency, max_tokens,
                                            res.recipe.measured_temperature))
            except MetricsError as e:  # the counters went down: the server restarted under us
                save(_failed(server, n, len(prompts), str(e)) | {"log_tail": quoted_tail(log_path, 15)})
                continue
            if point.get("failed") and not srv.alive():
                point["log_tail"] = quoted_tail(log_path, 15)
            where = {"context_length": n} if isinstance(n, int) else {"context_length": 0, "category": n}
            save({"k": server.k, "window": server.window, **where, "repeat": server.repeat,
                  "mean_prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1), **point})
            label = f"category {n}" if isinstance(n, str) else f"context {n or 'short'}"
            log(f"tune --served: {server.label}, {label}: AL {point['acceptance_length']}, "
                f"{point['output_throughput']} tok/s, {point['completed']} completed, {point['failed']} failed")
    return started


def prompt_sets(res: Resolved, context_lengths: list[int], num_prompts: int,
                prompts_file: Path | None = None) -> tuple[dict[int, list[list[int]]], EvalPrompts]:
    """Token ids per context length (0: the short prompts), as in-process eval builds them from
    the same held-out chats, and where they came from. An empty or unreadable prompts file stops
    here, before any server starts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(res.verifier_path)
    found = load_eval_prompts(prompt_source(res), tok, prompts_file, limit=max(num_prompts, 16))
    thinking = res.recipe.measured_thinking
    return {n: build_prompts(tok, found.chats, num_prompts, thinking, n) for n in [0, *context_lengths]}, found


def served_tune(res: Resolved, *, ks: list[int] | None = None, windows: list[int] | None = None,
                context_lengths: list[int] | None = None, allow_below: bool = False, num_prompts: int | None = None,
                max_new_tokens: int | None = None, prompts_file: Path | None = None, concurrency: int | None = None,
                dry_run: bool = False, log=lambda _m: None) -> dict:
    """`tune --served`: its inputs (the sweep's K values, windows at the serving engine's KV block and
    contexts; the eval sizes; the bench concurrency; the prompt sets), then the sweep (`run_served_tune`).
    None = the default each rule gives."""
    from dspark_kit.stages.evaluation.sweep_rules import sweep_inputs

    k_list, w_list, ctx = sweep_inputs(res, ks=ks, windows=windows, context_lengths=context_lengths,
                                       allow_below=allow_below, what="tune --served", served=True)
    sizes = eval_sizes(res.recipe, num_prompts, max_new_tokens, ctx)
    sets, found = prompt_sets(res, ctx, sizes.num_prompts, prompts_file)
    return run_served_tune(res, sets, ks=k_list, windows=w_list, concurrency=served_concurrency(res.recipe, concurrency),
                           max_new_tokens=sizes.max_new_tokens, dry_run=dry_run, log=log, prompts_source=found.source)


def run_served_tune(res: Resolved, prompt_sets: dict[int, list[list[int]]], *, ks: list[int], windows: list[int],
                    concurrency: int, max_new_tokens: int, dry_run: bool = False, log=lambda _m: None,
                    prompts_source: str = "") -> dict:
    """Sweep, save as it goes, recommend; writes DIR/eval/served_tune.json and .md (not in a dry run)."""
    servers, notes = sweep.plan_servers(res.engine, ks, windows)
    cfg = res.verifier_config or {}
    limit = language_model_config(cfg).get("max_position_embeddings")
    too_long = [n for n in prompt_sets if n and isinstance(limit, int) and n + max_new_tokens > limit]
    if too_long:  # the engine would refuse them (or fail to start with that max_model_len)
        notes.append(f"contexts {too_long} dropped: with {max_new_tokens} new tokens they pass the verifier's "
                     f"max_position_embeddings {limit}")
        prompt_sets = {n: p for n, p in prompt_sets.items() if n not in too_long}
    ctx = sorted(prompt_sets)
    path = res.run.served_tune_file
    settings = {"engine": res.engine, "checkpoint": str(res.checkpoint), "concurrency": concurrency,
                "max_new_tokens": max_new_tokens, "context_lengths": ctx,
                "temperature": res.recipe.measured_temperature, "num_prompts": len(prompt_sets[0]), "prompts": sweep.prompts_fingerprint(prompt_sets)}
    saved, why = sweep.load_saved(path, settings)
    if why:
        notes.append(why)
    todo = [s for s in servers if not sweep.server_done(s, saved, ctx)]
    longest = max(len(p) for ps in prompt_sets.values() for p in ps)
    max_model_len = max(res.recipe.serve.max_model_len or 0, longest + max_new_tokens + 1)
    if max_model_len != res.recipe.serve.max_model_len:
        notes.append(f"serve.max_model_len {max_model_len} for the sweep's servers (longest prompt {longest} "
                     f"+ {max_new_tokens} new tokens)")
    tokens = sum(len(ps) for ps in prompt_sets.values()) * max_new_tokens
    seconds, how = sweep.estimate_seconds(res.engine, len(todo), tokens, _measured(saved))
    plan = {"engine": res.engine, "servers": [s.label for s in servers], "to_run": [s.label for s in todo],
            "points": len(servers) * len(ctx), "points_saved": len(saved), "context_lengths": ctx,
            "concurrency": concurrency, "estimated_s": round(seconds), "estimate": how, "notes": notes,
            "file": str(path)}
    if dry_run:
        if not res.checkpoint_exists:
            notes.append(f"not trained yet: the sweep will load {res.checkpoint} (train first)")
        return {"plan": plan}
    points = list(saved)
    extra = {"prompts_source": prompts_source}

    def save(point: dict) -> None:
        points[:] = [p for p in points if sweep.point_key(p) != sweep.point_key(point)] + [point]
        sweep.write(path, _result(res, settings, points, ctx, notes, concurrency, partial=True) | extra)

    for server in todo:
        started = run_server_point(res, server, prompt_sets, concurrency, max_new_tokens, max_model_len, log, save)
        if started is not None:
            for p in points:
                if (p["k"], p["window"], bool(p.get("repeat"))) == (server.k, server.window, server.repeat):
                    p["server_start_s"] = round(started, 2)
    result = _result(res, settings, points, ctx, notes, concurrency, partial=False) | extra
    sweep.write(path, result)
    return {"plan": plan, **result, "file": str(path)}


def _measured(points: list[dict]) -> dict | None:
    starts = [p["server_start_s"] for p in points if p.get("server_start_s")]
    dur = sum(p.get("duration_s") or 0 for p in points)
    toks = sum(p.get("output_tokens") or 0 for p in points)
    if not starts or not dur or not toks:
        return None
    return {"server_start_s": sum(starts) / len(starts), "output_tokens_per_s": toks / dur}


def _result(res: Resolved, settings: dict, points: list[dict], ctx: list[int], notes: list[str],
            concurrency: int, partial: bool) -> dict[str, Any]:
    points = sorted(points, key=lambda p: (bool(p.get("repeat")), p["k"], p["window"] or 0, p["context_length"]))
    base = sweep.baseline_throughput(points)
    for p in points:
        n, t = p["context_length"], p.get("output_throughput")
        p["speedup"] = round(t / base[n], 3) if t and base.get(n) else None
    spread = sweep.baseline_spread(points)
    return {"schema": sweep.SCHEMA, "engine": res.engine, "concurrency": concurrency, "settings": settings,
            "context_lengths": ctx, "partial": partial, "spread": spread, "notes": notes,
            **sweep.recommend(points, ctx, spread), "points": points}


def served_eval(res: Resolved, log=lambda _m: None) -> dict:
    """`run`'s eval when the verifier does not fit the eval device: the serving engine (role spec,
    the resolved K and window) answers the eval prompts (short and eval.context_lengths) at the
    bench concurrency; writes eval.json / eval.md as in-process eval does, with "mode": "served"."""
    from dspark_kit.stages.evaluation.eval_outputs import write_outputs

    recipe = res.recipe
    sizes = eval_sizes(res.recipe)
    n, new = sizes.num_prompts, sizes.max_new_tokens
    sets, found = prompt_sets(res, sizes.context_lengths, n)
    categories = served_categories(res, n)
    sets.update({c.name: ids for c, ids in categories})
    k, window = res.k.value, res.window.value
    longest = max(len(p) for ps in sets.values() for p in ps)
    points: list[dict] = []
    run_server_point(res, sweep.ServerPoint(k, window), sets, served_concurrency(res.recipe), new,
                     max(recipe.serve.max_model_len or 0, longest + new + 1), log, points.append)
    # prompts go as token ids here: a later turn (MT-Bench's second) needs the reply's text, which
    # `eval` in-process and `bench` have; served eval says it asked the first turn only
    first_only = {"turns": 1, "note": "served eval asks the first turn only (eval in-process and bench ask both)"}
    per_category = [{**c.record(), **(first_only if c.follow_ups else {}), **_category_point(points, c.name)}
                    for c, _ in categories]
    points = [p for p in points if "category" not in p]
    done = [p for p in points if p.get("completed")]
    if not done or done[0]["context_length"] != 0:
        why = next((p.get("error") for p in points if p.get("error")), "no request completed")
        raise EvalError(f"served eval on engine {res.engine}: {why} (log: {res.run.logs})")
    runs = [{"context_length": p["context_length"], "window": window, "num_speculative_tokens": k,
             "mean_prompt_tokens": p.get("mean_prompt_tokens"), "acceptance_length": p["acceptance_length"],
             "per_position_acceptance": p["per_position_acceptance"], "tokens_per_verifier_forward": None,
             "wall_s": p.get("duration_s"), "output_throughput": p["output_throughput"], "ttft_ms": p["ttft_ms"],
             "tpot_ms": p["tpot_ms"], "completed": p["completed"], "failed": p["failed"]} for p in done]
    head = runs[0]
    summary = {"mode": "served", "mode_source": res.eval_mode.source, "engine": res.engine,
               "checkpoint": str(res.checkpoint), "verifier": res.verifier_path, "num_speculative_tokens": k,
               "num_speculative_tokens_source": res.k.source, "max_new_tokens": new,
               "temperature": recipe.measured_temperature, "draft_window_size": window,
               "draft_window_size_source": res.window.source, "concurrency": served_concurrency(res.recipe),
               "prompts": found.record(n), "acceptance_length": head["acceptance_length"],
               "per_position_acceptance": head["per_position_acceptance"], "tokens_per_verifier_forward": None,
               "num_drafts": None, "runs": runs, "categories": per_category}
    summary["files"] = write_outputs(summary, res.run.eval)
    return summary


def served_categories(res: Resolved, num_prompts: int) -> list[tuple]:
    """eval.categories for served eval: (CategoryPrompts, token ids) each, built as in-process eval builds them."""
    from transformers import AutoTokenizer

    from dspark_kit.data.categories import CategoryError, parse_categories
    from dspark_kit.measure.eval_prompts import category_prompts

    if not res.recipe.eval.categories:
        return []
    tok = AutoTokenizer.from_pretrained(res.verifier_path)
    try:
        found = category_prompts(prompt_source(res), parse_categories(res.recipe.eval.categories), num_prompts, tok,
                                 where="eval.categories")
    except CategoryError as e:
        raise EvalError(str(e)) from None
    thinking = res.recipe.measured_thinking
    return [(c, build_prompts(tok, c.chats, len(c.chats), thinking)) for c in found]


def _category_point(points: list[dict], name: str) -> dict:
    """A category's served figures (the fields in-process eval's category rows carry), or why it has none."""
    p = next((p for p in points if p.get("category") == name), {})
    keep = ("acceptance_length", "per_position_acceptance", "completed", "failed", "output_throughput", "error")
    return {k: p[k] for k in keep if k in p}
