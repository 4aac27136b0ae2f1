"""Offline autoregressive acceptance: `dspark-kit eval` and `dspark-kit window tune`.

Runs the reference decoder (lossless: greedy, or speculative sampling at eval.temperature, each
request seeded by its index) over eval prompts and reports
what a vLLM server's /metrics would: acceptance length = 1 + accepted/drafts,
per-position acceptance accepted_per_pos[i]/drafts, plus tokens per verifier
forward and wall time. Long contexts are built by prepending whole earlier
conversations (a multi-turn chat) until the prompt reaches the asked length,
which is where a draft trained on short sequences loses acceptance and a draft
KV window can win it back (docs/CONCEPTS.md#long-context, docs/CONCEPTS.md#dspark-at-inference).
"""

from __future__ import annotations

from pathlib import Path

from dspark_kit.data.chat import stop_token_ids
from dspark_kit.measure.eval_prompts import (
    EvalError,
    build_prompts,
    check_prompts_file,
    eval_sizes,
    load_eval_prompts,
    plan_line,
)
from dspark_kit.measure.served_gate import checkpoint_identity
from dspark_kit.progress import STANDALONE, Reporter
from dspark_kit.resolved import Resolved
from dspark_kit.specdec.checkpoints import ks_outside_slots, slots_error
from dspark_kit.specdec.window import LOCAL_KV_BLOCK_SIZE
from dspark_kit.stages.evaluation.eval_outputs import write_outputs
from dspark_kit.stages.plan import StagePlan
from dspark_kit.stages.prompts import prompt_source
from dspark_kit.stages.server_plan import spec_server_lines

# ---- running ----------------------------------------------------------------


def aggregate(results, k: int) -> dict:
    """vLLM-style acceptance figures summed over a run's requests (specdec.acceptance, as served
    eval and bench compute them), with eval's own throughput figures."""
    from dspark_kit.specdec.acceptance import acceptance

    per_pos = [sum(r.accepted_per_pos[i] for r in results if i < len(r.accepted_per_pos)) for i in range(k)]
    figures = acceptance(sum(r.num_drafts for r in results), sum(r.num_draft_tokens for r in results),
                         sum(r.num_accepted_tokens for r in results), per_pos)
    tokens = sum(len(r.token_ids) for r in results)
    forwards = sum(getattr(r, "verifier_forwards", 0) for r in results)
    return {
        "num_requests": len(results),
        **figures.as_dict(ndigits=4),
        "output_tokens": tokens,
        "verifier_forwards": forwards,
        "tokens_per_verifier_forward": round(tokens / forwards, 4) if forwards else None,
        "wall_s": round(sum(getattr(r, "wall_s", 0.0) for r in results), 3),
    }


class EvalSession:
    """One verifier + draft loaded once, measured under several settings.

    K, the window, the device and the dtype come from the command's `Resolved` (its
    --checkpoint and --draft-window-size included), so eval measures what serving will run
    (unless a sweep asks for another value).
    """

    def __init__(self, res: Resolved, sweep: bool = False):
        """`sweep`: the caller passes K to every measure() (tune), so the resolved K is not needed."""
        if res.eval_fit.value is False:  # before loading (or importing) anything: it would not fit
            raise EvalError(f"eval on {res.eval_device.value}: {res.eval_fit.source}; measure through the "
                            "serving engine instead: `dspark-kit tune --served` (or choose another --eval-device)")
        from transformers import AutoTokenizer

        from dspark_kit.specdec.decoder import Verifier
        from dspark_kit.specdec.draft_model import DSparkDraft

        self.resolved = res
        self.verifier_path = res.verifier_path
        self.checkpoint = res.checkpoint
        device = res.eval_device.value
        self.draft = DSparkDraft.load(self.checkpoint, self.verifier_path, device)
        self.verifier = Verifier(self.verifier_path, self.draft.target_layer_ids, device, res.eval_dtype.value)
        self.tokenizer = AutoTokenizer.from_pretrained(self.verifier_path)
        self.k = self.draft.slots if sweep else self.resolved.k.value
        if ks_outside_slots([self.k], self.draft.slots):
            raise EvalError(f"{slots_error('num_speculative_tokens', [self.k], self.draft.slots)} "
                            f"({self.resolved.k.source}); set serve.num_speculative_tokens: auto")
        self.stop_ids = stop_token_ids(self.tokenizer, self.verifier_path)
        self.temperature = res.recipe.measured_temperature

    def generate(self, prompts: list[list[int]], max_new_tokens: int, window: int | None,
                 confidence_threshold: float | None = None, k: int | None = None) -> list:
        """One SpecResult per prompt (the verifier's reply, greedy or sampled at the session's temperature
        with seed = the prompt's index, and the draft's acceptance counters)."""
        from dspark_kit.specdec.decoder import SpecGenerator

        gen = SpecGenerator(self.verifier, self.draft, k or self.k, window, confidence_threshold, LOCAL_KV_BLOCK_SIZE)
        return [gen.generate(p, max_new_tokens, temperature=self.temperature, seed=i, stop_ids=self.stop_ids)
                for i, p in enumerate(prompts)]

    def measure(self, prompts: list[list[int]], max_new_tokens: int, window: int | None,
                confidence_threshold: float | None = None, k: int | None = None) -> dict:
        return self.figures(self.generate(prompts, max_new_tokens, window, confidence_threshold, k), prompts, window, k)

    def figures(self, results: list, prompts: list[list[int]], window: int | None, k: int | None = None) -> dict:
        k = k or self.k
        out = aggregate(results, k)
        out["window"] = window
        out["num_speculative_tokens"] = k
        out["mean_prompt_tokens"] = round(sum(map(len, prompts)) / len(prompts), 1)
        return out


