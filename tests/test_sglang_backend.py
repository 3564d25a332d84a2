"""--rollout-backend sglang against real `miles serve` processes: the same run as the in-process
engine, a server killed mid-rollout (its requests redone elsewhere, nothing lost), and malformed
or partial answers named clearly."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles.errors import MilesError
from miles.models import registry
from miles.rollout import Request, SamplingParams
from miles.rollout.sglang_client import ServerError, SGLangRollout
from tests.conftest import comparable, small_run_args, start_server


@pytest.fixture(scope="module")
def servers():
    procs = [start_server() for _ in range(2)]
    yield [url for _, url in procs]
    for proc, _ in procs:
        proc.kill()
        proc.wait()


def small_run(out, *extra) -> list[str]:
    return [*small_run_args(out, 2), "--eval-interval", "1", *extra]


def test_a_run_on_miles_serve_processes_equals_the_in_process_run(servers, tmp_path):
    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train

    train(load_config(small_run(tmp_path / "local")))
    urls = ",".join(servers)
    train(load_config(small_run(tmp_path / "sglang", "--rollout-backend", "sglang", "--sglang-url", urls,
                                "--check-weight-update-equal")))  # fmt: skip
    local, remote = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "sglang")
    assert len(local) == len(remote) == 3  # the base's evaluation, then two steps
    for a, b in zip(comparable(local), comparable(remote)):
        for key, value in a.items():
            if key.startswith("sync_") or key == "engine_restarts":
                continue  # how the weights travel, not what the run computed
            assert key in b and b[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert remote[1]["reward_mean"] == local[1]["reward_mean"] and "eval_accuracy" in remote[0]
    assert (tmp_path / "sglang" / "sglang_weights" / "current" / "model.safetensors").exists()
    for url in servers:  # both servers hold the last step's weights
        info = json.loads(urllib.request.urlopen(url + "/get_server_info").read())
        assert info["weight_version"] == 2


def test_a_server_killed_mid_rollout_loses_nothing_and_rejoins(servers, tmp_path):
    """Requests in flight on a server that dies are redone on another: the same samples (the
    same seeds) as with no failure. The next weight update goes to the servers still up; the
    dead one, restarted on its port, loads the current weights before it serves again."""
    from miles.models.checkpoint import hf_state_dict

    policy, tokenizer = registry.load("tiny")
    victim, url = start_server()
    requests = lambda: [  # noqa: E731
        Request(
            tokenizer.encode(f"Calculate {i} + 3."), SamplingParams(temperature=1.0, max_new_tokens=8, seed=i)
        )
        for i in range(24)
    ]
    rollout = SGLangRollout(
        [url, *servers], tokenizer, policy.config, tmp_path, max_concurrency=4, backoff=0.01
    )
    rollout.update_weights(hf_state_dict(policy).items(), version=1)  # every server: the same weights
    calm = SGLangRollout(servers, tokenizer, policy.config, tmp_path, max_concurrency=4)
    want = calm.generate(requests())
    calls, original = [0], rollout._call

    def call(server, path, body=None, timeout=None):
        if path == "/generate":
            calls[0] += 1
            if calls[0] == 6:
                os.kill(victim.pid, signal.SIGKILL)  # mid-rollout: some requests done, some in flight
        return original(server, path, body, timeout)

    rollout._call = call
    got = rollout.generate(requests())
    victim.wait()
    assert rollout.restarts > 0
    assert [s.tokens for s in got] == [s.tokens for s in want]
    assert {s.metadata["server"] for s in got[12:]} <= set(servers)
    for a, b in zip(got, want):
        assert a.rollout_log_probs == pytest.approx(b.rollout_log_probs, abs=1e-5)
        assert (a.rollout_routed_experts == b.rollout_routed_experts).all()

    rollout._call = original
    rollout.update_weights(hf_state_dict(policy).items(), version=2)  # the victim is down: set aside
    assert [s.stale for s in rollout.servers] == [True, False, False]
    restarted, _ = start_server(port=int(url.rsplit(":", 1)[1]))
    try:
        again = rollout.generate(requests())
        info = json.loads(urllib.request.urlopen(url + "/get_server_info").read())
        assert info["weight_version"] == 2  # loaded before its first request
        assert url in {s.metadata["server"] for s in again} and not rollout.servers[0].stale
        assert [s.tokens for s in again] == [s.tokens for s in want]
        assert {s.weight_versions[0] for s in again} == {2}
    finally:
        restarted.kill()
        restarted.wait()


class Fake(BaseHTTPRequestHandler):
    """A server that answers /get_server_info with `info` and /generate with `answer`."""

    info: dict = {"version": "0.5.2"}
    answer: bytes = b"{}"

    def log_message(self, *args):
        pass

    def _send(self, raw: bytes):
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        self._send(json.dumps(type(self).info).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(type(self).answer)


@pytest.fixture
def fake():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("F", (Fake,), {}))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()


GOOD = {"output_ids": [5, 6], "meta_info": {"output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]],
        "finish_reason": {"type": "length"}, "routed_experts": None}}  # fmt: skip


@pytest.mark.parametrize(
    "answer, message",
    [
        (b"<html>", "is not JSON"),
        (json.dumps({"text": "hi"}).encode(), "no 'meta_info'"),
        (json.dumps({**GOOD, "output_ids": [5]}).encode(), "2 log-probs for 1 output tokens"),
        (json.dumps({**GOOD, "output_ids": [5, 7]}).encode(), "does not match token 7"),
        (json.dumps(GOOD).encode(), "no meta_info.routed_experts"),
        (json.dumps({**GOOD, "meta_info": {**GOOD["meta_info"], "routed_experts": [1, 2, 3]}}).encode(),
         "has 3 ids; want 4 tokens x 4 layers x 2"),
    ],
)  # fmt: skip
def test_malformed_or_partial_answers_are_named(fake, answer, message):
    policy, tokenizer = registry.load("tiny")
    fake.RequestHandlerClass.answer = answer
    url = f"http://127.0.0.1:{fake.server_address[1]}"
    rollout = SGLangRollout([url], tokenizer, policy.config, "/tmp/unused")
    with pytest.raises(ServerError, match=re.escape(message)) as e:
        rollout.generate([Request([1, 2, 3], SamplingParams(max_new_tokens=2))])
    assert url in str(e.value)


def test_an_old_sglang_is_refused_with_the_version_needed(fake):
    policy, tokenizer = registry.load("tiny")
    fake.RequestHandlerClass.info = {"version": "0.3.6"}
    with pytest.raises(ServerError, match=r"server version '0.3.6'; miles needs SGLang >= 0.4.6"):
        SGLangRollout([f"http://127.0.0.1:{fake.server_address[1]}"], tokenizer, policy.config, "/tmp/unused")
    with pytest.raises(ServerError, match="no server answered"):  # nothing listens there
        SGLangRollout(["http://127.0.0.1:9"], tokenizer, policy.config, "/tmp/unused", retries=1)


def test_backend_flags_are_checked():
    from miles.config import load_config

    with pytest.raises(MilesError, match="--rollout-backend sglang needs --sglang-url"):
        load_config(["--rollout-backend", "sglang"])
    with pytest.raises(MilesError, match="add --rollout-backend sglang"):
        load_config(["--sglang-url", "http://h:1"])
    with pytest.raises(MilesError, match="not an http"):
        load_config(["--rollout-backend", "sglang", "--sglang-url", "h:1"])
    with pytest.raises(MilesError, match="does not combine with --partial-rollout"):
        load_config(
            [
                "--rollout-backend",
                "sglang",
                "--sglang-url",
                "http://h:1",
                "--partial-rollout",
                "--over-sampling-batch-size",
                "64",
            ]
        )


def test_weights_broadcast_over_the_weight_update_group(servers):
    """--sglang-weight-transport distributed: both servers join SGLang's weight-update group and
    hold exactly the broadcast weights, under the version sent."""
    import torch

    policy, tokenizer = registry.load("tiny")
    rollout = SGLangRollout(servers, tokenizer, policy.config, "/tmp/unused", transport="distributed")
    from miles.models.checkpoint import hf_state_dict

    torch.manual_seed(0)
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in hf_state_dict(policy).items()}
    for version in (7, 8):  # the group is formed once, then reused
        rollout.update_weights(new.items(), version=version)
        for state in rollout.states():
            assert all(torch.equal(state[k], v) for k, v in new.items())
        new = {k: v * 1.001 for k, v in new.items()}
    for url in servers:
        assert json.loads(urllib.request.urlopen(url + "/get_server_info").read())["weight_version"] == 8


def test_lora_adapters_reach_the_servers_by_disk_and_by_group(servers, tmp_path):
    """A LoRA sync to miles serve: as a PEFT adapter directory (disk) or over the weight-update
    group, each server reads back the adapter sent and serves base + scale * B A."""
    import torch

    from miles.lora.adapters import LoraSpec, adapted, add_adapters, merged_state
    from miles.models.checkpoint import hf_state_dict
    from miles.sync.payload import published_weights

    policy, tokenizer = registry.load("tiny")
    add_adapters(policy, LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "down_proj")), seed=0)
    gen = torch.Generator().manual_seed(1)
    base = SGLangRollout(servers, tokenizer, policy.config, tmp_path / "base")
    base.update_weights(
        hf_state_dict(policy).items(), version=10
    )  # whole weights: what earlier tests sent goes
    for transport, version in (("disk", 11), ("distributed", 12)):
        with torch.no_grad():
            for m in adapted(policy).values():
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=gen) * 0.1)
        rollout = SGLangRollout(servers, tokenizer, policy.config, tmp_path / transport, transport=transport)
        payload = published_weights(policy)
        rollout.update_weights(payload.items(), version=version)
        merged = merged_state(policy, hf_state_dict(policy))
        for state in rollout.states():
            assert all(torch.equal(state[k], v.float()) for k, v in payload.items())
        rollout._shapes = {k: list(merged[k].shape) for k in ("model.layers.1.self_attn.q_proj.weight",)}
        for state in rollout.states():  # the served layer is merged (values pass through JSON)
            for k, v in state.items():
                assert (v - merged[k]).abs().max() < 1e-6
        if transport == "disk":
            assert (tmp_path / transport / "current" / "adapter_config.json").exists()


def test_tool_conversations_through_sglang_servers_equal_the_local_engines(servers, tmp_path):
    from miles.agents.tool_rollout import ToolCalling
    from miles.agents.tools import ToolBox, load_tools
    from miles.models.checkpoint import hf_state_dict
    from miles.rollout import Engine
    from tests.agent_fixtures import always_calculator

    policy, tokenizer = registry.load("tiny")
    rollout = SGLangRollout(servers, tokenizer, policy.config, tmp_path)
    rollout.update_weights(hf_state_dict(policy).items(), version=7)  # the base, whatever ran before
    local = Engine(policy, tokenizer, max_batch_size=8)
    box = ToolBox(load_tools(["calculator"]))
    calling = ToolCalling(box, always_calculator, ["</tool_call>"], max_turns=2, max_turn_tokens=6)

    def conversations(engine):
        prompts = [calling.prompt_ids(tokenizer, f"Calculate {i} + 3.", True) for i in range(4)]
        params = [SamplingParams(temperature=1.0, max_new_tokens=60, seed=i) for i in range(4)]
        return calling.generate(engine, [Request(p, q) for p, q in zip(prompts, params)])

    try:
        got, want = conversations(rollout), conversations(local)
    finally:
        box.close()
    assert [(s.tokens, s.loss_mask) for s in got] == [(s.tokens, s.loss_mask) for s in want]
    assert all(s.metadata["tool_calls"] == 1 and s.weight_versions == [7] for s in got)
    for s, w in zip(got, want):
        assert s.rollout_log_probs == pytest.approx(w.rollout_log_probs, abs=1e-5)
