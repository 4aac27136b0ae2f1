"""Stage 0: regenerate assistant turns with the verifier itself.

Per conversation: user/system turns kept, original assistant turns dropped,
each reply regenerated in order with the new replies as history.
Reasoning: a server with a reasoning parser (vLLM `--reasoning-parser qwen3`,
the local engine's too) returns it in `reasoning_content` / `reasoning`; a
server without one leaves `<think>..</think>` inline. Either way the row stores
it explicitly as the turn's `reasoning_content` (conversations.to_sharegpt).
History sent back holds role and content only: the Qwen3 template drops the
reasoning of turns before the last user turn anyway. Each reply also keeps the
verifier's own token ids (`return_token_ids`, as speculators' regenerate-responses
does; llama-server, which ignores that key, lists them in `logprobs`, asked of it alone): prepare
trains exactly those tokens rather than a re-tokenization of the text.
Tool-calling rows: the request carries the row's `tools`; the verifier's calls are kept and the
dataset's results spliced in under them (`regenerate` says how, and when a row ends early); the
row keeps its `tools` so prepare renders the schema the verifier saw.

`concurrency` workers per endpoint pull rows from one queue (faster servers
take more); the requests, their retries and endpoint health are
dspark_kit.engines.chat_client's. Refused connections do not use up a row's
retries: the request waits with backoff while the endpoint is down (a
restarting server), and the endpoint leaves the rotation only after refusing
for `unavailable_timeout` seconds (and `dead_after` times) in a row; with other
endpoints live its rows go to them at once. Every source row ends as written,
failed (with reason, in the errors file) or not attempted (all endpoints gone),
counted in the summary; an error that is not a failed request (a bug) stops the
run with its traceback. Output is a resumable append-only jsonl
(dspark_kit.jsonl_sink, fsync'ed every `fsync_every` rows, at most once a second); `resume` cuts a
partial last line and skips every idx present. Rows that exhaust their retries
go to `<outfile>.errors.jsonl`; a resume retries them and drops the entries of
rows that succeed. The source is checked before any output is touched, and an
existing output is only emptied with `overwrite`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark_kit.data import mode_rule
from dspark_kit.data.conversations import canonical_reasoning, split_reasoning, to_sharegpt
from dspark_kit.data.lengths import replies_cut
from dspark_kit.data.reasoning_formats import NONE, ReasoningFormat
from dspark_kit.engines import api_key_from_env
from dspark_kit.engines import openai_base_url as normalize_endpoint
from dspark_kit.engines.chat_client import (
    ChatClient,
    ClientOptions,
    Endpoint,
    EndpointDead,
    EndpointDown,
    RequestFailed,
    backoff,
    chat_with_retries,
    discover_model,
)
from dspark_kit.jsonl_sink import JsonlSink, compact_by_key, keys_in, open_for_resume
from dspark_kit.progress import STANDALONE, Reporter
from dspark_kit.recipe.mixture import TEMPERATURE, THINKING, choose
from dspark_kit.resolved import Resolved
from dspark_kit.rundir import regen_engine_log, regen_errors_file
from dspark_kit.stages.dataset.regen_summary import (
    failure_verdict,
    mode_line,
    tools_line,
    truncated_line,
)
from dspark_kit.stages.dataset.regen_turns import reshaped
from dspark_kit.stages.plan import Process, StagePlan

if TYPE_CHECKING:
    from dspark_kit.engines import ServerPlan


@dataclass
class RegenOptions(ClientOptions):
    max_tokens: int = 8192
    temperature: float | dict[float, float] = 0.0  # a mixture: each row's drawn by recipe.mixture.choose
    top_p: float = 1.0
    seed: int | None = 42
    thinking: bool | dict[bool, float] = False  # likewise
    model: str | None = None
    fsync_every: int = 32
    reasoning: ReasoningFormat = NONE  # the verifier's reasoning format (data/reasoning_formats.py)


def _row_idx(row: dict[str, Any]) -> int:
    return row["metadata"]["idx"]


def _error_idx(entry: dict[str, Any]) -> int:
    return entry["idx"]


# ---- one request, one conversation ------------------------------------------


TOOL_RESULT_MISSING = "the verifier called a tool the dataset has no result for (row cut after the call)"
TOOL_RESULT_OTHER = "the verifier called another tool than the dataset's result answers (row cut after the call)"


def _sent(m: dict[str, Any]) -> dict[str, Any]:
    """A history message as the server gets it: role, content and the tool fields."""
    return {k: m[k] for k in ("role", "content", "tool_calls", "tool_call_id", "name") if k in m}


async def regenerate(ep: Endpoint, client, idx: int, messages: list[dict], opts: RegenOptions,
                     peers: list[Endpoint] | None = None, tools: list[dict] | None = None) -> dict[str, Any]:
    """The output row for one conversation.

    Tool calling: the request carries the row's `tools`; a reply's `tool_calls` are kept as the
    verifier made them, and each call gets the dataset's next tool result of that turn (spliced in
    under the new call's id; a tool turn is never invented), then the verifier goes on, until it
    answers in text. A call the dataset has no result for (or one for another tool, when the
    result names its tool) ends the row after that call: `metadata.tool_chain` says why.
    Thinking mode and temperature: the row's draw from opts' mixtures (fixed by idx and seed, so a
    resumed run draws the same), recorded in `metadata`."""
    thinking = choose(opts.thinking, opts.seed, THINKING, idx)
    temperature = choose(opts.temperature, opts.seed, TEMPERATURE, idx)
    history: list[dict[str, Any]] = []
    finish: list[str | None] = []
    usage = Counter()

    async def reply() -> dict[str, Any]:
        body = {"model": ep.model, "messages": [_sent(m) for m in history], "max_tokens": opts.max_tokens,
                "temperature": temperature, "top_p": opts.top_p,
                "chat_template_kwargs": {"enable_thinking": thinking},
                "return_token_ids": True}  # the verifier's own tokens: prepare trains exactly these
        if ep.ids_in_logprobs:  # llama-server lists them in logprobs; the top 1 costs a partial sort
            body.update(logprobs=True, top_logprobs=1)
        if tools:
            body["tools"] = tools
        if opts.seed is not None:
            body["seed"] = opts.seed + idx * 1000 + len(finish)
        out = await chat_with_retries(ep, client, body, opts, peers)
        msg = {"role": "assistant", "content": out["text"]}
        reasoning = out["reasoning"]
        if reasoning is None:  # no reasoning parser: split inline markers (an unclosed block stays raw)
            inline, rest, _unclosed = split_reasoning(out["text"])
            if inline is not None:
                reasoning, msg["content"] = inline, rest
        else:  # cut as the verifier's template cuts it (Qwen3's trims newlines; Harmony keeps them)
            reasoning, msg["content"] = canonical_reasoning(reasoning, out["text"], opts.reasoning)
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if out.get("tool_calls"):
            msg["tool_calls"] = out["tool_calls"]
        if out["token_ids"] is not None:
            msg["token_ids"] = out["token_ids"]
        history.append(msg)
        finish.append(out["finish_reason"])
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            usage[k] += int(out["usage"].get(k) or 0)
        return msg

    async def turn(results: list[dict[str, Any]]) -> str | None:
        """The verifier's replies to one dataset turn, its calls answered by the turn's `results`;
        why the row ends here, or None."""
        while calls := (await reply()).get("tool_calls"):
            if len(calls) > len(results):
                return TOOL_RESULT_MISSING
            for call in calls:
                result = results.pop(0)
                if result.get("name") not in (None, call["function"]["name"]):
                    return TOOL_RESULT_OTHER
                spliced = {"role": "tool", "content": result["content"], "name": call["function"]["name"]}
                history.append({**spliced, **({"tool_call_id": call["id"]} if "id" in call else {})})
        return None

    wants_reply, results, cut, unused = False, [], None, 0
    for m in messages:
        if m["role"] == "assistant":
            wants_reply = wants_reply or bool(history)  # one new reply (or call chain) where the original had one
        elif m["role"] == "tool":
            results.append(m)
        else:
            if wants_reply and (cut := await turn(results)):
                break
            unused += len(results) if wants_reply else 0
            wants_reply, results = False, []
            history.append({"role": m["role"], "content": m["content"]})
    else:
        if wants_reply or history[-1]["role"] == "user":  # the source may end on a question: answer it too
            cut = await turn(results)
            unused += len(results) if not cut else 0
    meta = {"idx": idx, "finish_reasons": finish, "usage": dict(usage),
            "endpoint": ep.url, "model": ep.model, "thinking": thinking, "temperature": temperature,
            # the one decision on replies vs thinking mode (data/mode_rule.py): later stages read it
            mode_rule.RECORD: mode_rule.decide(history, thinking, opts.reasoning)}
    if tools:
        # the verifier's own calls in this row (every assistant turn in history is its reply)
        meta["tool_calls"] = sum(len(m.get("tool_calls") or ()) for m in history if m["role"] == "assistant")
    if cut:
        meta["tool_chain"] = cut
    if unused:  # the verifier answered without the calls the dataset's results were for
        meta["tool_results_unused"] = unused
    row = {"id": f"regen-{idx}", "conversations": to_sharegpt(history), "metadata": meta}
    return {**row, "tools": tools} if tools else row


# ---- the run -----------------------------------------------------------------


@dataclass
class _Run:
    opts: RegenOptions
    endpoints: list[Endpoint]
    sink: JsonlSink
    errors: JsonlSink
    on_row: Callable[[dict[str, Any]], None] | None
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(maxsize=4096))
    fed_all: asyncio.Event = field(default_factory=asyncio.Event)  # every row finished: stop backing off
    written: int = 0
    failed: int = 0
    completion_tokens: int = 0
    retrying: set = field(default_factory=set)  # idx the errors file names (earlier runs' failures)
    succeeded: set = field(default_factory=set)  # of those, idx written this run (not every row: 200k idx add up)
    fail_reasons: Counter = field(default_factory=Counter)
    tool_chains_cut: Counter = field(default_factory=Counter)  # reason -> rows written up to a call without its result
    tools: Counter = field(default_factory=Counter)  # rows with tools, the verifier's calls, rows answered without calls
    stopping: bool = False  # a worker raised: the others are being cancelled

    def live(self) -> list[Endpoint]:
        return [e for e in self.endpoints if not e.dead_reason]

    def fail(self, idx: int, ep: Endpoint, reason: str) -> None:
        self.failed += 1
        self.fail_reasons[reason] += 1
        ep.errors += 1
        self.errors.write({"idx": idx, "endpoint": ep.url, "reason": reason, "time": time.time()})
        if self.on_row:
            self.on_row({"idx": idx, "error": reason, "endpoint": ep.url})

    async def worker(self, ep: Endpoint, client: ChatClient) -> None:
        while not ep.dead_reason:
            item = await self.queue.get()
            if item is None:
                self.queue.task_done()
                return
            idx, messages, tools = item
            try:
                row = await regenerate(ep, client, idx, messages, self.opts, self.endpoints, tools)
            except EndpointDown:
                await self.queue.put(item)  # a live endpoint takes it while this one backs off
                self.queue.task_done()
                try:
                    await asyncio.wait_for(self.fed_all.wait(), backoff(self.opts, ep.refused_in_a_row - 1))
                except TimeoutError:
                    pass
                continue
            except EndpointDead as e:
                if self.live():
                    await self.queue.put(item)  # another endpoint takes it
                else:
                    self.fail(idx, ep, f"no live endpoint left ({e})")
            except RequestFailed as e:  # HTTP, transport or an unparsable reply; anything else is a bug
                self.fail(idx, ep, e.reason)
            else:
                self.sink.write(row)
                self.written += 1
                meta = row["metadata"]
                if meta.get("tool_chain"):
                    self.tool_chains_cut[meta["tool_chain"]] += 1
                if "tool_calls" in meta:
                    self.tools.update(rows=1, verifier_calls=meta["tool_calls"],
                                      rows_results_unused=bool(meta.get("tool_results_unused")))
                if idx in self.retrying:
                    self.succeeded.add(idx)
                ep.rows += 1
                self.completion_tokens += row["metadata"]["usage"].get("completion_tokens", 0)
                if self.on_row:
                    self.on_row(row)
            self.queue.task_done()


async def regen_rows(rows, endpoints: list[str], outfile: Path, opts: RegenOptions,
                     done: set[int], on_row=None) -> dict[str, Any]:
    """Regenerate `rows` ((idx, messages) or (idx, messages, tools) iterable) over `endpoints` into outfile."""
    eps = [Endpoint(normalize_endpoint(u), model=opts.model) for u in endpoints]
    errors_file = regen_errors_file(outfile)
    run = _Run(opts, eps, JsonlSink(outfile, opts.fsync_every), JsonlSink(errors_file, 1), on_row,
               retrying=keys_in(errors_file, _error_idx))
    skipped_done = queued = 0
    clients = {ep.url: ChatClient(ep.url, concurrency=opts.concurrency, timeout=opts.timeout, api_key=opts.api_key)
               for ep in eps}
    try:
        await asyncio.gather(*(discover_model(ep, clients[ep.url], opts) for ep in eps))
        workers = [asyncio.create_task(run.worker(ep, clients[ep.url]))
                   for ep in run.live() for _ in range(opts.concurrency)]

        async def feed() -> None:
            nonlocal skipped_done, queued
            try:
                for idx, messages, *tools in rows:
                    if idx in done:
                        skipped_done += 1
                        continue
                    queued += 1
                    await run.queue.put((idx, messages, tools[0] if tools else None))
                await run.queue.join()  # requeued rows included
            finally:  # also when reading the source fails: workers must not wait forever
                run.fed_all.set()
                for _ in workers if not run.stopping else ():
                    await run.queue.put(None)

        feeder = asyncio.create_task(feed())
        try:
            await asyncio.gather(*workers)  # ends on sentinels, or when every endpoint died
        except BaseException:  # a bug (or Ctrl-C): stop every task before the files close
            run.stopping = True
            for task in [*workers, feeder]:
                task.cancel()
            await asyncio.gather(*workers, feeder, return_exceptions=True)
            raise
        if feeder.done() and feeder.exception():
            raise feeder.exception()
        feeder.cancel()
        # rows the source still holds when every endpoint is gone: never sent anywhere
        unread = sum(1 for idx, *_ in rows if idx not in done) if not run.live() else 0
    finally:
        run.sink.close()
        run.errors.close()
        for client in clients.values():
            await client.close()
    compact_by_key(errors_file, (done & run.retrying) | run.succeeded, _error_idx)
    return {
        "written": run.written, "failed": run.failed,
        "not_attempted": queued - run.written - run.failed + unread,
        "source_rows": skipped_done + queued + unread,
        "failed_reasons": dict(run.fail_reasons.most_common()), "skipped_already_done": skipped_done,
        "tool_chains_cut": dict(run.tool_chains_cut.most_common()),
        "tools": {k: run.tools[k] for k in ("rows", "verifier_calls", "rows_results_unused")},
        "completion_tokens": run.completion_tokens,
        "endpoints": [{"url": e.url, "model": e.model, "rows": e.rows, "errors": e.errors,
                       "dead": e.dead_reason} for e in eps],
        "all_endpoints_dead": not run.live(),
    }


class OutputExists(ValueError):
    """--no-resume on an output that holds rows, without --overwrite."""


class RowProgress:
    """run_regen's `on_row` for a progress bar (dspark_kit.progress): advances it one row per row
    done (written or failed) and describes rows/min, completion tokens/s, errors and rows per endpoint."""

    def __init__(self, bar: Any, label: str = "regen", clock: Callable[[], float] = time.monotonic):
        self.bar, self.label, self.clock = bar, label, clock
        self.t0, self.rows, self.errors, self.tokens = clock(), 0, 0, 0
        self.per_endpoint: Counter = Counter()

    def stats(self) -> str:
        dt = max(self.clock() - self.t0, 1e-6)
        eps = " ".join(f"{k}:{v}" for k, v in self.per_endpoint.items())
        return f"{self.rows / dt * 60:.0f} rows/min {self.tokens / dt:.0f} tok/s err {self.errors} | {eps}"

    def __call__(self, row: dict[str, Any]) -> None:
        if "error" in row:
            self.errors += 1
        else:
            self.rows += 1
            self.tokens += row["metadata"]["usage"].get("completion_tokens", 0)
            self.per_endpoint[row["metadata"]["endpoint"].split("//")[-1]] += 1
        self.bar.describe(f"{self.label} {self.stats()}")
        self.bar.advance()


def run_regen(res: Resolved, outfile: str | Path, endpoints: list[str] | None = None,
              limit: int | None = None, resume: bool = True, overwrite: bool = False, dataset: str | None = None,
              model: str | None = None, concurrency: int | None = None, max_tokens: int | None = None,
              temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
              api_key: str | None = None, on_row: Callable[[dict[str, Any]], None] | None = None,
              engine_log: str | Path | None = None, server_plan: ServerPlan | None = None,
              **opt_overrides: Any) -> dict[str, Any]:
    """Regenerate recipe.data into outfile; returns a JSON-able summary.

    Endpoints: the argument, else recipe.regen.endpoints, else the recipe engine's chat server
    (`server_plan`: the stage plan's; else planned here) started for the run and stopped after it.
    The source is read (and a bad one reported) before the output is touched; resume=False on
    an output that holds rows needs overwrite=True.
    """
    from dspark_kit.data.sources import iter_chats

    recipe = res.recipe
    cfg = recipe.regen
    data = recipe.data.model_copy(update={"source": dataset}) if dataset else recipe.data
    opts = RegenOptions(
        concurrency=concurrency or cfg.concurrency, max_tokens=max_tokens or cfg.max_tokens,
        temperature=cfg.temperature if temperature is None else temperature,
        top_p=cfg.top_p if top_p is None else top_p, seed=cfg.seed if seed is None else seed,
        thinking=recipe.verifier.thinking, model=model, timeout=cfg.request_timeout, reasoning=res.reasoning_format,
        max_retries=cfg.max_retries, api_key=api_key or api_key_from_env(),
        **{"unavailable_timeout": cfg.unavailable_timeout, **opt_overrides})
    outfile = Path(outfile)
    errors_file = regen_errors_file(outfile)
    skipped: Counter = Counter()
    changed: Counter = Counter()
    dropped: list[dict[str, Any]] = []  # source rows no request can be made of: into the errors file, by line
    source = iter_chats(data, skipped=skipped, limit=limit, changed=changed,
                        on_drop=lambda idx, where, reason: dropped.append({"idx": idx, "where": where,
                                                                           "reason": reason, "source_row": True}),
                        drop_repeated_prompts=cfg.repeated_prompts == "drop")
    first = next(source, None)  # a missing file / unknown preset fails here: before any output is touched

    def counted(read):  # every row read, as the source's own changes are: done, sent or not attempted
        for item in read:
            changed.update(reshaped(item[1]))
            yield item

    rows = counted(itertools.chain([first] if first else [], source))
    if not resume and not overwrite and outfile.exists() and outfile.stat().st_size:
        raise OutputExists(f"{outfile} already holds rows: resume (the default) continues it, "
                           "--overwrite starts it over")
    done, repair = open_for_resume(outfile, resume, _row_idx)
    if not resume:
        errors_file.unlink(missing_ok=True)
    t0 = time.time()
    endpoints = list(endpoints or cfg.endpoints)
    server = None
    if not endpoints:
        from dspark_kit.engines.lifecycle import ManagedServer
        from dspark_kit.engines.servers import start_checks
        from dspark_kit.stages.server_plan import regen_server_plan

        plan = server_plan or regen_server_plan(res, api_key=opts.api_key)
        start_checks(plan)
        server = ManagedServer(plan, Path(engine_log or regen_engine_log(outfile)))
        server.start()
        endpoints = [plan.base_url]
    try:
        if server is not None:
            server.wait_healthy(recipe.serve.startup_timeout)
        summary = asyncio.run(regen_rows(rows, endpoints, outfile, opts, done, on_row))
    finally:
        if server is not None:
            server.stop()
    elapsed = time.time() - t0
    from dspark_kit.jsonl import read_jsonl

    # judged over the whole output: a resumed run counts the rows earlier runs wrote
    summary["mode"] = mode_rule.counts_of(read_jsonl(outfile) if outfile.exists() else (), opts.reasoning).as_dict()
    cut, replies, looping = replies_cut(read_jsonl(outfile) if outfile.exists() else ())
    summary["truncated"] = {"replies": cut, "of": replies, "looping": looping, "max_tokens": opts.max_tokens,
                            "kept": recipe.data.keep_truncated}
    summary["source_rows"] += sum(skipped.values())  # every row read: done, written, failed, not attempted or unusable
    listed = keys_in(errors_file, _error_idx) if dropped else set()
    if new := [d for d in dropped if d["idx"] not in listed]:  # once per row, also over resumes
        with errors_file.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps({**d, "time": time.time()}, ensure_ascii=False) + "\n" for d in new)
    summary["changed_rows"] = dict(changed.most_common())
    summary.update({
        "outfile": str(outfile), "errors_file": str(errors_file),
        "already_done": len(done), "resume_repair": repair, "skipped_rows": dict(skipped.most_common()),
        "elapsed_s": round(elapsed, 2), "rows_per_min": round(summary["written"] / elapsed * 60, 1),
        "tokens_per_s": round(summary["completion_tokens"] / elapsed, 1),
        "local_engine": server is not None,
    })
    return summary


def regen_plan(res: Resolved, endpoints: list[str] | None = None, outfile: Path | None = None,
               api_key: str | None = None) -> StagePlan:
    """What regen will do: the endpoints (N servers on M machines) into one resumable output, or the
    recipe engine's chat server it starts when there is none (the run starts exactly that one)."""
    from urllib.parse import urlparse

    from dspark_kit.stages.server_plan import regen_engine, regen_server_plan, server_plan

    recipe = res.recipe
    outfile = Path(outfile or res.run.regen_jsonl)
    endpoints = list(endpoints or recipe.regen.endpoints)
    urls = [urlparse(e if "//" in e else f"http://{e}") for e in endpoints]
    machines = sorted({u.hostname or e for u, e in zip(urls, endpoints, strict=True)})
    processes = [] if endpoints else [Process("chat server", regen_server_plan(res, api_key=api_key))]
    engine = [f"# chat server on engine {regen_engine(res)[0]} ({regen_engine(res)[1]})"] if processes else []
    lines = [*engine, processes[0].launch.shell_line()] if processes else [
        (f"# {len(endpoints)} server(s) on {len(machines)} machine(s) ({', '.join(machines)}): one client here "
         f"spreads rows over all of them ({recipe.regen.concurrency} in flight each) into one output {outfile}; "
         "--resume (default) skips rows already written and retries failed ones, a server that keeps refusing "
         "is dropped and its rows go to the others")]
    if endpoints and res.engine != "local":  # servers other machines send requests to: 0.0.0.0, the endpoint's port
        lines.append("# start on each server machine (same verifier and thinking mode everywhere; each on its "
                     "endpoint's port):")
        crowded = sorted(m for m in machines if sum(u.hostname == m for u in urls) > 1)
        if crowded:
            lines.append(f"# {', '.join(crowded)}: more than one server on a machine; give each its own "
                         "devices (serve.devices differs per server, e.g. --set serve.devices=[0,1])")
        for u, e in zip(urls, endpoints, strict=True):
            port = u.port or recipe.serve.port
            lines.append(f"#   {u.hostname or e}: {server_plan(res, 'chat', port=port, host='0.0.0.0').shell_line()}")
    lines += [f"endpoint {e}" for e in endpoints]
    from dspark_kit.resolved.prepare_input import missing_source

    lines += [w for w in (missing_source(res),) if w]  # planned all the same: the dry run says it fails
    plan = StagePlan.of(res, "regen", lines, processes, inputs={"data.source": recipe.data.source},
                        outputs={"regen": str(outfile), "errors": str(regen_errors_file(outfile))})
    plan.details.update(endpoints=endpoints, machines=machines, concurrency_per_endpoint=recipe.regen.concurrency,
                        engine=regen_engine(res)[0] if processes else None)
    return plan


# ---- `dspark-kit regen`: the stage with the command's options --------------------


def command_plan(res: Resolved, endpoints: list[str] | None = None, outfile: Path | None = None) -> StagePlan:
    """The plan `dspark-kit regen` runs (and prints with --dry-run): the stage's, with the command's
    endpoints and output; the API key from the environment, as the run takes it."""
    return regen_plan(res, endpoints, outfile or res.run.regen_jsonl, api_key=api_key_from_env())


def rows_to_regen(res: Resolved, limit: int | None = None, outfile: Path | None = None,
                  resume: bool = True) -> int | None:
    """How many rows a regen has left to do (a progress bar's total, so its rate and ETA are this
    run's): --limit, else data.limit (None: unknown), less the rows a resumed output already holds."""
    total = limit or res.recipe.data.limit
    if total is None or not resume or outfile is None or not Path(outfile).exists():
        return total
    return max(total - sum(1 for k in keys_in(Path(outfile), _row_idx) if k < total), 0)


def as_the_stage(res: Resolved, outfile: Path | None, resume: bool, options: dict[str, Any]) -> bool:
    """Whether `dspark-kit regen` ran exactly the stage `run` would (its output, resuming, no option
    that changes the rows): only then does it count as the regen stage done."""
    return (outfile is None or Path(outfile).resolve() == res.run.regen_jsonl) and resume and \
        not any(v is not None for v in options.values())


def run_command(res: Resolved, plan: StagePlan, *, outfile: Path | None = None, endpoints: list[str] | None = None,
                on_row: Callable[[dict[str, Any]], None] | None = None, **options: Any) -> dict[str, Any]:
    """`dspark-kit regen`: record the plan, run it with the command's options (run_regen's), then judge
    the result: the summary, with "verdict" (None: within regen.max_failed_fraction and
    data.max_mode_mismatch_fraction; else why the regen failed as a whole)."""
    plan.record(res.run.plan_file("regen"))
    chat = plan.process("chat server")
    t0 = time.time()
    s = run_regen(res, outfile or res.run.regen_jsonl, endpoints=endpoints, on_row=on_row,
                  server_plan=chat.server if chat else None, **options)
    s["command_seconds"] = round(time.time() - t0, 1)
    s["verdict"] = failure_verdict(s, res.recipe.regen.max_failed_fraction, res.recipe.data.max_mode_mismatch_fraction)
    return s


# ---- the stage ---------------------------------------------------------------


def plan(res: Resolved) -> StagePlan:
    """The chat server(s) regen starts (or the recipe's endpoints), the rows and the output."""
    if not res.recipe.regen.enabled:
        return StagePlan.of(res, "regen", ["# regen disabled (regen.enabled: false)"])
    # the key a run would take from the environment, so the dry run shows the same (masked) env
    return regen_plan(res, outfile=res.run.regen_jsonl, api_key=api_key_from_env())


def run(res: Resolved, plan: StagePlan, reporter: Reporter = STANDALONE) -> dict:
    """Regenerate into DIR/regen.jsonl (resuming), then judge the failures against the budgets."""
    note = reporter.note
    chat = plan.process("chat server")
    with reporter.bar("regen", total=rows_to_regen(res, outfile=res.run.regen_jsonl), unit="row") as bar:
        s = run_regen(res, res.run.regen_jsonl, resume=True, on_row=lambda _row: bar.advance(),
                      engine_log=res.run.server_log("chat"), server_plan=chat.server if chat else None)
    s["engine"] = plan.details.get("engine")
    note(f"regen: {s['written']} written, {s['failed']} failed, {s['not_attempted']} not attempted, "
         f"{s['skipped_already_done']} already done, {sum(s['skipped_rows'].values())} not sent "
         f"of {s['source_rows']} source rows" + (f" (engine {s['engine']})" if s["engine"] else ""))
    for reason, n in {**s["failed_reasons"], **s["skipped_rows"]}.items():
        note(f"  {n}: {reason}")
    for reason, n in s["changed_rows"].items():
        note(f"  changed {n}: {reason}")
    if s["failed_reasons"] or s["skipped_rows"]:
        note(f"  each row, with its line: {s['errors_file']}")
    for line in (tools_line(s), mode_line(s), truncated_line(s)):
        if line:
            note(f"  {line}")
    verdict = failure_verdict(s, res.recipe.regen.max_failed_fraction, res.recipe.data.max_mode_mismatch_fraction)
    if verdict:
        raise RuntimeError(verdict)
    return s
