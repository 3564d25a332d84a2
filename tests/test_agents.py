"""Agentic rollouts: tool calls parsed and run in sandboxed workers, conversations assembled from
the engine's exact tokens, custom generate functions and a black-box agent on the openai client."""

from __future__ import annotations

import pytest

from miles.agents.tool_calls import CallError, ToolCall, hermes
from miles.agents.tool_rollout import ToolCalling
from miles.agents.tools import ToolBox, calculator, load_tools
from miles.data.sample import Sample
from miles.errors import ConfigError
from miles.rewards.workers import Limits
from miles.rollout.engine import Engine
from miles.rollout.sampling import Request, SamplingParams
from tests.conftest import DEFAULT_YAML, random_model, response_logprobs

FIX = "tests.agent_fixtures"


@pytest.fixture(scope="module")
def smol_tokenizer():
    """SmolLM2's BPE tokenizer (from the converted checkpoint): where re-tokenization drifts."""
    from miles.models.gguf import gguf_checkpoint, smollm2_gguf_path
    from miles.models.tokenizer import load_tokenizer

    return load_tokenizer(gguf_checkpoint(smollm2_gguf_path()))


class Recorder:
    """A rollout that remembers every request it was sent and what it answered."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.tokenizer, self.calls = engine, engine.tokenizer, []

    def generate(self, requests):
        outs = self.engine.generate(requests)
        self.calls.append([(list(r.prompt_ids), list(o.response_tokens)) for r, o in zip(requests, outs)])
        return outs


def test_hermes_parser_reads_calls_and_names_what_it_cannot():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
        '<tool_call>{"name": "echo", "arguments": "{\\"text\\": \\"hi\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call><tool_call>{"name": "open"'
    )
    calls = hermes(text)
    assert calls[:2] == [ToolCall("calculator", {"expression": "2*3"}), ToolCall("echo", {"text": "hi"})]
    assert [c.kind for c in calls[2:]] == ["malformed_call"] * 4
    assert hermes("no calls here") == []
    assert calculator("123456789 * 987654321") == str(123456789 * 987654321)
    assert calculator("7 / 2") == "3.5"
    with pytest.raises(ValueError):
        calculator("__import__('os')")


def test_tool_schemas_come_from_signatures_and_bad_paths_are_refused():
    tools = load_tools(["calculator", f"{FIX}:echo"])
    assert tools["echo"].parameters == {
        "type": "object",
        "properties": {"text": {"type": "string", "description": "what to return"}},
        "required": ["text"],
    }
    with pytest.raises(ConfigError, match="--tool-path"):
        load_tools([f"{FIX}:nothing_here"])
    with pytest.raises(ConfigError, match="a second tool named 'echo'"):
        load_tools([f"{FIX}:echo", f"{FIX}:echo"])
    with pytest.raises(ConfigError, match="docstring"):
        load_tools([f"{FIX}:Sample"])  # a class without an Args: docstring


def test_every_tool_failure_is_an_observation_and_the_workers_go_on():
    names = ["echo", "boom", "sleepy", "hog", "big_file", "environment"]
    box = ToolBox(
        load_tools(["python", *(f"{FIX}:{n}" for n in names)]),
        timeout=2.0,
        limits=Limits(5, 512, 1),
        num_workers=4,
    )
    try:
        calls = [
            ToolCall("echo", {"text": "fine"}),
            ToolCall("boom", {"x": 3}),
            ToolCall("sleepy", {"seconds": 60.0}),  # killed at the timeout
            ToolCall("hog", {"gigabytes": 10}),  # over the 512 MiB address-space limit
            ToolCall("big_file", {"megabytes": 8}),  # over the 1 MiB file limit
            ToolCall("nope", {}),
            ToolCall("echo", {"text": 3}),
            ToolCall("echo", {"words": "x"}),
            CallError("malformed_call", "the tool call is not valid JSON"),
            ToolCall("environment", {"name": "MILES_SECRET"}),
            ToolCall("python", {"code": "print(6 * 7)"}),
            ToolCall("python", {"code": "while True:\n    pass"}),  # killed at the timeout
            ToolCall("python", {"code": "x = 'a' * 10**10"}),  # a MemoryError inside the program
        ]
        import os

        os.environ["MILES_SECRET"] = "leaked"
        results = box.run(calls)
        kinds = [r.error for r in results]
        assert kinds == [
            None, "tool_raised", "timeout", "memory", "tool_raised", "unknown_tool", "bad_arguments",
            "bad_arguments", "malformed_call", None, None, "timeout", None,
        ]  # fmt: skip
        assert results[0].text == "fine" and "boom 3" in results[1].text
        assert "--tool-timeout 2" in results[2].text and "File too large" in results[4].text
        assert results[-3].text == "42\n" and "MemoryError" in results[-1].text
        secret, cwd = results[-4].text.split("|")
        assert secret == "None" and "miles-tool-" in cwd  # a clean environment, a fresh directory
        assert box.run([ToolCall("echo", {"text": "after"})])[0].text == "after"  # replaced workers serve
    finally:
        os.environ.pop("MILES_SECRET", None)
        box.close()


def test_conversation_trains_on_the_engines_exact_tokens(smol_tokenizer):
    """A tool result that tokenizes differently alone than in context: the trajectory is the
    engine's own ids (re-tokenizing the text would change them), masks are 1 exactly on the
    policy's tokens, and the trainer's log-probs equal the engine's."""
    tok = smol_tokenizer
    model = random_model("llama", vocab_size=len(tok), max_position_embeddings=512)
    rollout = Recorder(Engine(model, tok, max_batch_size=4))
    box = ToolBox(load_tools([f"{FIX}:suffix"]))
    from tests.agent_fixtures import always_suffix

    calling = ToolCalling(box, always_suffix, ["</tool_call>"], max_turns=3, max_turn_tokens=6)
    try:
        prompts = [calling.prompt_ids(tok, f"Say something {i}", True) for i in range(3)]
        budget = [200, 200, 30]  # the last runs out of room for a tool result
        requests = [
            Request(
                p, SamplingParams(temperature=1.0, max_new_tokens=b, seed=i), sample=Sample(prompt=str(i))
            )
            for i, (p, b) in enumerate(zip(prompts, budget))
        ]
        samples = calling.generate(rollout, requests)
    finally:
        box.close()
    assert [s.metadata["finish"] for s in samples] == ["max_turns", "max_turns", "context"]
    assert [s.metadata["turns"] for s in samples] == [3, 3, 2]
    for i, s in enumerate(samples):
        # every request continued the previous one exactly; the sample is the last one plus its answer
        turns = [(pr, rs) for call in rollout.calls for pr, rs in call if pr[: len(prompts[i])] == prompts[i]]
        for (prompt, response), (next_prompt, _) in zip(turns, turns[1:]):
            assert next_prompt[: len(prompt) + len(response)] == prompt + response
        last_prompt, last_response = turns[-1]
        assert s.tokens == last_prompt + last_response
        generated = {j for prompt, response in turns for j in range(len(prompt), len(prompt) + len(response))}
        p = s.prompt_length
        assert [int(j + p in generated) for j in range(s.response_length)] == s.loss_mask
        assert s.metadata["observation_tokens"] == s.response_length - sum(s.loss_mask)
    # decoding and encoding again changes the ids: a trainer that re-tokenized would train on other tokens
    assert any(tok(tok.decode(s.tokens), add_special_tokens=False).input_ids != s.tokens for s in samples)
    trainer = response_logprobs(model, samples)
    gaps = [
        abs(a - b)
        for s, lp in zip(samples, trainer)
        for a, b, m in zip(lp, s.rollout_log_probs, s.loss_mask)
        if m
    ]
    assert max(gaps) < 1e-5, max(gaps)


