"""Ports are decided once (engines/ports.py): a configured port is honoured or refused before any
model loads; port 0 takes a free one when the plan is made, and the plan says so."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.engines import ports
from dspark_kit.engines.ports import (
    PortBusy,
    decide_port,
    ensure_free,
    free_ports_in_a_row,
    port_in_use,
)
from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml"


@pytest.fixture()
def listening():
    """A port something listens on, for as long as the test runs."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def _res(tmp_path, *sets):
    return Resolved(load_recipe(TINY, list(sets)), tmp_path, planning=True)


def test_a_configured_port_is_the_port_and_zero_is_chosen_at_start(tmp_path):
    res = _res(tmp_path, "serve.port=8123", "serve.hidden_states_port=0")
    spec = decide_port(res.recipe.serve, "spec")
    assert (spec.number, spec.key, spec.chosen_at_start) == (8123, "serve.port", False)
    assert decide_port(res.recipe.serve, "chat") == spec  # chat and spec share serve.port
    hs = decide_port(res.recipe.serve, "hidden-states")
    assert hs.key == "serve.hidden_states_port" and hs.chosen_at_start and hs.number > 0
    assert "0: a free port" in hs.source and port_in_use("127.0.0.1", hs.number) is None


def test_a_busy_configured_port_is_refused_naming_the_key_and_the_fix(tmp_path, listening):
    port = decide_port(_res(tmp_path, f"serve.port={listening}").recipe.serve, "spec")
    with pytest.raises(PortBusy) as e:
        ensure_free(port, "127.0.0.1")
    assert str(e.value) == (f"serve.port {listening} on 127.0.0.1 is in use: stop what listens there, or set "
                            "serve.port: 0 to take a free port when the run starts")
    ensure_free(decide_port(_res(tmp_path, "serve.port=0").recipe.serve, "spec"), "127.0.0.1")  # never refused


def _verifier_recipe(tmp_path: Path, port: int) -> Path:
    """A config-only local verifier: nothing here can load a model, so a refusal is the port's."""
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 4,
                                                      "vocab_size": 1024}))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"workdir": str(tmp_path / "run"), "verifier": {"path": str(verifier)},
                                      "hidden_states": {"target_layer_ids": [1, 2, 3]},
                                      "train": {"device": "cpu"}, "serve": {"port": port}}))
    return recipe


def test_serve_refuses_a_busy_port_before_the_server_starts(tmp_path, listening):
    """Reproduced: a busy port showed only after the model loaded, at the end of a 20-line log tail."""
    r = CliRunner().invoke(app, ["serve", "--role", "chat", "-r", str(_verifier_recipe(tmp_path, listening))])
    assert r.exit_code == 1, r.output
    assert r.output.strip().splitlines()[-1] == (
        f"error: serve --role chat: serve.port {listening} on 127.0.0.1 is in use: stop what listens there, "
        "or set serve.port: 0 to take a free port when the run starts")
    assert not (tmp_path / "run" / "logs").exists() or not any((tmp_path / "run" / "logs").iterdir())


def test_preflight_warns_about_a_busy_port_and_is_quiet_about_a_free_one(tmp_path, listening):
    recipe = _verifier_recipe(tmp_path, listening)
    busy = CliRunner().invoke(app, ["preflight", "-r", str(recipe), "--json"])
    ports = [f for f in json.loads(busy.stdout)["findings"] if f["code"] == "port"]
    assert [(f["level"], f"serve.port {listening} on 127.0.0.1 is in use" in f["message"]) for f in ports] == [
        ("warning", True)]
    free = CliRunner().invoke(app, ["preflight", "-r", str(recipe), "--json", "--set", "serve.port=0"])
    assert not [f for f in json.loads(free.stdout)["findings"] if f["code"] == "port"]


def test_the_dry_run_and_serve_agree_on_a_configured_port(tmp_path):
    """serve --dry-run prints the configured port; a plan never picks a random one behind it."""
    recipe = _verifier_recipe(tmp_path, 8123)
    r = CliRunner().invoke(app, ["serve", "--role", "chat", "-r", str(recipe), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "--port 8123" in r.stdout


def _held_port_after_a_free_one() -> socket.socket:
    """A listening socket on a port P whose P - 1 is free at the time: in a parallel suite the port
    below an ephemeral one is often another test's (a CI run once found it so, and the check named
    the RPC port instead of the HTTP one)."""
    for _ in range(100):
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        held.listen()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", held.getsockname()[1] - 1))
                return held
            except OSError:
                held.close()
    raise AssertionError("no port P with P - 1 free in 100 tries")


def test_mooncake_master_ports_are_checked_before_it_starts(tmp_path):
    """Both ports mooncake_master listens on (RPC, and HTTP next to it) are refused in one line
    naming the recipe key when something holds one, before anything starts."""
    from dspark_kit.engines.servers import start_checks
    from dspark_kit.stages.training.train import plan as plan_train

    with _held_port_after_a_free_one() as held:
        rpc = held.getsockname()[1] - 1  # the HTTP port (rpc + 1) is the one held
        recipe = load_recipe(TINY, ["hidden_states.mode=online", "hidden_states.transport=mooncake",
                                    f"hidden_states.mooncake.master_port={rpc}"])
        master = plan_train(Resolved(recipe, tmp_path, planning=True)).process("mooncake master").server
        assert master.other_ports == {"hidden_states.mooncake.master_port": rpc,
                                      "hidden_states.mooncake.master_port + 1 (its HTTP port)": rpc + 1}
        with pytest.raises(PortBusy) as e:
            start_checks(master)
    msg = str(e.value)
    assert msg.startswith(f"hidden_states.mooncake.master_port + 1 (its HTTP port) {rpc + 1} is in use")
    assert "set hidden_states.mooncake.master_port to a free port" in msg and "\n" not in msg


def test_consecutive_free_ports_skip_a_run_with_one_held_and_stay_below_the_ephemeral_range(monkeypatch):
    """mooncake_master listens on port and port + 1: a run with the second port held is passed over."""
    low, _ = ports._ephemeral_range()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        for candidate in range(20000, low - 2):  # a port below the ephemeral range that we can hold
            try:
                held.bind(("127.0.0.1", candidate + 1))
                break
            except OSError:
                continue
        held.listen()
        tries, asked = iter([candidate, candidate + 7]), []  # the first run has its second port held

        def randrange(self, start, stop):
            asked.append((start, stop))
            return next(tries)

        monkeypatch.setattr(ports.random.SystemRandom, "randrange", randrange)
        first = free_ports_in_a_row(2)
    assert first == candidate + 7
    # the highest run it could draw (first port stop - 1, two ports) ends below the ephemeral range
    assert asked and all((stop - 1) + 1 < low for _, stop in asked)
