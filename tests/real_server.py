#!/usr/bin/env python3
"""Opt-in check against a real OpenAI-compatible server: llama-cpp-python.

Not part of the normal suite (its name does not match test_*.py): it needs a
virtual environment with `llama-cpp-python[server]`, `gguf` and `numpy` from
PyPI, and building llama-cpp-python compiles llama.cpp (about 7 minutes on two
cores). Make one once, then run this as often as you like (about 10 s):

    python3 tests/real_server.py --venv /tmp/realsrv/venv --install   # once
    python3 tests/real_server.py --venv /tmp/realsrv/venv             # or
    GPU_PREFLIGHT_REAL_VENV=/tmp/realsrv/venv python3 tests/real_server.py

It writes a tiny llama-architecture GGUF with random weights
(tests/make_tiny_gguf.py, run by the venv's Python), starts
`VENV/bin/python -m llama_cpp.server` on a free loopback port and runs the
real gpu_preflight.py as cron would (environment PATH=/usr/bin:/bin only, no
TTY, cwd /) under /usr/bin/python3 and under this interpreter:

  a   while the server starts and loads the model (recorded, not asserted)
  b   --api openai                                  -> 0
  c   --api auto                                    -> 0 and api=openai logged
  d   --api openai --model no-such-model            (recorded, not asserted)
  e   --api openai --timeout 1 --deadline 2         -> 0 within 2 s + slack
  e2  the same against the server stopped by SIGSTOP -> ends within 2 s + slack
  f*  the server restarted with --api_key: right token from a 0600 file,
      wrong and missing token (recorded, not asserted; the token must not
      appear in any output, checked)
  g   the server restarted with --embedding true (embeddings enabled on the
      same tiny GGUF): --api openai --json -> 0 (its completions still work,
      so the model is proven by a token; the kind is recorded)
  g2  the same server behind a loopback proxy that answers POST
      /v1/completions and /v1/chat/completions as llama-server started with
      --embeddings does (501 "This server does not support completions. Start
      it without `--embeddings`") and forwards everything else untouched:
      -> 0, kind "embed" in --json, and the real server answered the
      preflight's POST /v1/embeddings (its per-token vectors, a list of lists,
      as this pooling-less GGUF gives them)

It prints a table (case, python, exit, seconds, reason), stops the server and
removes its files. Exit status: 0 when b, c, e, e2, g and g2 hold, 1 when one
does not, 2 when the environment is unusable (no venv, the server never came
up).
Stdlib only, Python 3.6+ syntax.
"""

import argparse
import json
import os
import re
import shutil
import signal
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
SCRIPT = os.path.join(REPO, "gpu_preflight.py")
MAKER = os.path.join(TESTS, "make_tiny_gguf.py")
CRON_ENV = {"PATH": "/usr/bin:/bin"}
SLACK = 1.0          # seconds allowed past --deadline, interpreter start included
READY_WITHIN = 180   # seconds for the server to open its port
INSTALL_SPEC = ["llama-cpp-python[server]", "gguf", "numpy"]
# CPU only, no tests, examples, tools or bundled server: the smallest build.
INSTALL_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF "
                      "-DGGML_VULKAN=OFF -DGGML_OPENMP=OFF -DLLAMA_CURL=OFF "
                      "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
                      "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF "
                      "-DLLAVA_BUILD=OFF")

if TESTS not in sys.path:            # run from any cwd, or imported: emu_base is beside us
    sys.path.insert(0, TESTS)
from emu_base import free_port  # noqa: E402


def say(msg):
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def install(venv):
    """Create venv (if missing) and pip install the server; return seconds."""
    started = time.monotonic()
    if not os.path.exists(os.path.join(venv, "bin", "python")):
        subprocess.check_call([sys.executable, "-m", "venv", venv])
    env = dict(os.environ)
    env.setdefault("CMAKE_ARGS", INSTALL_CMAKE_ARGS)
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    say("installing %s into %s (compiles llama.cpp; CMAKE_ARGS=%s)"
        % (" ".join(INSTALL_SPEC), venv, env["CMAKE_ARGS"]))
    subprocess.check_call([os.path.join(venv, "bin", "pip"), "install", "-q",
                           "--disable-pip-version-check"] + INSTALL_SPEC, env=env)
    return time.monotonic() - started


