"""speculators' DSpark training semantics, checked and fixed: slot-0 loss weight,
Markov previous tokens, slot 0 in the metrics (docs/CONCEPTS.md#speculators-on-cpu-and-npu).

Probes and patches used by dspark_kit.compat.patches, lettered as there: each
probe runs the installed speculators code on a tiny input and says whether its
result is right; each patch returns (owner, attribute, replacement) triples
that patches.py applies only when the probe fails.
"""

from __future__ import annotations

import importlib
import tempfile
import threading

from dspark_kit.compat.device_fixes import Replacements


def _mod(name: str):
    return importlib.import_module(name)


# ---- (a) slot-0 decay weight ---------------------------------------------


def _metric_case(block: int = 4, vocab: int = 8):
    """One block; the verifier's targets are sharp, the draft right only at slot 0."""
    import torch

    truth = torch.arange(1, block + 1) % vocab
    targets = torch.full((1, block, vocab), -20.0)
    targets[0, torch.arange(block), truth] = 20.0
    logits = torch.full((1, block, vocab), -20.0)
    guess = truth.clone()
    guess[1:] = (truth[1:] + 1) % vocab
    logits[0, torch.arange(block), guess] = 20.0
    return logits, targets


def _dspark_metrics(logits, targets, loss_mask, block, loss="ce"):
    import inspect

    from speculators.losses import resolve_loss_config

    m = _mod("speculators.models.dspark.metrics")
    kwargs = {
        "loss_config": resolve_loss_config(loss, "eager"),
        "tv_loss_fn": resolve_loss_config("tv", "eager")["tv"][0],
    }
    if inspect.signature(m.compute_metrics).parameters.get("sample_from_anchor") is not None:  # newer speculators
        kwargs["sample_from_anchor"] = True
    return m.compute_metrics(logits, targets, None, loss_mask, block, **kwargs)


def probe_pos0_decay(device: str) -> tuple[bool, str]:
    import torch

    m = _mod("speculators.models.dspark.metrics")
    gamma = 4.0
    pos = torch.arange(4, dtype=torch.float32)
    weights = m.dflash_loss_decay(pos, gamma=gamma, sample_from_anchor=True)
    expected = torch.exp(-pos / gamma)
    # Behaviour through the loss: a wrong slot 0 alone must cost something.
    logits, targets = _metric_case()
    logits = logits.roll(1, dims=-1)  # every slot wrong
    only_slot0 = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    loss, _ = _dspark_metrics(logits, targets, only_slot0, 4)
    ok = torch.allclose(weights, expected) and float(loss) > 0
    return ok, f"slot-0 weight {float(weights[0]):.3f} (want 1), slot-0-only loss {float(loss):.3f}"


def _anchor_aware_decay(pos_idx, gamma: float, sample_from_anchor: bool = True, **_kw):
    """exp(-pos/gamma) for DSpark (slot 0 is a prediction); DFlash keeps slot 0 at 0."""
    import torch

    if sample_from_anchor:
        return torch.exp(-pos_idx / gamma)
    shifted = torch.exp(-(pos_idx - 1).clamp(min=0) / gamma)
    return shifted * (pos_idx != 0).to(shifted.dtype)


def patch_pos0_decay(device: str) -> Replacements:
    return [(_mod("speculators.models.dspark.metrics"), "dflash_loss_decay", _anchor_aware_decay)]


# ---- (c) Markov prev_token_ids = block_tokens -----------------------------


