"""speculators fix registry: probes pass on 0.9.0, catch the pre-fix code, patches repair it."""

from __future__ import annotations

import inspect
import json
import sys
import textwrap

import pytest
import speculators  # noqa: F401 (a hard dependency: missing, this file fails to import)
import torch

from dspark_kit.compat import patches


def revert_all() -> None:
    """Undo every patch applied in this process (the patches module records each original)."""
    while patches._ORIGINALS:
        owner, attr, original = patches._ORIGINALS.pop()
        setattr(owner, attr, original)


@pytest.fixture()
def mp(monkeypatch):
    """monkeypatch whose undo runs after our patches are reverted (ordering matters)."""
    yield monkeypatch
    revert_all()


def _probe(name: str, device: str = "cpu") -> patches.ProbeResult:
    return patches.probe(name, device)


def _old_version(func, old: str, new: str):
    """Rebuild `func` from its source with `old` replaced: the pre-fix speculators code."""
    source = textwrap.dedent(inspect.getsource(func))
    assert old in source, f"speculators changed: {old!r} not in {func.__qualname__}"
    source = source.replace(old, new)
    source = "\n".join(line for line in source.splitlines() if not line.startswith("@"))
    namespace = dict(sys.modules[func.__module__].__dict__)
    exec(compile(source, f"<pre-fix {func.__qualname__}>", "exec"), namespace)  # noqa: S102
    return namespace[func.__name__]


def _random_block_case(blocks=3, block=4, vocab=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, blocks * block, vocab, generator=gen) * 3
    targets = torch.randn(1, blocks * block, vocab, generator=gen) * 3
    targets[..., :3] += logits[..., :3]  # some agreement so prefixes are not all empty
    mask = (torch.rand(1, blocks * block, generator=gen) > 0.2).float()
    conf = torch.randn(1, blocks * block, generator=gen)
    return logits, targets, conf, mask


def _metrics_now(logits, targets, conf, mask, block=4):
    from speculators.losses import resolve_loss_config
    from speculators.models.dspark import metrics

    return metrics.compute_metrics(
        logits, targets, conf, mask, block,
        loss_config=resolve_loss_config('{"ce": 0.7, "tv": 0.3}', "eager"),
        tv_loss_fn=resolve_loss_config("tv", "eager")["tv"][0],
        sample_from_anchor=True,
    )  # fmt: skip


def test_model_probes_pass_on_installed_speculators():
    for result in patches.probe_all("cpu")[:3]:
        assert result.ok, result


def test_pos0_decay_probe_catches_old_decay_and_patch_restores_loss(mp):
    from speculators.models.dspark import metrics

    case = _random_block_case()
    reference_loss, _ = _metrics_now(*case)

    def dflash_only_decay(pos_idx, gamma, **_kwargs):  # pre-PR#798: slot 0 weight 0
        w = torch.exp(-((pos_idx - 1).clamp(min=0)) / gamma)
        return w * (pos_idx != 0).to(w.dtype)

    mp.setattr(metrics, "dflash_loss_decay", dflash_only_decay)
    assert not _probe("pos0-decay").ok
    assert float(_metrics_now(*case)[0]) != pytest.approx(float(reference_loss))
    assert "pos0-decay" in patches.apply_for_training("cpu")
    assert _probe("pos0-decay").ok
    assert float(_metrics_now(*case)[0]) == pytest.approx(float(reference_loss), rel=1e-6)


def test_markov_probe_catches_shifted_prev_tokens_and_patch_unshifts(mp):
    from speculators.models.dspark.core import DSparkDraftModel

    shifted = _old_version(
        DSparkDraftModel.forward,
        "    prev_token_ids = block_tokens\n",
        "    prev_token_ids = torch.cat([block_tokens[:, :1], block_tokens[:, :-1]], dim=1)\n",
    )
    mp.setattr(DSparkDraftModel, "forward", shifted)
    result = _probe("markov-prev-token")
    assert not result.ok, result
    assert "markov-prev-token" in patches.apply_for_training("cpu")
    assert _probe("markov-prev-token").ok


