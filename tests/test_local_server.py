"""The local engine over real HTTP on 127.0.0.1 (uvicorn in a thread, one model load)."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import uvicorn

from dspark_kit.engines.local.server import Engine, build_generator, create_app, parse_args
from dspark_kit.specdec.verifier import load_tokenizer, load_verifier

pytestmark = pytest.mark.slow  # every test serves the tiny verifier


class ThreadServer:
    def __init__(self, app, engine=None):
        self.engine = engine
        # bound here, port 0: a free_port() number could be taken again before uvicorn binds it
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 120  # a hang, not a busy machine
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def verifier(tiny_verifier):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engine does: oversubscribed OpenMP crawls on 2 busy cores
    path = str(tiny_verifier)
    model, tok = load_verifier(path, "cpu", "float32"), load_tokenizer(path)
    yield path, model, tok
    torch.set_num_threads(threads)


def _serve(verifier, *flags):
    path, model, tok = verifier
    args = parse_args(["--model", path, *flags])
    engine = Engine(args, model, tok, build_generator(args, model))
    return ThreadServer(create_app(engine), engine)


@pytest.fixture(scope="module")
def chat_server(verifier):
    s = _serve(verifier, "--served-model-name", "tiny")
    yield s
    s.stop()


def _chat(url, content, **extra):
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 16,
            "chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_health_models_and_greedy_chat_match_hf_generate(chat_server, verifier):
    _, model, tok = verifier
    assert httpx.get(chat_server.url + "/health").status_code == 200
    assert [m["id"] for m in httpx.get(chat_server.url + "/v1/models").json()["data"]] == ["tiny"]
    r = _chat(chat_server.url, "Sort these words alphabetically: pear, apple, cat")
    assert r.status_code == 200, r.text
    body = r.json()
    ids = body["choices"][0]["token_ids"]
    # independent reference: transformers' own greedy generate on the same prompt ids
    ref = model.generate(torch.tensor([body["prompt_token_ids"]]), max_new_tokens=16, do_sample=False,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=0)
    ref_new = ref[0, len(body["prompt_token_ids"]):].tolist()
    stop_id = tok.convert_tokens_to_ids("<|im_end|>")
    assert ids == ref_new  # as in vLLM, a stop token is part of the output ids, not of the text
    assert body["choices"][0]["finish_reason"] == ("stop" if stop_id in ref_new else "length")
    shown = [t for t in ids if t != stop_id]
    assert body["choices"][0]["message"]["content"] == tok.decode(shown, skip_special_tokens=False)
    assert body["usage"] == {"prompt_tokens": len(body["prompt_token_ids"]), "completion_tokens": len(ids),
                             "total_tokens": len(body["prompt_token_ids"]) + len(ids)}


def test_length_finish_seeded_sampling_and_completions(chat_server):
    r = _chat(chat_server.url, "Continue the story: the cat sat.", max_tokens=2).json()
    assert r["choices"][0]["finish_reason"] == "length" and len(r["choices"][0]["token_ids"]) == 2
    a = _chat(chat_server.url, "Count up", temperature=1.0, seed=7).json()["choices"][0]["token_ids"]
    b = _chat(chat_server.url, "Count up", temperature=1.0, seed=7).json()["choices"][0]["token_ids"]
    assert a == b
    c = httpx.post(chat_server.url + "/v1/completions", json={"prompt": [1, 5, 6, 7], "max_tokens": 3,
                                                              "return_token_ids": True}).json()
    assert c["choices"][0]["prompt_token_ids"] == [1, 5, 6, 7] and c["usage"]["prompt_tokens"] == 4
    t = httpx.post(chat_server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}).json()
    assert t["object"] == "text_completion" and t["usage"]["completion_tokens"] <= 2


def _metric(text, name):
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_metrics_count_tokens_with_vllm_names(chat_server):
    before = httpx.get(chat_server.url + "/metrics").text
    usage = _chat(chat_server.url, "Sort these words alphabetically: b, a").json()["usage"]
    after = httpx.get(chat_server.url + "/metrics").text
    assert 'engine="0"' in after and 'model_name="tiny"' in after
    gen = _metric(after, "vllm:generation_tokens_total") - _metric(before, "vllm:generation_tokens_total")
    prompt = _metric(after, "vllm:prompt_tokens_total") - _metric(before, "vllm:prompt_tokens_total")
    assert (gen, prompt) == (usage["completion_tokens"], usage["prompt_tokens"])
    assert "vllm:num_requests_running" in after and "vllm:spec_decode" not in after


@pytest.mark.parametrize("body, status", [
    ({"messages": [], "max_tokens": 4}, 400),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, 400),
])
def test_bad_chat_requests_get_4xx_json(chat_server, body, status):
    r = httpx.post(chat_server.url + "/v1/chat/completions", json=body)
    assert r.status_code == status and "message" in r.json()["error"]


def test_bad_completions_and_oversized_body(chat_server):
    url = chat_server.url + "/v1/completions"
    assert httpx.post(url, json={"prompt": [5, 10**7]}).status_code == 400
    assert httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    assert httpx.post(url, content=b"x" * (17 * 2**20)).status_code == 413


def test_api_key_everywhere_but_health(verifier):
    s = _serve(verifier, "--api-key", "sekret")
    try:
        assert httpx.get(s.url + "/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(s.url + path).status_code == 401
            assert httpx.get(s.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(s.url + path, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.post(s.url + "/v1/completions", json={"prompt": [1]}).status_code == 401
    finally:
        s.stop()


def running(url: str) -> float:
    """The server's own count of requests in flight (vllm:num_requests_running on /metrics)."""
    return _metric(httpx.get(url + "/metrics", timeout=30).text, "vllm:num_requests_running")