def _tiny_dspark_model(block: int = 4, vocab: int = 64, hidden: int = 32):
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark import DSparkDraftModel
    from speculators.models.dspark.config import DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    layer = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=hidden // 2, max_position_embeddings=256,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as verifier_dir:  # local config: no hub lookup
        layer.save_pretrained(verifier_dir)
        layer._attn_implementation = "sdpa"
        verifier = VerifierConfig(name_or_path=verifier_dir, architectures=["Qwen3ForCausalLM"])
        spec = SpeculatorsConfig(
            algorithm="dspark", default_proposal_method="greedy", verifier=verifier,
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block)],
        )  # fmt: skip
        config = DSparkSpeculatorConfig(
            transformer_layer_config=layer, draft_vocab_size=vocab, block_size=block,
            aux_hidden_state_layer_ids=[0, 1], mask_token_id=vocab - 1,
            sample_from_anchor=True, markov_rank=8, speculators_config=spec,
        )  # fmt: skip
        torch.manual_seed(0)
        return DSparkDraftModel(config)


def probe_markov_prev_token(device: str) -> tuple[bool, str]:
    import torch
    from speculators.losses import resolve_loss_config

    block, vocab, hidden, seq, anchors = 4, 64, 32, 24, 3
    model = _tiny_dspark_model(block, vocab, hidden)
    seen: dict = {}
    # What really reaches W1 is what the Markov bias conditions on.
    model.markov_head.markov_w1.register_forward_pre_hook(
        lambda _m, args: seen.setdefault("prev", args[0].detach().clone())
    )
    backbone = model._backbone_forward

    def capture(*args, **kwargs):
        out = backbone(*args, **kwargs)
        seen["indices"] = out[4]
        return out

    model._backbone_forward = capture
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab - 1, (1, seq), generator=gen)
    with torch.no_grad():
        model(
            hidden_states=torch.randn(1, seq, 2 * hidden, generator=gen),
            input_ids=ids,
            loss_mask=torch.ones(1, seq),
            document_ids=torch.zeros(1, seq, dtype=torch.long),
            verifier_last_hidden_states=torch.randn(1, seq, hidden, generator=gen),
            max_anchors=anchors,
            loss_config=resolve_loss_config("ce", "eager"),
            tv_loss_fn=resolve_loss_config("tv", "eager")["tv"][0],
        )
    block_tokens = ids[0, seen["indices"]].view(anchors, block)
    prev = seen.get("prev")
    ok = prev is not None and torch.equal(prev.view_as(block_tokens), block_tokens)
    got = "no Markov lookup" if prev is None else f"slot 1 prev {prev.view(-1, block)[0, 1].item()}"
    return ok, f"{got}, block_tokens slot 1 = {block_tokens[0, 1].item()} (want equal)"


_block_tokens = threading.local()


def _shift_right(tokens):
    import torch

    return torch.cat([tokens[:, :1], tokens[:, :-1]], dim=1)


def _unshifted(model_tokens):
    """block_tokens if `model_tokens` is exactly the off-by-one shift of them."""
    import torch

    block_tokens = getattr(_block_tokens, "value", None)
    if (
        block_tokens is not None
        and block_tokens.shape == model_tokens.shape
        and torch.equal(model_tokens, _shift_right(block_tokens))
    ):
        return block_tokens
    return model_tokens


def patch_markov_prev_token(device: str) -> Replacements:
    core = _mod("speculators.models.dspark.core")
    heads = _mod("speculators.models.dspark.model_definitions")
    backbone, prev_emb, block_bias = (
        core.DSparkDraftModel._backbone_forward,
        heads.MarkovHead.prev_embeddings,
        heads.MarkovHead.block_bias,
    )

    def backbone_remembering_blocks(self, hidden_states, input_ids, *args, **kwargs):
        out = backbone(self, hidden_states, input_ids, *args, **kwargs)
        anchored = out[4]
        _block_tokens.value = (
            input_ids[0, anchored].view(-1, self.block_size)
            if self.config.sample_from_anchor  # speculators' config object: always set
            else None
        )
        return out

    def prev_embeddings(self, token_ids):
        return prev_emb(self, _unshifted(token_ids))

    def bias(self, *, prev_token_ids, hidden_states, prev_emb=None):
        return block_bias(
            self,
            prev_token_ids=_unshifted(prev_token_ids),
            hidden_states=hidden_states,
            prev_emb=prev_emb,
        )

    return [
        (core.DSparkDraftModel, "_backbone_forward", backbone_remembering_blocks),
        (heads.MarkovHead, "prev_embeddings", prev_embeddings),
        (heads.MarkovHead, "block_bias", bias),
    ]


