"""The tiny gpt-oss verifier's two size problems: a 201,088-token tokenizer, and an embedding to match.

**The tokenizer** is o200k_harmony itself, rebuilt as a transformers tokenizer from the Harmony
encoding installed with the `oss-harmony` package (which carries the vocabulary: no download):
each id's bytes give the BPE ranks, the merges follow from the ranks (as transformers' tiktoken
converter derives them), the pre-tokenizer is o200k's split, and ids 199,998..201,087 are
Harmony's special tokens at their real ids. vLLM renders every gpt-oss chat in Harmony itself,
so a tokenizer whose ids differ from Harmony's would see other prompts than the kit renders.

**The model** trains on the tokens its corpus and template use (a few hundred) plus one shared
"rest" row standing for every other token, whose logit counts log(number of other tokens) in the
softmax: exactly the full-vocabulary model in which every unused token has that shared row. The
build then writes the full 201,088-row embedding and lm_head (`expand`): the same function, in the
real shape, ~400 times cheaper to train (a full-vocabulary step costs ~1 s on one thread).
"""

from __future__ import annotations

import math

VOCAB = 201_088  # gpt-oss's vocab_size: o200k_harmony's 199,998 ranks and 1,090 special tokens
N_RANKS = 199_998


def harmony_encoding():
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def build_harmony_tokenizer(split_regex: str):
    """o200k_harmony as a `tokenizers` BPE (byte-level, o200k's split, Harmony's specials at their ids)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    enc = harmony_encoding()
    ranks = {bytes(enc._inner.decode_bytes([i])): i for i in range(N_RANKS)}
    byte_char = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(byte_char[c] for c in b)

    merges = []
    for token, rank in ranks.items():  # every split of a token into two ranked pieces, by the token's rank
        pieces = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ranks and token[k:] in ranks]
        merges += [(a, b, rank) for a, b in sorted(pieces, key=lambda p: (ranks[p[0]], ranks[p[1]]))]
    merges.sort(key=lambda m: m[2])
    # ignore_merges: a pre-token that is itself in the vocabulary is that token, as tiktoken does
    bpe = Tokenizer(models.BPE({text(b): r for b, r in ranks.items()}, [(text(a), text(b)) for a, b, _ in merges],
                               ignore_merges=True))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken(enc.decode([i]), special=True, normalized=False)
                            for i in range(N_RANKS, VOCAB)])
    return bpe


def compact_ids(sequences, always: list[int]) -> list[int]:
    """The token ids the build trains on: every id of its sequences, and `always` (stop tokens)."""
    used = set(always)
    for seq in sequences:
        used.update(int(t) for t in seq)
    return sorted(used)


class Compact:
    """The map between the full vocabulary and the trained one (its last row: every other token)."""

    def __init__(self, used: list[int], vocab: int = VOCAB):
        import torch

        self.used, self.vocab = used, vocab
        self.rest = len(used)
        self.lut = torch.full((vocab,), self.rest, dtype=torch.long)
        self.lut[torch.tensor(used)] = torch.arange(len(used))
        self.rest_weight = math.log(vocab - len(used))  # the rest row stands for this many tokens (log)

    @property
    def rows(self) -> int:
        return self.rest + 1

    def to_compact(self, ids):
        return self.lut[ids.clamp(min=0)].masked_fill(ids < 0, -100)

    def full_softmax_logits(self, logits):
        """The compact logits with the rest row counted once per token it stands for."""
        bump = logits.new_zeros(logits.shape[-1])
        bump[self.rest] = self.rest_weight
        return logits + bump

    def expand(self, model, full_config):
        """The full-vocabulary model: each used token's rows where its id is, the rest row everywhere
        else (input embedding and lm_head alike)."""
        import torch
        from transformers import AutoModelForCausalLM

        state = model.state_dict()
        full = AutoModelForCausalLM.from_config(full_config)
        out = {}
        for name, tensor in state.items():
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                tensor = tensor[self.lut]
            out[name] = tensor
        full.load_state_dict(out, strict=True)
        full.generation_config = model.generation_config
        with torch.no_grad():
            return full.eval()
