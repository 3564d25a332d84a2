"""A reward server for the remote-reward tests: `python -m tests.reward_server` prints its URL.

POST /score scores one sample (1.0 when response == label) and misbehaves on purpose by prompt:
"slow" answers after 5 s, "flaky" gets a 500 on its first try, "bad" gets a JSON object without a
score, "notjson" gets plain text. POST /batch scores {"samples": [...]}; POST /constant answers 0.5
to anything; POST /v1/chat/completions is a judge comparing the reference and the graded answer.
GET /stats: what it saw.
"""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STATS = {"score_calls": 0, "batch_sizes": [], "flaky_tries": 0}


def score(sample: dict) -> float:
    return float(sample["response"] == sample["label"])


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(200, json.dumps(STATS).encode())

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/chat/completions":  # a judge that compares the two answers it is shown
            question = body["messages"][-1]["content"]
            label = question.split("Reference answer:\n")[1].split("\n")[0]
            response = question.split("Answer to grade:\n")[1].split("\n")[0]
            reply = "I cannot tell." if response == "ramble" else f"Compared. SCORE: {int(label == response)}"
            answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]}
            self._send(200, json.dumps(answer).encode())
            return
        if self.path == "/constant":  # one number, whatever was asked
            self._send(200, b"0.5")
            return
        if self.path == "/batch":
            STATS["batch_sizes"].append(len(body["samples"]))
            self._send(200, json.dumps([score(s) for s in body["samples"]]).encode())
            return
        STATS["score_calls"] += 1
        prompt = body["prompt"]
        if prompt == "slow":
            time.sleep(5)
        if prompt == "flaky":
            STATS["flaky_tries"] += 1
            if STATS["flaky_tries"] == 1:
                self._send(500, b"try again")
                return
        if prompt == "bad":
            self._send(200, json.dumps({"oops": 1}).encode())
        elif prompt == "notjson":
            self._send(200, b"<html>not a reward</html>")
        else:
            self._send(200, json.dumps({"score": score(body)}).encode())


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()
