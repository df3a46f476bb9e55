"""Shared helpers for the gpu_preflight tests (stdlib only, Python 3.6+).

run_script() runs the real script as a subprocess the way cron does: an
environment of only PATH=/usr/bin:/bin (no LANG, so the C locale), no TTY on
any stream, and a session of its own. SyslogSink is a real UNIX datagram
socket that receives what the script logs.

Hermetic: no run reads the host's /etc/gpu_preflight.conf, writes to the
host's /dev/log or keeps state in /run/gpu_preflight. cron_env() names a
config file of comments only, a log socket nobody listens on (as on a host
with no syslog daemon) and a state directory, all in a directory of this test
process's; a test that wants a log passes its own --syslog-address, one that
wants a config or state directory names its own. tests/run.py proves
it: the suite runs where /etc/gpu_preflight.conf is planted and /dev/log is
watched.
"""

import atexit
import http.server
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
SCRIPT = os.path.join(REPO, "gpu_preflight.py")
IN_CI = os.environ.get("CI", "").lower() == "true"

if TESTS not in sys.path:
    sys.path.insert(0, TESTS)


def load_script():
    """Import gpu_preflight.py by path (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_preflight", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_hermetic, _hermetic_lock = [], threading.Lock()     # tests run cases in threads


def hermetic_dir():
    """This test process's stand-ins for the host's config file, log socket
    and state directory: (directory, a config of comments only, a log path
    nobody listens on, a state directory)."""
    with _hermetic_lock:
        return _make_hermetic()


def _make_hermetic():
    if not _hermetic:
        directory = tempfile.mkdtemp(prefix="gpfl-hermetic-")
        os.chmod(directory, 0o755)          # runs as nobody read the config too
        atexit.register(shutil.rmtree, directory, True)
        os.mkdir(os.path.join(directory, "state"), 0o700)
        config = os.path.join(directory, "gpu_preflight.conf")
        with open(config, "w") as handle:
            handle.write("# the tests' own: the host's config is never read\n"
                         "[gpu_preflight]\n")
        os.chmod(config, 0o644)
        _hermetic.extend([directory, config, os.path.join(directory, "no-daemon.sock"),
                          os.path.join(directory, "state")])
    return tuple(_hermetic)


def cron_env(**extra):
    """The environment cron gives a job, plus what a test adds; kept off the
    host's config file, log socket and state directory (a value of None drops
    a variable)."""
    _, config, log, state = hermetic_dir()
    env = {"PATH": "/usr/bin:/bin", "GPU_PREFLIGHT_CONFIG": config,
           "GPU_PREFLIGHT_SYSLOG_ADDRESS": log, "GPU_PREFLIGHT_STATE_DIR": state}
    env.update(extra)
    return dict((name, value) for name, value in env.items() if value is not None)


def own_seconds(res, fields=None):
    """The run's own elapsed time in seconds, counted from its process start:
    elapsed_ms from its log fields, else from the line or --json it printed.
    A loaded machine slows the test's wall clock, not the run's."""
    if fields is None:
        found = re.findall(r'elapsed_ms["=: ]+([0-9.]+)', res.stdout + res.stderr)
        assert found, "the run printed no elapsed_ms: %r" % (res,)
        return float(found[-1]) / 1000
    return float(fields["elapsed_ms"]) / 1000


class Result(object):
    def __init__(self, code, stdout, stderr, elapsed):
        self.code, self.stdout, self.stderr = code, stdout, stderr
        self.elapsed = elapsed

    def __repr__(self):
        return "Result(code=%r, elapsed=%.2f, stdout=%r, stderr=%r)" % (
            self.code, self.elapsed, self.stdout[:500], self.stderr[:500])


#: Run by a fresh interpreter in front of a command: every signal at its
#: default action and none blocked, then argv[1]'s (comma-separated numbers)
#: ignored, the umask argv[2] (octal), the descriptors argv[3] closed, the
#: user argv[4] (its own group, no others); then exec argv[5:]. An exec where
#: Popen's preexec_fn would run Python in a fork of the threaded test process,
#: which may deadlock on a lock another thread held at the fork.
_PREPARE = r"""
import os, signal, sys, warnings  # os.execvp imports warnings: not as the user
ignored, umask, closed, uid = sys.argv[1:5]
for signum in range(1, signal.NSIG):
    try:
        signal.signal(signum, signal.SIG_DFL)
    except (OSError, ValueError, RuntimeError):
        pass                            # SIGKILL, SIGSTOP, libc's own
for signum in ignored.split(",") if ignored else ():
    signal.signal(int(signum), signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_SETMASK, [])
if umask:
    os.umask(int(umask, 8))
for fd in closed.split(",") if closed else ():
    os.close(int(fd))
if uid:
    os.setgroups([])
    os.setgid(int(uid))
    os.setuid(int(uid))
