"""A local server that speaks the OpenAI chat protocol (``GET /v1/models``, ``POST /v1/chat/completions``) the way
a served judge does, for the judge tests: real HTTP on a real socket, in a thread of the test process.

Its verdicts come from reading the user message as docs/JUDGE.md documents the template: the line that starts
``Candidate answer (JSON string): `` holds the answer as one JSON string and the references line a JSON list, and
it answers ``yes`` when the answer, lower-cased, is one of the references, lower-cased. A prompt it cannot read
that way (an answer that broke out of its field, a second candidate line) gets ``error: template`` as its reply,
which the judge's parser cannot read. Tests set ``delay_s``, ``fail_first`` (HTTP 503 that many times),
``reply`` (a fixed reply), ``trickle_s`` (a chat reply's headers, then a space of its body every ``trickle_s``
seconds, never ending until ``stop``), ``redirect_to`` (every request answered HTTP 302 to that origin, the same
path), ``raw_reply`` (these bytes written to the socket instead of an HTTP reply) and read ``requests``,
``max_in_flight``, ``completed`` and ``headers`` (of every request).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CANDIDATE = "Candidate answer (JSON string): "
REFERENCES = "Reference answers (JSON list of strings): "


def read_template(text: str) -> tuple[list[str], str] | None:
    """(references, answer) from a user message, or None when it is not one well-formed template."""
    candidates = [line for line in text.split("\n") if line.startswith(CANDIDATE)]
    references = [line for line in text.split("\n") if line.startswith(REFERENCES)]
    if len(candidates) != 1 or len(references) != 1:
        return None
    try:
        answer = json.loads(candidates[0][len(CANDIDATE) :])
        refs = json.loads(references[0][len(REFERENCES) :])
    except ValueError:
        return None
    if not isinstance(answer, str) or not isinstance(refs, list):
        return None
    return refs, answer


class JudgeServer:
    def __init__(self, model: str = "judge-model", api_key: str | None = None):
        self.model, self.api_key = model, api_key
        self.delay_s = 0.0
        self.fail_first = 0
        self.reply: str | None = None
        self.trickle_s: float | None = None
        self.redirect_to: str | None = None
        self.raw_reply: bytes | None = None
        self._stopped = threading.Event()
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.completed = 0  # requests answered
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _answered_otherwise(self) -> bool:
                """A redirect or raw bytes, where the test set one."""
                if server.redirect_to is not None:
                    self.send_response(302)
                    self.send_header("Location", server.redirect_to + self.path)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif server.raw_reply is not None:
                    self.wfile.write(server.raw_reply)
                return server.redirect_to is not None or server.raw_reply is not None

            def _trickle(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(1 << 30))
                self.end_headers()
                try:
                    while not server._stopped.wait(server.trickle_s):
                        self.wfile.write(b" ")
                        self.wfile.flush()
                except OSError:  # the client gave up
                    pass

            def _authorised(self) -> bool:
                if server.api_key is None or self.headers.get("Authorization") == f"Bearer {server.api_key}":
                    return True
                self._send(401, {"error": "bad key"})
                return False

            def do_GET(self):
                with server._lock:
                    server.headers.append(dict(self.headers))
                if self._answered_otherwise() or not self._authorised():
                    return
                if server.trickle_s is not None:
                    self._trickle()
                    return
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": server.model, "object": "model"}]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length))
                with server._lock:
                    server.requests.append(body)
                    server.headers.append(dict(self.headers))
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    failing = server.fail_first > 0
                    server.fail_first -= int(failing)
                try:
                    time.sleep(server.delay_s)
                    if self._answered_otherwise() or not self._authorised():
                        return
                    if server.trickle_s is not None:
                        self._trickle()
                        return
                    if self.path != "/v1/chat/completions" or body.get("model") != server.model:
                        self._send(404, {"error": f"no model {body.get('model')!r}"})
                        return
                    if failing:
                        self._send(503, {"error": "overloaded"})
                        return
                    self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": server.verdict(body)}}]})
                finally:
                    with server._lock:
                        server.in_flight -= 1
                        server.completed += 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def verdict(self, body: dict) -> str:
        if self.reply is not None:
            return self.reply
        content = body["messages"][-1]["content"]
        if isinstance(content, list):
            content = "\n".join(part.get("text", "") for part in content if part.get("type") == "text")
        read = read_template(content)
        if read is None:
            return "error: template"
        references, answer = read
        return "yes" if answer.lower() in {str(r).lower() for r in references} else "no"

    def stop(self) -> None:
        self._stopped.set()
        self.httpd.shutdown()
        self.httpd.server_close()
