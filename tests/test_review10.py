"""Adversarial review of issues 10 and 13 (review10): regression tests for
what a hostile server, a careless operator and an odd host still break.

Each test asserts the contract of issue 10: a documented exit status (never
70), exactly one syslog line, the deadline kept, a reason that says what to
do. Every test here FAILED on the code reviewed (main at fa1ba4d); the
docstring of each says what was seen.

The real script runs as a subprocess in cron's environment (only
PATH=/usr/bin:/bin, no TTY) against loopback servers, fake GPU sysfs trees
and a fake nvidia-smi, as the rest of the suite does.
"""

import json
import os
import resource
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import fakes
import support
from test_contract import SLACK, ContractCase

#: One more digit than Python 3.11's (and 3.7.14+'s) int() accepts from text.
PAST_INT_LIMIT = "9" * 5000

READY_TAGS = b'{"models": [{"name": "llama3.2:latest", "model": "llama3.2:latest"}]}'
READY_PS = (b'{"models": [{"name": "llama3.2:latest", "model": "llama3.2:latest", '
            b'"size": 10, "size_vram": 10}]}')
READY_GEN = b'{"model": "llama3.2:latest", "response": "!", "done": true}'


def ready_answer(method, path, calls):
    """A faithful ready Ollama (one model, loaded, in VRAM)."""
    return {"/api/tags": (200, READY_TAGS), "/api/ps": (200, READY_PS),
            "/api/generate": (200, READY_GEN)}.get(path, (404, b"404 page not found"))


def run_odd(args, env=None, ignored=(), close_fds=True, wrapper=(), timeout=60):
    """run_script() with signals ignored or a wrapper command before the
    interpreter."""
    started = time.monotonic()
    proc = subprocess.Popen(
        support.prepared(list(wrapper) + [sys.executable, support.SCRIPT] + list(args),
                         ignored),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=support.cron_env() if env is None else env, cwd="/",
        start_new_session=True, close_fds=close_fds)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError("gpu_preflight did not exit within %ss: %r" % (timeout, err))
    return support.Result(proc.returncode, out.decode("ascii", "replace"),
                          err.decode("ascii", "replace"), time.monotonic() - started)


