"""The embedded tiny verifier: a Qwen3 causal LM made locally, no hub.

`ensure_tiny_verifier()` returns a HF model directory (config.json,
model.safetensors, tokenizer files with a Qwen3-style chat template that has a
thinking switch) in the cache; a content hash of the build settings names the entry.

The package ships the built files (assets/tiny_verifier, ~3.7 MB) and the first use
copies them into the cache in well under a second. Shipping them is what makes every
machine decode with the same weights: the build below is deterministic for one set of
CPU kernels only (the same seed on AVX2 and on ATEN_CPU_CAPABILITY=default gives
different weights), so a verifier built on each machine would give each machine its
own replies, rows and figures. The builder stays as the record of how the files were
made (byte-level BPE over the shipped corpus + ~4 minutes of training on one thread):
`python -m dspark_kit.data.tiny_verifier --ship` rebuilds and re-ships them after a
change to the spec, the template or the corpus (the shipped manifest records the spec
hash, and a fast test fails while the two disagree), and a slow test checks that a
rebuild reaches the shipped build's quality (its bytes differ across machines).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock

from dspark_kit.data.chat import encode, render
from dspark_kit.data.tiny_corpus import conversations, thinking_reply
from dspark_kit.progress import note
from dspark_kit.recipe import TINY_VERIFIER

# Qwen3's template, reduced to what the tiny model needs: reasoning comes from
# `reasoning_content` when it is a string, else from inline <think>..</think>
# (split as Qwen3 splits it); reasoning of assistant turns before the last user
# turn is dropped from history, the final assistant turn always
# carries a (possibly empty) think block, and enable_thinking=false pre-fills
# an empty one -- so, as with Qwen3, multi-turn history renders differently
# from the incremental render.
CHAT_TEMPLATE = (
    # tools (OpenAI's `tools`): Qwen3's system block; a conversation without them renders as before
    "{%- if tools -%}{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, '"
    " + '\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if tools and loop.first and m.role == 'system' -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = m.content if m.content is string else '' -%}{%- set reasoning = '' -%}"
    "{%- if m.reasoning_content is string -%}{%- set reasoning = m.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}"
    # each call as Qwen3 writes it (Hermes format: what vLLM's `--tool-call-parser hermes` reads back)
    "{%- for call in (m.tool_calls or []) -%}{%- set f = call.function if call.function else call -%}"
    "{%- if not loop.first or content -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' -}}"
    "{{- f.arguments if f.arguments is string else (f.arguments | tojson) -}}{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}{{- '<|im_end|>\\n' -}}"
    # tool results: consecutive ones share one user turn, as in Qwen3
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|MASK|>"]
# As in Qwen3's tokenizer, <think>/</think> are added tokens (always one id) but NOT special:
# servers decode replies with skip_special_tokens=True (vLLM's default), and the think block
# must survive in the reply text exactly as with the production verifier.
NOT_SPECIAL = ("<think>", "</think>")


@dataclass(frozen=True)
class TinySpec:
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 4096
    corpus_rows: int = 6000
    train_steps: int = 1800
    batch_size: int = 8
    # Every `long_every`-th step trains on `long_batch` packed multi-turn chats of
    # `long_len` tokens, so the verifier stays coherent at 8x the demo draft's
    # training length (long-context eval and window tuning need that).
    long_every: int = 12
    long_len: int = 2048
    long_batch: int = 1
    lr: float = 3e-3
    # Tied input/output embeddings, as in Qwen3-0.6B..4B: copying a prompt word into the
    # reply then needs no learned embedding->unembedding map; untied, the 4-layer model
    # did not learn to fill templates with the prompt's words in 1800 steps (issue 13).
    tie_embeddings: bool = True
    seed: int = 0
    # bump when the build code changes meaning (3: <think> not special; 4: long-context
    # corpus; 5: template corpus)
    version: int = 5


def cache_root() -> Path:
    return Path(os.environ.get("DSPARK_KIT_CACHE", Path.home() / ".cache" / "dspark-kit"))


def spec_hash(spec: TinySpec) -> str:
    blob = json.dumps(asdict(spec), sort_keys=True) + CHAT_TEMPLATE
    blob += (Path(__file__).parent / "assets" / "words.txt").read_text()
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def resolve_verifier_path(path: str) -> str:
    """Map the recipe's verifier path to something transformers can load (builds the tiny one)."""
    if path == TINY_VERIFIER:
        return str(ensure_tiny_verifier())
    return path


