"""The OpenAI-compatible endpoint black-box agents talk to during training.

Each sample's agent gets its own base URL (`http://127.0.0.1:PORT/s/<session>/v1`); what it
asks there is answered by the run's rollout (through `Lockstep`, batched with every other
agent's requests) and recorded in that session as exact tokens (`ChatSession`).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from miles.agents import openai_api as api
from miles.agents.lockstep import EngineClient
from miles.rollout.server import BadRequest, Listener, json_handler


class AgentGateway:
    def __init__(self, tokenizer, default_max_tokens: int, model: str = "policy") -> None:
        self.tokenizer, self.default_max_tokens, self.model = tokenizer, default_max_tokens, model
        self.sessions: dict[str, tuple[api.ChatSession, EngineClient]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.httpd = Listener(("127.0.0.1", 0), json_handler(self.get, self.post))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="miles-agent-api")
        self._thread.start()

    def open(self, client: EngineClient) -> tuple[str, str]:
        """(session id, base URL) for one agent run."""
        with self._lock:
            sid = str(next(self._ids))
            self.sessions[sid] = (api.ChatSession(self.tokenizer), client)
        return sid, f"http://127.0.0.1:{self.port}/s/{sid}/v1"

    def take(self, sid: str) -> api.ChatSession:
        with self._lock:
            return self.sessions.pop(sid)[0]

    def _session(self, path: str) -> tuple[api.ChatSession, EngineClient, str]:
        parts = path.split("/", 4)  # '', 's', sid, 'v1', endpoint
        if len(parts) < 5 or parts[1] != "s" or parts[3] != "v1":
            raise BadRequest(f"no such endpoint {path}; use the base URL the agent was given")
        with self._lock:
            found = self.sessions.get(parts[2])
        if found is None:
            raise BadRequest(f"session {parts[2]} is over (its sample was collected)")
        return found[0], found[1], parts[4]

    def get(self, path: str) -> tuple[int, Any]:
        _, _, endpoint = self._session(path)
        if endpoint == "models":
            return 200, {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "owned_by": "miles"}],
            }
        return 404, {"error": f"no such endpoint: GET {path}"}

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        session, client, endpoint = self._session(path)
        try:
            if endpoint == "chat/completions":
                messages, tools = api.chat_request(body)
                params = api.sampling(body, self.default_max_tokens)
                sample = client.generate(session.prompt(messages, tools), params)
                session.record(messages, tools, sample)
                return 200, api.chat_response(sample, self.tokenizer, self.model, bool(body.get("logprobs")))
            if endpoint == "completions":
                ids = api.completion_request(body, self.tokenizer)
                params = api.sampling(body, self.default_max_tokens)
                sample = client.generate(ids, params)
                session.record(None, None, sample)
                return 200, api.completion_response(
                    sample, self.tokenizer, self.model, bool(body.get("logprobs"))
                )
        except api.APIError as e:
            raise BadRequest(str(e)) from e
        return 404, {"error": f"no such endpoint: POST {path}"}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=10)
