"""`dspark-kit eval --suite NAME` / `--benchmarks a,b`: the published benchmarks, measured as the field reports.

Each benchmark's rows (data.benchmarks: a local copy, a packaged copy or the hub through
`datasets`) are decoded by the reference decoder (lossless: greedy at T=0, speculative sampling
at T>0, each request seeded by its index) at every asked temperature; every draft step's drafted
and accepted counts and the confidence head's per-slot outputs are kept, and
measure.suite_metrics turns them into the paper's figures with bootstrap intervals over prompts.
MT-Bench's (and any list column's) later turns are asked after the verifier's own reply, and
count towards the same prompt. `--compare A B` measures two checkpoints on the same prompts and
seeds and reports the paired difference per benchmark.

Writes <out>/eval.json (the table, the figures and every request's record, so a later compare
can read it), eval.md and two pictures: tau per benchmark, and the reliability diagram.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dspark_kit import atomic
from dspark_kit.data.benchmarks import (
    BenchmarkError,
    BenchmarkPrompts,
    Suite,
    load_benchmark,
    where_from,
)
from dspark_kit.measure.eval_prompts import EvalError, build_prompts
from dspark_kit.measure.suite_metrics import RequestRecord, paired_difference, tau, with_intervals
from dspark_kit.measure.suite_report import (
    compare_markdown,
    suite_markdown,
    write_suite_outputs,
)
from dspark_kit.resolved import Resolved
from dspark_kit.specdec.window import LOCAL_KV_BLOCK_SIZE
from dspark_kit.stages.plan import StagePlan


@dataclass(frozen=True)
class SuiteOptions:
    suite: Suite
    limit: int  # rows per benchmark, drawn with `seed`
    temperatures: tuple[float, ...] = (0.0, 1.0)
    seed: int = 0
    bootstrap: int = 1000
    max_new_tokens: int = 64
    local: dict[str, Path] = field(default_factory=dict)  # benchmark -> its local copy


def suite_options(suite: str | None, benchmarks: str | None, limit: int, temperatures: tuple[float, ...], seed: int,
                  bootstrap: int, max_new_tokens: int, recipe_files: dict[str, str],
                  given_files: list[str] | None) -> SuiteOptions:
    """The command's choices as options; a bad one is one line (EvalError)."""
    from dspark_kit.data.benchmarks import resolve_suite

    try:
        chosen = resolve_suite(suite, benchmarks)
    except BenchmarkError as e:
        raise EvalError(str(e)) from None
    return SuiteOptions(chosen, limit, temperatures, seed, bootstrap, max_new_tokens,
                        local_copies(recipe_files, given_files))


def compare_checkpoints(resolve, given: tuple[str, str], opts: SuiteOptions, out: Path, log=lambda _m: None) -> dict:
    """`--compare A B`: each a checkpoint (measured now, into out/A and out/B, through `resolve(checkpoint)`)
    or a suite eval.json measured before; then the paired differences, written to out/compare.*."""
    runs = []
    for label, item in zip("AB", given, strict=True):
        path = Path(item)
        if path.suffix == ".json" and path.is_file():
            try:
                runs.append(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError) as e:
                raise EvalError(f"--compare {item}: unreadable ({type(e).__name__}); pass a suite eval.json or a "
                                "checkpoint") from None
            continue
        log(f"eval --compare: {label} = {item}")
        runs.append(run_suite(resolve(item), opts, out / label, log))
    result = compare_runs(runs[0], runs[1], max(opts.bootstrap, 1), opts.seed)
    result["files"] = write_compare(result, out)
    return result


def local_copies(recipe_files: dict[str, str], given: list[str] | None) -> dict[str, Path]:
    """eval.benchmark_files, then --benchmark-file NAME=PATH (the command's win)."""
    out = {k: Path(v).expanduser() for k, v in (recipe_files or {}).items()}
    for item in given or []:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise EvalError(f"--benchmark-file {item!r}: expected NAME=PATH, e.g. --benchmark-file gsm8k=gsm8k.jsonl")
        out[name.strip()] = Path(path.strip()).expanduser()
    return out