def test_slot0_metrics_probe_catches_skipped_slot0_and_patch_recounts(mp):
    from speculators.models.dspark import core, metrics

    case = _random_block_case()
    _, reference = _metrics_now(*case)
    skip_slot0 = _old_version(
        metrics.compute_metrics,
        "start_pos = 0 if sample_from_anchor else 1",
        "start_pos = 1  # pre-PR#805: DFlash slot-0 skip",
    )
    mp.setattr(metrics, "compute_metrics", skip_slot0)
    mp.setattr(core, "compute_metrics", skip_slot0)
    assert not _probe("slot0-metrics").ok
    assert "slot0-metrics" in patches.apply_for_training("cpu")
    assert _probe("slot0-metrics").ok
    _, repaired = _metrics_now(*case)
    for key in ("accept_len", "eal", "full_acc", "position_0_acc", "confidence_cumprod_bias"):
        got = float(repaired[f"{key}_sum"] / repaired[f"{key}_total"])
        want = float(reference[f"{key}_sum"] / reference[f"{key}_total"])
        assert got == pytest.approx(want, abs=1e-5), key


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the cpu-only behaviour")
def test_cpu_device_patches_are_exactly_the_reference_set(mp):
    before = {r.name: r.ok for r in patches.probe_all("cpu")}
    applied = patches.apply_for_training("cpu")
    assert set(applied) == {n for n, ok in before.items() if not ok}
    assert {"device-local-rank", "device-trainer-type", "device-checkpointer"} <= set(applied)
    assert all(r.ok for r in patches.probe_all("cpu"))
    assert patches.apply_for_training("cpu") == []  # idempotent
    from speculators.train import checkpointer, trainer

    assert trainer.get_local_rank() == "cpu"
    assert checkpointer.get_current_device() == "cpu"
    torch.accelerator.synchronize()  # no-op instead of an error
    revert_all()
    assert not _probe("device-local-rank").ok


def test_a_crashing_probe_is_reported_not_raised(mp):
    from speculators.models.dspark import metrics

    mp.setattr(metrics, "compute_metrics", lambda *a, **k: 1 / 0)
    result = _probe("slot0-metrics")
    assert not result.ok and result.failed
    assert result.detail.startswith("probe failed: ZeroDivisionError")


def test_a_crashing_probe_makes_train_refuse_instead_of_patching(mp, capsys):
    """Crash != fix needed: nothing is patched, train_entry stops with the probe-failed line."""
    from speculators.models.dspark.core import DSparkDraftModel

    from dspark_kit.compat import train_entry

    def planted(*_a, **_k):
        raise RuntimeError("planted crash")

    mp.setattr(DSparkDraftModel, "_backbone_forward", planted)
    with pytest.raises(
        patches.ProbeFailed, match=r"markov-prev-token: probe failed: RuntimeError: planted crash"
    ):
        patches.apply_for_training("cpu")
    assert patches._ORIGINALS == [] and DSparkDraftModel._backbone_forward is planted  # untouched
    with pytest.raises(SystemExit) as exit_info:
        train_entry.main(["--dspark-device", "cpu", "--data-path", "/nonexistent"])
    assert exit_info.value.code == train_entry.PROBE_FAILED_EXIT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(train_entry.REFUSAL_PREFIX), err
    assert "markov-prev-token: probe failed: RuntimeError: planted crash" in err[0]
    assert patches._ORIGINALS == []


def test_training_failure_names_the_refusal_of_this_run_only(tmp_path):
    from dspark_kit.compat.train_entry import REFUSAL_PREFIX
    from dspark_kit.stages.training.train import training_failure

    log = tmp_path / "train.log"
    log.write_text(f"{REFUSAL_PREFIX}speculators fix old: probe failed: from an earlier run\n")
    since = log.stat().st_size
    assert training_failure(1, log, since) == f"speculators train exited with 1; see {log}"
    with log.open("a") as f:
        f.write(f"noise\n{REFUSAL_PREFIX}speculators fix x: probe failed: Boom: no\n")
    assert training_failure(3, log, since) == "speculators fix x: probe failed: Boom: no"


def test_doctor_reports_a_crashing_probe_as_probe_failed_and_exits_1(mp):
    from speculators.models.dspark import metrics
    from typer.testing import CliRunner

    from dspark_kit.cli import app

    mp.setattr(metrics, "compute_metrics", lambda *a, **k: 1 / 0)
    result = CliRunner().invoke(app, ["doctor", "--probe-device", "cpu", "--json"])
    assert result.exit_code == 1, result.output
    probes = {p["name"]: p for p in json.loads(result.stdout)["probes"]}
    assert probes["slot0-metrics"]["failed"] and not probes["slot0-metrics"]["ok"]
    assert probes["slot0-metrics"]["detail"].startswith("probe failed: ZeroDivisionError")
    assert "refuses" in probes["slot0-metrics"]["action"]
    assert probes["markov-prev-token"]["ok"] and not probes["markov-prev-token"]["failed"]
    table = CliRunner().invoke(app, ["doctor", "--probe-device", "cpu"])
    assert table.exit_code == 1
    assert "slot0-metrics: probe failed: ZeroDivisionError" in table.output
    assert "slot0-metrics" not in table.output.split("will apply patches:")[-1].split("\n")[0]