def test_lockstep_batches_every_waiting_conversation_in_sample_order():
    from miles.agents.lockstep import Lockstep
    from miles.models.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    rollout = Recorder(Engine(random_model("llama", vocab_size=len(tok)), tok, max_batch_size=8))

    def job(i, client):
        first = client.generate([10 + i, 11], SamplingParams(max_new_tokens=3, seed=i))
        if i % 2:
            return first.tokens
        return client.generate(first.tokens + [12], SamplingParams(max_new_tokens=2, seed=i)).tokens

    import functools

    out = Lockstep(rollout).run([functools.partial(job, i) for i in range(5)], tok)
    assert [len(call) for call in rollout.calls] == [5, 3]  # all five waited together, then the three
    assert [p[0] for p, _ in rollout.calls[0]] == [10, 11, 12, 13, 14]  # in sample order
    assert out[1] == rollout.calls[0][1][0] + rollout.calls[0][1][1]


def agent_run(tmp_path, *flags: str, steps: int = 2):
    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train
    from tests.conftest import small_run_args

    rollouts = str(tmp_path / "rollout_{rollout_id}.pt")
    args = small_run_args(tmp_path, steps) + ["--save-debug-rollout-data", rollouts, *flags]
    train(load_config(args))
    return read_metrics(tmp_path), rollouts