class Review10Case(ContractCase):
    def setUp(self):
        ContractCase.setUp(self)
        self.dir = tempfile.mkdtemp(prefix="gpfl-review10-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        os.chmod(self.dir, 0o755)

    def amd_root(self):
        """A fake amdgpu sysfs with one idle GPU (GPU_PREFLIGHT_ROOT)."""
        return fakes.make_amd_sysfs(os.path.join(self.dir, "root"), [dict(
            busy=5, used_mib=1024, temp_c=45, unique_id="abc123", name="AMD Fake")])

    def assertReady(self, res):
        self.assertEqual(res.code, 0, res)
        fields = self.log()[1]
        self.assertEqual(fields["result"], "ready", fields)
        return fields

    def assertNotInternal(self, res, deadline=None):
        """The contract of issue 10 for a run without -- COMMAND."""
        self.assertIn(res.code, (0, 69, 75, 78), res)
        self.assertNotIn("Traceback", res.stderr)
        fields = self.log()[1]
        self.assertEqual(fields["code"], str(res.code), fields)
        if deadline is not None:
            self.assertLess(res.elapsed, deadline + SLACK, res)
        return fields


class HostileServerTest(Review10Case):
    def test_api_ps_naming_the_loaded_model_another_way_is_not_an_internal_error(self):
        """No --model; /api/tags lists llama3.2:latest, /api/ps names the
        same model LLAMA3.2:latest or llama3.2 (same_model() agrees).
        Seen: 70 "internal error: StopIteration" (ollama_kinds() looks the
        /api/ps spelling up in /api/tags with ==)."""
        for spelling in ("LLAMA3.2:latest", "llama3.2"):
            with self.subTest(ps_name=spelling):
                ps = ('{"models": [{"name": "%s", "size": 10, "size_vram": 10}]}'
                      % spelling).encode()
                url = self.scripted_server(lambda method, path, calls: (
                    200, ps) if path == "/api/ps" else ready_answer(method, path, calls))
                self.sink.messages(wait=0.01)
                res = self.run_gp(["--host", url, "--deadline", "3"])
                fields = self.assertReady(res)
                self.assertEqual(fields["model"], "llama3.2:latest")

    def test_a_huge_model_name_with_a_token_keeps_the_deadline(self):
        """The server's only model has a 2-million-character name (4 MB of
        UTF-8, within MAX_BODY); a token is set and --json asked. Seen: the
        verdict at 0.1 s, the exit at 5-7 s with --deadline 2 (redact() runs
        a Python loop over every character of the JSON output and state)."""
        name = "\u00e9" * 2000000
        models = json.dumps({"object": "list", "data": [{"id": name}]},
                            ensure_ascii=False).encode("utf-8")

        def answer(method, path, calls):
            if path == "/v1/models":
                return 200, models
            if path == "/v1/completions":
                return 200, b'{"choices": [{"text": "!"}]}'
            return 200, b""
        url = self.scripted_server(answer)
        state = os.path.join(self.dir, "state")
        res = self.run_gp(["--host", url, "--api", "openai", "--deadline", "2", "--json",
                           "--share-result", "5", "--state-dir", state],
                          env=support.cron_env(GPU_PREFLIGHT_TOKEN="sk-review10-secret"))
        self.assertNotInternal(res, deadline=2)

    def test_a_tls_name_mismatch_is_a_configuration_error_on_every_python(self):
        """A certificate from the trusted CA for another name. Seen on 3.6:
        69 "CertificateError: hostname '127.0.0.1' doesn't match ..." (there
        ssl.CertificateError is a ValueError, not an SSLError); 78 on 3.7+."""
        openssl = support.require_tool(self, "openssl")
        d = self.dir

        def sh(*args):
            subprocess.check_call([openssl] + list(args), cwd=d, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        sh("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
           "-out", "ca.pem", "-days", "2", "-subj", "/CN=review10 CA")
        sh("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "s.key", "-out", "s.csr",
           "-subj", "/CN=other.example")
        with open(os.path.join(d, "ext"), "w") as handle:
            handle.write("subjectAltName=DNS:other.example\nbasicConstraints=CA:FALSE\n")
        sh("x509", "-req", "-in", "s.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
           "-CAcreateserial", "-out", "s.pem", "-days", "2", "-extfile", "ext")
        os.chmod(os.path.join(d, "ca.pem"), 0o644)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER) if hasattr(
            ssl, "PROTOCOL_TLS_SERVER") else ssl.SSLContext(ssl.PROTOCOL_SSLv23)
        context.load_cert_chain(os.path.join(d, "s.pem"), os.path.join(d, "s.key"))
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        self.addCleanup(listener.close)

        def serve():
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                try:
                    context.wrap_socket(conn, server_side=True).close()
                except (OSError, ValueError):
                    conn.close()
        thread = threading.Thread(target=serve)
        thread.daemon = True
        thread.start()
        res = self.run_gp(["--host", "https://127.0.0.1:%d" % listener.getsockname()[1],
                           "--cafile", os.path.join(d, "ca.pem"), "--deadline", "3"])
        self.assertSkip(res, 78, "tags", "127.0.0.1", deadline=3)


class OperatorTest(Review10Case):
    def test_digit_strings_past_the_int_limit_are_refused_never_70(self):
        """Python 3.11 (and 3.7.14+, 3.8.14+...) int() refuses text of more
        than 4300 digits with ValueError. Seen: OLLAMA_HOST=127.0.0.1:<5000
        digits> exits 70 with no syslog line at all (resolve_options calls
        parse_ollama_host outside its ValueError handler); --gpu-id <5000
        digits> exits 70 (select_gpus() calls int())."""
        res = self.run_gp(["--deadline", "2"], env=support.cron_env(
            OLLAMA_HOST="127.0.0.1:" + PAST_INT_LIMIT))
        self.assertNotInternal(res, deadline=2)
        self.sink.messages(wait=0.01)
        url = self.scripted_server(ready_answer)
        env = support.cron_env(GPU_PREFLIGHT_ROOT=self.amd_root())
        for where in ("cli", "env"):
            with self.subTest(gpu_id=where):
                self.sink.messages(wait=0.01)
                args = ["--host", url, "--deadline", "2", "--gpu-backend", "amd-sysfs"]
                if where == "cli":
                    res = self.run_gp(args + ["--gpu-id", PAST_INT_LIMIT], env=env)
                else:
                    res = self.run_gp(args, env=dict(env, GPU_PREFLIGHT_GPU_ID=PAST_INT_LIMIT))
                if res.code == 64 and where == "cli":   # refused as it is parsed
                    self.assertIn("--gpu-id", res.stderr)
                    continue
                fields = self.assertNotInternal(res, deadline=2)
                self.assertEqual(res.code, 78, fields)  # no such GPU, or a bad value

    def test_many_models_keep_the_deadline(self):
        """3000 names in --model. Seen: 13 s with --deadline 1 (5000 names:
        37 s): unique_models() compares every pair, before supervision."""
        names = ",".join("m%d" % i for i in range(3000))
        res = self.run_gp(["--host", "127.0.0.1:9", "--deadline", "1", "--model", names])
        self.assertLess(res.elapsed, 1 + SLACK, res)
        self.assertNotInternal(res)

    def test_a_host_urllib_cannot_send_is_refused_as_a_usage_error(self):
        """Seen: --host http://127.0.0.1:PORT/\u00fc is accepted, then every
        request fails with 69 "UnicodeEncodeError: 'ascii' codec..." (and
        --wait retries it until the deadline); a control character from the
        config file gives 69 "InvalidURL". A usage error (64) or a
        configuration error (78) naming --host is what the operator needs."""
        url = self.scripted_server(ready_answer)
        res = self.run_gp(["--host", url + "/\u00fc", "--deadline", "2"])
        self.assertEqual(res.code, 64, res)
        self.assertIn("--host", res.stderr)
        conf = os.path.join(self.dir, "gp.conf")
        with open(conf, "w") as handle:
            handle.write("[gpu_preflight]\nhost = %s/a\x01b\n" % url)
        res = self.run_gp(["--config", conf, "--deadline", "2"])
        self.assertSkip(res, 78, "config", "host", deadline=2)

    def test_a_config_file_saved_with_a_byte_order_mark_is_read(self):
        """Windows editors save UTF-8 with a BOM. Seen: 78 "its first setting
        comes before any section: put [gpu_preflight] on a line above it"
        although that line is there (and 78 for the all-comment example)."""
        conf = os.path.join(self.dir, "gp.conf")
        for text in ("[gpu_preflight]\nmodel = absent\n",
                     "# all comments\n[gpu_preflight]\n# timeout = 2\n"):
            with self.subTest(config=text):
                with open(conf, "wb") as handle:
                    handle.write(b"\xef\xbb\xbf" + text.encode("ascii"))
                self.sink.messages(wait=0.01)
                res = self.run_gp(["--config", conf, "--host", "127.0.0.1:9",
                                   "--deadline", "2"])
                fields = self.assertNotInternal(res, deadline=2)
                self.assertNotEqual(fields["stage"], "config", fields)


class OddHostTest(Review10Case):
    def test_the_gpu_probe_with_stdio_descriptors_closed(self):
        """Started with two of 0, 1, 2 closed, os.pipe() returns two of them;
        the forked probe then dup2()s /dev/null over its own write end. Seen:
        69 "AMD sysfs probe died (exit 0)"."""
        url = self.scripted_server(ready_answer)
        env = support.cron_env(GPU_PREFLIGHT_ROOT=self.amd_root())
        for closed in ((0, 1), (1, 2), (0, 2)):
            with self.subTest(closed=closed):
                self.sink.messages(wait=0.01)
                started = time.monotonic()
                proc = subprocess.Popen(support.prepared(
                    [sys.executable, support.SCRIPT, "--host", url, "--deadline", "3",
                     "--gpu-backend", "amd-sysfs", "--syslog-address", self.sink.path],
                    closed=closed), env=env, cwd="/", start_new_session=True)
                self.assertEqual(proc.wait(30), 0)
                self.assertLess(time.monotonic() - started, 3 + SLACK)
                self.assertEqual(self.log()[1]["result"], "ready")

    def test_the_gpu_probe_with_more_than_1024_descriptors_open(self):
        """A parent that leaks descriptors (RLIMIT_NOFILE above 1024, as in
        many containers). Seen: 70 "ValueError: filedescriptor out of range
        in select()" for every GPU backend (collect() uses select.select)."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and hard < 1200:
            self.skipTest("RLIMIT_NOFILE hard limit %d < 1200" % hard)
        url = self.scripted_server(ready_answer)
        leak = ("import os, resource, sys\n"
                "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
                "resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))\n"
                "for _ in range(1100):\n"
                "    os.set_inheritable(os.open('/dev/null', os.O_RDONLY), True)\n"
                "os.execv(sys.argv[1], sys.argv[1:])\n")
        res = run_odd(["--host", url, "--deadline", "3", "--gpu-backend", "amd-sysfs",
                       "--syslog-address", self.sink.path],
                      env=support.cron_env(GPU_PREFLIGHT_ROOT=self.amd_root()),
                      wrapper=(sys.executable, "-c", leak))
        self.assertReady(res)
        self.assertLess(res.elapsed, 3 + SLACK, res)

    def test_nvidia_smi_with_sigchld_ignored(self):
        """A parent that ignores SIGCHLD (inherited across exec): children
        are reaped by the kernel and waitpid() fails with ECHILD. Seen: 75
        "GPU probe hung: nvidia-smi did not exit within 2.9s of its output
        ending", at once and on every run."""
        smi_dir = os.path.join(self.dir, "bin")
        fakes.write_fake_smi(smi_dir)
        os.chmod(smi_dir, 0o755)
        url = self.scripted_server(ready_answer)
        res = run_odd(["--host", url, "--deadline", "3", "--gpu-backend", "nvidia-smi",
                       "--syslog-address", self.sink.path],
                      env=support.cron_env(PATH=smi_dir + ":/usr/bin:/bin"),
                      ignored=(signal.SIGCHLD,))
        self.assertReady(res)

    def test_an_nvidia_smi_figure_too_large_for_a_float_is_not_70(self):
        """nvidia-smi printing a 400-digit memory.free (a broken driver or
        wrapper). Seen: 70 "OverflowError: cannot convert float infinity to
        integer" (parse_smi_csv: int(float(text)))."""
        smi_dir = os.path.join(self.dir, "bin")
        os.makedirs(smi_dir)
        os.chmod(smi_dir, 0o755)
        smi = os.path.join(smi_dir, "nvidia-smi")
        with open(smi, "w") as handle:
            handle.write("#!/bin/sh\ncase \"$1\" in\n--query-gpu=*) echo \"0, GPU-abc, "
                         "Fake, 00000000:01:00.0, 81920, 1, %s, 5, 40\";;\n*) echo "
                         "\"GPU-abc, 123\";;\nesac\n" % ("9" * 400))
        os.chmod(smi, 0o755)
        url = self.scripted_server(ready_answer)
        res = self.run_gp(["--host", url, "--deadline", "3", "--gpu-backend", "nvidia-smi"],
                          env=support.cron_env(PATH=smi_dir + ":/usr/bin:/bin"))
        self.assertNotInternal(res, deadline=3)

    def test_the_gpu_probe_without_proc(self):
        """No /proc (a chroot, a minimal container). Seen: 69 "AMD sysfs
        probe died (exit 70)": the forked child lists /proc/self/fd to close
        descriptors, and that raises before it probes anything."""
        unshare = support.require_tool(self, "unshare")
        if os.geteuid() != 0:
            self.skipTest("needs root to mount over /proc in a mount namespace")
        url = self.scripted_server(ready_answer)
        res = run_odd(["--host", url, "--deadline", "3", "--gpu-backend", "amd-sysfs",
                       "--syslog-address", self.sink.path],
                      env=support.cron_env(GPU_PREFLIGHT_ROOT=self.amd_root()),
                      wrapper=(unshare, "--mount", "--propagation", "private", "/bin/sh",
                               "-c", 'mount -t tmpfs none /proc && exec "$@"', "sh"))
        self.assertReady(res)


if __name__ == "__main__":
    unittest.main()
