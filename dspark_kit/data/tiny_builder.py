"""How a tiny verifier is made: tokenizer, model config and training, per family (families.py).

A tiny verifier is a 4-layer model of its family's architecture with a byte-level BPE
tokenizer trained on the shipped corpus (tiny_corpus.py), the family's special tokens and
chat template, trained ~4 minutes on one thread to answer the corpus's prompts (the loss on
assistant replies and their end-of-turn token only). The build is deterministic for one set
of CPU kernels, so the package ships the built files (tiny_verifier.py unpacks them into the
cache); this module is the record of how they were made and what `--ship` reruns.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass

from dspark_kit.data.chat import encode, render
from dspark_kit.data.families import QWEN3, Family
from dspark_kit.data.tiny_corpus import conversations, thinking_reply
from dspark_kit.progress import note


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


DEFAULT_SPEC = TinySpec()


def spec_dict(spec: TinySpec) -> dict:
    return asdict(spec)


def render_corpus(spec: TinySpec, family: Family = QWEN3) -> list[list[dict[str, str]]]:
    """The training chats; a family with a thinking switch gets a third of them in thinking style
    so the model learns the switch; one that always reasons (Harmony) reasons in every last reply."""
    chats = conversations(spec.corpus_rows, seed=spec.seed)
    fmt = family.reasoning
    if fmt.switch:
        rng = random.Random(spec.seed + 1)
        for i in range(0, len(chats), 3):
            prompt, reply, reasoning = thinking_reply(rng)
            chats[i] = [{"role": "user", "content": prompt}, fmt.corpus_reply(reply, reasoning)]
    elif fmt.always:
        chats = always_reasoning(chats, family, spec.seed + 1)
    return chats


def always_reasoning(chats: list[list[dict]], family: Family, seed: int) -> list[list[dict]]:
    """Chats of a family that reasons in every reply: each one's last turn a reasoning reply."""
    rng = random.Random(seed)
    out = []
    for chat in chats:
        prompt, reply, reasoning = thinking_reply(rng)
        out.append(chat[:-2] + [{"role": "user", "content": prompt}, family.reasoning.corpus_reply(reply, reasoning)])
    return out


def reasons(msgs: list[dict]) -> bool:
    """Whether a corpus chat's last reply carries reasoning (inline or apart)."""
    from dspark_kit.data.conversations import split_reasoning

    last = msgs[-1]
    return bool(last.get("reasoning_content")) or split_reasoning(last["content"])[0] is not None


def build_tokenizer(spec: TinySpec, family: Family = QWEN3):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from dspark_kit.data.tiny_corpus import sentence

    if family.tokenizer_source == "harmony":  # the real vocabulary, from the installed Harmony encoding
        from dspark_kit.data.tiny_harmony import build_harmony_tokenizer

        tok = PreTrainedTokenizerFast(tokenizer_object=build_harmony_tokenizer(family.split_regex),
                                      eos_token=family.eos, pad_token=family.pad,
                                      model_max_length=spec.max_position_embeddings)
        tok.chat_template = family.chat_template
        return tok

    rng = random.Random(spec.seed)
    texts = [m["content"] for c in render_corpus(spec, family)[:2000] for m in c]
    texts += [sentence(rng) for _ in range(500)] + ["user assistant system\n"]
    bpe = Tokenizer(models.BPE())
    # the family's split pattern: newline runs stay whole before a word, so a render
    # that ends in "\n\n" tokenizes as a prefix of the longer render.
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(family.split_regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    at_start = family.specials_at == "start"
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(family.specials),
        special_tokens=list(family.specials) if at_start else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    if not at_start:  # Llama-3's order: the merges first, then every special token
        bpe.add_special_tokens(list(family.specials))
    if family.bos:  # a plain encode adds BOS, as Llama-3's tokenizer does; the template writes it itself
        bos = bpe.token_to_id(family.bos)
        bpe.post_processor = processors.TemplateProcessing(single=f"{family.bos} $A", pair=f"{family.bos} $A $B",
                                                           special_tokens=[(family.bos, bos)])
    raw = json.loads(bpe.to_str())
    for added in raw["added_tokens"]:
        if added["content"] in family.not_special:
            added["special"] = False
    bpe = Tokenizer.from_str(json.dumps(raw))
    named = {"eos_token": family.eos, "pad_token": family.pad}
    if family.mask:
        named["mask_token"] = family.mask
    if family.bos:
        named["bos_token"] = family.bos
    extra = family.additional_special if at_start else tuple(
        s for s in family.specials if s not in (family.eos, family.pad, family.bos))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, **named, additional_special_tokens=list(extra),
                                  model_max_length=spec.max_position_embeddings)
    tok.chat_template = family.chat_template
    return tok


def model_config(spec: TinySpec, vocab: int, tok, family: Family = QWEN3):
    import transformers

    cls = getattr(transformers, family.config_class)
    extra = dict(family.model_extra)  # the family's terms, over the dense shape's (rope, ties, MoE)
    theta = extra.pop("rope_theta", 10000.0)
    stops = [tok.convert_tokens_to_ids(t) for t in family.stop_tokens]
    return cls(**{
        "vocab_size": vocab,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.hidden_size // spec.num_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": spec.tie_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": tok.convert_tokens_to_ids(family.bos) if family.bos else None,
        "eos_token_id": stops[0] if len(stops) == 1 else stops,
        "pad_token_id": tok.convert_tokens_to_ids(family.pad),
        **extra,
    })