def versions(venv):
    code = ("import llama_cpp, gguf, numpy, sys; "
            "from importlib.metadata import version as v; "
            "print('python %s, llama-cpp-python %s, gguf %s, numpy %s' % "
            "(sys.version.split()[0], llama_cpp.__version__, v('gguf'), numpy.__version__))")
    try:
        out = subprocess.check_output([os.path.join(venv, "bin", "python"), "-c", code],
                                      stderr=subprocess.STDOUT)
        return out.decode("utf-8", "replace").strip()
    except (subprocess.CalledProcessError, OSError) as exc:
        return "unknown (%s)" % exc


class Server(object):
    """`VENV/bin/python -m llama_cpp.server` on a free loopback port."""

    def __init__(self, venv, model, workdir, extra=()):
        self.port = free_port()
        self.url = "http://127.0.0.1:%d" % self.port
        self.log_path = os.path.join(workdir, "server-%d.log" % self.port)
        self.log = open(self.log_path, "wb")
        cmd = [os.path.join(venv, "bin", "python"), "-m", "llama_cpp.server",
               "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
               "--n_ctx", "128", "--n_threads", "1"] + list(extra)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, cwd=workdir,
                                     start_new_session=True)
        self.ready_after = None

    def get(self, path, timeout=2.0):
        """(status, body) of GET path; status None when no HTTP answer."""
        try:
            resp = urlopen(self.url + path, timeout=timeout)
            return resp.status, resp.read().decode("utf-8", "replace")
        except HTTPError as exc:
            return exc.code, exc.read().decode("utf-8", "replace")
        except (URLError, OSError) as exc:
            return None, str(getattr(exc, "reason", exc))

    def post(self, path, obj, timeout=30.0):
        """(status, body) of POST path with a JSON body."""
        request = Request(self.url + path, data=json.dumps(obj).encode(),
                          headers={"Content-Type": "application/json"})
        try:
            resp = urlopen(request, timeout=timeout)
            return resp.status, resp.read().decode("utf-8", "replace")
        except HTTPError as exc:
            return exc.code, exc.read().decode("utf-8", "replace")
        except (URLError, OSError) as exc:
            return None, str(getattr(exc, "reason", exc))

    def alive(self):
        return self.proc.poll() is None

    def wait_ready(self, limit=READY_WITHIN, headers_ok=(200, 401)):
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if not self.alive():
                return False
            status, _ = self.get("/v1/models", timeout=1.0)
            if status in headers_ok:
                self.ready_after = time.monotonic() - self.started
                return True
            time.sleep(0.05)
        return False

    def log_tail(self, n=30):
        self.log.flush()
        with open(self.log_path, "rb") as handle:
            lines = handle.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except OSError:
                pass
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class _ThreadingServer(socketserver.ThreadingMixIn, HTTPServer):
    daemon_threads = True


