"""`miles serve`: the SGLang-compatible HTTP subset, and 4xx (never a crash) on bad requests."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
import torch

from miles.models import byte_tokenizer, save_model
from miles.rollout import Engine, Request, SamplingParams
from miles.serve.server import EngineServer
from tests.conftest import random_model


def call(url: str, path: str, body=None, raw: bytes | None = None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server():
    tok = byte_tokenizer()
    model = random_model("qwen3_moe", seed=0, vocab_size=len(tok))
    model.init_weights(std=0.15, seed=0)
    srv = EngineServer(Engine(model, tok, max_batch_size=4, max_seq_len=128), port=0).start()
    yield srv
    srv.shutdown()


def test_health_and_binding(server):
    assert server.host == "127.0.0.1"
    assert call(server.url, "/health") == (200, {"status": "ok"})


def test_generate_text_matches_engine(server):
    status, out = call(
        server.url,
        "/generate",
        {
            "text": "12+7=",
            "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
            "return_logprob": True,
            "return_routed_experts": True,
        },
    )
    assert status == 200
    tok = server.engine.tokenizer
    local = Engine(server.engine.model, tok, max_batch_size=1, max_seq_len=128).generate(
        [Request(tok("12+7=").input_ids, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))]
    )[0]
    assert out["output_ids"] == local.response_tokens and out["text"] == local.response
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 8
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert (
        max(abs(a - b) for (a, _, _), b in zip(meta["output_token_logprobs"], local.rollout_log_probs)) < 1e-6
    )
    assert len(meta["routed_experts"]) == 5 + 8 - 1


def test_batch_and_input_ids(server):
    status, out = call(
        server.url,
        "/generate",
        {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
    )
    assert status == 200 and isinstance(out, list) and len(out) == 2
    assert all(len(o["output_ids"]) == 3 for o in out)


def test_concurrent_clients_share_the_engine(server):
    results = []

    def client(i):
        results.append(
            call(
                server.url,
                "/generate",
                {
                    "input_ids": [i + 1, 2],
                    "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
                },
            )
        )

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(s == 200 and len(o["output_ids"]) == 5 for s, o in results)


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({}, "exactly one of 'text' or 'input_ids'"),
        ({"text": "a", "input_ids": [1]}, "exactly one"),
        ({"input_ids": []}, "non-empty list"),
        ({"input_ids": ["x"]}, "non-empty list"),
        ({"input_ids": [1, 99999]}, "input_ids must be in"),
        ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature must be >= 0"),
        ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"text": "a", "sampling_params": {"max_new_tokens": "5"}}, "wrong type"),
        ({"text": "a", "sampling_params": {"frequency_penalty": 1.0}}, "frequency_penalty is not supported"),
        ({"text": "a", "bogus": 1}, "unsupported field"),
        ({"text": "a", "stream": True}, "stream"),
        ({"text": "x" * 200}, "does not fit"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}, "add return_logprob"),
        (
            {
                "input_ids": [1, 2],
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": -1,
            },
            "logprob_start_len must be",
        ),
    ],  # fmt: skip
)
def test_malformed_requests_get_400(server, body, fragment):
    status, out = call(server.url, "/generate", body)
    assert status == 400 and fragment in out["error"]


def test_bad_json_and_unknown_path(server):
    status, out = call(server.url, "/generate", raw=b"{not json")
    assert status == 400 and "not valid JSON" in out["error"]
    assert call(server.url, "/nope", {})[0] == 404
    assert call(server.url, "/health")[0] == 200  # still serving


def test_flush_cache_and_update_weights_from_disk(server, tmp_path):
    assert call(server.url, "/flush_cache", {}) == (200, {"success": True, "message": "Cache flushed."})
    new = random_model("qwen3_moe", seed=5, vocab_size=len(server.engine.tokenizer))
    save_model(new, tmp_path / "new")
    status, out = call(
        server.url, "/update_weights_from_disk", {"model_path": str(tmp_path / "new"), "weight_version": 3}
    )
    assert status == 200 and out["weight_version"] == 3
    assert torch.equal(server.engine.model.model.norm.weight, new.model.norm.weight)
    status, out = call(
        server.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    )
    assert out["meta_info"]["weight_version"] == 3
    status, out = call(server.url, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert status == 400 and "no such file" in out["error"]


def test_a_large_body_is_refused_before_it_is_read(server):
    import socket
    import time

    from miles.rollout.http import MAX_BODY_BYTES

    head = (
        f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {10 * 1024**2}\r\n\r\n"
    ).encode()
    t0 = time.perf_counter()
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(head + b'{"text": "' + b"a" * 65536)  # the rest of the 10 MB never comes
        reply = b""
        while chunk := sock.recv(65536):  # the server closes the connection after its answer
            reply += chunk
        reply = reply.decode()
    elapsed = time.perf_counter() - t0
    assert reply.startswith("HTTP/1.1 413") and str(MAX_BODY_BYTES) in reply
    assert elapsed < 2, elapsed  # answered at once, not after waiting for a body that never comes (10 s)


def test_nan_weights_from_disk_are_refused_and_the_served_weights_kept(server, tmp_path):
    tok = byte_tokenizer()
    bad = random_model("qwen3_moe", seed=3, vocab_size=len(tok))
    with torch.no_grad():
        bad.model.layers[0].self_attn.q_proj.weight[0, 0] = float("nan")
    save_model(bad, tmp_path / "bad")
    before = {k: v.clone() for k, v in server.engine.model.state_dict().items()}
    status, out = call(server.url, "/update_weights_from_disk", {"model_path": str(tmp_path / "bad")})
    assert status == 400 and "q_proj.weight" in out["error"] and "NaN" in out["error"]
    assert all(torch.equal(v, before[k]) for k, v in server.engine.model.state_dict().items())


def test_generation_stops_at_the_model_context():
    tok = byte_tokenizer()
    model = random_model("qwen3", vocab_size=len(tok), max_position_embeddings=24)
    engine = Engine(model, tok, max_batch_size=1, max_seq_len=2048)
    assert engine.max_seq_len == 24
    out = engine.generate([Request(list(range(5, 15)), SamplingParams(max_new_tokens=100, ignore_eos=True))])[
        0
    ]
    assert len(out.tokens) == 24 and out.status.value == "truncated"


def test_a_client_that_disconnects_is_not_an_error(server, capfd):
    import socket

    body = json.dumps(
        {"text": "1+1=", "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}
    ).encode()
    for _ in range(3):
        with socket.create_connection((server.host, server.port), timeout=10) as sock:
            sock.sendall(
                f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
            )
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    assert call(server.url, "/health")[0] == 200
    import time

    time.sleep(1.0)  # the abandoned requests finish and their replies hit closed sockets
    err = capfd.readouterr().err
    assert "BrokenPipeError" not in err and "ConnectionResetError" not in err and "Traceback" not in err


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b'{"text": "a", "sampling_params": {"temperature": NaN}}', "temperature must be a finite number"),
        (b'{"text": "\xff\xfe"}', "not valid JSON (UTF-8)"),
        (b"[" * 50_000 + b"]" * 50_000, "nests too deeply"),
    ],
    ids=["nan-temperature", "not-utf8", "deep-json"],
)
def test_hostile_bodies_get_400(server, raw, fragment):
    status, out = call(server.url, "/generate", raw=raw)
    assert status == 400 and fragment in out["error"]


def test_a_text_too_long_for_any_context_is_refused_before_tokenizing(server):
    import time

    t0 = time.perf_counter()
    status, out = call(server.url, "/generate", {"text": "x" * 5_000_000})
    assert status == 400 and "cannot fit the model's context" in out["error"]
    assert time.perf_counter() - t0 < 5  # the 5 MB text was never tokenized


def test_a_burst_of_200_simultaneous_clients_is_all_answered(server):
    """The listen backlog holds a burst (the default of 5 reset connections under 50 at once)."""
    barrier, statuses = threading.Barrier(200), []

    def client():
        barrier.wait()
        statuses.append(call(server.url, "/health")[0])

    threads = [threading.Thread(target=client) for _ in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses == [200] * 200


def test_a_prefill_only_request_scores_the_input_tokens(server):
    """max_new_tokens 0 with return_logprob (a distillation teacher's request): each token's
    log-prob given the ones before it, equal to a full forward of the served model."""
    from miles.algo.logprobs import token_logprobs

    ids = [5, 17, 42, 99, 7, 3]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    status, out = call(server.url, "/generate", {**body, "logprob_start_len": 2})
    assert status == 200 and out["output_ids"] == []
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids[2:]
    with torch.no_grad():
        logits = server.engine.model(torch.tensor([ids])).logits[0, :-1]
        want = token_logprobs(logits, torch.tensor(ids[1:])).tolist()
    assert [e[0] for e in entries] == pytest.approx(want[1:], abs=1e-5)
    status, whole = call(server.url, "/generate", body)
    assert whole["meta_info"]["input_token_logprobs"][0][0] is None  # the first token has no context
