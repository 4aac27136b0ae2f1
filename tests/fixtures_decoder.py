"""Checkpoints for decoder/eval tests: a fresh DSpark draft and a briefly trained one.

Built with speculators' own classes (from_training_args, save_pretrained, the
model's training forward as the loss), so the tests exercise real checkpoints
without depending on the project's train stage.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from dspark_kit.data.chat import encode, render
from dspark_kit.data.tiny_corpus import conversations

TARGET_LAYER_IDS = [1, 2, 3]  # tiny verifier: 4 layers, ids 0..4 (vLLM convention)


def fresh_draft(verifier_path: str | Path, block_size: int = 4, num_layers: int = 1, markov_rank: int = 32,
                seed: int = 0, sliding_window: int | None = None, markov_head_type: str = "vanilla",
                draft_arch: str = "qwen3", mask_token_id: int | None = None):
    from speculators.models.dspark import DSparkDraftModel
    from speculators.train.cli import create_transformer_layer_config
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(str(verifier_path))
    full = [] if sliding_window else list(range(num_layers))
    layer_cfg = create_transformer_layer_config(
        str(verifier_path), num_layers, draft_arch, None, sliding_window or 2048, full
    )
    return DSparkDraftModel.from_training_args(
        layer_cfg,
        verifier_name_or_path=str(verifier_path),
        draft_vocab_size=layer_cfg.vocab_size,
        block_size=block_size,
        target_layer_ids=TARGET_LAYER_IDS,
        mask_token_id=tok.mask_token_id if mask_token_id is None else mask_token_id,
        draft_attn_impl="sdpa",
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
    )


def save_draft(model, out: Path) -> Path:
    model.save_pretrained(str(out))
    return out


def training_rows(verifier_path: str | Path, n: int, seed: int = 0) -> list[dict]:
    """Tokenised tiny-corpus chats with an assistant-only loss mask."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(verifier_path))
    rows = []
    for chat in conversations(n, seed=seed, max_turns=1):
        prompt = encode(tok, render(tok, chat[:1], thinking=False, add_generation_prompt=True))
        full = encode(tok, render(tok, chat, thinking=False))
        mask = [0] * len(prompt) + [1] * (len(full) - len(prompt))
        rows.append({"input_ids": full, "loss_mask": mask, "messages": chat})
    return rows


def verifier_states(verifier, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [n, 3H] for the draft's target ids, last-layer pre-norm [n, H])."""
    from dspark_kit.specdec.decoder import Verifier

    assert isinstance(verifier, Verifier)
    _, aux = verifier.forward(ids, verifier.new_cache(), 0)
    h = verifier.model.config.hidden_size
    return aux[:, : len(TARGET_LAYER_IDS) * h], aux[:, len(TARGET_LAYER_IDS) * h:]


def train_draft(model, verifier_path: str | Path, steps: int = 100, lr: float = 3e-3, seed: int = 0):
    """A short in-process training loop on the model's own loss (speculators forward)."""
    from dspark_kit.specdec.decoder import Verifier

    verifier = Verifier(verifier_path, [*TARGET_LAYER_IDS, 4])
    rows = training_rows(verifier_path, 48, seed=seed + 100)
    feats = []
    for r in rows:
        aux, last = verifier_states(verifier, r["input_ids"])
        feats.append((aux, last, r))
    kwargs, _ = model.get_trainer_kwargs(loss_fn='{"ce": 0.7, "tv": 0.3}', loss_implementation="eager", max_anchors=16)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model.train()
    for _ in range(steps):
        aux, last, r = feats[rng.randrange(len(feats))]
        n = len(r["input_ids"])
        _, loss, _ = model(
            hidden_states=aux[None], input_ids=torch.tensor([r["input_ids"]]),
            loss_mask=torch.tensor([r["loss_mask"]]), verifier_last_hidden_states=last[None],
            document_ids=torch.zeros(1, n, dtype=torch.long), **kwargs,
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model