def planned_verifier_path(path: str) -> str:
    """Where resolve_verifier_path will find the verifier, without building anything: plans
    (dry runs, `recipe show`) name the tiny verifier's cache entry and never spend ~4 minutes."""
    if path == TINY_VERIFIER:
        return str(tiny_verifier_dir())
    return path


def planned_config(spec: TinySpec = TinySpec()) -> dict:
    """The parts of the tiny verifier's config.json a plan needs, before it is built (its size
    too; vocab_size is the spec's bound, the built one is the tokenizer's, a little smaller)."""
    return {"model_type": "qwen3", "num_hidden_layers": spec.num_layers, "hidden_size": spec.hidden_size,
            "vocab_size": spec.vocab_size, "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.hidden_size // spec.num_heads,
            "intermediate_size": spec.intermediate_size, "tie_word_embeddings": spec.tie_embeddings}


def tiny_verifier_dir(spec: TinySpec = TinySpec(), root: Path | None = None) -> Path:
    return (root or cache_root()) / f"tiny-qwen3-{spec_hash(spec)}"


def lock_holder(owner: Path, now: float | None = None) -> str:
    """Who holds the build lock, from the note its holder leaves beside it."""
    try:
        held = json.loads(owner.read_text())
        return f"process {held['pid']} (building for {(now or time.time()) - held['since']:.0f} s)"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _acquire(lock: FileLock, owner: Path, what: str, log) -> None:
    """Take the lock; when someone has it, say who and since when before waiting."""
    from filelock import Timeout

    try:
        lock.acquire(timeout=0)
    except Timeout:
        log(f"waiting for {what}: {lock_holder(owner)} holds {lock.lock_file}")
        lock.acquire()
    owner.write_text(json.dumps({"pid": os.getpid(), "since": time.time()}))


SHIPPED = Path(__file__).parent / "assets" / "tiny_verifier"
SHIPPED_MANIFEST = "shipped.json"  # spec hash, sha256 per file, where and how the files were built


def shipped_manifest(folder: Path = SHIPPED) -> dict | None:
    try:
        return json.loads((folder / SHIPPED_MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def ensure_tiny_verifier(spec: TinySpec = TinySpec(), root: Path | None = None, log=note,
                         build: bool = False) -> Path:
    """The verifier's cache entry: the shipped files copied there when they are this spec's,
    else (or with `build`) built there. One process does it; others wait on the lock."""
    out = tiny_verifier_dir(spec, root)
    if (out / "model.safetensors").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    lock, owner = FileLock(str(out) + ".lock"), Path(str(out) + ".lock.owner")
    _acquire(lock, owner, "the tiny verifier", log)
    try:
        return _materialize(spec, out, log, build)
    finally:
        owner.unlink(missing_ok=True)
        lock.release()


def _materialize(spec: TinySpec, out: Path, log, build: bool = False) -> Path:
    """Under the lock: another process may have finished meanwhile."""
    if (out / "model.safetensors").exists():
        return out
    return _unpack_or_build(spec, out, log, build)


def _unpack_or_build(spec: TinySpec, out: Path, log, build: bool) -> Path:
    """Unpack (or build) into a partial folder, then rename it into place, so a half-written entry
    never looks complete."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shipped = shipped_manifest()
    if not build and shipped and shipped.get("spec_hash") == spec_hash(spec):
        shutil.copytree(SHIPPED, tmp, ignore=shutil.ignore_patterns("__init__.py", "__pycache__"))
        tmp.rename(out)
        log(f"tiny verifier: the shipped build (made {shipped.get('built_on', '?')}) -> {out}")
        return out
    t0 = time.time()
    why = "--build" if build else "the shipped files are another spec's"
    log(f"building the tiny verifier ({why}; ~4 min on one thread, a line every 100 steps) -> {out}")
    _build_into(spec, tmp, log)
    tmp.rename(out)
    log(f"tiny verifier ready in {time.time() - t0:.0f}s")
    return out


def _build_into(spec: TinySpec, folder: Path, log) -> dict:
    """The build itself: tokenizer, training, and what the manifest records of it."""
    import platform

    import torch

    t0 = time.time()
    tok = build_tokenizer(spec)
    tok.save_pretrained(folder)
    model, losses = train_tiny_model(spec, tok, log=log)
    model.save_pretrained(folder)
    (folder / "dspark_kit_tiny.json").write_text(json.dumps(asdict(spec), indent=1))
    record = {"spec_hash": spec_hash(spec), "final_loss": round(sum(losses[-100:]) / len(losses[-100:]), 4),
              "heldout_loss": round(heldout_loss(model, tok, spec), 4),
              "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "machine": platform.machine(), "build_seconds": round(time.time() - t0)}
    (folder / "build.json").write_text(json.dumps(record, indent=1))
    return record


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ship(spec: TinySpec = TinySpec(), log=note) -> Path:
    """Rebuild the verifier and replace the package's shipped files with it (a maintainer's
    command after changing the spec, template or corpus; the manifest says where it was made)."""
    import datetime

    tmp = SHIPPED.with_name(SHIPPED.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    record = _build_into(spec, tmp, log)
    record["built_on"] = f"{datetime.date.today()} ({record['machine']}, {record['cpu_capability']} kernels)"
    record["files"] = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / SHIPPED_MANIFEST).write_text(json.dumps(record, indent=1) + "\n")
    old = SHIPPED.with_name(SHIPPED.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if SHIPPED.exists():
        SHIPPED.rename(old)
    tmp.rename(SHIPPED)
    shutil.rmtree(old, ignore_errors=True)
    return SHIPPED


def rebuild_check_root() -> Path:
    """Where this machine's own rebuild is kept (per CPU kernels: the build is deterministic for one
    set only), for the test that compares its quality with the shipped build's."""
    import torch

    return cache_root() / "rebuild-check" / torch.backends.cpu.get_cpu_capability()