BUDGET_THRESHOLDS = (0.3, 0.5, 0.7)  # confidence cut-offs measured beside the fixed K


def verify_budget(session: EvalSession, prompts: list[list[int]], max_new_tokens: int, window: int | None,
                  k: int, thresholds: tuple[float, ...] = BUDGET_THRESHOLDS, fixed: dict | None = None) -> dict | None:
    """What sizing the verify budget from the confidence head gives against a fixed K, offline:
    acceptance length and draft tokens verified per step, per threshold (a slot below the threshold
    ends the block, as vLLM's adaptive verification and vllm-ascend's dynamic speculation drop
    low-confidence slots). None when the draft has no confidence head. `fixed`: the caller's own
    measure() of these prompts, window and K without a threshold, so it is not decoded twice."""
    if session.draft.model.confidence_head is None:
        return None

    def row(m: dict) -> dict:
        return {key: m[key] for key in ("acceptance_length", "mean_verified_per_step", "tokens_per_verifier_forward",
                                        "acceptance_rate")}

    fixed = row(fixed or session.measure(prompts, max_new_tokens, window, None, k))
    return {"k": k, "fixed": fixed,
            "thresholds": [{"threshold": t, **row(session.measure(prompts, max_new_tokens, window, t, k))}
                           for t in thresholds]}


def evaluate_checkpoint(res: Resolved, *, prompts_file: Path | None = None, from_data: bool = False,
             num_prompts: int | None = None, max_new_tokens: int | None = None,
             context_lengths: list[int] | None = None, out_dir: Path | None = None,
             categories: list[str] | None = None, budget_thresholds: tuple[float, ...] = BUDGET_THRESHOLDS,
             log=lambda _msg: None) -> dict:
    """Measure acceptance on held-out prompts (stages.heldout); write eval.json (with the prompts'
    source and ids), eval.md and plots under out_dir (default <workdir>/eval). `categories`
    (default eval.categories): named prompt sets measured one by one, num_prompts each.
    `budget_thresholds`: the confidence cut-offs verify_budget decodes the prompts again at, one
    decode each (empty: the fixed K alone, as a caller comparing two drafts' acceptance needs)."""
    recipe = res.recipe
    sizes = eval_sizes(res.recipe, num_prompts, max_new_tokens, context_lengths)
    num_prompts, max_new, ctx_lens = sizes.num_prompts, sizes.max_new_tokens, sizes.context_lengths
    session = EvalSession(res)
    window = res.window.value
    found = load_eval_prompts(prompt_source(res), session.tokenizer, prompts_file, from_data, limit=max(num_prompts, 16))
    chats = found.chats
    thinking = recipe.measured_thinking
    thr = recipe.eval.confidence_threshold

    short = build_prompts(session.tokenizer, chats, num_prompts, thinking)
    log(f"eval: {len(short)} prompts from {found.source}, K={session.k}, window={window} ({res.window.source}), "
        f"temperature {session.temperature}, {res.eval_device.value} {res.eval_dtype.value}")
    headline = session.measure(short, max_new, window, thr)
    runs = [{"context_length": 0, **headline}]
    if ctx_lens:
        if window is not None:
            runs.append({"context_length": 0, **session.measure(short, max_new, None, thr)})
        for length in ctx_lens:
            prompts = build_prompts(session.tokenizer, chats, num_prompts, thinking, length)
            for w in dict.fromkeys([None, window]):
                log(f"eval: context {length} window {w}")
                runs.append({"context_length": length, **session.measure(prompts, max_new, w, thr)})
    budget = verify_budget(session, short, max_new, window, session.k, thresholds=tuple(budget_thresholds),
                           fixed=headline if thr is None else None)
    per_category = measure_categories(session, res, recipe.eval.categories if categories is None else categories,
                                      num_prompts, max_new, window, thr, log)
    summary = {
        "checkpoint": str(session.checkpoint),
        "verifier": session.verifier_path,
        "num_speculative_tokens": session.k,
        "num_speculative_tokens_source": session.resolved.k.source,
        "max_new_tokens": max_new,
        "temperature": session.temperature,  # the served gate compares only at the same one
        "kv_block_size": LOCAL_KV_BLOCK_SIZE,
        "training_window": recipe.training_window,
        "draft_window_size": window,
        "draft_window_size_source": res.window.source,
        "device": res.eval_device.value,
        "dtype": res.eval_dtype.value,
        "prompts": found.record(num_prompts),
        "checkpoint_identity": checkpoint_identity(session.checkpoint),  # the served gate compares it
        **{k: headline[k] for k in ("acceptance_length", "acceptance_rate", "per_position_acceptance",
                                    "tokens_per_verifier_forward", "wall_s", "num_drafts")},
        "runs": runs,
        "verify_budget": budget,
        "categories": per_category,
    }
    summary["files"] = write_outputs(summary, Path(out_dir) if out_dir else res.run.eval)
    return summary


