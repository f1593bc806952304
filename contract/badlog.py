"""Malformed HTTP requests in the log: one line per peer per interval, never the raw bytes.

aiohttp logs every request its parser refuses at ERROR with a traceback that quotes the bytes it
choked on (a client's headers, an `Authorization` among them): a flood of junk became tens of MB of
log a second, with secrets in it (issue 16). `BAD_REQUESTS` is a logging filter on `aiohttp.server`
that turns those records into one warning per peer per `every` seconds (how many were folded into
it, the error class and status; no bytes) and counts them all (`atomesh_bad_http_requests_total`).
"""

from __future__ import annotations

import logging
import time

from aiohttp.http_exceptions import HttpProcessingError


class BadRequestLog(logging.Filter):
    def __init__(self, every: float = 60.0, peers: int = 4096) -> None:
        super().__init__()
        self.every, self.peers = every, peers
        self.total = 0
        self._last: dict[str, tuple[float, int]] = {}   # peer -> (last report, folded since)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        self.total += 1
        msg = str(record.msg)
        args = record.args
        peer = str(args[0]) if "from %s" in msg and isinstance(args, tuple) and args else "?"
        now = time.monotonic()
        last, folded = self._last.get(peer, (float("-inf"), 0))
        if now - last < self.every:
            self._last[peer] = (last, folded + 1)
            return False
        if len(self._last) >= self.peers:   # bounded: forget the quietest half
            for k in sorted(self._last, key=lambda p: self._last[p][0])[: self.peers // 2]:
                del self._last[k]
        self._last[peer] = (now, 0)
        record.msg = "bad HTTP request from %s: %s %s (%d more from it since its last report; raw bytes not logged)"
        record.args = (peer, type(exc).__name__, getattr(exc, "code", ""), folded)
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


BAD_REQUESTS = BadRequestLog()


def install() -> None:
    log = logging.getLogger("aiohttp.server")
    if BAD_REQUESTS not in log.filters:
        log.addFilter(BAD_REQUESTS)