def heldout_loss(model, tok, spec: TinySpec, n: int = 200) -> float:
    """Mean loss on the assistant tokens of `n` chats the build never trained on (another seed of
    the same corpus): the quality figure a rebuild is compared by, across machines."""
    import torch

    chats = conversations(n, seed=spec.seed + 1000)
    assistant = encode(tok, "<|im_start|>assistant\n")
    total = count = 0.0
    model.eval()
    with torch.no_grad():
        for msgs in chats:
            ids = torch.tensor([encode(tok, render(tok, msgs, False))])
            labels = _assistant_labels(ids[0], assistant)[None]
            k = int((labels[0, 1:] != -100).sum())
            if k:
                total += float(model(input_ids=ids, labels=labels).loss) * k
                count += k
    return total / count


def _render_corpus(spec: TinySpec) -> list[list[dict[str, str]]]:
    """Chats in both template modes so the model learns the think switch."""
    rng = random.Random(spec.seed + 1)
    chats = conversations(spec.corpus_rows, seed=spec.seed)
    for i in range(0, len(chats), 3):  # a third of them in thinking style
        prompt, reply = thinking_reply(rng)
        chats[i] = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
    return chats


def build_tokenizer(spec: TinySpec):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from dspark_kit.data.tiny_corpus import sentence

    rng = random.Random(spec.seed)
    texts = [m["content"] for c in _render_corpus(spec)[:2000] for m in c]
    texts += [sentence(rng) for _ in range(500)] + ["user assistant system\n"]
    bpe = Tokenizer(models.BPE())
    # Qwen2's split pattern: newline runs stay whole before a word, so a render
    # that ends in "\n\n" tokenizes as a prefix of the longer render.
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(SPECIALS),
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    raw = json.loads(bpe.to_str())
    for added in raw["added_tokens"]:
        if added["content"] in NOT_SPECIAL:
            added["special"] = False
    bpe = Tokenizer.from_str(json.dumps(raw))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|MASK|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=spec.max_position_embeddings,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _config(spec: TinySpec, vocab: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=spec.tie_embeddings,
        torch_dtype="float32",
        bos_token_id=None,
        eos_token_id=2,  # <|im_end|>
        pad_token_id=0,
    )