def measure_categories(session: EvalSession, res: Resolved, specs: list[str], num_prompts: int, max_new: int,
                       window: int | None, thr: float | None, log=lambda _msg: None) -> list[dict]:
    """Acceptance per named prompt set (data.categories), each aggregated as the headline is."""
    from dspark_kit.data.categories import CategoryError, parse_categories
    from dspark_kit.measure.eval_prompts import category_prompts

    try:
        sets = category_prompts(prompt_source(res), parse_categories(specs), num_prompts, session.tokenizer,
                                where="eval.categories / --categories")
    except CategoryError as e:
        raise EvalError(str(e)) from None
    out = []
    thinking = res.recipe.measured_thinking
    for found in sets:
        log(f"eval: category {found.name}: {len(found.chats)} prompts")
        prompts = build_prompts(session.tokenizer, found.chats, len(found.chats), thinking)
        results = session.generate(prompts, max_new, window, thr)
        histories = [list(chat) for chat in found.chats]
        replies = dict(enumerate(results))
        for turn in range(max((len(f) for f in found.follow_ups), default=0)):
            # the user's next turn after the verifier's own reply (the decoder's output is the verifier's, or a
            # sample of the verifier's own distribution at a temperature)
            asked = [i for i in replies if turn < len(found.later_turns(i))]
            for i in asked:
                reply = session.tokenizer.decode(replies[i].token_ids, skip_special_tokens=True)
                histories[i] += [{"role": "assistant", "content": reply},
                                 {"role": "user", "content": found.later_turns(i)[turn]}]
            more = build_prompts(session.tokenizer, [histories[i] for i in asked], len(asked), thinking)
            replies = dict(zip(asked, session.generate(more, max_new, window, thr), strict=True))
            results += list(replies.values())
            prompts += more
        out.append({**found.record(), **session.figures(results, prompts, window)})
    return out


# ---- the stage ---------------------------------------------------------------


def plan(res: Resolved) -> StagePlan:
    """In-process when the verifier fits the eval device, else through the serving engine (Resolved.eval_mode)."""
    t = res.recipe.measured_temperature
    at = "greedy" if t == 0 else f"sampled at temperature {t:g} (eval.temperature)"
    mode, where = res.eval_mode, f"{plan_line(res.recipe)}, {at} -> {res.run.eval}"
    device = f"{res.eval_device.value} ({res.eval_dtype.value})"
    outputs = {"eval": str(res.run.eval_json)}
    if mode.value == "served":  # the server is sized at start for the longest eval prompt (its max_model_len)
        lines, _ = spec_server_lines(res, "eval")
        plan = StagePlan.of(res, "eval", [(f"# served: acceptance through the {res.engine} engine at the bench "
                                           f"concurrency, {where} (why: {mode.source})"), *lines], outputs=outputs)
        plan.details["server"] = "chosen at start: a spec server with room for the longest eval prompt"
        return plan
    if res.eval_fit.value is None:  # cannot tell on this machine: the run decides
        lines, _ = spec_server_lines(res, "eval if served")
        return StagePlan.of(res, "eval", [(f"# decided when it runs: in-process on {device} if the verifier fits "
                                           f"there, else served through the {res.engine} engine (the server below); "
                                           f"{where}; {res.eval_fit.source}"), *lines], outputs=outputs)
    return StagePlan.of(res, "eval", [f"# in-process: offline acceptance on {device}, {where} (why: {mode.source})"],
                        outputs=outputs)


