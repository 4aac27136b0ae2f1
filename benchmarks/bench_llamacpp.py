"""Served speedup on llama.cpp: generated tokens/s with the kit's DSpark draft vs the same server without it.

    .venv/bin/python benchmarks/bench_llamacpp.py --checkpoint CKPT --verifier HF_DIR [--verifier-gguf FILE]
        [--prompts 8] [--max-new 96] [--rounds 2] [--json out.json]
    .venv/bin/python benchmarks/bench_llamacpp.py --workdir RUN --verifier HF_DIR ...   (RUN/checkpoints/checkpoint_best)
    .venv/bin/python benchmarks/bench_llamacpp.py [--rows 96]   (`make bench-perf`: trains the SmolLM2 draft first)

Without a checkpoint it trains one: recipes/smollm2-135m-cpu.yaml, regen on llama-server
(serve.engine and regen.engine llama.cpp), `--rows` rows, stages regen..train.

llama-server (`make llama-cpp`) serves the verifier's GGUF alone and with the draft
(`dspark-kit export --layout gguf`), one server per setting, all up at once (an idle llama-server
costs no CPU), and the settings are measured interleaved round by round on the same prompts, so
a busy machine slows all of them alike. Settings: the verifier alone; the draft at K = 1 .. the
block size; at K = block with `--spec-draft-p-min 0.5` (the confidence cut-off); greedy and
temperature 1 (alone and K = block). Acceptance is llama.cpp's own counters (/metrics). Also the
acceptance served against the verifier's own Q4_1 GGUF and against an F16 GGUF converted by
llama.cpp from the HF folder (the draft was trained on the dequantized model). Throughput is the
server's own generation time (`timings.predicted_ms`), one stream, all cores.

The ratio goal (>= 1.5x the verifier alone, SmolLM2 greedy, one stream) depends on the draft's
acceptance: the figure is what this draft gives, reported as measured.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from common import Row, cli, emit, this_command

from dspark_kit.engines.lifecycle import ManagedServer
from dspark_kit.engines.llamacpp import LlamaCppServe, plan_llamacpp
from dspark_kit.engines.ports import free_port
from dspark_kit.measure.llamacpp_accept import PromptSet, chat_prompt_ids, served
from dspark_kit.specdec.gguf_export import (
    DRAFT_GGUF,
    VERIFIER_GGUF,
    convert_with_llamacpp,
    export_gguf,
)

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a binary search does, step by step.",
    "Give three tips for staying focused while studying.",
    "What is photosynthesis? Explain it simply.",
    "List the planets of the solar system in order.",
    "How do I make a cup of tea?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Why is the sky blue?",
    "Write a Python function that reverses a string.",
    "What are the benefits of regular exercise?",
    "Describe a cat to someone who has never seen one.",
]
GOAL = 1.5
CONF_MIN = 0.5


THREADS: list[int | None] = [None]


def start(stack: ExitStack, logs: Path, name: str, **kw) -> str:
    p = LlamaCppServe(host="127.0.0.1", port=free_port("127.0.0.1"), served_name=name, parallel=1, seed=0,
                      threads=THREADS[0], ctx_size=2048, **kw)
    srv = stack.enter_context(ManagedServer(plan_llamacpp(p), logs / f"{name}.log"))
    srv.wait_healthy(600)
    return srv.base_url


def main() -> int:
    ap = cli(__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--workdir", type=Path, help="a trained run: its checkpoints/checkpoint_best")
    ap.add_argument("--verifier", type=Path, help="the verifier's HF folder (default: the SmolLM2 recipe's)")
    ap.add_argument("--rows", type=int, default=96, help="rows to train on when no checkpoint is given")
    ap.add_argument("--verifier-gguf", type=Path, help="the verifier's own GGUF (e.g. SmolLM2's Q4_1)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--keep", type=Path, help="keep the GGUF files and server logs here")
    ap.add_argument("--threads", type=int, help="llama-server -t/-td (default: the CPUs this process may use; "
                                                "on a machine other work shares, 1 is often faster)")
    args = ap.parse_args()
    THREADS[0] = args.threads
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-llamacpp-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.checkpoint is None and args.workdir is None:
        args.workdir, args.verifier, args.verifier_gguf = train_smollm2(work / "run", args.rows, args.threads)
    ckpt = args.checkpoint or (args.workdir / "checkpoints" / "checkpoint_best")
    if args.verifier is None:
        raise SystemExit("--verifier: the verifier's HF folder (with --checkpoint or --workdir)")
    gguf = work / "gguf"
    if not (gguf / DRAFT_GGUF).exists():
        export_gguf(ckpt, gguf, args.verifier, args.verifier_gguf)
    f16 = work / "verifier-f16.gguf"
    if args.verifier_gguf is not None and not f16.exists():
        convert_with_llamacpp(args.verifier.resolve(), None, f16, "f16", work / "convert-f16.log")
    block = json.loads((ckpt / "config.json").read_text())["block_size"]
    target, draft = str(gguf / VERIFIER_GGUF), str(gguf / DRAFT_GGUF)
    prompts = PromptSet(chat_prompt_ids(args.verifier, QUESTIONS[: args.prompts]), args.max_new)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    settings: dict[str, tuple[str, float]] = {}  # name -> (server, temperature)
    with ExitStack() as stack:
        alone = start(stack, logs, "alone", role="chat", verifier_gguf=target)
        settings["verifier alone, greedy"] = (alone, 0.0)
        settings["verifier alone, T=1"] = (alone, 1.0)
        for k in range(1, block + 1):
            url = start(stack, logs, f"k{k}", role="spec", verifier_gguf=target, draft_gguf=draft, k=k)
            settings[f"draft K={k}, greedy"] = (url, 0.0)
            if k == block:
                settings[f"draft K={k}, T=1"] = (url, 1.0)
        settings[f"draft K={block} p-min {CONF_MIN} (confidence cut-off), greedy"] = (
            start(stack, logs, "conf", role="spec", verifier_gguf=target, draft_gguf=draft, k=block,
                  conf_min=CONF_MIN), 0.0)
        if args.verifier_gguf is not None:
            settings[f"draft K={block} on the F16 target, greedy"] = (
                start(stack, logs, "f16", role="spec", verifier_gguf=str(f16), draft_gguf=draft, k=block), 0.0)
            settings["F16 verifier alone, greedy"] = (start(stack, logs, "f16-alone", role="chat",
                                                            verifier_gguf=str(f16)), 0.0)
        results: dict[str, list[dict]] = {name: [] for name in settings}
        for r in range(args.rounds):  # interleaved: every setting once per round
            for name, (url, temp) in settings.items():
                out = served(url, prompts, temperature=temp, seed=1000 * r)
                out.pop("tokens")
                results[name].append(out)
                al = (out["acceptance"] or {}).get("acceptance_length")
                print(f"round {r} {name}: {out['tokens_per_s']:.1f} tok/s, AL {al}", file=sys.stderr, flush=True)
    rows = table_rows(results, block)
    (work / "results.json").write_text(json.dumps(results, indent=1))
    emit(rows, args.json, this_command("bench_llamacpp.py", f"--checkpoint {ckpt} --verifier {args.verifier}"
                                       + (f" --verifier-gguf {args.verifier_gguf}" if args.verifier_gguf else "")
                                       + (f" --threads {args.threads}" if args.threads else "")))
    return 0


def train_smollm2(wd: Path, rows: int, threads: int | None) -> tuple[Path, Path, Path]:
    """A SmolLM2 draft trained on `rows` rows regenerated by llama-server: (workdir, HF folder, its GGUF)."""
    import subprocess

    from common import REPO

    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved

    recipe = REPO / "recipes" / "smollm2-135m-cpu.yaml"
    sets = ["serve.engine=llama.cpp", "regen.engine=llama.cpp", f"data.limit={rows}"]
    sets += [f"serve.cpu_threads={threads}"] if threads else []
    argv = [sys.executable, "-m", "dspark_kit", "run", str(recipe), "-w", str(wd), "--stages",
            "regen,prepare,hidden-states,train", *(x for s in sets for x in ("--set", s))]
    print("training: " + " ".join(argv), file=sys.stderr, flush=True)
    subprocess.run(argv, check=True, cwd=REPO)
    res = Resolved(load_recipe(recipe, sets), wd)
    return wd, Path(res.verifier_path), Path(res.verifier_gguf)


def _tps(runs: list[dict]) -> float:
    return statistics.median(r["tokens_per_s"] for r in runs if r["tokens_per_s"])


def _al(runs: list[dict]) -> float | None:
    acc = [r["acceptance"] for r in runs if r["acceptance"]]
    if not acc:
        return None
    return 1 + sum(a["num_accepted_tokens"] for a in acc) / sum(a["num_drafts"] for a in acc)


def table_rows(results: dict[str, list[dict]], block: int) -> list[Row]:
    rows = []
    base = {0.0: _tps(results["verifier alone, greedy"]), 1.0: _tps(results["verifier alone, T=1"])}
    for name, runs in results.items():
        tps, al = _tps(runs), _al(runs)
        if name.startswith(("verifier alone", "F16 verifier alone")):
            rows.append(Row("llama.cpp", f"{name}: generated tokens/s", tps, "tok/s", notes="SmolLM2, one stream"))
            continue
        if "F16" in name:
            f16 = _tps(results["F16 verifier alone, greedy"])
            rows.append(Row("llama.cpp", f"{name}: acceptance length (Q4_1 target: see K={block}, greedy)", al,
                            notes=f"{tps:.1f} tok/s vs F16 alone {f16:.1f} ({tps / f16:.2f}x)"))
            continue
        temp = 1.0 if "T=1" in name else 0.0
        ratio = tps / base[temp]
        greedy_full = name == f"draft K={block}, greedy"
        rows.append(Row("llama.cpp", f"{name}: tokens/s over the verifier alone", ratio, "x",
                        goal=f">= {GOAL}x" if greedy_full else "", met=(ratio >= GOAL) if greedy_full else None,
                        notes=f"{tps:.1f} vs {base[temp]:.1f} tok/s; acceptance length {al:.3f}" if al else
                        f"{tps:.1f} vs {base[temp]:.1f} tok/s"))
    return rows


if __name__ == "__main__":
    sys.exit(main())
