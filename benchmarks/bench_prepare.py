"""Prepare throughput vs the raw HF tokenizer on the same conversations, and worker scaling.

    .venv/bin/python benchmarks/bench_prepare.py [--conversations 3000] [--json out.json]

Baseline: `tokenizer(apply_chat_template(conv))` of every full conversation (rendered
one by one, encoded in one batched call: the fastest plain use of the HF API).
Ours: dspark_kit.stages.dataset.prepare's tokenize path (normalise, the prefix renders the loss
mask needs, one batched encode per chunk), then the whole `prepare()` (which also
writes speculators' Arrow dataset and token_freq.pt) with 1 and 2 workers.
Throughput is counted in tokens of the full conversations for both sides, so the
ratio compares the time to turn the same input into training rows. Before timing,
the masks are checked against a plain per-prefix reference (tests/prefix_reference.py,
transformers' own render and encode).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from common import REPO, Row, cli, emit, paired_ratios, spread, this_command

sys.path.insert(0, str(REPO / "tests"))
from prefix_reference import reference_rows  # the tests' plain per-prefix rule

GOAL = 0.5


def main() -> None:
    ap = cli(__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=3000)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from dspark_kit.data.tiny_corpus import conversations
    from dspark_kit.data.tiny_verifier import ensure_tiny_verifier
    from dspark_kit.stages.dataset import prepare as P

    vp = str(ensure_tiny_verifier())
    tok = AutoTokenizer.from_pretrained(vp)
    convs = conversations(args.conversations, seed=1, max_turns=3)
    rows = [{"messages": m} for m in convs]

    # same masks as the per-prefix reference (on a subset: the reference is slow by design)
    P._init_worker(vp, False)
    sample = rows[:1000]
    ours = [r for res in P._work((sample, False, 10**9, False, None, "train")) for r in res["rows"]]
    ref = [r for row in sample for r in reference_rows(tok, row["messages"], False)]
    same = [(r["input_ids"], r["loss_mask"]) for r in ours] == ref

    def raw():
        texts = [tok.apply_chat_template(m, tokenize=False) for m in convs]
        return tok(texts, add_special_tokens=False)["input_ids"]

    tokens = sum(map(len, raw()))

    def timed(fn):
        def run() -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return run

    def tokenize_path():
        return [P._work((rows[i : i + 64], False, 10**9, False, None, "train")) for i in range(0, len(rows), 64)]

    pr = paired_ratios(timed(raw), timed(tokenize_path), 3)
    raw_s, ours_s, ratio = pr["baseline_s"], pr["subject_s"], pr["ratio"]
    out = [
        Row("prepare", "raw HF tokenizer", tokens / raw_s, "tok/s", notes=f"{len(convs)} conversations, {tokens:,} tokens"),
        Row("prepare", "dspark-kit tokenize path", tokens / ours_s, "tok/s",
            notes="same conversations; the mask needs 2 renders per assistant turn (prompt, prompt + reply); "
                  "text they share is encoded once"),
        Row("prepare", "tokenize path / raw tokenizer", ratio, "x", f">= {GOAL}x", ratio >= GOAL,
            notes=f"{spread(pr)}; masks identical to the per-prefix reference "
                  f"({len(sample)} conversations): {'yes' if same else 'NO'}"),
    ]
    per_worker = {}
    with tempfile.TemporaryDirectory() as d:
        for workers in (1, 2):
            t0 = time.perf_counter()
            P.prepare(rows, vp, Path(d) / f"w{workers}", seq_length=10**6, thinking=False, num_workers=workers)
            per_worker[workers] = time.perf_counter() - t0
            out.append(Row("prepare", f"prepare() end to end, {workers} worker(s)", tokens / per_worker[workers], "tok/s",
                           notes="incl. token_freq.pt and the Arrow dataset in speculators' format"))
    e2e = raw_s / per_worker[1]
    out.append(Row("prepare", "prepare() 1 worker / raw tokenizer", e2e, "x", notes="end to end; informational"))
    out.append(Row("prepare", "scaling 2 workers / 1 worker", per_worker[1] / per_worker[2], "x", "> 1x",
                   per_worker[1] / per_worker[2] > 1.0, notes="2 cores"))
    if not same:
        out[2].met = False
    emit(out, args.json, this_command("bench_prepare.py", f"--conversations {args.conversations}"))


if __name__ == "__main__":
    main()