def run(res: Resolved, plan: StagePlan, reporter: Reporter = STANDALONE) -> dict:
    if res.eval_mode.value == "served":
        from dspark_kit.stages.evaluation.served_tune import served_eval

        with reporter.doing("eval", "served: starting the spec server, then timing the eval prompts"):
            s = served_eval(res)
    else:
        with reporter.doing("eval", f"in-process: loading the verifier and draft, then decoding "
                                    f"{eval_sizes(res.recipe).num_prompts} prompts with speculation"):
            s = evaluate_checkpoint(res)
    return {k: s[k] for k in STAGE_SUMMARY}


STAGE_SUMMARY = ("acceptance_length", "per_position_acceptance", "tokens_per_verifier_forward")


def as_the_stage(res: Resolved, options: dict) -> bool:
    """Whether `dspark-kit eval` measured exactly what the eval stage would (no option of its own,
    and in-process, as the stage runs a verifier that fits): only then does it count as eval done."""
    return res.eval_mode.value != "served" and not any(v not in (None, False) for v in options.values())


def checkpoint_plan(res: Resolved, prompts: Path | None, from_data: bool, num_prompts: int | None,
                    max_new_tokens: int | None, lengths: list[int] | None, categories: list[str],
                    out: Path | None) -> StagePlan:
    """The eval stage's plan as this command runs it: always in-process (the pipeline's eval serves a
    verifier too large for the device; this command refuses it), with its prompts, counts and output."""
    device = f"{res.eval_device.value} ({res.eval_dtype.value})"
    if res.eval_fit.value is False:  # what the run says, before it loads anything
        raise EvalError(f"eval on {device}: {res.eval_fit.source}; `eval` would refuse before loading: measure "
                         "through the serving engine (`dspark-kit tune --served`, or `dspark-kit run --stages eval`), "
                         "or choose another --eval-device")
    staged = plan(res)  # the stage's own plan, then this command's choices
    if res.eval_fit.value is None:  # the stage's lines add a server for the case it proves too large: not here
        staged.processes = []
        staged.lines = [(f"# in-process: offline acceptance on {device}; {res.eval_fit.source} (`eval` loads it "
                         "there regardless; the pipeline's eval would serve it if too large)")]
    out_dir = out or res.run.eval
    staged.outputs = {"eval": str(out_dir / "eval.json")}
    staged.inputs = {"checkpoint": str(res.checkpoint), "verifier": res.verifier_path}
    if out is not None:
        staged.lines.append(f"# --out: eval.json, eval.md and the plots go to {out_dir} instead")
    if prompts is not None:  # as the run reads them: --prompts first, then --from-data
        check_prompts_file(prompts)
        staged.inputs["prompts"] = str(prompts)
        staged.lines.append(f"# --prompts: prompts from {prompts} instead")
    elif from_data:
        staged.inputs["prompts"] = res.recipe.data.source
        staged.lines.append(f"# --from-data: prompts from the first rows of {res.recipe.data.source} instead "
                            "(they may be training rows)")
    sizes = eval_sizes(res.recipe, num_prompts, max_new_tokens, lengths)
    n, new, lengths = sizes.num_prompts, sizes.max_new_tokens, sizes.context_lengths
    staged.details.update(num_prompts=n, max_new_tokens=new, context_lengths=lengths, categories=categories)
    staged.lines.append(f"# checkpoint {res.checkpoint}: K {res.k.value}, window {res.window.value} "
                        f"({res.window.source}); {n} prompts, up to {new} new tokens each")
    if lengths:
        staged.lines.append(f"# also at context lengths {', '.join(map(str, lengths))}, with and without the window")
    if categories:
        staged.lines.append(f"# and per category: {', '.join(categories)} ({n} prompts each)")
    return staged
