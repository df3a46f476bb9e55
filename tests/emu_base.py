"""Plumbing shared by gpu_preflight's loopback test servers.

  free_port()        a loopback TCP port nothing listens on
  shutdown_sockets   shutdown(SHUT_RDWR) a list of sockets, errors ignored
  Service            lock, stop event, open connections, stop(), `with` support
                     (the emulators and tls_util.TLSProxy)
  HTTPEmulator       a threaded HTTP server on a loopback port for one
                     emulator (ollama_emu.Emulator, openai_emu.OpenAIEmulator):
                     start/stop, an optional delay before listen(), and the
                     fault modes both emulators answer alike (hang, trickle,
                     huge); each emulator still builds its own replies' bytes
                     (status line, header names and order, bodies)
  Handler            its request handler: every method goes to emu._serve
  cli_parser, serve_until_signalled   an emulator's command line: the
                     argument parser with its modes listed, then start, serve
                     until SIGINT or SIGTERM, stop

Standard library only, CPython 3.6+.
"""

import argparse
import os
import select
import signal
import socket
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on (for connection-refused tests)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
    finally:
        sock.close()


def shutdown_sockets(socks):
    """Shut both directions of each socket (wakes a thread blocked in send/recv on it)."""
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class Service(object):
    """A lock, a stop event and the open connections of a loopback server.

    A subclass defines start(), which returns self and starts self._thread,
    and the two halves of stopping: _detach() (called under the lock: take
    what the server listens with away from self, None when not started) and
    _close(taken, conns) (after the stop event is set).
    """

    def __init__(self):
        self._conns = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    def stop(self):
        with self._lock:
            taken = self._detach()
            conns = list(self._conns)
        if taken is None:
            return
        self._stop.set()
        self._close(taken, conns)
        self._thread.join(1.0)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    def _track(self, conn, add):
        """Add or drop an open connection; False (not added) once stopping."""
        with self._lock:
            if add and self._stop.is_set():
                return False
            (self._conns.add if add else self._conns.discard)(conn)
            return True


# ---------------------------------------------------------------- HTTP plumbing

class ThreadingServer(socketserver.ThreadingMixIn, HTTPServer):
    daemon_threads = True
    block_on_close = False           # 3.7+: never join handler threads in server_close()
    request_queue_size = 64

    def server_bind(self):           # skip HTTPServer's getfqdn() (a DNS look-up)
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def server_activate(self):
        # poll() may call the listener readable for a connection that is gone by
        # accept(): a blocking accept() would then hang the loop and stop() for ever
        # (non-blocking, it raises BlockingIOError, which the loop skips)
        HTTPServer.server_activate(self)
        self.socket.setblocking(False)

    def get_request(self):
        conn, addr = self.socket.accept()
        conn.setblocking(True)       # the connections themselves block, as before
        return conn, addr

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], OSError):
            HTTPServer.handle_error(self, request, client_address)


class ThreadingServer6(ThreadingServer):
    address_family = socket.AF_INET6


