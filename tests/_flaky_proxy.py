"""An HTTP proxy on 127.0.0.1 that fails a share of requests, as an overloaded tracking server's gateway does.

A failed request is answered at once with HTTP 500 or 503 (a plain-text body, as nginx sends) and never
reaches the server; every other request is held ``delay_s`` (uniform) and then forwarded. Seeded: the
same seed gives the same sequence of outcomes.
"""

from __future__ import annotations

import http.client
import http.server
import random
import threading
import time
from collections import Counter

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
    "proxy-connection",
}


class FlakyProxy:
    def __init__(
        self,
        upstream_port: int,
        fail: float,
        delay_s: tuple[float, float] = (0.5, 2.0),
        seed: int = 0,
    ):
        self.upstream_port, self.fail, self.delay_s = upstream_port, fail, delay_s
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.outcomes: Counter[int] = Counter()  # HTTP status -> requests answered with it
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy._lock:
                    failed = proxy._rng.random() < proxy.fail
                    code = proxy._rng.choice((500, 503)) if failed else 0
                    delay = proxy._rng.uniform(*proxy.delay_s)
                if failed:
                    text = f"{code} {'Internal Server Error' if code == 500 else 'Service Unavailable'}\n".encode()
                    self.send_response(code)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(text)))
                    self.end_headers()
                    self.wfile.write(text)
                    with proxy._lock:
                        proxy.outcomes[code] += 1
                    return
                time.sleep(delay)
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP_BY_HOP:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                with proxy._lock:
                    proxy.outcomes[resp.status] += 1

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _any

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.uri = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def failed(self) -> int:
        return self.outcomes[500] + self.outcomes[503]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
