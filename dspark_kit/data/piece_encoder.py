"""Token ids of many texts that share most of their pieces, each distinct piece encoded once.

prepare encodes every prefix render of a conversation next to the full one: the same
message text several times over. A fast tokenizer cuts its input at added tokens
(`<|im_start|>`, `<think>`, ...) before anything else and encodes the text between
them independently, so a text's ids are the ids of its pieces in order. We cut the
same way, encode each distinct piece once and put the ids back together.

That holds when the tokenizer cuts exactly where we do: added tokens that strip no
whitespace, match anywhere and are matched on the raw text, no truncation or padding,
special tokens recognised. Anything else, or a first batch whose ids differ from a
plain encode (checked once per encoder), and every text is encoded whole.
"""

from __future__ import annotations

import re


class PieceEncoder:
    def __init__(self, tokenizer):
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.tokenizer = tokenizer
        self.split = self._splitter()
        self.checked = False

    def _splitter(self):
        b = self.backend
        if b is None or b.truncation is not None or b.padding is not None or getattr(b, "encode_special_tokens", False):
            return None
        if getattr(self.tokenizer, "split_special_tokens", False):
            return None
        added = b.get_added_tokens_decoder()  # id -> AddedToken
        if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added.values()):
            return None
        self.ids = {t.content: i for i, t in added.items()}
        # leftmost-longest, as the tokenizer matches them: longer alternatives first
        alts = sorted(self.ids, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, alts)) + ")").split

    def _batch(self, texts: list[str]) -> list[list[int]]:
        # the ids alone: the fast batch call skips offsets we never read
        batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [e.ids for e in batch(texts, add_special_tokens=False)]

    def _whole(self, texts: list[str]) -> list[list[int]]:
        if self.backend is None:
            return [list(x) for x in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        return self._batch(texts)

    def __call__(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text (no special tokens added: the template holds them)."""
        if not texts:
            return []
        if self.split is None:
            return self._whole(texts)
        cut = [self.split(t) for t in texts]  # [text, added, text, added, ..., text]
        distinct = list({p: None for parts in cut for p in parts[0::2] if p})
        piece_ids = dict(zip(distinct, self._batch(distinct)))
        added = self.ids
        out = []
        for parts in cut:
            ids: list[int] = []
            for k, p in enumerate(parts):
                if k % 2:
                    ids.append(added[p])
                elif p:
                    ids += piece_ids[p]
            out.append(ids)
        if not self.checked:  # the rules above are ours: hold them to the tokenizer once
            self.checked = True
            if out != self._whole(texts):
                self.split = None
                return self._whole(texts)
        return out