def suite_plan(res: Resolved, opts: SuiteOptions, out: Path, compare: tuple[str, str] | None = None,
               endpoint: str | None = None) -> StagePlan:
    """What each benchmark will load and run (nothing is read): the dry run."""
    temps = ", ".join(f"T={t:g}" for t in opts.temperatures)
    ckpts = f"checkpoints {compare[0]} (A) and {compare[1]} (B), paired" if compare else f"checkpoint {res.checkpoint}"
    lines = [(f"# suite {opts.suite.name} ({opts.suite.source}): {len(opts.suite.benchmarks)} benchmarks, "
             f"{opts.limit} rows each (drawn with seed {opts.seed}), {temps}, up to {opts.max_new_tokens} new tokens"),
             (f"# served: first turns as token ids to {endpoint} ({SERVED_NOTE.split(': ', 1)[1]})" if endpoint else
              f"# in-process: the reference decoder on {res.eval_device.value} ({res.eval_dtype.value}), {ckpts}, "
              f"K {res.k.value}, window {res.window.value}; bootstrap {opts.bootstrap} resamples over prompts")]
    for b in opts.suite.benchmarks:
        unknown = b.name in opts.local and not opts.local[b.name].exists()
        lines.append(f"#   {b.name}: {where_from(b, opts.local.get(b.name))}; prompt column "
                     f"{' / '.join(b.fields)}{' (missing: the run fails on it)' if unknown else ''}")
    lines.append(f"# writes {out / 'eval.json'}, eval.md, eval_suite_tau.png, eval_reliability.png")
    plan = StagePlan.of(res, "eval", lines, outputs={"eval": str(out / "eval.json")})
    plan.details.update(suite=opts.suite.name, benchmarks=[b.name for b in opts.suite.benchmarks],
                        limit=opts.limit, temperatures=list(opts.temperatures), seed=opts.seed)
    return plan


def load_all(opts: SuiteOptions, log=lambda _m: None) -> list[BenchmarkPrompts]:
    out = []
    for b in opts.suite.benchmarks:
        found = load_benchmark(b, opts.limit, opts.seed, opts.local.get(b.name))
        log(f"eval: {b.name}: {len(found.turns)} of {found.rows_total} rows from {found.source}")
        out.append(found)
    return out


def decode(session, found: BenchmarkPrompts, temperature: float, max_new: int) -> list[RequestRecord]:
    """Every turn of every row, the later turns after the verifier's own reply; one record per request."""
    from dspark_kit.specdec.decoder import SpecGenerator

    gen = SpecGenerator(session.verifier, session.draft, session.k, session.resolved.window.value, None,
                        LOCAL_KV_BLOCK_SIZE, record_confidence=True)
    thinking = session.resolved.recipe.measured_thinking
    histories = [[{"role": "user", "content": t[0]}] for t in found.turns]
    records: list[RequestRecord] = []
    asked = list(range(len(found.turns)))
    turn = 0
    while asked:
        prompts = build_prompts(session.tokenizer, [histories[i] for i in asked], len(asked), thinking)
        results = [gen.generate(p, max_new, temperature=temperature, seed=1000 * turn + i, stop_ids=session.stop_ids)
                   for i, p in zip(asked, prompts, strict=True)]
        for i, r in zip(asked, results, strict=True):
            records.append(RequestRecord(found.ids[i], list(r.step_drafted), list(r.step_accepted),
                                         r.step_confidence, len(r.token_ids), r.wall_s))
        turn += 1
        later = [i for i in asked if turn < len(found.turns[i])]
        for i in later:
            reply = session.tokenizer.decode(results[asked.index(i)].token_ids, skip_special_tokens=True)
            histories[i] += [{"role": "assistant", "content": reply}, {"role": "user", "content": found.turns[i][turn]}]
        asked = later
    return records


def measure_suite(res: Resolved, opts: SuiteOptions, sets: list[BenchmarkPrompts], log=lambda _m: None) -> dict:
    from dspark_kit.stages.evaluation.evaluate import EvalSession

    session = EvalSession(res)
    rows, requests = [], {}
    for found in sets:
        per_t = {}
        for t in opts.temperatures:
            log(f"eval: {found.name} at T={t:g}")
            recs = decode(session, found, t, opts.max_new_tokens)
            per_t[f"{t:g}"] = with_intervals(recs, session.k, opts.bootstrap, opts.seed)
            requests.setdefault(found.name, {})[f"{t:g}"] = [r.as_dict() for r in recs]
        rows.append({**found.record(), "results": per_t})
    pooled = {t: with_intervals([RequestRecord.from_dict(d) for by_t in requests.values() for d in by_t[t]],
                                session.k, opts.bootstrap, opts.seed) for t in (f"{x:g}" for x in opts.temperatures)}
    return {
        "suite": opts.suite.name, "suite_source": opts.suite.source, "checkpoint": str(session.checkpoint),
        "verifier": session.verifier_path, "num_speculative_tokens": session.k,
        "draft_window_size": res.window.value, "has_confidence_head": session.draft.model.confidence_head is not None,
        "device": res.eval_device.value, "dtype": res.eval_dtype.value, "limit": opts.limit, "seed": opts.seed,
        "max_new_tokens": opts.max_new_tokens, "temperatures": list(opts.temperatures), "mode": "in-process",
        "benchmarks": rows, "pooled": pooled, "requests": requests,
    }


SERVED_NOTE = ("served: acceptance from the engine's /metrics (counts summed over a benchmark's requests): no "
               "per-request records, so no bootstrap interval, conditional acceptance or calibration; first turns only")