def _long_sequences(spec: TinySpec, tok, chats: list[list[dict[str, str]]]):
    """`long_len`-token multi-turn chats: earlier conversations as history, as eval builds long prompts."""
    import torch

    if not spec.long_every:
        return []
    rng = random.Random(spec.seed + 2)
    plain = [c for c in chats if "</think>" not in c[-1]["content"]]
    n = max(8, spec.train_steps // spec.long_every * spec.long_batch // 2)
    out = []
    for _ in range(n):
        msgs: list[dict[str, str]] = []
        ids: list[int] = []
        while len(ids) < spec.long_len:
            msgs += rng.choice(plain)
            ids = encode(tok, render(tok, msgs, False))
        out.append(torch.tensor(ids[: spec.long_len]))
    return out


def _assistant_labels(ids, assistant: list[int]):
    """Labels with the loss on assistant replies only (+ their <|im_end|>): the prompts are
    random by construction, so learning them only adds noise; what the verifier must learn
    is to answer the prompt."""
    import torch

    labels = torch.full_like(ids, -100)
    row = ids.tolist()
    a = len(assistant)
    start = None
    for i, t in enumerate(row):
        if row[i : i + a] == assistant:
            start = i + a
        elif t == assistant[0]:  # another role's turn
            start = None
        if start is not None and i >= start:
            labels[i] = t
            if t == 2:  # <|im_end|>
                start = None
    return labels


def train_tiny_model(spec: TinySpec, tok, log=note):
    """The trained model and its per-step training losses."""
    import torch

    torch.manual_seed(spec.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread beats two, by far on a busy machine
    try:
        return _train(spec, tok, log)
    finally:
        torch.set_num_threads(threads)


def _train(spec: TinySpec, tok, log):
    import torch
    from transformers import Qwen3ForCausalLM

    assert tok.convert_tokens_to_ids("<|im_end|>") == 2, "special token order changed"
    vocab = ((len(tok) + 63) // 64) * 64
    model = Qwen3ForCausalLM(_config(spec, vocab))
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    chats = _render_corpus(spec)
    seqs = []
    for msgs in chats:
        thinking = "</think>" in msgs[-1]["content"]
        seqs.append(torch.tensor(encode(tok, render(tok, msgs, thinking))))
    longs = _long_sequences(spec, tok, chats)
    assistant = encode(tok, "<|im_start|>assistant\n")
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, spec.lr, total_steps=spec.train_steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(spec.seed)
    model.train()
    t_start = time.time()
    losses = []
    for step in range(spec.train_steps):
        if spec.long_every and step % spec.long_every == spec.long_every - 1:
            idx = torch.randint(len(longs), (spec.long_batch,), generator=gen).tolist()
            batch = torch.stack([longs[i] for i in idx])
        else:
            idx = torch.randint(len(seqs), (spec.batch_size,), generator=gen).tolist()
            batch = torch.nn.utils.rnn.pad_sequence([seqs[i] for i in idx], batch_first=True, padding_value=-100)
        inputs = batch.clamp(min=0)
        labels = torch.stack([_assistant_labels(row, assistant) for row in batch])
        out = model(input_ids=inputs, attention_mask=(batch != -100).long(), labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        if step % 100 == 0 or step == spec.train_steps - 1:
            log(f"  tiny verifier step {step:4d}/{spec.train_steps} loss {out.loss.item():.3f} ({time.time() - t_start:.0f}s)")
    model.eval()
    return model, losses


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m dspark_kit.data.tiny_verifier",
                                 description="The tiny verifier: unpack it into the cache (default), "
                                             "build it from its recipe, or rebuild and re-ship it.")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--build-into", type=Path, metavar="ROOT",
                     help="build it (never unpack) into the cache folder ROOT; prints its build.json")
    how.add_argument("--rebuild-check", action="store_true",
                     help="build it into this machine's rebuild-check folder (the slow quality test reads it)")
    how.add_argument("--ship", action="store_true",
                     help="rebuild and replace the package's shipped files (after a spec/template/corpus change)")
    a = ap.parse_args(argv)
    if a.ship:
        print(ship())
    elif a.build_into or a.rebuild_check:
        out = ensure_tiny_verifier(root=a.build_into or rebuild_check_root(), build=True)
        print((out / "build.json").read_text())
    else:
        print(ensure_tiny_verifier())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