os.execvp(sys.argv[5], sys.argv[5:])
"""


def prepared(argv, ignored=(), umask=None, closed=(), uid=None):
    """argv run with every signal at its default action and none blocked
    (whatever the test process inherited: a suite started from a background
    job `( ... & )` has SIGINT and SIGQUIT ignored, a nohup one SIGHUP), then
    `ignored` ignored, the umask set, `closed` descriptors closed, as uid."""
    return [sys.executable, "-c", _PREPARE, ",".join(str(int(s)) for s in ignored),
            "" if umask is None else "%o" % umask, ",".join(str(fd) for fd in closed),
            "" if uid is None else str(uid)] + list(argv)


def wait_for_flock(paths, timeout=20.0):
    """Wait until some process holds a flock on one of paths (a callable that
    lists them, or a list), as /proc/locks shows it: a test then knows that a
    run started in the background has its lock, however loaded the machine."""
    ends = time.monotonic() + timeout
    while time.monotonic() < ends:
        inodes = set()
        for path in paths() if callable(paths) else paths:
            try:
                inodes.add(os.stat(path).st_ino)
            except OSError:
                pass
        with open("/proc/locks") as handle:
            held = set(int(line.split()[5].rsplit(":", 1)[1]) for line in handle
                       if line.split()[1:2] == ["FLOCK"])
        if inodes & held:
            return
        time.sleep(0.02)
    raise AssertionError("no flock on %r within %ss" % (paths, timeout))


def sig_mask(signums):
    """The /proc/PID/status SigIgn/SigBlk hex mask of these signals."""
    return "%016x" % sum(1 << (int(s) - 1) for s in signums)


def run_script(args, env=None, timeout=60, python=None, cwd="/", wrapper=()):
    """Run gpu_preflight.py under cron-like conditions (behind a wrapper
    command, if given); return a Result."""
    started = time.monotonic()
    proc = subprocess.Popen(
        list(wrapper) + [python or sys.executable, SCRIPT] + list(args),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=cron_env() if env is None else env,
        cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError("gpu_preflight did not exit within %ss: %r"
                             % (timeout, err))
    return Result(proc.returncode, out.decode("ascii"), err.decode("ascii"),
                  time.monotonic() - started)


class SyslogSink(object):
    """A UNIX datagram socket standing in for /dev/log."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="gpfl-log-")
        self.path = os.path.join(self.dir, "log.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)

    def messages(self, wait=2.0):
        """Every datagram received so far, waiting up to `wait` for the first."""
        got = []
        self.sock.settimeout(wait)
        try:
            while True:
                got.append(self.sock.recv(65536).decode("ascii"))
                self.sock.settimeout(0.05)
        except socket.timeout:
            pass
        return got

    def close(self):
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def require_tool(testcase, name, path=None):
    """The path of a tool, or skip; in CI a missing tool fails the test."""
    found = path if path and os.path.exists(path) else shutil.which(name)
    if found:
        return found
    message = "%s is not installed" % name
    if IN_CI:
        testcase.fail(message + " (CI=true: .ci/run must install it)")
    raise unittest.SkipTest(message)


def parse_fields(line):
    """key=value fields of a log line; quoted values unescaped."""
    fields, i = {}, 0
    while i < len(line):
        eq = line.find("=", i)
        if eq < 0:
            break
        key = line[i:eq].strip()
        if line[eq + 1:eq + 2] == '"':
            j, value = eq + 2, []
            while line[j] != '"':
                if line[j] == "\\":
                    j += 1
                value.append(line[j])
                j += 1
            fields[key] = "".join(value)
            i = j + 2
        else:
            end = line.find(" ", eq)
            end = len(line) if end < 0 else end
            fields[key] = line[eq + 1:end]
            i = end + 1
    return fields


class ScriptedServer(object):
    """A scripted HTTP server on loopback (a hostile one, or one a test plays
    line by line): answer(method, path, token) -> (status, body bytes,
    [(header, value)]) sees the bearer token of the request it answers; seen
    lists every token sent."""

    def __init__(self, testcase, answer):
        self.seen = seen = []
        class Handler(http.server.BaseHTTPRequestHandler):
            def reply(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                token = (self.headers.get("Authorization") or "")[len("Bearer "):]
                seen.append(token)
                status, body, headers = answer(self.command, self.path, token)
                self.send_response(status)
                for name, value in [("Content-Type", "application/json")] + headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            do_GET = do_POST = reply

            def log_message(self, *args):
                pass
        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=self.server.serve_forever)
        thread.daemon = True
        thread.start()
        testcase.addCleanup(self.server.server_close)
        testcase.addCleanup(self.server.shutdown)
        self.url = "http://127.0.0.1:%d" % self.server.server_port


READY_TAGS = b'{"models": [{"name": "llama3.2:latest", "model": "llama3.2:latest"}]}'
READY_PS = (b'{"models": [{"name": "llama3.2:latest", "model": "llama3.2:latest", '
            b'"size": 10, "size_vram": 10}]}')
READY_GEN = b'{"model": "llama3.2:latest", "response": "!", "done": true}'


def ready_answer(method, path, calls):
    """A faithful ready Ollama (one model, loaded, in VRAM)."""
    return {"/api/tags": (200, READY_TAGS), "/api/ps": (200, READY_PS),
            "/api/generate": (200, READY_GEN)}.get(path, (404, b"404 page not found"))
