"""`miles serve --model <a reward model>`: a reward model behind HTTP, for `--rm-type remote_rm`.

POST /reward (any path but /health) takes slime's reward payload, {"prompt", "response", ...},
and answers {"score": r}; {"samples": [...]} (`--rm-batch-size N`) is answered with
{"rewards": [...]}. The sequence scored is the prompt through the chat template (unless the
server runs with chat off) followed by the response's tokens and EOS, as `miles rm` trained it.
One lock serialises the forwards; a malformed body gets a 400 naming the field.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from miles.models.tokenizer import encode_prompt
from miles.rewards.reward_model import sequence_rewards
from miles.rollout.http import BadRequest, Listener, json_handler


class RewardServer:
    def __init__(
        self, model, tokenizer, host: str = "127.0.0.1", port: int = 30000, chat: bool = True
    ) -> None:
        self.model, self.tokenizer, self.chat = model, tokenizer, chat
        self.lock = threading.Lock()
        self.httpd = Listener((host, port), json_handler(self.get, self.post))
        self.httpd.daemon_threads = True
        self.host, self.port = self.httpd.server_address[:2]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="miles-reward-http")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> RewardServer:
        self.thread.start()
        return self

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)

    def tokens(self, item: Any) -> list[int]:
        """The sequence a payload stands for: prompt (chat template) + response + EOS."""
        if not isinstance(item, dict) or not isinstance(item.get("response"), str) or "prompt" not in item:
            raise BadRequest('each sample needs "prompt" and "response" (a string)')
        eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        response = self.tokenizer(item["response"], add_special_tokens=False).input_ids
        return encode_prompt(self.tokenizer, item["prompt"], self.chat) + response + eos

    def scores(self, items: list) -> list[float]:
        sequences = [self.tokens(item) for item in items]
        with self.lock, torch.no_grad():
            return sequence_rewards(self.model, sequences).float().tolist()

    def get(self, path: str) -> tuple[int, Any]:
        if path == "/health":
            return 200, {"status": "ok", "reward_model": True}
        raise BadRequest(f"GET {path}: only /health; POST a sample to /reward")

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        if isinstance(body, dict) and "samples" in body:
            if not isinstance(body["samples"], list) or not body["samples"]:
                raise BadRequest('"samples" must be a non-empty list of {"prompt", "response"}')
            return 200, {"rewards": self.scores(body["samples"])}
        return 200, {"score": self.scores([body])[0]}
