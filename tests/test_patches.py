"""speculators fix registry: probes pass on 0.9.0, catch the pre-fix code, patches repair it."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import speculators  # noqa: F401 (a hard dependency: missing, this file fails to import)
import torch

from dspark_kit.compat import patches


@pytest.fixture()
def mp(monkeypatch):
    """monkeypatch whose undo runs after our patches are reverted (ordering matters)."""
    yield monkeypatch
    patches.revert_all()


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
    patches.revert_all()
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
    from dspark_kit.stages.train import training_failure

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
    result = CliRunner().invoke(app, ["doctor", "--device", "cpu", "--json"])
    assert result.exit_code == 1, result.output
    probes = {p["name"]: p for p in json.loads(result.stdout)["probes"]}
    assert probes["slot0-metrics"]["failed"] and not probes["slot0-metrics"]["ok"]
    assert probes["slot0-metrics"]["detail"].startswith("probe failed: ZeroDivisionError")
    assert "refuses" in probes["slot0-metrics"]["action"]
    assert probes["markov-prev-token"]["ok"] and not probes["markov-prev-token"]["failed"]
    table = CliRunner().invoke(app, ["doctor", "--device", "cpu"])
    assert table.exit_code == 1
    assert "slot0-metrics: probe failed: ZeroDivisionError" in table.output
    assert "slot0-metrics" not in table.output.split("will apply patches:")[-1].split("\n")[0]


def _pythonpath() -> str:
    """This checkout first, then whatever the caller had (a --target site on a GPU box)."""
    here = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])


# ---- a CUDA machine, emulated on this CPU one -------------------------------
# speculators decides at import whether to torch.compile DSpark's forward
# (`torch.cuda.is_available()`); forcing it True before the import reproduces what
# the H200 saw: the probes' CPU tensors went through Inductor's C++ path (a hang),
# or crashed. Probes must run uncompiled and finish in seconds.

EMULATED_CUDA = """
import json, runpy, sys, time
import torch
torch.cuda.is_available = lambda: True
t0 = time.time()
sys.argv = ["dspark-kit", "doctor", "--device", "cuda", "--json"]
try:
    runpy.run_module("dspark_kit", run_name="__main__")
except SystemExit as e:
    code = e.code