def test_every_seed_fix_names_its_upstream_pr_and_release():
    """The registry says where each speculators fix landed, and the installed release has them."""
    from packaging.version import Version

    from dspark_kit.compat import versions

    seed = {f.name: f for f in patches.FIXES if not f.name.startswith("device-")}
    assert {"pos0-decay", "markov-prev-token", "slot0-metrics"} <= set(seed)
    for name in ("pos0-decay", "markov-prev-token", "slot0-metrics"):
        fix = seed[name]
        assert fix.upstream.startswith("vllm-project/speculators#") and fix.upstream.split("#")[1] in fix.summary
        assert Version(versions.installed("speculators")) >= Version(fix.fixed_in)


def test_a_fused_loss_that_fails_under_compile_is_named_with_its_fix(tmp_path):
    """On an H200 (torch 2.11.0+cu130, speculators 0.9.0) the fused loss dies inside torch.compile;
    the line the trainer left is the one we read (shortened), and the stage names the recipe key."""
    from dspark_kit.stages.training.train import training_failure

    log = tmp_path / "train.log"
    log.write_text(
        "  | AssertionError: ListVariable(length=21) is already tracked for mutation. Source of new object: "
        "AttrSource(base=AttrSource(base=GlobalSource(global_name='__import_speculators_dot_losses_dot_fused'), "
        "member='loss_backward_kernel'), member='configs').\n")
    assert "train.loss_implementation=eager" in training_failure(1, log)
    log.write_text("  | AssertionError: ListVariable(length=21) is already tracked for mutation.\n")
    assert training_failure(1, log) == f"speculators train exited with 1; see {log}"


def test_the_cpu_attention_fix_runs_a_low_precision_call_in_float32(monkeypatch):
    """Where this CPU's kernels cannot run bf16 sdpa (torch 2.13 on an AMX CPU under
    ATEN_CPU_CAPABILITY=default), the probe fails and the patched attention computes it in float32.
    Here the kernel's refusal is planted, so the test sees the fix on any machine."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from dspark_kit.compat import patches
    from dspark_kit.compat.device_fixes import patch_cpu_bf16_attention

    real = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def refuses_low_precision(module, query, *args, **kwargs):
        if query.dtype == torch.bfloat16 or torch.is_autocast_enabled("cpu"):
            raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")
        return real(module, query, *args, **kwargs)

    monkeypatch.setattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", {"sdpa": refuses_low_precision})
    first = patches.probe("device-cpu-bf16-attention", "cpu")
    assert not first.ok and not first.failed and "pack_vnni2" in first.detail
    for owner, attr, value in patch_cpu_bf16_attention("cpu"):
        monkeypatch.setattr(owner, attr, value)
    assert patches.probe("device-cpu-bf16-attention", "cpu").ok
    module = torch.nn.Module()
    module.is_causal = False
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    want, _ = real(module, q, k, v, None, scaling=0.25)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, None, scaling=0.25)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want, atol=1e-2)


def test_a_sigterm_landing_in_a_rich_log_write_reaches_speculators_save(monkeypatch):
    """speculators' own signal handler and the RichHandler its trainer logs with: a SIGTERM delivered
    while a line is being written is swallowed by logging (training would run on, deaf to later
    signals) until the stop-in-log-write patch lets it through to the save."""
    import io
    import logging
    import os
    import signal

    from rich.console import Console
    from rich.logging import RichHandler
    from speculators.train.graceful_shutdown import (
        GracefulShutdownHandler,
        TrainingInterruptedError,
    )

    lines: list[str] = []

    class SignalledWhileWriting(io.StringIO):
        def write(self, text):
            lines.append(text)
            os.kill(os.getpid(), signal.SIGTERM)  # its Python handler runs before this write returns
            return super().write(text)

    logger = logging.getLogger("test.stop_in_log_write")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    monkeypatch.setattr(logging, "raiseExceptions", False)  # the swallowed case prints no traceback
    logger.addHandler(handler := RichHandler(console=Console(file=SignalledWhileWriting(), width=80)))

    def stop_during_a_log_line() -> str:
        shutdown = GracefulShutdownHandler()
        shutdown.install()
        try:
            logger.info("epoch=0, lr=0.003, global_step=1")
            os.kill(os.getpid(), signal.SIGTERM)  # a second stop: speculators counts itself interrupted
            return "training ran on"
        except TrainingInterruptedError:
            return "interrupted"
        finally:
            shutdown.restore()

    try:
        assert patches.probe("stop-in-log-write", "cpu").ok is False  # speculators 0.9.0 as installed
        assert stop_during_a_log_line() == "training ran on"
        assert "global_step=1" in "".join(lines)  # the stop landed in writing the line
        for owner, attr, value in patches.patch_stop_in_log_write("cpu"):
            monkeypatch.setattr(owner, attr, value)
        assert patches.probe("stop-in-log-write", "cpu").ok
        assert stop_during_a_log_line() == "interrupted"
    finally:
        logger.removeHandler(handler)
