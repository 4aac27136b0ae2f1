"""Prepare one example file per data format (docs/DATA.md) with `dspark-kit prepare` and print a table:
rows read, trained, changed and dropped by reason.

The files hold the kit's builtin chats (data/tiny_corpus.py) in each shape, with the faults people's
files have planted in them: bytes that are not UTF-8, a byte-order mark, a reply longer than
data.seq_length, a TRL row with an empty prompt, a line that is not JSON. The hub source is read
offline from a `datasets` cache made here. The verifier is the tokenizer fixture (no weights load).

    .venv/bin/python scripts/data_formats_table.py [--rows 40] [--keep DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "tests" / "fixtures" / "tiny_tokenizer"
LONG = " ".join(str(i) for i in range(400))  # a reply past data.seq_length 512


def sharegpt(msgs: list[dict]) -> list[dict]:
    return [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]} for m in msgs]


def lines(rows: list) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def make_files(folder: Path, chats: list[list[dict]]) -> list[tuple[str, str, str]]:
    """(format, faults planted, data.source) per example."""
    single = [c[:2] for c in chats]
    out = []
    # OpenAI messages: one reply in latin-1 (not UTF-8), one cut at seq_length
    raw = lines([{"messages": c} for c in chats])
    raw += json.dumps({"messages": [{"role": "user", "content": "Name a dessert."},
                                    {"role": "assistant", "content": "XX"}]}).encode().replace(b"XX", b"cr\xe8me br\xfbl\xe9e") + b"\n"
    raw += lines([{"messages": [{"role": "user", "content": "Count to 400."}, {"role": "assistant", "content": LONG}]}])
    (folder / "openai.jsonl").write_bytes(raw)
    out.append(("OpenAI messages", "1 latin-1 row, 1 reply past seq_length", str(folder / "openai.jsonl")))
    # ShareGPT with a top-level system prompt, a byte-order mark, a line that is not JSON
    raw = b"\xef\xbb\xbf" + lines([{"system": "Answer briefly.", "conversations": sharegpt(c)} for c in chats])
    (folder / "sharegpt.jsonl").write_bytes(raw + b"{not json\n")
    out.append(("ShareGPT (top-level system)", "BOM, 1 line not JSON", str(folder / "sharegpt.jsonl")))
    # Alpaca, a .json list
    rows = [{"instruction": c[0]["content"], "input": "", "output": c[1]["content"]} for c in single]
    (folder / "alpaca.json").write_text(json.dumps(rows))
    out.append(("Alpaca (.json list)", "none", str(folder / "alpaca.json")))
    # TRL conversational, gzip; one row with an empty prompt
    rows = [{"prompt": c[:-1], "completion": c[-1:]} for c in chats]
    rows.append({"prompt": [{"role": "user", "content": ""}], "completion": [{"role": "assistant", "content": "Hi."}]})
    with gzip.open(folder / "trl_conv.jsonl.gz", "wb") as f:
        f.write(lines(rows))
    out.append(("TRL prompt/completion, conversational (.jsonl.gz)", "1 empty prompt", str(folder / "trl_conv.jsonl.gz")))
    # TRL plain, zstandard when at hand
    rows = lines([{"prompt": c[0]["content"], "completion": c[1]["content"]} for c in single])
    try:
        import zstandard

        (folder / "trl_plain.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(rows))
        out.append(("TRL prompt/completion, plain (.jsonl.zst)", "none", str(folder / "trl_plain.jsonl.zst")))
    except ImportError:
        (folder / "trl_plain.jsonl").write_bytes(rows)
        out.append(("TRL prompt/completion, plain (.jsonl)", "none", str(folder / "trl_plain.jsonl")))
    from datasets import Dataset

    # prompt/response in parquet, read beside a saved dataset folder named `parquet`
    Dataset.from_list([{"prompt": c[0]["content"], "response": c[1]["content"]} for c in single]).to_parquet(
        str(folder / "pr.parquet"))
    out.append(("prompt/response (.parquet)", "none", str(folder / "pr.parquet")))
    # a save_to_disk folder (ShareGPT rows)
    Dataset.from_list([{"conversations": sharegpt(c)} for c in chats]).save_to_disk(str(folder / "saved"))
    Dataset.from_list([{"a": 1}]).save_to_disk(str(folder / "parquet"))
    out.append(("save_to_disk folder (ShareGPT)", "none", str(folder / "saved")))
    # a hub dataset, from the datasets cache (offline)
    cache_hub(folder / "hf-cache", "local-org/tiny_chats", "train_sft", [{"messages": c} for c in chats])
    out.append(("hf:local-org/tiny_chats:train_sft (offline, cached)", "none", "hf:local-org/tiny_chats:train_sft"))
    return out


def cache_hub(cache: Path, repo: str, split: str, rows: list[dict]) -> None:
    """As `datasets` keeps a downloaded hub dataset (tests/test_data_formats.py does the same)."""
    import datasets
    from datasets import Dataset
    from datasets.arrow_writer import ArrowWriter

    org, name = repo.split("/")
    folder = cache / f"{org}___{name}" / "default" / "0.0.0" / "0123456789abcdef"
    folder.mkdir(parents=True)
    ds = Dataset.from_list(rows)
    with ArrowWriter(path=str(folder / f"{name}-{split}.arrow")) as w:
        w.write_table(ds.data.table)
        n, nbytes = w.finalize()
    splits = datasets.SplitDict({split: datasets.SplitInfo(split, num_bytes=nbytes, num_examples=n, dataset_name=name)})
    datasets.DatasetInfo(features=ds.features, config_name="default", dataset_name=name,
                         splits=splits).write_to_directory(str(folder))


def prepare(source: str, run: Path, cwd: Path, env: dict) -> dict:
    cmd = [str(Path(sys.executable).with_name("dspark-kit")), "prepare", "--json", "-w", str(run),
           "--set", f"verifier.path={TOKENIZER}", "--set", "regen.enabled=false",
           "--set", f"data.source={source}", "--set", "data.seq_length=512"]
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=40, help="chats per file")
    ap.add_argument("--keep", type=Path, help="write the files and runs here (default: a temporary folder)")
    args = ap.parse_args()
    from dspark_kit.data.tiny_corpus import conversations

    folder = args.keep or Path(tempfile.mkdtemp(prefix="data-formats-"))
    folder.mkdir(parents=True, exist_ok=True)
    examples = make_files(folder, conversations(args.rows, seed=0))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(folder / "hf-cache")}
    print("| format | planted | rows read | trained | changed (reason) | dropped (reason) |")
    print("|---|---|---|---|---|---|")
    for i, (name, planted, source) in enumerate(examples):
        s = prepare(source, folder / f"run{i}", folder, env)
        s = s.get("summary", s)
        changed = "; ".join(f"{n}: {r}" for r, n in s["changed"].items()) or "0"
        dropped = "; ".join(f"{n}: {r}" for r, n in s["rejected"].items()) or "0"
        print(f"| {name} | {planted} | {s['conversations_in']} | {s['conversations_used']} | {changed} | {dropped} |")


if __name__ == "__main__":
    main()
