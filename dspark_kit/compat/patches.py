"""speculators fixes DSpark training depends on, each guarded by a behavioural probe.

DSpark training needs four behaviours older speculators trees lack: (a) slot-0 loss
weight 1 under sample_from_anchor, (b) device adaptation, (c) Markov
prev_token_ids = block_tokens (no shift), (d) slot-0 counted in the metrics.
speculators 0.9.0 ships (a), (c), (d); (b) is still partial (docs/CONCEPTS.md#speculators-on-cpu-and-npu).
Every fix here has a probe that runs the *installed* code on a tiny input and
checks the result; the patch is applied only when the probe fails, so a newer
speculators is used as is and an older tree gets exactly the missing fix.
Call `apply_for_training(device)` in every training process before
speculators' train main runs (dspark_kit.compat.train_entry does).

Probes run with torch.compile off (`torch.compiler.set_stance("force_eager")`):
speculators wraps DSpark's forward in torch.compile whenever CUDA is available
(`conditional_torch_compile`, decided at import), and the probes' tiny CPU
tensors would otherwise send Inductor into a C++ build for the CPU (minutes or
a hang on a GPU machine). A probe that crashes is "probe failed", never "fix
needed": `apply_for_training` then refuses (ProbeFailed) instead of patching
on a guess.
"""

from __future__ import annotations

import contextlib
import importlib
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dspark_kit.compat.device_fixes import (
    Replacements,
    patch_checkpointer_device,
    patch_distributed_setup,
    patch_local_rank,
    patch_seed,
    patch_synchronize,
    patch_trainer_device_type,
    probe_checkpointer_device,
    probe_distributed_setup,
    probe_local_rank,
    probe_seed,
    probe_synchronize,
    probe_trainer_device_type,
)
from dspark_kit.devices import detect_device

ALL_DEVICES = ("cpu", "cuda", "npu")


@dataclass(frozen=True)
class ProbeResult:
    name: str
    ok: bool
    detail: str
    failed: bool = False  # the probe itself crashed: detail is "probe failed: <reason>"


class ProbeFailed(RuntimeError):
    """A fix probe crashed: whether the fix is needed is unknown, so nothing is patched."""


@dataclass(frozen=True)
class Fix:
    name: str
    summary: str
    probe: Callable[[str], tuple[bool, str]]  # device -> (ok, detail)
    patch: Callable[[str], Replacements]  # device -> what to replace
    devices: tuple[str, ...] = ALL_DEVICES
    upstream: str | None = None  # the speculators PR that fixed it; None: no upstream fix yet
    fixed_in: str | None = None  # first speculators release with the fix (its probe passes there)


_ORIGINALS: list[tuple[object, str, object]] = []


def _replace(owner: object, attr: str, value: object) -> None:
    _ORIGINALS.append((owner, attr, getattr(owner, attr)))
    setattr(owner, attr, value)


def revert_all() -> None:
    """Undo every patch applied in this process (tests; a fresh probe run)."""
    while _ORIGINALS:
        owner, attr, original = _ORIGINALS.pop()
        setattr(owner, attr, original)


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
    if "sample_from_anchor" in inspect.signature(m.compute_metrics).parameters:
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
            if getattr(self.config, "sample_from_anchor", False)
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

    def compute_metrics(logits, targets, confidence_logits, loss_mask, block_size, *a, **kw):
        loss, metrics = original(
            logits, targets, confidence_logits, loss_mask, block_size, *a, **kw
        )
        if kw.get("sample_from_anchor", True):
            tv_fn = kw.get("tv_loss_fn") or metrics_mod.tv_loss
            _slot0_inclusive(
                metrics, logits, targets, confidence_logits, loss_mask, block_size, tv_fn
            )
        return loss, metrics

    return [
        (metrics_mod, "compute_metrics", compute_metrics),
        (core, "compute_metrics", compute_metrics),
    ]


