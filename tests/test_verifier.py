"""One loader and one layer tap (vLLM layer-id convention) shared by every verifier user."""

from __future__ import annotations

import pytest
import torch

from dspark_kit.devices import detect_device
from dspark_kit.specdec.verifier import (
    LayerTap,
    decoder_layers,
    load_verifier,
    resolve_device,
    sample_token,
)

IDS = [5, 17, 33, 9, 2, 101, 7]


@pytest.fixture(scope="module")
def model(tiny_verifier):
    return load_verifier(tiny_verifier, "cpu")


@pytest.mark.slow
def test_layer_convention_matches_vllm(model):
    n = model.config.num_hidden_layers
    ids = torch.tensor(IDS)
    with LayerTap(model, [0, 1, n]) as tap:
        got = tap(ids)
    with torch.inference_mode():
        ref = model.model(input_ids=ids[None], output_hidden_states=True).hidden_states
    assert got.shape == (len(IDS), 3, model.config.hidden_size)
    assert torch.allclose(got[:, 0], ref[0][0]) and torch.allclose(got[:, 1], ref[1][0])
    assert not torch.allclose(got[:, 2], ref[n][0], atol=1e-3)  # HF's last entry is post-norm
    normed = model.model.norm(got[:, 2])
    assert torch.allclose(normed, ref[n][0], atol=1e-5)


@pytest.mark.slow
def test_cached_server_and_offline_paths_agree(tiny_verifier, model):
    from dspark_kit.engines.verifier_generator import extract_hidden_states
    from dspark_kit.specdec.decoder import Verifier

    layer_ids = [1, 3, 4]
    with LayerTap(model, layer_ids) as tap:
        offline = tap(torch.tensor(IDS))
    served, next_token = extract_hidden_states(model, IDS, layer_ids)
    assert torch.equal(served, offline)
    assert next_token == int(model(input_ids=torch.tensor([IDS])).logits[0, -1].argmax())
    v = Verifier(tiny_verifier, layer_ids)
    cache = v.new_cache()  # prefill in two chunks: the tap must read the cached forward too
    _, head = v.forward(IDS[:4], cache, 0)
    _, tail = v.forward(IDS[4:], cache, 4)
    cached = torch.cat([head, tail])
    assert cached.shape == (len(IDS), len(layer_ids) * model.config.hidden_size)
    assert torch.allclose(cached, offline.flatten(1), atol=1e-5)


@pytest.mark.slow
def test_bad_layer_ids_name_the_field(tiny_verifier, model):
    from dspark_kit.engines.verifier_generator import extract_hidden_states
    from dspark_kit.specdec.decoder import Verifier

    extract_hidden_states(model, IDS, [4])  # transformers installs its own capture hooks on a first forward
    hooks_before = list(decoder_layers(model)[-1]._forward_hooks)
    with pytest.raises(ValueError, match=r"^layer ids: \[5\] outside 0\.\.4 for a 4-layer verifier"):
        LayerTap(model, [0, 5])
    with pytest.raises(ValueError, match=r"^--layer-ids: \[-1\]"):
        extract_hidden_states(model, IDS, [-1, 2])
    with pytest.raises(ValueError, match=r"^aux_hidden_state_layer_ids: \[9\]"):
        Verifier(tiny_verifier, [1, 9])
    assert list(decoder_layers(model)[-1]._forward_hooks) == hooks_before  # no tap hook left behind


@pytest.mark.slow
def test_device_resolution_goes_through_detect_device(tiny_verifier):
    assert resolve_device("cpu:0") == "cpu:0"
    with pytest.raises(ValueError, match="device 'gpu'"):
        resolve_device("gpu")
    auto = load_verifier(tiny_verifier)  # default device auto
    assert next(auto.parameters()).device.type == detect_device("auto")
    assert not auto.training


def test_sample_token():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample_token(logits, 0.0) == 1
    # top_p this small keeps only the most likely token, whatever the temperature
    assert {sample_token(logits, 5.0, top_p=0.01, gen=torch.Generator().manual_seed(s)) for s in range(20)} == {1}
    draws = [sample_token(logits, 5.0, gen=torch.Generator().manual_seed(s)) for s in range(40)]
    assert len(set(draws)) > 1  # hot sampling really samples
    again = [sample_token(logits, 5.0, gen=torch.Generator().manual_seed(s)) for s in range(40)]
    assert draws == again  # and a seed makes it reproducible


def test_verifier_config_is_none_only_when_there_is_none(tmp_path, monkeypatch):
    """A verifier whose config exists but cannot be read is an error naming it, not "no config.json"
    (which sends users to set verifier.num_hidden_layers for the wrong reason)."""
    import transformers

    from dspark_kit.specdec.verifier import verifier_config

    assert verifier_config(str(tmp_path / "absent")) is None
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"broken/config.json is not valid JSON"):
        verifier_config(str(broken))

    def not_cached(*_a, **_k):
        raise OSError("couldn't find them in the cached files")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", not_cached)
    assert verifier_config("org/model") is None  # not in the HF cache here

    def unknown_type(*_a, **_k):
        raise ValueError("The checkpoint you are trying to load has model type `qwen9`")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", unknown_type)
    with pytest.raises(ValueError, match="qwen9"):
        verifier_config("org/model")
