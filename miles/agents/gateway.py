"""The OpenAI-compatible endpoint black-box agents talk to during training.

Each sample's agent gets its own base URL (`http://127.0.0.1:PORT/s/<session>/v1`); what it
asks there is answered by the run's rollout (through `Lockstep`, batched with every other
agent's requests) and recorded in that session as exact tokens (`ChatSession`).

The run's sampling settings apply (temperature, top-p, top-k: the trainer's log-probs assume
them; greedy during evaluation), and each completion's seed follows from the sample's seed and
its place in the session. The agent chooses `max_tokens` (at most the run's response length)
and stop strings.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from typing import Any

from miles.agents import openai_api as api
from miles.agents.lockstep import EngineClient
from miles.rollout.http import BadRequest, Listener, json_handler
from miles.rollout.sampling import SamplingParams

log = logging.getLogger("miles")


class AgentGateway:
    def __init__(self, tokenizer, default_max_tokens: int, model: str = "policy") -> None:
        self.tokenizer, self.default_max_tokens, self.model = tokenizer, default_max_tokens, model
        self.sessions: dict[str, tuple[api.ChatSession, EngineClient, SamplingParams]] = {}
        self._warned = False
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.httpd = Listener(("127.0.0.1", 0), json_handler(self.get, self.post))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="miles-agent-api")
        self._thread.start()

    def open(self, client: EngineClient, params: SamplingParams) -> tuple[str, str]:
        """(session id, base URL) for one agent run sampled with the run's `params`."""
        with self._lock:
            sid = str(next(self._ids))
            self.sessions[sid] = (api.ChatSession(self.tokenizer), client, params)
        return sid, f"http://127.0.0.1:{self.port}/s/{sid}/v1"

    def take(self, sid: str) -> api.ChatSession:
        with self._lock:
            return self.sessions.pop(sid)[0]

    def _session(self, path: str) -> tuple[api.ChatSession, EngineClient, SamplingParams, str]:
        parts = path.split("/", 4)  # '', 's', sid, 'v1', endpoint
        if len(parts) < 5 or parts[1] != "s" or parts[3] != "v1":
            raise BadRequest(f"no such endpoint {path}; use the base URL the agent was given")
        with self._lock:
            found = self.sessions.get(parts[2])
        if found is None:
            raise BadRequest(f"session {parts[2]} is over (its sample was collected)")
        return *found, parts[4]

    def get(self, path: str) -> tuple[int, Any]:
        *_, endpoint = self._session(path)
        if endpoint == "models":
            return 200, {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "owned_by": "miles"}],
            }
        return 404, {"error": f"no such endpoint: GET {path}"}

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        session, client, run_params, endpoint = self._session(path)
        try:
            if endpoint == "chat/completions":
                messages, tools = api.chat_request(body)
                params = self._params(api.sampling(body, self.default_max_tokens), run_params, session)
                sample = client.generate(session.prompt(messages, tools), params)
                session.record(messages, tools, sample)
                return 200, api.chat_response(sample, self.tokenizer, self.model, bool(body.get("logprobs")))
            if endpoint == "completions":
                ids = api.completion_request(body, self.tokenizer)
                params = self._params(api.sampling(body, self.default_max_tokens), run_params, session)
                sample = client.generate(ids, params)
                session.record(None, None, sample)
                return 200, api.completion_response(
                    sample, self.tokenizer, self.model, bool(body.get("logprobs"))
                )
        except api.APIError as e:
            raise BadRequest(str(e)) from e
        return 404, {"error": f"no such endpoint: POST {path}"}

    def _params(self, asked: SamplingParams, run: SamplingParams, session: api.ChatSession) -> SamplingParams:
        if not self._warned and (asked.temperature, asked.top_p, asked.top_k) != (
            run.temperature,
            run.top_p,
            run.top_k,
        ):
            self._warned = True
            log.warning(
                "an agent asked for temperature %g / top_p %g / top_k %d; the run samples with its own "
                "(%g / %g / %d): the trainer's log-probs assume them",
                asked.temperature, asked.top_p, asked.top_k, run.temperature, run.top_p, run.top_k,
            )  # fmt: skip
        seed = None if run.seed is None else hash((run.seed, len(session.completions))) % 2**63
        return dataclasses.replace(
            run, max_new_tokens=min(asked.max_new_tokens, run.max_new_tokens), stop=asked.stop, seed=seed
        )

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=10)