class RefusingProxy(object):
    """A loopback proxy in front of a real server: POST /v1/completions and
    /v1/chat/completions get llama-server's answer in --embeddings mode (501,
    the 2024-2025 builds), everything else is forwarded and answered by the
    server as it is. .seen lists (method, path, status) of what passed."""

    REFUSAL = (b'{"error":{"code":501,"message":"This server does not support '
               b'completions. Start it without `--embeddings`","type":"not_supported_error"}}')
    REFUSED = ("/v1/completions", "/v1/chat/completions", "/completions", "/chat/completions")

    def __init__(self, backend):
        self.backend, self.seen = backend, []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def relay(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length > 0 else None
                if self.command == "POST" and self.path.split("?")[0] in proxy.REFUSED:
                    status, ctype, data = (501, "application/json; charset=utf-8",
                                           proxy.REFUSAL)
                else:
                    headers = dict((k, v) for k, v in self.headers.items()
                                   if k.lower() in ("content-type", "accept", "authorization"))
                    request = Request(proxy.backend + self.path, data=body,
                                      method=self.command, headers=headers)
                    try:
                        resp = urlopen(request, timeout=60)
                        status, ctype, data = (resp.status, resp.headers.get("Content-Type"),
                                               resp.read())
                    except HTTPError as exc:
                        status, ctype, data = (exc.code, exc.headers.get("Content-Type"),
                                               exc.read())
                proxy.seen.append((self.command, self.path, status))
                self.send_response(status)
                self.send_header("Content-Type", ctype or "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
            do_GET = do_POST = relay

        self.server = _ThreadingServer(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever)
        self.thread.daemon = True
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def json_kinds(run):
    """The kinds in a --json answer's "models" list, or None."""
    try:
        return [m.get("kind") for m in json.loads(run.stdout).get("models")]
    except (ValueError, TypeError, AttributeError):
        return None


def embedding_shape(text):
    """A summary of a /v1/embeddings answer: data[0].embedding flat or per token."""
    try:
        vector = json.loads(text)["data"][0]["embedding"]
    except (ValueError, KeyError, IndexError, TypeError):
        return text[:200]
    if vector and isinstance(vector[0], list):
        return "data[0].embedding: %d per-token vectors of %d" % (len(vector), len(vector[0]))
    return "data[0].embedding: one vector of %d" % len(vector)


class Run(object):
    def __init__(self, case, python, args, code, stdout, stderr, seconds):
        self.case, self.python, self.args = case, python, args
        self.code, self.stdout, self.stderr, self.seconds = code, stdout, stderr, seconds
        self.fields = parse_line(stderr)
        self.verdict = ""

    @property
    def reason(self):
        return self.fields.get("reason", (self.stderr.strip().splitlines() or ["-"])[-1])


def parse_line(text):
    """key=value fields of the last gpu_preflight: line (values may be quoted)."""
    lines = [l for l in text.splitlines() if l.startswith("gpu_preflight:")]
    if not lines:
        return {}
    fields = {}
    for m in re.finditer(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', lines[-1]):
        value = m.group(2)
        if value.startswith('"'):
            value = value[1:-1].replace('\\"', '"').replace("\\\\", "\\")
        fields[m.group(1)] = value
    return fields


def preflight(case, python, url, args, env=None, limit=60):
    """Run gpu_preflight.py the way cron does; return a Run."""
    cmd = [python, SCRIPT, "--host", url, "--no-syslog", "-v"] + list(args)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env or dict(CRON_ENV), cwd="/",
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += b"\n(killed by real_server.py after %ds)" % limit
    return Run(case, python, args, proc.returncode, out.decode("utf-8", "replace"),
               err.decode("utf-8", "replace"), time.monotonic() - started)


def short(python):
    return python


def table(runs):
    rows = [("case", "python", "exit", "seconds", "verdict", "reason")]
    for r in runs:
        rows.append((r.case, short(r.python), str(r.code), "%.2f" % r.seconds,
                     r.verdict, r.reason))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    out = []
    for i, row in enumerate(rows):
        out.append("  ".join(row[j].ljust(widths[j]) for j in range(5)) + "  " + row[5])
        if i == 0:
            out.append("  ".join("-" * w for w in widths) + "  " + "-" * 6)
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description="gpu_preflight against a real "
                                 "llama-cpp-python server (opt-in)")
    ap.add_argument("--venv", default=os.environ.get("GPU_PREFLIGHT_REAL_VENV"),
                    help="virtual environment with llama-cpp-python[server], gguf, "
                    "numpy (default: GPU_PREFLIGHT_REAL_VENV)")
    ap.add_argument("--install", action="store_true",
                    help="create the venv if missing and pip install them first")
    ap.add_argument("--python", action="append", default=None,
                    help="interpreter to run gpu_preflight.py with (repeatable; "
                    "default /usr/bin/python3 and this one)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args(argv)
    if not args.venv:
        ap.error("name the virtual environment: --venv PATH or GPU_PREFLIGHT_REAL_VENV")
    venv = os.path.abspath(args.venv)
    t0 = time.monotonic()
    if args.install:
        say("install took %.0f s" % install(venv))
    vpy = os.path.join(venv, "bin", "python")
    if not os.path.exists(vpy):
        say("no %s: make the venv with --install (see the docstring)" % vpy)
        return 2

    pythons = args.python or []
    if not pythons:
        for p in ("/usr/bin/python3", sys.executable):
            if os.path.exists(p) and os.path.realpath(p) not in \
                    [os.path.realpath(q) for q in pythons]:
                pythons.append(p)
    say("server side: %s" % versions(venv))
    say("gpu_preflight under: %s" % ", ".join(
        "%s (%s)" % (p, subprocess.check_output(
            [p, "-c", "import sys; print(sys.version.split()[0])"]).decode().strip())
        for p in pythons))

    work = tempfile.mkdtemp(prefix="gpfl-real-")
    servers = []
    runs = []
    failed = []
    observed = []

    def check(run, ok, why):
        run.verdict = "ok" if ok else "FAIL"
        if not ok:
            failed.append("%s (%s): %s; exit %s in %.2fs; stderr: %s"
                          % (run.case, short(run.python), why, run.code, run.seconds,
                             run.stderr.strip()[-600:]))

    try:
        model = os.path.join(work, "tiny.gguf")
        t = time.monotonic()
        out = subprocess.check_output([vpy, MAKER, model], stderr=subprocess.STDOUT)
        say("%s in %.2f s" % (out.decode("utf-8", "replace").strip(), time.monotonic() - t))

        # (a) while the server starts: run gpu_preflight back to back until
        # the port answers, and record every distinct outcome.
        srv = Server(venv, model, work)
        servers.append(srv)
        loading = []
        while srv.alive() and time.monotonic() - srv.started < READY_WITHIN:
            r = preflight("a", pythons[0], srv.url, ["--api", "openai"])
            loading.append(r)
            if r.code == 0:
                break
        if not srv.wait_ready():
            say("the server did not come up (exit %s); its log:\n%s"
                % (srv.proc.poll(), srv.log_tail()))
            return 2
        seen = []
        for r in loading:
            key = (r.code, r.fields.get("stage"), r.reason)
            if not seen or seen[-1][0] != key:
                seen.append([key, 1, r])
            else:
                seen[-1][1] += 1
        for key, count, r in seen:
            r.case = "a x%d" % count
            r.verdict = "seen"
            runs.append(r)
        say("server on %s answered /v1/models after %.2f s" % (srv.url, srv.ready_after))

        # what the server itself says, for the report
        for path in ("/health", "/v1/health", "/v1/models", "/api/version"):
            status, body = srv.get(path)
            observed.append("GET %-13s -> %s %s" % (path, status, body[:200]))

        for py in pythons:
            r = preflight("b", py, srv.url, ["--api", "openai"])
            check(r, r.code == 0, "expected exit 0")
            runs.append(r)

            r = preflight("c", py, srv.url, ["--api", "auto"])
            check(r, r.code == 0 and r.fields.get("api") == "openai",
                  "expected exit 0 and api=openai in the log line")
            runs.append(r)

            r = preflight("d", py, srv.url, ["--api", "openai", "--model", "no-such-model"])
            r.verdict = "seen"
            runs.append(r)

            r = preflight("e", py, srv.url, ["--api", "openai", "--timeout", "1",
                                             "--deadline", "2"])
            check(r, r.code == 0 and r.seconds <= 2 + SLACK,
                  "expected exit 0 within %.1f s" % (2 + SLACK))
            runs.append(r)

        # the server's own answer to an unknown model name, for the report
        req = json.dumps({"model": "no-such-model", "prompt": "test", "max_tokens": 1,
                          "stream": False}).encode()
        try:
            from urllib.request import Request
            resp = urlopen(Request(srv.url + "/v1/completions", data=req,
                                   headers={"Content-Type": "application/json"}),
                           timeout=10)
            body = resp.read().decode("utf-8", "replace")
            observed.append("POST /v1/completions model=no-such-model -> %s %s"
                            % (resp.status, body[:300]))
        except HTTPError as exc:
            observed.append("POST /v1/completions model=no-such-model -> %s %s"
                            % (exc.code, exc.read()[:300]))

        # (e2) the same server frozen: the kernel still accepts connections,
        # nothing answers. The deadline must hold.
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            for py in pythons:
                r = preflight("e2", py, srv.url, ["--api", "openai", "--timeout", "1",
                                                  "--deadline", "2"])
                check(r, r.code != 0 and r.seconds <= 2 + SLACK,
                      "expected a failure within %.1f s" % (2 + SLACK))
                runs.append(r)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        srv.stop()

        # (f*) the server with an API key: the token travels, and never shows.
        token = "gpfl-real-" + os.urandom(12).hex()
        srv = Server(venv, model, work, extra=["--api_key", token])
        servers.append(srv)
        if not srv.wait_ready():
            say("the server with --api_key did not come up; its log:\n%s" % srv.log_tail())
            return 2
        status, body = srv.get("/v1/models")
        observed.append("GET /v1/models without the key -> %s %s" % (status, body[:200]))
        fd, token_file = tempfile.mkstemp(prefix="token-", dir=work)  # mode 0600
        os.write(fd, (token + "\n").encode())
        os.close(fd)
        for py in pythons:
            variants = [
                ("f-file", ["--api", "openai", "--token-file", token_file, "--json"], None),
                ("f-env", ["--api", "auto", "--debug"],
                 dict(CRON_ENV, GPU_PREFLIGHT_TOKEN=token)),
                ("f-wrong", ["--api", "openai"],
                 dict(CRON_ENV, GPU_PREFLIGHT_TOKEN="wrong-" + token[::-1])),
                ("f-none", ["--api", "openai"], None),
            ]
            for case, extra, env in variants:
                r = preflight(case, py, srv.url, extra, env=env)
                if token in r.stdout or token in r.stderr:
                    check(r, False, "the token appears in the output")
                else:
                    r.verdict = "seen"
                runs.append(r)
        srv.stop()

        # (g, g2) embeddings enabled: completions still work, so the model is
        # generative; behind a proxy refusing completions as llama-server
        # --embeddings does, it must be proven through the real /v1/embeddings.
        srv = Server(venv, model, work, extra=["--embedding", "true"])
        servers.append(srv)
        if not srv.wait_ready():
            say("the server with --embedding true did not come up; its log:\n%s"
                % srv.log_tail())
            return 2
        status, body = srv.post("/v1/embeddings", {"input": "test"})
        observed.append("--embedding true: POST /v1/embeddings -> %s %s"
                        % (status, embedding_shape(body)))
        status, body = srv.post("/v1/completions", {"prompt": "test", "max_tokens": 1})
        observed.append("--embedding true: POST /v1/completions -> %s %s" % (status, body[:160]))
        proxy = RefusingProxy(srv.url)
        try:
            for py in pythons:
                r = preflight("g", py, srv.url, ["--api", "openai", "--json"])
                check(r, r.code == 0, "expected exit 0 (completions work in embedding mode)")
                observed.append("g (%s): kinds %s" % (py, json_kinds(r)))
                runs.append(r)

                before = len(proxy.seen)
                r = preflight("g2", py, proxy.url, ["--api", "openai", "--json"])
                answered = ("POST", "/v1/embeddings", 200) in proxy.seen[before:]
                check(r, r.code == 0 and json_kinds(r) == ["embed"] and answered,
                      "expected exit 0, kind embed and a POST /v1/embeddings answered 200 "
                      "by the server (proxy saw %s)" % proxy.seen[before:])
                runs.append(r)
        finally:
            proxy.stop()
        srv.stop()
    finally:
        for s in servers:
            s.stop()
        if args.keep:
            say("kept %s" % work)
        else:
            shutil.rmtree(work, ignore_errors=True)

    say("")
    say("what the server answers:")
    for line in observed:
        say("  " + line)
    say("")
    say(table(runs))
    say("")
    say("total %.1f s" % (time.monotonic() - t0))
    if failed:
        say("FAILED:")
        for f in failed:
            say("  " + f)
        return 1
    say("PASS: b, c, e, e2, g, g2 hold against llama-cpp-python's server")
    return 0


if __name__ == "__main__":
    sys.exit(main())