def test_tool_mode_trains_with_agent_metrics_and_routing_replay(tmp_path):
    """The default MoE job with the calculator tool: conversations train (R3 on, train/rollout
    log-probs at the usual level) and every step logs the agent_* metrics."""
    from miles.rollout.debug_data import load_rollout

    metrics, rollouts = agent_run(
        tmp_path, "--tool-path", "calculator", "--tool-call-parser", f"{FIX}:always_calculator",
        "--rollout-max-response-len", "64", "--max-turn-tokens", "8", "--max-turns", "2",
    )  # fmt: skip
    steps = [m for m in metrics if m["rollout"] >= 0]
    for m in steps:
        assert m["turns_mean"] == 2 and m["tool_calls_mean"] == 1 and m["trajectory_max_turns_frac"] == 1
        assert m["tool_errors"] == 0 and m["observation_tokens_mean"] > 0
        assert m["train_rollout_logprob_abs_diff"] < 1e-5 and m["routing_mismatch_frac"] == 0
    groups, _ = load_rollout(rollouts, 0)
    s = groups[0][0]
    assert s.rollout_routed_experts.shape[0] == len(s.tokens) - 1  # routing for every token fed
    from miles.models.tokenizer import byte_tokenizer

    assert "<|im_start|>tool\n408<|im_end|>" in byte_tokenizer().decode(s.tokens[s.prompt_length :])


def test_custom_generate_function_trains_and_a_raising_one_drops_its_group(tmp_path):
    from miles.rollout.debug_data import load_rollout

    metrics, rollouts = agent_run(
        tmp_path, "--custom-generate-function-path", f"{FIX}:flaky_generate", steps=1
    )
    step = metrics[-1]
    groups, _ = load_rollout(rollouts, 0)
    assert step["agent_errors"] > 0 and len(groups) < 4  # the raising prompts' groups were dropped
    for s in (s for g in groups for s in g):
        assert len(s.loss_mask) == s.response_length and 0 in s.loss_mask
    assert step["train_rollout_logprob_abs_diff"] < 1e-5


def test_custom_generate_function_that_breaks_the_contract_stops_the_run_clearly(tmp_path):
    from miles.errors import MilesError

    with pytest.raises(
        MilesError, match="--custom-generate-function-path returned a sample the trainer cannot use"
    ):
        agent_run(tmp_path, "--custom-generate-function-path", f"{FIX}:bad_generate", steps=1)


def test_agent_on_the_openai_client_trains_on_what_the_server_generated(tmp_path):
    pytest.importorskip("openai")
    from miles.rollout.debug_data import load_rollout
    from tests import agent_fixtures

    agent_fixtures.SEEN.clear()
    metrics, rollouts = agent_run(tmp_path, "--agent-path", f"{FIX}:openai_agent", "--eval-size", "0")
    served = [(r["prompt_token_ids"], r["choices"][0]["token_ids"]) for r in agent_fixtures.SEEN]
    for rollout_id in range(2):
        groups, _ = load_rollout(rollouts, rollout_id)
        samples = [s for g in groups for s in g]
        assert len(samples) == 16 and all(s.metadata["turns"] == 2 for s in samples)
        for s in samples:
            # the trajectory is the second request's exact prompt + its answer, and that prompt
            # continues the first request's exact prompt + answer
            second = next((p, a) for p, a in served if p + a == s.tokens and len(p) > s.prompt_length)
            first = next(
                (p, a)
                for p, a in served
                if p == s.tokens[: s.prompt_length] and second[0][: len(p + a)] == p + a
            )
            middle = len(second[0]) - len(first[0]) - len(first[1])
            assert s.loss_mask == [1] * len(first[1]) + [0] * middle + [1] * len(second[1])
    assert all(m["train_rollout_logprob_abs_diff"] < 1e-5 for m in metrics if m["rollout"] >= 0)