def measure_served(res: Resolved, opts: SuiteOptions, sets: list[BenchmarkPrompts], endpoint: str,
                   concurrency: int, log=lambda _m: None) -> dict:
    """The same prompts (first turns, as token ids) sent to a running spec server at `endpoint` (its
    /v1 base), per benchmark and temperature; tau and per-position acceptance from its /metrics."""
    import asyncio

    from dspark_kit.engines.chat_client import ChatClient
    from dspark_kit.specdec.verifier import load_tokenizer
    from dspark_kit.stages.evaluation.served_tune import measure

    base = endpoint.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"

    async def model_id() -> str:
        async with ChatClient(base, concurrency=1, timeout=30.0) as client:
            ids = await client.model_ids()
        if not ids:
            raise EvalError(f"--endpoint {endpoint}: /v1/models lists no model")
        return ids[0]

    try:
        model = asyncio.run(model_id())
    except EvalError:
        raise
    except Exception as e:  # noqa: BLE001 - unreachable, refused, not OpenAI-compatible: one line
        raise EvalError(f"--endpoint {endpoint}: no answer from /v1/models ({type(e).__name__}); start the spec "
                        "server first (`dspark-kit serve`)") from None
    tok = load_tokenizer(res.verifier_path, res.recipe.verifier.trust_remote_code)
    thinking = res.recipe.measured_thinking
    rows = []
    for found in sets:
        prompts = build_prompts(tok, [[{"role": "user", "content": t[0]}] for t in found.turns], len(found.turns),
                                thinking)
        per_t = {}
        for t in opts.temperatures:
            log(f"eval: {found.name} at T={t:g} via {base}")
            m = asyncio.run(measure(base.removesuffix("/v1"), model, prompts, concurrency, opts.max_new_tokens, t))
            per = m["per_position_acceptance"]
            per_t[f"{t:g}"] = {"requests": m["completed"], "prompts": len(prompts), "tau": m["acceptance_length"],
                               "tau_interval": None, "per_position_unconditional": per,
                               "per_position_conditional": [None] * len(per), "drafts_per_request": None,
                               "calibration": None, "output_throughput": m["output_throughput"],
                               "failed": m["failed"], **({"error": m["error"]} if m.get("error") else {})}
        rows.append({**found.record(), "turns": 1, "results": per_t})
    return {"suite": opts.suite.name, "suite_source": opts.suite.source, "checkpoint": f"served: {model} at {base}",
            "verifier": res.verifier_path, "num_speculative_tokens": len(rows[0]["results"][f"{opts.temperatures[0]:g}"]
                                                                       ["per_position_unconditional"]) if rows else 0,
            "draft_window_size": None, "has_confidence_head": False, "device": "the server's",
            "dtype": "the server's", "limit": opts.limit, "seed": opts.seed, "max_new_tokens": opts.max_new_tokens,
            "temperatures": list(opts.temperatures), "mode": f"served ({base})", "note": SERVED_NOTE,
            "benchmarks": rows, "requests": {}}


def run_suite(res: Resolved, opts: SuiteOptions, out: Path, log=lambda _m: None, endpoint: str | None = None,
              concurrency: int = 1) -> dict:
    """In-process (the reference decoder), or with `endpoint` against a running spec server."""
    try:
        sets = load_all(opts, log)  # every benchmark found before any decoding
    except BenchmarkError as e:
        raise EvalError(str(e)) from None
    summary = (measure_served(res, opts, sets, endpoint, concurrency, log) if endpoint
               else measure_suite(res, opts, sets, log))
    summary["files"] = write_suite_outputs(summary, out)
    return summary


def records_of(summary: dict) -> dict[tuple[str, str], list[RequestRecord]]:
    return {(b, t): [RequestRecord.from_dict(d) for d in recs]
            for b, by_t in summary.get("requests", {}).items() for t, recs in by_t.items()}


def compare_runs(a: dict, b: dict, samples: int = 1000, seed: int = 0) -> dict:
    """Paired tau difference (B - A) per benchmark and temperature, with its bootstrap interval."""
    ra, rb = records_of(a), records_of(b)
    rows = []
    for key in ra:
        if key not in rb:
            continue
        d = paired_difference(ra[key], rb[key], tau, samples, seed)
        rows.append({"benchmark": key[0], "temperature": float(key[1]), **d})
    if not rows:
        raise EvalError("--compare: the two runs share no benchmark and temperature")
    return {"a": a.get("checkpoint"), "b": b.get("checkpoint"), "suite": a.get("suite"), "statistic": "tau",
            "bootstrap": {"samples": samples, "seed": seed, "unit": "prompt"}, "rows": rows}


def write_compare(result: dict, out: Path) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "compare.json", "markdown": out / "compare.md"}
    atomic.write_text(files["markdown"], compare_markdown(result))
    atomic.write_text(files["json"], json.dumps({**result, "files": {k: str(v) for k, v in files.items()}}, indent=2))
    return {k: str(v) for k, v in files.items()}


__all__ = [
    "SuiteOptions",
    "compare_runs",
    "local_copies",
    "run_suite",
    "suite_markdown",
    "suite_plan",
    "write_compare",
]
