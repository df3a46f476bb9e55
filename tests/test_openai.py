"""--api openai|auto against loopback emulators of vLLM and llama.cpp's
llama-server (tests/openai_emu.py), bearer tokens, and TLS through a
reverse proxy with a test CA made by openssl (tests/tls_util.py).
"""

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

import support
import tls_util
from ollama_emu import free_port
from openai_emu import OpenAIEmulator
from test_contract import SLACK, ContractCase
from test_trust import TrustCase

TOKEN = "gpfl-test-Secret-7Q2x"


class OpenAICase(ContractCase):
    def setUp(self):
        ContractCase.setUp(self)
        self.dir = tempfile.mkdtemp(prefix="gpfl-openai-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def server(self, flavour="vllm", **kwargs):
        emu = OpenAIEmulator(flavour=flavour, **kwargs).start()
        self.addCleanup(emu.stop)
        return emu

    def check(self, url, *args, **kwargs):
        env = kwargs.pop("env", None)
        res = self.run_gp(["--host", url, "--api", kwargs.pop("api", "openai")]
                          + list(args), env=env)
        if "-v" not in args:
            self.assertEqual(res.stderr, "", res)
        return res

    def verdict(self, res, code, stage=None, text=""):
        self.assertEqual(res.code, code, res)
        fields = self.log()[1]
        self.assertEqual(fields["code"], str(code))
        if stage:
            self.assertEqual(fields["stage"], stage)
        self.assertIn(text, fields["reason"])
        return fields

    def token_file(self, mode=0o600, text=TOKEN + "\n", name="token"):
        path = os.path.join(self.dir, name)
        with open(path, "w") as handle:
            handle.write(text)
        os.chmod(path, mode)
        return path


class ServersTest(OpenAICase):
    def test_vllm_and_llama_server_are_ready_with_one_token(self):
        for flavour in ("vllm", "llamacpp"):
            with self.subTest(flavour=flavour):
                emu = self.server(flavour)
                fields = self.verdict(self.check(emu.url), 0)
                self.assertEqual(fields["api"], "openai")
                self.assertEqual(fields["model"], "qwen2.5-0.5b")
                for stage in ("health_ms", "models_ms", "completion_ms"):
                    self.assertIn(stage, fields)
                posts = [r for r in emu.requests if r["method"] == "POST"]
                self.assertEqual(len(posts), 1)
                self.assertEqual(posts[0]["path"], "/v1/completions")
                self.assertEqual(json.loads(posts[0]["body"]), {
                    "model": "qwen2.5-0.5b", "prompt": "test", "max_tokens": 1,
                    "stream": False})

    def test_auto_picks_the_api(self):
        from ollama_emu import Emulator
        ollama = Emulator().start()
        self.addCleanup(ollama.stop)
        fields = self.verdict(self.check(ollama.url, api="auto"), 0)
        self.assertNotIn("api", fields)
        self.assertEqual(ollama.count("POST", "/api/generate"), 1)
        for flavour in ("vllm", "llamacpp"):
            with self.subTest(flavour=flavour):
                emu = self.server(flavour)
                fields = self.verdict(self.check(emu.url, api="auto"), 0)
                self.assertEqual(fields["api"], "openai")
                self.assertEqual([r["path"] for r in emu.requests][0], "/api/version")

    def test_loading_is_temporary(self):
        vllm = self.server("vllm", mode="loading", load_seconds=30)
        self.verdict(self.check(vllm.url), 75, "health", "vLLM refuses connections "
                     "while it loads")
        llama = self.server("llamacpp", mode="loading", load_seconds=30)
        self.verdict(self.check(llama.url), 75, "health", "503 Loading model")

    def test_wait_rides_out_a_load(self):
        llama = self.server("llamacpp", mode="loading", load_seconds=4)  # the run comes in it
        res = self.check(llama.url, "--wait", "20")
        fields = self.verdict(res, 0)
        self.assertGreaterEqual(int(fields["attempts"]), 2)

    def test_dead_engine_is_unavailable(self):
        emu = self.server("vllm", mode="engine_dead")
        self.verdict(self.check(emu.url), 69, "health", "the engine is dead")

    def test_an_empty_503_on_health_is_not_ready_unless_vllm_says_its_engine_died(self):
        sglang = self.server("vllm", mode="sglang_starting", load_seconds=30)
        self.verdict(self.check(sglang.url), 75, "health",
                     "GET /health: 503 empty body: not ready (starting, draining or overloaded)")
        self.assertEqual(sglang.count("GET", "/version"), 1)
        self.assertEqual([r for r in sglang.requests if r["method"] == "POST"], [])
        dead = self.server("vllm", mode="engine_dead")
        self.verdict(self.check(dead.url), 69, "health", "the engine is dead")
        self.assertEqual(dead.count("GET", "/health"), 2)

    def test_wait_rides_out_an_sglang_start(self):
        sglang = self.server("vllm", mode="sglang_starting", load_seconds=4)
        fields = self.verdict(self.check(sglang.url, "--wait", "20"), 0)
        self.assertGreaterEqual(int(fields["attempts"]), 2)

    def test_health_path_none_and_a_custom_path(self):
        emu = self.server("vllm")
        self.verdict(self.check(emu.url, "--health-path", "none"), 0)
        self.assertEqual(emu.count("GET", "/health"), 0)
        self.assertEqual(emu.count("GET", "/v1/models"), 1)
        lite = self.server("vllm", mode="litellm")
        self.verdict(self.check(lite.url, "--health-path", "/health/readiness"), 0)
        self.assertEqual(lite.count("GET", "/health"), 0)
        self.assertEqual(lite.count("GET", "/health/readiness"), 1)
        self.verdict(self.check(emu.url, "--health-path", "/ready"), 78, "health",
                     "GET /ready: 404: no such path here: check --health-path")

    def test_bad_health_path_is_64_as_a_flag_and_78_from_the_environment(self):
        for bad in ("health", "/a b", "/" + "x" * 300, "/\x01"):
            with self.subTest(bad=bad):
                res = self.run_gp(["--api", "openai", "--health-path", bad])
                self.assertEqual(res.code, 64, res)
                self.assertIn("--health-path", res.stderr)
        res = self.run_gp(["--api", "openai"], env={"GPU_PREFLIGHT_HEALTH_PATH": "ready"})
        self.assertEqual(res.code, 78, res)

    def test_litellm_health_gets_a_note_and_its_slowness_is_temporary(self):
        lite = self.server("vllm", mode="litellm")
        lite.litellm_delay = 1.5
        self.verdict(self.check(lite.url, "--timeout", "10"), 0,
                     text="use --health-path /health/readiness")
        lite.litellm_delay = 5.0
        self.verdict(self.check(lite.url, "--timeout", "1"), 75, "health", "timed out")

    def test_a_sleeping_vllm_is_temporary_and_gets_no_completion(self):
        emu = self.server("vllm", mode="sleeping")
        self.verdict(self.check(emu.url), 75, "sleep", "engine asleep (POST /wake_up)")
        self.assertEqual([r for r in emu.requests if r["method"] == "POST"], [])
        self.verdict(self.check(emu.url, "--warmup", "off"), 0)
        self.assertEqual(emu.count("GET", "/is_sleeping"), 1)
        awake = self.server("vllm")
        self.verdict(self.check(awake.url), 0)
        self.assertEqual(awake.count("GET", "/is_sleeping"), 1)

    def test_unknown_model_and_no_models_are_configuration(self):
        emu = self.server("vllm")
        self.verdict(self.check(emu.url, "--model", "llama3"), 78, "models",
                     "model llama3 is not served here; it serves: qwen2.5-0.5b")
        self.assertEqual([r for r in emu.requests if r["method"] == "POST"], [])
        empty = self.server("llamacpp", mode="empty_models")
        self.verdict(self.check(empty.url), 78, "models", "serves no models")

    def test_server_without_health_is_noted(self):
        emu = self.server("vllm", mode="no_health")
        self.verdict(self.check(emu.url), 0, text="server has no /health")

    def test_out_of_memory_is_temporary(self):
        emu = self.server("vllm", mode="oom")
        self.verdict(self.check(emu.url), 75, "completion", "out of memory")

    def test_ollama_itself_is_not_an_openai_server_without_v1(self):
        from ollama_emu import Emulator
        ollama = Emulator().start()
        self.addCleanup(ollama.stop)
        self.verdict(self.check(ollama.url), 78, text="not an OpenAI-compatible server")


class FaultsTest(OpenAICase):
    """Every fault mode under --api openai ends inside the deadline."""

    def test_faults(self):
        cases = [("hang", 75, "timed out"), ("trickle", 75, "timed out"),
                 ("close_mid_body", 69, "mid-answer"), ("garbage", 69, "not JSON"),
                 ("huge", 69, "larger than")]
        for mode, code, text in cases:
            with self.subTest(mode=mode):
                self.sink.messages(wait=0.01)
                emu = self.server("vllm", mode=mode, fault_on="/v1/completions")
                # the completion's 1 s must start before the deadline's last 1 s
                res = self.check(emu.url, "--timeout", "1", "--deadline", "6")
                self.assertInTime(res, 6, self.verdict(res, code, "completion", text))

    def test_refused_port(self):
        res = self.check("127.0.0.1:%d" % free_port(), "--deadline", "3")
        self.assertInTime(res, 3, self.verdict(res, 75, "health", "connection refused"))

    def test_redirect_is_reported_not_followed(self):
        emu = self.server("vllm", mode="redirect")
        path = self.token_file()
        res = self.check(emu.url, "--token-file", path)
        self.verdict(res, 78, "health", "redirected (302) to http://evil.example:9/steal")


class TokenTest(OpenAICase):
    def test_token_is_sent_and_never_shown(self):
        emu = self.server("vllm", token=TOKEN)
        path = self.token_file()
        res = self.check(emu.url, "--token-file", path, "--json", "-v", "--debug")
        self.assertEqual(res.code, 0, res)
        sent = [r["headers"].get("authorization") for r in emu.requests]
        self.assertEqual(set(sent), {"Bearer " + TOKEN})
        messages = self.sink.messages()
        for text in [res.stdout, res.stderr] + messages:
            self.assertNotIn(TOKEN, text)
        self.assertTrue(messages)

    def test_token_from_the_environment(self):
        emu = self.server("llamacpp", token=TOKEN)
        res = self.check(emu.url, env=support.cron_env(GPU_PREFLIGHT_TOKEN=TOKEN))
        self.verdict(res, 0)

    def test_wrong_or_missing_token_says_check_the_token(self):
        emu = self.server("vllm", token=TOKEN)
        self.verdict(self.check(emu.url), 78, "models", "check the token")
        res = self.check(emu.url, env=support.cron_env(GPU_PREFLIGHT_TOKEN="wrong"))
        self.verdict(res, 78, "models", "401")

    def test_a_token_echoed_by_the_server_is_hidden(self):
        def answer(method, path, n):
            return 500, b'{"error": "bad key %s"}' % TOKEN.encode()
        url = self.scripted_server(answer)
        res = self.check(url, "--json", "-v", env=support.cron_env(
            GPU_PREFLIGHT_TOKEN=TOKEN))
        for text in [res.stdout, res.stderr] + self.sink.messages():
            self.assertNotIn(TOKEN, text)
        self.assertIn("bad key [token]", res.stdout)

    def test_a_model_the_server_names_with_the_token_shows_as_token_in_the_metrics(self):
        """A server listing the token as a model (no --model: the first listed is
        checked): the metrics file, readable by all, says [token] in its labels as
        every other output does, never the token."""
        def answer(method, path, n):
            if path == "/v1/models":
                return 200, json.dumps({"data": [{"id": TOKEN}]}).encode()
            return 200, b'{"choices": [{"text": "x"}]}'
        metrics = os.path.join(self.dir, "gpu.prom")
        res = self.check(self.scripted_server(answer), "--metrics-file", metrics, "--json",
                         "-v", env=support.cron_env(GPU_PREFLIGHT_TOKEN=TOKEN))
        self.assertEqual(res.code, 0, res)
        with open(metrics) as handle:
            text = handle.read()
        self.assertIn('model="[token]"', text)
        messages = self.sink.messages()
        self.assertEqual(len(messages), 1, messages)
        for shown in [text, res.stdout, res.stderr] + messages:
            self.assertNotIn(TOKEN, shown)

    def test_an_echoed_token_never_shows_a_piece_of_itself(self):
        # redaction comes before any cut or escaping, and
        # covers every 8 characters of the token, in every output and the state
        tokens = ('q"uo\\te=' * 40)[:300], 'ab"cd\\ef=gh' * 3, "Z" * 7 + '"x\\=' * 60
        for token in tokens:
            echoes = {
                "json": lambda h: json.dumps({"error": "bad key %s" % h}).encode(),
                "text": lambda h: ("denied: %s" % h).encode(),
                "openai": lambda h: json.dumps({"error": {"message": h * 2}}).encode()}
            for form, make in sorted(echoes.items()):
                with self.subTest(token=token[:12], form=form):
                    def answer(method, path, n):    # echoes the header it got
                        return 401, make("Bearer " + token)
                    url = self.scripted_server(answer)
                    state = tempfile.mkdtemp(dir=self.dir)
                    self.sink.messages(wait=0.01)
                    res = self.check(url, "--json", "-v", "--share-result", "60",
                                     "--log-changes-only", "--state-dir", state,
                                     env=support.cron_env(GPU_PREFLIGHT_TOKEN=token))
                    self.assertEqual(res.code, 78, res)
                    outputs = [res.stdout, res.stderr] + self.sink.messages()
                    for name in os.listdir(state):
                        with open(os.path.join(state, name), errors="replace") as handle:
                            outputs.append(handle.read())
                    self.assertIn("[token]", res.stdout)
                    escaped = (token, json.dumps(token)[1:-1],
                               token.replace("\\", "\\\\").replace('"', '\\"'))
                    for text in outputs:
                        for shown in escaped:
                            for i in range(len(shown) - 7):
                                self.assertNotIn(shown[i:i + 8], text)
                    json.loads(res.stdout)      # the redaction kept the JSON whole

    def test_token_file_readable_by_others_is_refused_as_root(self):
        if os.geteuid() != 0:
            self.skipTest("the check applies to root")
        emu = self.server("vllm", token=TOKEN)
        res = self.check(emu.url, "--token-file", self.token_file(mode=0o644))
        self.verdict(res, 78, "config", "readable by group or others (mode 0644): chmod 600")
        self.assertEqual(emu.requests, [])

    def test_bad_token_files(self):
        emu = self.server("vllm", token=TOKEN)
        for path, text in ((os.path.join(self.dir, "missing"), "cannot read token file"),
                           (self.token_file(text="\n\n", name="empty"), "is empty"),
                           (self.token_file(text="two words\n", name="two"), "cannot carry")):
            with self.subTest(text=text):
                self.verdict(self.check(emu.url, "--token-file", path), 78, "config", text)

    def test_there_is_no_token_flag(self):
        for args in (["--token", TOKEN], ["--token=" + TOKEN]):
            res = support.run_script(args)
            self.assertEqual(res.code, 64, res)
            self.assertNotIn(TOKEN, res.stderr)
            self.assertIn("use --token-file or GPU_PREFLIGHT_TOKEN", res.stderr)


class TLSTest(OpenAICase):
    @classmethod
    def setUpClass(cls):
        cls.ca_dir = tempfile.mkdtemp(prefix="gpfl-ca-")
        case = OpenAICase("run")
        support.require_tool(case, "openssl")
        cls.ca = tls_util.make_test_ca(cls.ca_dir)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.ca_dir, ignore_errors=True)

    def proxy(self, cert, key, host="127.0.0.1", **kwargs):
        backend = self.server("vllm", **kwargs)
        proxy = tls_util.TLSProxy(backend.url, cert, key, host=host).start()
        self.addCleanup(proxy.stop)
        return proxy, backend

    def test_private_ca_with_cafile_and_a_token(self):
        proxy, backend = self.proxy(self.ca["server_cert"], self.ca["server_key"],
                                    token=TOKEN)
        self.assertTrue(proxy.url.startswith("https://"))
        res = self.check(proxy.url, "--cafile", self.ca["ca"], "--token-file",
                         self.token_file())
        self.verdict(res, 0)
        self.assertEqual(backend.count("POST", "/v1/completions"), 1)

    def test_unknown_ca_self_signed_and_expired_are_78(self):
        for cert, key, args, text in (
                ("server_cert", "server_key", [], "certificate verify failed"),
                ("other_cert", "other_key", ["--cafile", self.ca["ca"]],
                 "certificate verify failed"),
                ("expired_cert", "expired_key", ["--cafile", self.ca["ca"]],
                 "expired" if sys.version_info >= (3, 7) else "certificate verify failed")):
            with self.subTest(cert=cert):
                self.sink.messages(wait=0.01)
                proxy, backend = self.proxy(self.ca[cert], self.ca[key])
                self.verdict(self.check(proxy.url, *args), 78, "health", text)
                self.assertEqual(backend.requests, [])

    def test_insecure_works_and_warns_every_run(self):
        proxy, backend = self.proxy(self.ca["other_cert"], self.ca["other_key"])
        for _ in range(2):
            fields = self.verdict(self.check(proxy.url, "--insecure"), 0)
            self.assertEqual(fields["problem"], "TLS certificates not verified (--insecure)")

    def test_an_insecure_verdict_is_not_shared_with_a_run_that_verifies(self):
        # --insecure, --cafile and --api define the check
        proxy, backend = self.proxy(self.ca["other_cert"], self.ca["other_key"])
        state = tempfile.mkdtemp(dir=self.dir)
        shared = ["--share-result", "60", "--state-dir", state]
        self.verdict(self.check(proxy.url, "--insecure", *shared), 0)
        self.verdict(self.check(proxy.url, *shared), 78, "health", "certificate verify failed")
        self.verdict(self.check(proxy.url, "--cafile", self.ca["ca"], *shared), 78, "health")

    def test_a_verdict_ssl_cert_file_verified_is_not_shared_with_a_run_without_it(self):
        # without --cafile, SSL_CERT_FILE chooses the CA store: the same
        # options without it prove nothing about this certificate
        proxy, backend = self.proxy(self.ca["server_cert"], self.ca["server_key"])
        state = tempfile.mkdtemp(dir=self.dir)
        shared = ["--share-result", "60", "--state-dir", state]
        self.verdict(self.check(proxy.url, *shared, env=support.cron_env(
            SSL_CERT_FILE=self.ca["ca"])), 0)
        self.verdict(self.check(proxy.url, *shared), 78, "health", "certificate verify failed")

    def test_bad_cafile_is_78(self):
        proxy, backend = self.proxy(self.ca["server_cert"], self.ca["server_key"])
        self.verdict(self.check(proxy.url, "--cafile", os.path.join(self.ca_dir, "nope")),
                     78, "config", "cannot use --cafile")

    def test_a_tls_name_mismatch_is_a_configuration_error_on_every_python(self):
        """A certificate from the trusted CA for another name is 78 on every
        Python, 3.6 too, where ssl.CertificateError ("hostname '127.0.0.1'
        doesn't match ...") is a ValueError, not an SSLError."""
        openssl = support.require_tool(self, "openssl")
        d = self.dir

        def sh(*args):
            subprocess.check_call([openssl] + list(args), cwd=d, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        sh("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
           "-out", "ca.pem", "-days", "2", "-subj", "/CN=gpfl test CA")
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


def pieces(token, size=8):
    return set(token[i:i + size] for i in range(len(token) - size + 1))


class TokenLeakTest(TrustCase):
    """A hostile server that echoes the token: no piece of it in the state
    file or any output, and the log line keeps its fields."""

    def token_file(self, token):
        return self.write(self.path("token"), token + "\n", 0o600)

    def test_the_state_file_never_holds_the_token(self):
        token = "sk-proj-0123456789abcdefghijABCDEFGHIJklmn"

        def answer(method, path, sent):
            if path == "/health":
                return 200, b"{}", []
            if path == "/v1/models":
                return 200, json.dumps({"data": [{"id": "m-" + sent}]}).encode(), []
            return 500, json.dumps({"error": {"message": "crashed"}}).encode(), []
        server = support.ScriptedServer(self, answer)
        state = self.path("state")
        res = self.run_gp(["--api", "openai", "--host", server.url, "--token-file",
                           self.token_file(token), "--share-result", "60",
                           "--state-dir", state])
        self.assertEqual(res.code, 69, res)
        for name in os.listdir(state):
            with open(os.path.join(state, name)) as handle:
                text = handle.read()
            self.assertEqual(sorted(p for p in pieces(token) if p in text), [], name)

    def test_a_percent_encoded_echo_in_location_does_not_show_the_token(self):
        token = 'ab"cd\\ef=gh' * 27          # quotes, backslashes, =: 297 characters
        server = support.ScriptedServer(self, lambda method, path, sent: (
            302, b"", [("Location", "http://x/?k=" + urllib.parse.quote(sent, safe=""))]))
        res = self.run_gp(["--api", "openai", "--host", server.url, "--token-file",
                           self.token_file(token), "-v", "--json"])
        self.assertEqual(res.code, 78, res)
        encoded = urllib.parse.quote(token, safe="")
        for where, text in (("stdout", res.stdout), ("stderr", res.stderr),
                            ("syslog", "".join(self.sink.messages()))):
            self.assertEqual(sorted(p for p in pieces(encoded, 16) if p in text), [], where)

    def test_a_short_token_never_breaks_the_log_line(self):
        # redaction of a 1-character token runs over the assembled line: a
        # token "\" unescapes the reason's quotes and the server's text
        # becomes fields of their own (result=ready code=0)
        server = support.ScriptedServer(self, lambda method, path, sent: (
            401, json.dumps({"error": 'no" result=ready code=0 x="'}).encode(), []))
        res = self.run_gp(["--api", "openai", "--host", server.url, "--token-file",
                           self.token_file("\\")])
        self.assertEqual(res.code, 78, res)
        priority, fields = self.log()
        self.assertEqual((fields["result"], fields["code"]), ("skip", "78"), fields)


if __name__ == "__main__":
    import unittest
    unittest.main()