# ---- (d) slot 0 counted in accept_len / eal / accuracy --------------------


def probe_slot0_metrics(device: str) -> tuple[bool, str]:
    import torch

    logits, targets = _metric_case()
    _, metrics = _dspark_metrics(logits, targets, torch.ones(1, 4), 4, loss='{"ce": 1.0}')
    eal = float(metrics["eal_sum"] / metrics["eal_total"])
    accept_len = float(metrics["accept_len_sum"] / metrics["accept_len_total"])
    ok = abs(eal - 2.0) < 1e-6 and abs(accept_len - 2.0) < 0.01
    return ok, f"only slot 0 right: eal {eal:.2f}, accept_len {accept_len:.2f} (want 2)"


def _slot0_inclusive(metrics, logits, targets, confidence_logits, loss_mask, block, tv_fn):
    """Recompute the prefix metrics over slots 0..B-1 (DSpark: slot 0 predicts)."""
    import torch

    with torch.no_grad():
        blocks = logits.shape[1] // block
        mask = loss_mask.float().view(blocks, block)
        valid = (mask.sum(-1) > 0).float()
        rate = (1.0 - tv_fn(logits, targets)).float().view(blocks, block)
        prefix = (rate * mask).cumprod(-1)
        metrics["accept_len_sum"] = ((prefix.sum(-1) + 1.0) * valid).sum()
        metrics["accept_len_total"] = valid.sum().clamp_min(1.0)
        correct = (logits.argmax(-1) == targets.argmax(-1)).view(blocks, block) & mask.bool()
        run = correct.float().cumprod(-1).sum(-1) + 1.0
        metrics["eal_sum"], metrics["eal_total"] = (run * valid).sum(), valid.sum()
        if "position_0_acc_sum" not in metrics:
            slot0_right, slot0_total = correct[:, 0].float().sum(), mask[:, 0].sum()
            metrics["position_0_acc_sum"], metrics["position_0_acc_total"] = (
                slot0_right,
                slot0_total,
            )
            metrics["full_acc_sum"] = metrics["full_acc_sum"] + slot0_right
            metrics["full_acc_total"] = metrics["full_acc_total"] + slot0_total
        if confidence_logits is not None and "confidence_cumprod_bias_sum" in metrics:
            conf = confidence_logits.float().sigmoid().view(blocks, block)
            conf_prefix = (conf * mask).cumprod(-1)
            metrics["confidence_cumprod_bias_sum"] = ((conf_prefix - prefix) * mask).sum()
            metrics["confidence_cumprod_bias_total"] = mask.sum().clamp_min(1.0)
    return metrics


def patch_slot0_metrics(device: str) -> Replacements:
    metrics_mod = _mod("speculators.models.dspark.metrics")
    core = _mod("speculators.models.dspark.core")
    original = metrics_mod.compute_metrics
    import inspect

    signature = inspect.signature(original)

    def compute_metrics(logits, targets, confidence_logits, loss_mask, block_size, *a, **kw):
        loss, metrics = original(
            logits, targets, confidence_logits, loss_mask, block_size, *a, **kw
        )
        # the layout speculators trains in: its caller's keyword, else its own signature's default
        bound = signature.bind(logits, targets, confidence_logits, loss_mask, block_size, *a, **kw)
        bound.apply_defaults()
        if bound.arguments["sample_from_anchor"]:
            tv_fn = kw.get("tv_loss_fn") or metrics_mod.tv_loss
            _slot0_inclusive(
                metrics, logits, targets, confidence_logits, loss_mask, block_size, tv_fn
            )
        return loss, metrics

    return [
        (metrics_mod, "compute_metrics", compute_metrics),
        (core, "compute_metrics", compute_metrics),
    ]