def test_miles_serve_answers_the_openai_client(tmp_path):
    pytest.importorskip("openai")
    import openai

    from miles.models.tokenizer import byte_tokenizer
    from miles.serve.server import EngineServer

    tok = byte_tokenizer()
    model = random_model("qwen3", vocab_size=len(tok))
    server = EngineServer(Engine(model, tok, max_batch_size=4, max_seq_len=256), port=0).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        out = client.chat.completions.create(
            model="m", messages=messages, max_tokens=6, logprobs=True, seed=1
        )
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert out.model_extra["prompt_token_ids"] == tok(ids, add_special_tokens=False).input_ids
        answer = out.choices[0].model_extra["token_ids"]
        assert out.usage.completion_tokens == len(answer) == len(out.choices[0].logprobs.content)
        sample = Sample(tokens=out.model_extra["prompt_token_ids"] + answer, response_length=len(answer))
        oracle = response_logprobs(model, [sample])[0]
        engine_lp = [c.logprob for c in out.choices[0].logprobs.content]
        assert max(abs(a - b) for a, b in zip(oracle, engine_lp)) < 1e-5
        text = client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=4, seed=2)
        assert (
            text.model_extra["prompt_token_ids"] == [5, 6, 7]
            and len(text.choices[0].model_extra["token_ids"]) <= 4
        )
        with pytest.raises(openai.BadRequestError, match="stream=true is not supported"):
            client.chat.completions.create(model="m", messages=messages, stream=True)
        with pytest.raises(openai.BadRequestError, match="messages"):
            client.chat.completions.create(model="m", messages=[])
    finally:
        server.shutdown()


def test_agent_flags_are_checked_before_any_work():
    from miles.config import load_config

    with pytest.raises(ConfigError, match="--tool-path and --agent-path are two rollout modes"):
        load_config(["--config", str(DEFAULT_YAML), "--tool-path", "calculator", "--agent-path", "a:b"])
    with pytest.raises(ConfigError, match="--tool-path with --partial-rollout"):
        load_config(
            [
                "--config",
                str(DEFAULT_YAML),
                "--tool-path",
                "calculator",
                "--partial-rollout",
                "--over-sampling-batch-size",
                "64",
            ]
        )
    with pytest.raises(ConfigError, match="--max-turns"):
        load_config(["--config", str(DEFAULT_YAML), "--tool-path", "calculator", "--max-turns", "0"])
    cfg = load_config(["--config", str(DEFAULT_YAML), "--tool-path", "calculator", "--tool-path", "python"])
    assert cfg.agent.tool_path == ["calculator", "python"]


def test_a_forking_agent_yields_one_trajectory_per_branch():
    pytest.importorskip("openai")
    from miles.agents.modes import BlackBoxAgent
    from miles.models.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    engine = Engine(random_model("llama", vocab_size=len(tok)), tok, max_batch_size=8, max_seq_len=256)
    agent = BlackBoxAgent(f"{FIX}:forking_agent", max_tokens=16)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=3)
    try:
        (samples,) = agent.generate_each(engine, [Request([1], params, sample=Sample(prompt="hi"))])
    finally:
        agent.close()
    assert len(samples) == 3 and all(s.metadata["agent_reward"] == 0.5 for s in samples)
    left, right, rewritten = samples
    assert left.metadata["turns"] == right.metadata["turns"] == 2 and rewritten.metadata["turns"] == 1
    first = left.prompt_length + left.loss_mask.index(0)  # the shared first reply ends here
    assert left.tokens[:first] == right.tokens[:first] and left.tokens != right.tokens
    assert "left" in tok.decode(left.tokens) and "right" in tok.decode(right.tokens)
    assert "something else" in tok.decode(rewritten.tokens) and "user\nhi" not in tok.decode(rewritten.tokens)