class Handler(BaseHTTPRequestHandler):
    """Hands every request to self.server.emu._serve(handler, method, target, body)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def setup(self):
        BaseHTTPRequestHandler.setup(self)
        self.server.emu._track(self.connection, True)

    def handle(self):
        try:
            BaseHTTPRequestHandler.handle(self)
        except (OSError, ValueError):
            pass

    def finish(self):
        try:
            BaseHTTPRequestHandler.finish(self)
        except (OSError, ValueError):
            pass
        self.server.emu._track(self.connection, False)

    def _read_body(self):              # Content-Length bodies only (what urllib sends)
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = 0
        return self.rfile.read(length) if length > 0 else b""

    def _dispatch(self):
        self.close_connection = True
        self.server.emu._serve(self, self.command, self.path, self._read_body())

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _dispatch

    def client_gone(self, timeout):
        """Wait up to timeout; True when the client has closed its side."""
        try:
            readable = select.select([self.connection], [], [], timeout)[0]
            if readable and self.connection.recv(1, socket.MSG_PEEK) == b"":
                return True
            if readable:                     # data, not EOF: do not spin
                time.sleep(timeout)
            return False
        except (OSError, ValueError):
            return True

    def pieces(self, reply):
        """The writes of reply to this request (HEAD: no body; HTTP/1.0: not chunked)."""
        return self.server.emu._pieces(reply, self.command == "HEAD",
                                       self.request_version == "HTTP/1.0")

    def send(self, reply):
        for piece in self.pieces(reply):
            self.wfile.write(piece)


class HTTPEmulator(Service):
    """A server look-alike on a loopback port, for ollama_emu and openai_emu.

    A subclass sets handler (a Handler subclass) if it needs another and defines:
      _record(h, method, path, target, body)   log the request; returns what
                                               _serve_mode takes as context
      _serve_mode(h, method, path, body, mode, context)   answer it
      _pieces(reply, head_only, http10)        the bytes of a reply, in writes
      _huge_parts()                            (prefix, item, last) of mode huge
      _huge_head(length)                       its status line and headers
    and may override _listen_delay() (seconds between bind and listen).
    """

    handler = Handler

    def __init__(self, mode, fault_on, host, port, load_seconds):
        Service.__init__(self)
        self.mode, self.fault_on, self.host, self.port = mode, fault_on, host, port
        self.load_seconds = float(load_seconds)
        self.trickle_interval = 2.0
        self.huge_size = 100 * 1000 * 1000
        self.requests = []
        self.url = None
        self._server = None
        self._serving = False
        self._started_at = None

    # -- lifecycle

    def start(self):
        """Bind now; listen now, or only after _listen_delay() seconds."""
        if self._server is not None:
            return self
        cls = ThreadingServer6 if ":" in self.host else ThreadingServer
        server = cls((self.host, self.port), self.handler, bind_and_activate=False)
        server.emu = self
        try:
            server.server_bind()
            delay = self._listen_delay()
            if delay <= 0:
                server.server_activate()
        except BaseException:
            server.server_close()
            raise
        self._server = server
        self.port = server.server_address[1]
        shown = "[%s]" % self.host if ":" in self.host else self.host
        self.url = "http://%s:%d" % (shown, self.port)
        self._started_at = time.time()
        self._serving = delay <= 0
        self._thread = threading.Thread(target=self._run, args=(server, delay))
        self._thread.daemon = True
        self._thread.start()
        return self

    def _listen_delay(self):
        return 0.0

    def _run(self, server, delay):
        if delay > 0:
            if self._stop.wait(delay):
                return
            with self._lock:
                if self._server is not server:
                    return
                server.server_activate()      # listen(): connections succeed from now
                self._serving = True
        server.serve_forever(poll_interval=0.05)

    def _detach(self):
        server, self._server = self._server, None
        serving, self._serving = self._serving, False
        return None if server is None else (server, serving)

    def _close(self, taken, conns):
        server, serving = taken
        if serving:                      # shutdown() waits for serve_forever to end
            server.shutdown()
        server.server_close()
        shutdown_sockets(conns)          # wake handlers blocked in send/recv

    # -- per-request entry point

    def _serve(self, h, method, target, body):
        path = target.split("?", 1)[0]
        context = self._record(h, method, path, target, body)
        mode = self.mode if self.fault_on in ("all", path) else "healthy"
        try:
            self._serve_mode(h, method, path, body, mode, context)
        except (OSError, ValueError):
            pass                          # the client went away, or stop() cut the socket

    # -- fault modes both emulators answer alike

    def _hang(self, h):
        """Mode hang: answer nothing until the client leaves or the emulator stops."""
        while not self._stop.is_set() and not h.client_gone(0.1):
            pass

    def _trickle(self, h, reply):
        """Mode trickle: the reply's bytes one at a time, trickle_interval apart."""
        data = b"".join(h.pieces(reply))
        for i in range(len(data)):
            h.wfile.write(data[i:i + 1])
            h.wfile.flush()
            if self._stop.wait(self.trickle_interval):
                return

    def _send_huge(self, h):
        """Mode huge: a JSON body of huge_size bytes, streamed in blocks."""
        prefix, item, last = self._huge_parts()
        items = max(0, (self.huge_size - len(prefix) - len(last)) // len(item))
        pad = max(0, self.huge_size - len(prefix) - len(last) - items * len(item))
        h.wfile.write(self._huge_head(len(prefix) + items * len(item) + len(last) + pad))
        if h.command == "HEAD":
            return
        h.wfile.write(prefix)
        block_items = 4096
        block = item * block_items
        while items > 0 and not self._stop.is_set():
            n = min(block_items, items)
            h.wfile.write(block if n == block_items else item * n)
            items -= n
        if not self._stop.is_set():
            h.wfile.write(last + b" " * pad)


# ---------------------------------------------------------------- command line

def cli_parser(prog, description, modes):
    """An emulator's argument parser; its --help ends with the (name, meaning) pairs of modes."""
    epilog = "modes:\n" + "\n".join("  %-15s %s" % m for m in modes)
    return argparse.ArgumentParser(
        prog=prog, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=description)


def serve_for_command(emu, name, details, command):
    """Start emu, say "NAME: URL DETAILS" on stderr, run COMMAND with
    OLLAMA_HOST set to the URL, stop emu; COMMAND's exit status. No port
    is fixed, so nothing else listening can answer in its place."""
    import subprocess
    emu.start()
    sys.stderr.write("%s: %s %s\n" % (name, emu.url, details))
    sys.stderr.flush()
    try:
        return subprocess.call(command, env=dict(os.environ, OLLAMA_HOST=emu.url))
    except OSError as exc:
        sys.stderr.write("%s: cannot run %s: %s\n" % (name, command[0], exc.strerror))
        return 127
    finally:
        emu.stop()


def serve_until_signalled(emu, name, cannot, details):
    """Start emu, print "NAME: URL DETAILS", serve until SIGINT/SIGTERM; the exit status.

    When it cannot start: "NAME: CANNOT HOST port PORT: error" on stderr, 1.
    """
    done = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: done.set())
    try:
        emu.start()
    except OSError as exc:
        sys.stderr.write("%s: %s %s port %d: %s\n" % (name, cannot, emu.host, emu.port, exc))
        return 1
    sys.stdout.write("%s: %s %s\n" % (name, emu.url, details))
    sys.stdout.flush()
    while not done.is_set():
        done.wait(0.2)
    emu.stop()
    return 0
