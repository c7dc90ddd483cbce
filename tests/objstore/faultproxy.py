"""A TCP proxy on 127.0.0.1 between an S3 client and the test server that misbehaves like a real network and a
busy store: it answers some connections with ``503 Slow Down`` without forwarding them, drops some at once,
delays some, and cuts some connections in the middle of a response (the request reached the store; its answer
is lost, so the client retries a write that already happened). ``mode="deny"`` answers every request with a
403 instead. Faults are drawn from a seeded generator. ``on_request`` sees the client's bytes before they are
forwarded (the kill tests use it to kill -9 a worker at an exact step of a commit) and scripts what happens to that
request: ``True`` swallows it and cuts the connection (the store never sees it); ``"lose"`` forwards it and cuts
the connection when the store's answer comes (the write happened, the client never hears of it); ``("hold", ev)``
holds it until ``ev`` is set, then forwards it (a request in flight while its sender pauses); ``("hold-answer",
ev)`` forwards it at once and holds the store's answer until ``ev`` is set. ``strip`` names request headers taken
out before forwarding (a store, or a proxy in front of one, that ignores them). One request per chunk of the
client's bytes is assumed: true of the small requests these scripts pick (a head of a few hundred bytes)."""

from __future__ import annotations

import random
import re
import socket
import threading
import time
from collections.abc import Callable

DENY = (b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: {n}\r\n\r\n")
DENY_BODY = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code>"
             b"<Message>Access Denied</Message></Error>")
SLOW = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: {n}\r\n\r\n")
SLOW_BODY = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
             b"<Message>Please reduce your request rate.</Message></Error>")


class FaultProxy:
    def __init__(self, upstream: str, mode: str = "faults", seed: int = 0, p503: float = 0.15, pdrop: float = 0.08,
                 pdelay: float = 0.1, pcut: float = 0.01, on_request: Callable[[bytes], object] | None = None,
                 first: tuple[str, ...] = (), strip: tuple[str, ...] = ()):
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.mode, self.rng = mode, random.Random(seed)
        self.p503, self.pdrop, self.pdelay, self.pcut = p503, pdrop, pdelay, pcut
        self.on_request = on_request  # sees client bytes first and scripts their fate (the module docstring)
        self.strip = re.compile(rb"\r\n(?:" + b"|".join(re.escape(h.encode()) for h in strip) + rb"):[^\r]*",
                                re.I) if strip else None
        # the first connections' faults, in order ("503", "drop", "delay", "ok"), then drawn: how many requests a
        # job makes (and so which draws it meets) follows its threads' timing, a fault the test counts on must not
        self.first = list(first)
        self.counts = {"503": 0, "drop": 0, "delay": 0, "cut": 0, "ok": 0, "403": 0, "lost": 0, "held": 0,
                       "stripped": 0}
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._mu = threading.Lock()
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _draw(self) -> float:
        with self._mu:
            return self.rng.random()

    def _fault(self) -> float:
        """A connection's draw: the next scripted fault's (``first``) while any is left, else a random one."""
        with self._mu:
            if self.first:
                return {"503": 0.0, "drop": self.p503, "delay": self.p503 + self.pdrop,
                        "ok": 1.0}[self.first.pop(0)]
            return self.rng.random()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _read_head(self, client: socket.socket) -> bool:
        """Read a request's head; whether it is a HEAD request (answered without a body)."""
        data = b""
        client.settimeout(5)
        while b"\r\n\r\n" not in data:
            chunk = client.recv(65536)
            if not chunk:
                break
            data += chunk
        return data.startswith(b"HEAD ")

    def _answer(self, client: socket.socket, head: bytes, body: bytes) -> None:
        is_head = self._read_head(client)
        client.sendall(head.replace(b"{n}", str(len(body)).encode()) + (b"" if is_head else body))

    def _handle(self, client: socket.socket) -> None:
        try:
            if self.mode == "deny":
                self._answer(client, DENY, DENY_BODY)
                self.counts["403"] += 1
                return
            r = self._fault()
            if r < self.p503:
                self._answer(client, SLOW, SLOW_BODY)
                self.counts["503"] += 1
                return
            if r < self.p503 + self.pdrop:
                self.counts["drop"] += 1
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                return  # closed with RST below
            if r < self.p503 + self.pdrop + self.pdelay:
                self.counts["delay"] += 1
                time.sleep(0.3)
            self.counts["ok"] += 1
            upstream = socket.create_connection(self.upstream)
            conn: dict[str, object] = {}  # this connection's scripted fate of the answer now awaited
            threading.Thread(target=self._pipe, args=(client, upstream, False, self.on_request, conn),
                             daemon=True).start()
            self._pipe(upstream, client, True, None, conn)
        except OSError:
            pass
        finally:
            client.close()

    def _pipe(self, src: socket.socket, dst: socket.socket, may_cut: bool,
              hook: Callable[[bytes], object] | None = None, conn: dict[str, object] | None = None) -> None:
        conn = {} if conn is None else conn
        try:
            src.settimeout(None)
            while chunk := src.recv(65536):
                act = hook(chunk) if hook is not None else None
                if act is True:
                    break
                if act == "lose":
                    conn["answer"] = "lose"  # set before the request goes: its answer is what gets cut
                elif isinstance(act, tuple) and act[0] == "hold":
                    self.counts["held"] += 1
                    act[1].wait()
                elif isinstance(act, tuple) and act[0] == "hold-answer":
                    conn["answer"] = act[1]
                if self.strip is not None and not may_cut:
                    chunk, n = self.strip.subn(b"", chunk)
                    self.counts["stripped"] += n
                if may_cut and chunk.startswith(b"HTTP/1.1 100 "):  # "send the body" (Expect: 100-continue):
                    dst.sendall(chunk)  # not the answer to script
                    continue
                if may_cut and conn.get("answer") == "lose":  # the store did the work; its answer is lost
                    self.counts["lost"] += 1
                    break
                if may_cut and isinstance(conn.get("answer"), threading.Event):
                    self.counts["held"] += 1
                    conn.pop("answer").wait()  # type: ignore[union-attr]
                if may_cut and self._draw() < self.pcut:  # the store did the work; its answer is lost
                    self.counts["cut"] += 1
                    break
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()