def long_sequences(spec: TinySpec, tok, chats: list[list[dict[str, str]]], family: Family = QWEN3):
    """`long_len`-token multi-turn chats: earlier conversations as history, as eval builds long prompts.
    A family whose history is not trained (Harmony) keeps whole chats, the last reply in the window."""
    import torch

    if not spec.long_every:
        return []
    rng = random.Random(spec.seed + 2)
    plain = [c for c in chats if not reasons(c)] or chats
    n = max(8, spec.train_steps // spec.long_every * spec.long_batch // 2)
    out = []
    for _ in range(n):
        msgs: list[dict[str, str]] = []
        ids: list[int] = []
        fits: list[int] = []
        while len(ids) < spec.long_len:
            fits = ids
            msgs = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs] + rng.choice(plain)
            ids = encode(tok, render(tok, msgs, False))
        out.append(torch.tensor(ids[: spec.long_len] if family.history_trained else fits or ids))
    return out


def assistant_labels(ids, assistant: list[int], end_of_turn: int, last_only: bool = False):
    """Labels with the loss on assistant replies only (+ their end-of-turn token): the prompts are
    random by construction, so learning them only adds noise; what the verifier must learn
    is to answer the prompt. The assistant header inside a reply (Harmony's next channel) is the
    reply's own; `last_only`: the last reply alone (a template that rewrites history)."""
    import torch

    labels = torch.full_like(ids, -100)
    row = ids.tolist()
    a = len(assistant)
    start = None
    opened = 0
    for i, t in enumerate(row):
        if row[i : i + a] == assistant:
            if start is None:
                start, opened = i + a, i + a
        elif t == assistant[0]:  # another role's turn
            start = None
        if start is not None and i >= start:
            labels[i] = t
            if t == end_of_turn:
                start = None
    if last_only:
        labels[:opened] = -100
    return labels


def heldout_loss(model, tok, spec: TinySpec, n: int = 200, family: Family = QWEN3) -> float:
    """Mean loss on the assistant tokens of `n` chats the build never trained on (another seed of
    the same corpus): the quality figure a rebuild is compared by, across machines."""
    import torch

    chats = conversations(n, seed=spec.seed + 1000)
    if family.reasoning.always:  # as the verifier answers: reasoning first
        chats = always_reasoning(chats, family, spec.seed + 1001)
    assistant = encode(tok, family.assistant_prefix)
    eot = tok.convert_tokens_to_ids(family.end_of_turn)
    total = count = 0.0
    model.eval()
    with torch.no_grad():
        for msgs in chats:
            ids = torch.tensor([encode(tok, render(tok, msgs, reasons(msgs)))])
            labels = assistant_labels(ids[0], assistant, eot, not family.history_trained)[None]
            k = int((labels[0, 1:] != -100).sum())
            if k:
                total += float(model(input_ids=ids, labels=labels).loss) * k
                count += k
    return total / count


def train_tiny_model(spec: TinySpec, tok, log=note, family: Family = QWEN3):
    """The trained model and its per-step training losses."""
    import torch

    torch.manual_seed(spec.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread beats two, by far on a busy machine
    try:
        return _train(spec, tok, log, family)
    finally:
        torch.set_num_threads(threads)


def _train(spec: TinySpec, tok, log, family: Family):
    import torch
    from transformers import AutoModelForCausalLM

    eot = tok.convert_tokens_to_ids(family.end_of_turn)
    if family is QWEN3:
        assert eot == 2, "special token order changed"
    full_cfg = cfg = model_config(spec, family.embedding_rows(len(tok)), tok, family)
    stops = [tok.convert_tokens_to_ids(t) for t in family.stop_tokens]
    chats = render_corpus(spec, family)
    seqs = []
    for msgs in chats:
        seqs.append(torch.tensor(encode(tok, render(tok, msgs, reasons(msgs)))))
    longs = long_sequences(spec, tok, chats, family)
    assistant = encode(tok, family.assistant_prefix)
    compact = None
    if family.tokenizer_source == "harmony":  # train on the tokens used, one row for the rest (tiny_harmony.py)
        from dspark_kit.data.tiny_corpus import vocabulary
        from dspark_kit.data.tiny_harmony import Compact, compact_ids

        words = [encode(tok, form) for group in vocabulary().values() for w in group
                 for form in (w, " " + w, w.capitalize(), " " + w.capitalize())]  # what a prompt may name
        compact = Compact(compact_ids(seqs + longs + words, stops), full_cfg.vocab_size)
        cfg = model_config(spec, compact.rows, tok, family)
        cfg.pad_token_id = int(compact.lut[cfg.pad_token_id])  # the trained model's own ids
        cfg.eos_token_id = [int(compact.lut[i]) for i in stops]
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.eos_token_id = stops[0] if len(stops) == 1 else stops
    model.generation_config.pad_token_id = full_cfg.pad_token_id
    if family.bos:
        model.generation_config.bos_token_id = cfg.bos_token_id
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
        labels = torch.stack([assistant_labels(row, assistant, eot, not family.history_trained) for row in batch])
        if compact is None:
            out = model(input_ids=batch.clamp(min=0), attention_mask=(batch != -100).long(), labels=labels)
            loss = out.loss
        else:
            logits = model(input_ids=compact.to_compact(batch).clamp(min=0), attention_mask=(batch != -100).long()).logits
            loss = torch.nn.functional.cross_entropy(compact.full_softmax_logits(logits[:, :-1]).flatten(0, 1),
                                                     compact.to_compact(labels[:, 1:]).flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 100 == 0 or step == spec.train_steps - 1:
            log(f"  tiny verifier step {step:4d}/{spec.train_steps} loss {loss.item():.3f} ({time.time() - t_start:.0f}s)")
    model.eval()
    return (compact.expand(model, full_cfg) if compact else model), losses
