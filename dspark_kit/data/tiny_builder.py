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
    so the model learns the switch."""
    chats = conversations(spec.corpus_rows, seed=spec.seed)
    if family.reasoning == "think":
        rng = random.Random(spec.seed + 1)
        for i in range(0, len(chats), 3):
            prompt, reply = thinking_reply(rng)
            chats[i] = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
    return chats


def build_tokenizer(spec: TinySpec, family: Family = QWEN3):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from dspark_kit.data.tiny_corpus import sentence

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
    extra = dict(family.model_extra)
    theta = extra.pop("rope_theta", 10000.0)
    stops = [tok.convert_tokens_to_ids(t) for t in family.stop_tokens]
    return cls(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        tie_word_embeddings=spec.tie_embeddings,
        torch_dtype="float32",
        bos_token_id=tok.convert_tokens_to_ids(family.bos) if family.bos else None,
        eos_token_id=stops[0] if len(stops) == 1 else stops,
        pad_token_id=tok.convert_tokens_to_ids(family.pad),
        **extra,
    )


def long_sequences(spec: TinySpec, tok, chats: list[list[dict[str, str]]]):
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


def assistant_labels(ids, assistant: list[int], end_of_turn: int):
    """Labels with the loss on assistant replies only (+ their end-of-turn token): the prompts are
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
            if t == end_of_turn:
                start = None
    return labels


def heldout_loss(model, tok, spec: TinySpec, n: int = 200, family: Family = QWEN3) -> float:
    """Mean loss on the assistant tokens of `n` chats the build never trained on (another seed of
    the same corpus): the quality figure a rebuild is compared by, across machines."""
    import torch

    chats = conversations(n, seed=spec.seed + 1000)
    assistant = encode(tok, family.assistant_prefix)
    eot = tok.convert_tokens_to_ids(family.end_of_turn)
    total = count = 0.0
    model.eval()
    with torch.no_grad():
        for msgs in chats:
            ids = torch.tensor([encode(tok, render(tok, msgs, False))])
            labels = assistant_labels(ids[0], assistant, eot)[None]
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
    cfg = model_config(spec, family.embedding_rows(len(tok)), tok, family)
    model = AutoModelForCausalLM.from_config(cfg)
    stops = [tok.convert_tokens_to_ids(t) for t in family.stop_tokens]
    model.generation_config.eos_token_id = stops[0] if len(stops) == 1 else stops
    model.generation_config.pad_token_id = cfg.pad_token_id
    if family.bos:
        model.generation_config.bos_token_id = cfg.bos_token_id
    chats = render_corpus(spec, family)
    seqs = []
    for msgs in chats:
        thinking = "</think>" in msgs[-1]["content"]
        seqs.append(torch.tensor(encode(tok, render(tok, msgs, thinking))))
    longs = long_sequences(spec, tok, chats)
    assistant = encode(tok, family.assistant_prefix)
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
        labels = torch.stack([assistant_labels(row, assistant, eot) for row in batch])
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
