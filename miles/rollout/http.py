"""JSON over HTTP: the request handler and listener `miles serve` and the agents' gateway share.

A malformed request gets a 4xx with a JSON {"error": ...} (the OpenAI API's error shape under
/v1/); a bug gets a 500 and the server goes on."""

from __future__ import annotations

import json
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from miles.errors import MilesError

MAX_BODY_BYTES = 8 * 1024**2  # larger request bodies are refused (413) before they are read


class BadRequest(Exception):
    status = HTTPStatus.BAD_REQUEST


class TooLarge(BadRequest):
    status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE


def json_handler(get, post):
    """A JSON-over-HTTP request handler: `get(path)` and `post(path, body)` return (status, payload).
    A malformed request gets a 4xx with {"error": ...}; a bug gets a 500 and the server goes on."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet by default
            pass

        def _send(self, status: int, payload: Any, close: bool = False) -> None:
            body = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if close:  # the unread body stays on the socket: end the connection
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the client left; nothing to tell it
                self.close_connection = True

        def handle(self) -> None:
            try:
                super().handle()
            except (BrokenPipeError, ConnectionResetError):  # a client that disconnects is not an error
                pass

        def _body(self) -> Any:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                raise BadRequest("Content-Length is not a number") from None
            if length > MAX_BODY_BYTES:
                raise TooLarge(f"request body of {length} bytes is over the limit of {MAX_BODY_BYTES}")
            raw = self.rfile.read(length) if length else b""
            try:
                return json.loads(raw or b"{}")
            except ValueError as e:  # not JSON, or not UTF-8
                raise BadRequest(f"request body is not valid JSON (UTF-8): {e}") from e
            except RecursionError:
                raise BadRequest("request body nests too deeply") from None

        def _error(self, message: str, kind: str) -> dict:
            if "/v1/" in self.path:  # the OpenAI API's shape, which its clients read
                return {"error": {"message": message, "type": kind, "param": None, "code": None}}
            return {"error": message}

        def _answer(self, route) -> None:
            try:
                self._send(*route())
            except BadRequest as e:
                self._send(
                    e.status, self._error(str(e), "invalid_request_error"), close=isinstance(e, TooLarge)
                )
            except MilesError as e:
                self._send(HTTPStatus.BAD_REQUEST, self._error(str(e), "invalid_request_error"))
            except Exception as e:  # a bug: report it, keep serving
                self._send(
                    HTTPStatus.INTERNAL_SERVER_ERROR, self._error(f"{type(e).__name__}: {e}", "server_error")
                )

        def do_GET(self) -> None:
            self._answer(lambda: get(self.path))

        def do_POST(self) -> None:
            self._answer(lambda: post(self.path, self._body()))

    return Handler


class Listener(ThreadingHTTPServer):
    """The HTTP server with a listen backlog that holds a burst of clients (the default 5 resets
    connections when dozens arrive at once)."""

    request_queue_size = 1024
