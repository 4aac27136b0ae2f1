"""Device layer: detection, env, train flags, describe; `dspark-kit doctor`."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from dspark_kit import devices


@pytest.fixture()
def fake_npu(monkeypatch):
    """A stand-in torch_npu that registers torch.npu with one visible device."""
    module = types.ModuleType("torch_npu")
    npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1,
                                get_device_name=lambda i: "Ascend910B3")  # fmt: skip
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(devices, "_installed", lambda name: name == "torch_npu")
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    return npu


@pytest.mark.skipif(torch.cuda.is_available(), reason="cpu-only expectations")
def test_auto_is_cpu_without_accelerators():
    assert devices.detect_device() == "cpu"
    assert devices.detect_device("cpu") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="cpu-only expectations")
def test_requesting_an_absent_device_names_the_fix():
    for name in ("npu", "cuda"):
        with pytest.raises(RuntimeError, match=f"device {name}:.*use auto or cpu"):
            devices.detect_device(name)
    with pytest.raises(ValueError, match="expected one of"):
        devices.detect_device("tpu")


def test_npu_wins_auto_when_torch_npu_sees_a_device(fake_npu):
    assert devices.detect_device() == "npu"
    assert devices.describe()["names"] == ["Ascend910B3"]
    fake_npu.is_available = lambda: False
    assert devices.detect_device() != "npu"


def test_a_broken_torch_npu_import_falls_back(monkeypatch):
    monkeypatch.setattr(devices, "_installed", lambda name: name == "torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ImportError
    assert devices.npu_available() is False


def test_visible_devices_env_uses_the_vendor_variable():
    assert devices.visible_devices_env("npu", "0, 1") == {"ASCEND_RT_VISIBLE_DEVICES": "0,1"}
    assert devices.visible_devices_env("cuda", "2") == {"CUDA_VISIBLE_DEVICES": "2"}
    assert devices.visible_devices_env("cpu", "0") == {}
    assert devices.visible_devices_env("npu", None) == {}


def test_npu_env_defaults_yield_to_the_user(monkeypatch):
    monkeypatch.delenv("HCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("HCCL_OP_EXPANSION_MODE", "AI_CPU")
    env = devices.npu_env()
    assert env["HCCL_SOCKET_IFNAME"] == "lo" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["HCCL_OP_EXPANSION_MODE"] == "AI_CPU"
    assert set(env) == {"HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "HCCL_NPU_SOCKET_PORT_RANGE",
                        "HCCL_OP_EXPANSION_MODE"}  # fmt: skip


def test_train_flags_per_device():
    eager = ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    assert devices.train_flags("cpu") == eager
    assert devices.train_flags("npu", has_triton=False) == eager
    assert devices.train_flags("npu", has_triton=True) == ["--draft-attn-impl", "sdpa"]
    assert devices.train_flags("cuda") == []


def test_describe_reports_versions():
    info = devices.describe("cpu")
    assert info["device"] == "cpu" and info["count"] >= 1
    assert info["versions"]["speculators"] and info["versions"]["torch"] == torch.__version__
    assert info["versions"]["vllm"] is None or isinstance(info["versions"]["vllm"], str)


@pytest.mark.slow
@pytest.mark.skipif(torch.accelerator.is_available(), reason="cpu-only expectations")
def test_doctor_json_lists_probes_and_pending_patches():
    from typer.testing import CliRunner

    from dspark_kit.cli import app

    result = CliRunner().invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["device"] == "cpu"
    probes = {p["name"]: p for p in report["probes"]}
    assert probes["markov-prev-token"]["ok"] and probes["pos0-decay"]["ok"]
    assert not probes["device-local-rank"]["ok"]
    assert "device-local-rank" in probes["device-local-rank"]["action"]


def test_doctor_table_exits_zero_and_names_patches():
    from typer.testing import CliRunner

    from dspark_kit.cli import app

    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "markov-prev-token" in result.output and "speculators" in result.output