doctor_s = time.time() - t0
from speculators.models.dspark.core import DSparkDraftModel
from dspark_kit.compat.patches import apply_for_training
t1 = time.time()
applied = apply_for_training("cuda")
from torch._dynamo.utils import counters
print("@@" + json.dumps({
    "code": code, "doctor_s": doctor_s, "apply_s": time.time() - t1, "applied": applied,
    "compiled": hasattr(DSparkDraftModel.forward, "_torchdynamo_orig_callable"),
    "graphs": counters["stats"]["unique_graphs"],
}))
"""


@pytest.mark.slow
def test_probes_finish_uncompiled_on_an_emulated_cuda_machine():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": _pythonpath()}
    proc = subprocess.run(
        [sys.executable, "-c", EMULATED_CUDA],
        check=False, capture_output=True, text=True, env=env, timeout=600,  # a hang (Inductor's C++ build)
    )  # fmt: skip
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    doctor_out, _, marker = proc.stdout.rpartition("@@")
    result = json.loads(marker)
    assert result["compiled"], "emulation did not reach speculators' conditional_torch_compile"
    assert result["code"] in (0, None), tail
    report = json.loads(doctor_out)
    assert report["device"] == "cuda"
    assert {p["name"] for p in report["probes"]} == {
        "pos0-decay",
        "markov-prev-token",
        "slot0-metrics",
    }
    assert all(p["ok"] and not p["failed"] for p in report["probes"]), report["probes"]
    assert (
        result["applied"] == []
    )  # speculators 0.9.0 needs no fix on cuda: nothing patched blindly
    assert result["graphs"] == 0, f"the probes compiled {result['graphs']} graph(s) with torch.compile"


# ---- real speculators training on CPU after apply_for_training("cpu") ------

TRAIN_SCRIPT = """
import sys
from dspark_kit.compat.patches import apply_for_training
from dspark_kit.compat.train_entry import eager_on_cpu
eager_on_cpu()  # as train_entry does: no Inductor C++ build on a host that has CUDA
print("APPLIED", apply_for_training("cpu"), flush=True)
from speculators.train.cli import main
from speculators.train.config import TrainConfig
main(TrainConfig.resolve(sys.argv[1:]))
"""


def _write_tiny_dataset(out: Path, verifier: Path, rows: int = 16) -> list[int]:
    """prepared rows + hidden states in the vLLM layer-id convention (ids 1,2,3 + N=4)."""
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_kit.data.chat import encode, render
    from dspark_kit.data.tiny_corpus import conversations

    tok = AutoTokenizer.from_pretrained(verifier)
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    targets = [1, 2, 3]
    last_layer_out = {}
    model.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: last_layer_out.__setitem__(
            "h", out[0] if isinstance(out, tuple) else out
        )
    )
    columns = {"input_ids": [], "loss_mask": [], "seq_len": []}
    (out / "hidden_states").mkdir(parents=True)
    for i, chat in enumerate(conversations(rows, seed=3)):
        prompt = encode(tok, render(tok, chat[:1], False, add_generation_prompt=True))
        ids = encode(tok, render(tok, chat[:2], False))[:128]
        mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        layers = [hs[k][0] for k in targets] + [last_layer_out["h"].reshape(len(ids), -1)]
        stacked = torch.stack(layers, dim=1).to(torch.bfloat16).contiguous()
        assert stacked.shape == (len(ids), len(targets) + 1, model.config.hidden_size)
        save_file(
            {"hidden_states": stacked, "token_ids": torch.tensor(ids, dtype=torch.int64)},
            str(out / "hidden_states" / f"hs_{i}.safetensors"),
        )
        columns["input_ids"].append(ids)
        columns["loss_mask"].append(mask)
        columns["seq_len"].append(len(ids))
    dataset = Dataset.from_dict(columns)
    dataset.set_format(
        type="torch"
    )  # speculators reads torch-formatted rows (as prepare-data saves)
    dataset.save_to_disk(str(out))
    assert n == 4
    return targets


@pytest.mark.slow
def test_real_speculators_training_runs_on_cpu_after_patches(tmp_path, tiny_verifier):
    from transformers import AutoTokenizer

    data = tmp_path / "prepared"
    targets = _write_tiny_dataset(data, tiny_verifier)
    mask_id = AutoTokenizer.from_pretrained(tiny_verifier).convert_tokens_to_ids("<|MASK|>")
    save = tmp_path / "checkpoints"
    argv = [
        "--verifier-name-or-path", str(tiny_verifier), "--data-path", str(data),
        "--save-path", str(save), "--speculator-type", "dspark",
        "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--optimizer", "adamw",
        "--epochs", "1", "--num-layers", "1", "--block-size", "4", "--max-anchors", "16",
        "--total-seq-len", "128", "--num-workers", "0", "--log-dir", str(tmp_path / "logs"),
        "--full-attention-indices", "0", "--mask-token-id", str(mask_id),
        "--target-layer-ids", *map(str, targets), "--loss-fn", '{"ce": 0.7, "tv": 0.3}',
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-c", TRAIN_SCRIPT, *argv],
        check=False, capture_output=True, text=True, env=env, timeout=600,  # a hang, not a busy machine
    )  # fmt: skip
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert "device-local-rank" in proc.stdout, tail
    checkpoint = save / "0"
    assert (checkpoint / "model.safetensors").exists(), tail
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["block_size"] == 4 and config["speculators_model_type"] == "dspark"


EMULATED_CUDA_CPU_TRAIN = """
import sys
import torch
torch.cuda.is_available = lambda: True
import speculators.train.cli as cli
from speculators.train.config import TrainConfig
from dspark_kit.compat import patches
from dspark_kit.compat import train_entry

def fake_main(config):  # what speculators' train main does first: DSpark's forward on the device
    ok, detail = patches.probe_markov_prev_token("cpu")  # no _eager(): the process's own stance
    print("FORWARD", ok, detail, flush=True)

cli.main = fake_main
TrainConfig.resolve = staticmethod(lambda argv: None)
train_entry.main(["--dspark-device", "cpu", "--data-path", "/nonexistent"])
"""


@pytest.mark.slow
def test_cpu_training_on_a_cuda_host_runs_the_forward_uncompiled():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": _pythonpath()}
    proc = subprocess.run(
        [sys.executable, "-c", EMULATED_CUDA_CPU_TRAIN],
        check=False, capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert "FORWARD True" in proc.stdout, tail


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