def wait_running(url: str, n: int, deadline_s: float = 60) -> None:
    """Until the server counts n requests in flight; fails only if it never does (a hang)."""
    deadline = time.monotonic() + deadline_s
    while running(url) != n:
        assert time.monotonic() < deadline, f"never {n} request(s) in flight"
        time.sleep(0.02)


def test_503_when_full_and_health_stays_responsive(verifier):
    s = _serve(verifier, "--max-concurrency", "1", "--token-delay-ms", "100")
    try:
        # ignore_eos: the slow request decodes 60 tokens x 100 ms (6 s at least) whatever the
        # verifier would say, so it is still decoding when /health and the second request come
        body = {"prompt": [1, 5, 6], "max_tokens": 60, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:
            slow = pool.submit(httpx.post, s.url + "/v1/completions", json=body, timeout=120)
            wait_running(s.url, 1)
            # decoding runs off the event loop: /health answers while the request still decodes
            assert httpx.get(s.url + "/health", timeout=30).status_code == 200
            busy = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
            assert busy.status_code == 503 and "max-concurrency" in busy.json()["error"]["message"]
            assert running(s.url) == 1 and not slow.done(), "the slow request ended before the checks"
            assert slow.result().status_code == 200
        assert httpx.post(s.url + "/v1/completions", json={**body, "max_tokens": 1}, timeout=60).status_code == 200
    finally:
        s.stop()


@pytest.fixture(scope="module")
def hs_server(verifier, tmp_path_factory):
    storage = tmp_path_factory.mktemp("hs")
    s = _serve(verifier, "--role", "hidden-states", "--layer-ids", "1,2,4", "--storage-path", str(storage))
    s.storage = storage
    yield s
    s.stop()


def test_hidden_states_via_speculators_client_match_hf_forward(hs_server, verifier):
    import openai
    from hs_connectors.transfer import FileTransfer
    from speculators.data_generation.offline import check_hidden_states
    from speculators.data_generation.vllm_client import generate_hidden_states

    path, model, _ = verifier
    ids = [1, 90, 593, 204, 370, 311, 300, 2, 204]
    # exactly what speculators' online dataloader does (train/data.py)
    client = openai.OpenAI(base_url=hs_server.url + "/v1", api_key="EMPTY", max_retries=0)
    model_id = client.models.list().data[0].id
    assert model_id == path  # the trainer requires served id == verifier path
    handle, params = generate_hidden_states(client, model_id, {"input_ids": ids}, max_retries=0)
    assert handle.startswith(str(hs_server.storage)) and not (handle + ".lock") in str(
        list(hs_server.storage.iterdir()))
    loaded = FileTransfer(hs_server.storage).get_generated(params)
    check_hidden_states(loaded, ids)
    hs = loaded["hidden_states"]
    assert hs.shape == (len(ids), 3, 128) and hs.dtype == torch.bfloat16
    assert loaded["token_ids"].dtype == torch.int64 and loaded["token_ids"].tolist() == ids

    captured = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: captured.setdefault("x", o))
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    hook.remove()
    last = captured["x"][0] if isinstance(captured["x"], tuple) else captured["x"]
    expected = [out.hidden_states[1][0], out.hidden_states[2][0], last[0]]
    for slot, ref in enumerate(expected):
        torch.testing.assert_close(hs[:, slot].float(), ref.to(torch.bfloat16).float())
    # id N is pre-norm: it must differ from HF's post-norm last entry
    assert not torch.allclose(hs[:, 2].float(), out.hidden_states[-1][0].to(torch.bfloat16).float(), atol=1e-2)


@pytest.mark.parametrize("rid", ["../escape", "a/b", "..", "/etc/passwd", "x\\y"])
def test_hidden_states_request_id_cannot_escape_storage(hs_server, rid):
    r = httpx.post(hs_server.url + "/v1/completions", json={"prompt": [1, 5], "max_tokens": 1, "request_id": rid})
    assert r.status_code == 400
    assert not any(p.suffix == ".safetensors" for p in hs_server.storage.parent.iterdir())


def test_hidden_states_header_request_id_names_the_file(hs_server):
    r = httpx.post(hs_server.url + "/v1/completions", json={"prompt": [1, 5, 6], "max_tokens": 1},
                   headers={"X-Request-Id": "row-7"})
    assert r.status_code == 200
    assert r.json()["kv_transfer_params"]["hidden_states_path"] == str(hs_server.storage / "row-7.safetensors")
    assert (hs_server.storage / "row-7.safetensors").exists()
    assert not (hs_server.storage / "row-7.safetensors.lock").exists()


def test_spec_role_greedy_equals_verifier_and_reports_acceptance(verifier, chat_server, tmp_path):
    from fixtures_decoder import fresh_draft, save_draft
    from transformers import AutoConfig

    path, _, tok = verifier
    ckpt = save_draft(fresh_draft(path, block_size=4), tmp_path / "draft")
    args = parse_args(["--model", path, "--role", "spec", "--draft", str(ckpt), "--device", "cpu",
                       "--num-speculative-tokens", "3", "--served-model-name", "tiny"])
    s = ThreadServer(create_app(Engine(args, None, tok, build_generator(args, None),
                                       config=AutoConfig.from_pretrained(path))))
    try:
        prompt = "Sort these words alphabetically: pear, apple, cat"
        spec = _chat(s.url, prompt).json()["choices"][0]["token_ids"]
        assert spec == _chat(chat_server.url, prompt).json()["choices"][0]["token_ids"]
        text = httpx.get(s.url + "/metrics").text
        drafts = _metric(text, "vllm:spec_decode_num_drafts_total")
        accepted = _metric(text, "vllm:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and _metric(text, "vllm:spec_decode_num_draft_tokens_total") >= accepted
        assert _metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    finally:
        s.stop()