_DEVICE_ONLY = ("cpu", "npu")  # cuda is what speculators was written for
FIXES: list[Fix] = [
    Fix("pos0-decay", "(a) slot-0 loss weight 1 under sample_from_anchor (PR#798)",
        probe_pos0_decay, patch_pos0_decay,
        upstream="vllm-project/speculators#798", fixed_in="0.7.0"),
    Fix("markov-prev-token", "(c) Markov prev_token_ids = block_tokens, no shift (PR#806)",
        probe_markov_prev_token, patch_markov_prev_token,
        upstream="vllm-project/speculators#806", fixed_in="0.7.0"),
    Fix("slot0-metrics", "(d) accept_len/eal/accuracy count slot 0 (PR#805)",
        probe_slot0_metrics, patch_slot0_metrics,
        upstream="vllm-project/speculators#805", fixed_in="0.7.0"),
    Fix("device-local-rank", "(b) Trainer moves the model to this device",
        probe_local_rank, patch_local_rank, _DEVICE_ONLY),
    Fix("device-trainer-type", "(b) Trainer.device_type is this device (autocast)",
        probe_trainer_device_type, patch_trainer_device_type, _DEVICE_ONLY),
    Fix("device-synchronize", "(b) step timer synchronize works without an accelerator",
        probe_synchronize, patch_synchronize, ("cpu",)),
    Fix("device-checkpointer", "(b) resume loads checkpoints onto this device",
        probe_checkpointer_device, patch_checkpointer_device, _DEVICE_ONLY),
    Fix("device-seed", "(b) set_seed seeds this device, not torch.cuda",
        probe_seed, patch_seed, _DEVICE_ONLY),
    Fix("device-distributed", "(b) torchrun workers start a gloo process group on cpu",
        probe_distributed_setup, patch_distributed_setup, ("cpu",)),
]  # fmt: skip


@contextlib.contextmanager
def _eager() -> Iterator[None]:
    """torch.compile'd functions run as plain Python: probes never compile."""
    import torch

    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:  # torch < 2.6 (speculators 0.9 needs >= 2.9)
        with torch._dynamo.config.patch(disable=True):
            yield
        return
    with set_stance("force_eager"):
        yield


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _run_probe(fix: Fix, device: str) -> ProbeResult:
    try:
        with _eager():
            ok, detail = fix.probe(device)
    except Exception as e:  # noqa: BLE001 - a crash is a failed probe, reported in one line
        reason = _one_line(f"{type(e).__name__}: {e}")
        return ProbeResult(fix.name, False, f"probe failed: {reason}", failed=True)
    return ProbeResult(fix.name, bool(ok), detail)


def refusal(result: ProbeResult, device: str) -> str:
    """The one line train stops with when a probe failed."""
    return (
        f"speculators fix {result.name}: {result.detail}; not patching on a guess "
        f"(see `dspark-kit doctor --device {device}`)"
    )


def _prepare_device(device: str) -> None:
    if device == "npu":
        importlib.import_module("torch_npu")  # registers torch.npu; no transfer_to_npu


def probe(name: str, device: str = "cpu") -> ProbeResult:
    """Run one fix's probe by name (e.g. "markov-prev-token")."""
    return _run_probe(next(f for f in FIXES if f.name == name), device)


def probe_all(device: str | None = None) -> list[ProbeResult]:
    """Probe every fix that applies to `device` (default: this machine's)."""
    device = device or detect_device()
    _prepare_device(device)
    return [_run_probe(fix, device) for fix in FIXES if device in fix.devices]


def apply_for_training(device: str) -> list[str]:
    """Patch what this speculators gets wrong on `device`; return the patch names.

    Every probe runs once before anything is patched: if one crashed, raise
    ProbeFailed (one line) and leave speculators untouched. Then fix by fix, in
    order (a later probe sees the earlier patches): probe, patch, re-probe.
    """
    _prepare_device(device)
    fixes = [fix for fix in FIXES if device in fix.devices]
    for fix in fixes:
        if (first := _run_probe(fix, device)).failed:
            raise ProbeFailed(refusal(first, device))
    applied = []
    for fix in fixes:
        before = _run_probe(fix, device)
        if before.failed:
            raise ProbeFailed(refusal(before, device) + f" (after patches {applied})")
        if before.ok:
            continue
        for owner, attr, value in fix.patch(device):
            _replace(owner, attr, value)
        applied.append(fix.name)
        after = _run_probe(fix, device)
        if after.failed:
            raise ProbeFailed(refusal(after, device) + f" (after patch {fix.name})")
        if not after.ok:
            raise RuntimeError(
                f"speculators fix {fix.name} {fix.summary}: still failing after the patch "
                f"({after.detail}); upgrade speculators (pip install -U speculators)"
            )
    return applied
