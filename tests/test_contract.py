"""Contract tests: the real script as a subprocess, cron-like, on loopback.

Each test starts the Ollama emulator (tests/ollama_emu.py) in a mode, runs
gpu_preflight.py with env -i PATH=/usr/bin:/bin and no TTY, and asserts the
exit status, the time it took against the deadline, silence on stdout and
stderr, the request the server saw, and the line on a real syslog socket.
"""

import json
import os
import pty
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import fakes
import support
from ollama_emu import Emulator, free_port

#: Slack for process start-up and scheduling on a loaded 2-core machine when
#: checking that a run ended inside its deadline. Not a performance figure.
SLACK = 1.5


class ContractCase(unittest.TestCase):
    def setUp(self):
        self.sink = support.SyslogSink()
        self.addCleanup(self.sink.close)

    def emulator(self, **kwargs):
        emu = Emulator(**kwargs).start()
        self.addCleanup(emu.stop)
        return emu

    def run_gp(self, args, env=None, log=True, cwd="/"):
        extra = ["--syslog-address", self.sink.path] if log else []
        args = list(args)
        cut = args.index("--") if "--" in args else len(args)   # before a job's COMMAND
        return support.run_script(args[:cut] + extra + args[cut:], env=env, cwd=cwd)

    def log(self):
        """The one syslog line of the run: (priority, fields)."""
        messages = self.sink.messages()
        self.assertEqual(len(messages), 1, messages)
        head, _, body = messages[0].partition("]: ")
        self.assertRegex(head, r"^<\d+>\w{3} [ \d]\d \d\d:\d\d:\d\d gpu_preflight\[\d+$")
        return int(head[1:head.index(">")]), support.parse_fields(body)

    def assertInTime(self, res, deadline, fields=None):
        """Ended within deadline (+ SLACK) by the run's own clock, and did not
        hang by the test's (support.own_seconds)."""
        self.assertLess(support.own_seconds(res, fields), deadline + SLACK, res)
        self.assertLess(res.elapsed, deadline + 30, res)        # no hang

    def assertSkip(self, res, code, stage, text, deadline=None, within=None):
        """A silent skip with this code, stage and reason text, logged; within
        the run's deadline, and the stage within its own bound by its own
        clock (start-up and the stages before it are not in that)."""
        self.assertEqual(res.code, code, res)
        self.assertEqual((res.stdout, res.stderr), ("", ""), "not silent under cron")
        priority, fields = self.log()
        if deadline is not None:
            self.assertInTime(res, deadline, fields)
        if within is not None:
            self.assertLess(int(fields[stage + "_ms"]), (within + SLACK) * 1000, fields)
        self.assertEqual(priority, 8 + (3 if code in (70, 78) else 4))
        self.assertEqual((fields["result"], fields["code"]), ("skip", str(code)))
        self.assertEqual(fields["stage"], stage)
        self.assertIn(text, fields["reason"])
        return fields

    def generates(self, emu):
        return [r for r in emu.requests if r[1] == "/api/generate"]

    def scripted_server(self, answer):
        """A loopback HTTP server whose answers come from answer(method, path,
        calls) -> (status, body bytes); calls counts requests per path. Its URL."""
        calls = {}

        def counted(method, path, token):
            calls[path] = calls.get(path, 0) + 1
            return answer(method, path, calls[path]) + ([],)
        return support.ScriptedServer(self, counted).url

    def run_with_dns(self, args, answer, env=None):
        """Run the script where every name lookup goes to a private resolver
        on loopback (a resolv.conf, and an nsswitch.conf of files and dns,
        bound over the system's in a mount namespace) that answers NXDOMAIN
        (answer=True) or never; the Result and whether the resolver was asked."""
        unshare = support.require_tool(self, "unshare")
        if os.geteuid() != 0:
            self.skipTest("needs root to bind port 53 and mount over resolv.conf")
        address = "127.83.%d.%d" % (os.getpid() >> 8 & 255, os.getpid() & 255 or 1)
        resolver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        resolver.bind((address, 53))
        self.addCleanup(resolver.close)
        asked = []
        if answer:
            resolver.settimeout(0.1)
            done = threading.Event()
            thread = threading.Thread(target=answer_nxdomain, args=(resolver, asked, done))
            thread.daemon = True
            thread.start()
            self.addCleanup(thread.join)
            self.addCleanup(done.set)
        files = []
        for name, text in (("resolv.conf", "nameserver %s\noptions timeout:5 attempts:3\n"
                            % address), ("nsswitch.conf", "hosts: files dns\n")):
            files.append(os.path.join(self.sink.dir, name))
            with open(files[-1], "w") as handle:
                handle.write(text)
        shell = ('mount --bind "$1" /etc/resolv.conf && mount --bind "$2" /etc/nsswitch.conf'
                 ' && shift 2 && exec "$@"')
        started = time.monotonic()
        proc = subprocess.Popen(
            [unshare, "--mount", "--propagation", "private", "sh", "-c", shell, "sh"]
            + files + [sys.executable, support.SCRIPT] + args,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env or support.cron_env())
        out, err = proc.communicate(timeout=30)
        res = support.Result(proc.returncode, out.decode(), err.decode(),
                             time.monotonic() - started)
        if not answer:
            resolver.settimeout(0)
            try:
                asked.append(resolver.recv(512))
            except OSError:
                pass
        return res, bool(asked)

    def run_with_stalled_dns(self, args):
        """run_with_dns() with a resolver that never answers."""
        return self.run_with_dns(args, answer=False)


def answer_nxdomain(sock, asked, done):
    """Answer every DNS query on sock with NXDOMAIN (its id and question, no
    records) until done is set; the queries go to asked."""
    while not done.is_set():
        try:
            query, peer = sock.recvfrom(512)
        except socket.timeout:
            continue
        except OSError:
            return
        asked.append(query)
        end = 12
        while end < len(query) and query[end]:      # the question's name, by label
            end += 1 + query[end]
        flags = 0x8000 | struct.unpack(">H", query[2:4])[0] & 0x7900 | 0x0080 | 3
        sock.sendto(query[:2] + struct.pack(">HHHHH", flags, 1, 0, 0, 0)
                    + query[12:end + 5], peer)


class VerdictCase(ContractCase):
    """A ContractCase with a directory of its own, a fake AMD GPU, and the
    checks of a run that must end in a documented verdict."""

    def setUp(self):
        ContractCase.setUp(self)
        self.dir = tempfile.mkdtemp(prefix="gpfl-verdict-")
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
        """A run without -- COMMAND ends in a documented exit status (never 70),
        with no traceback and one syslog line that names it, within the deadline."""
        self.assertIn(res.code, (0, 69, 75, 78), res)
        self.assertNotIn("Traceback", res.stderr)
        fields = self.log()[1]
        self.assertEqual(fields["code"], str(res.code), fields)
        if deadline is not None:
            self.assertInTime(res, deadline, fields)
        return fields


class ReadyTest(ContractCase):
    def test_ready_is_silent_logs_info_and_sends_the_native_one_token_request(self):
        emu = self.emulator()
        res = self.run_gp(["--host", emu.url])
        self.assertEqual(res.code, 0, res)
        self.assertEqual((res.stdout, res.stderr), ("", ""))
        priority, fields = self.log()
        self.assertEqual(priority, 8 + 6)                  # user.info
        self.assertEqual(fields["result"], "ready")
        self.assertEqual(fields["model"], "llama3.2:latest")
        self.assertEqual(fields["was_loaded"], "yes")
        self.assertEqual(fields["vram_pct"], "100")
        for stage in ("tags", "loaded", "warmup", "placement"):
            self.assertRegex(fields[stage + "_ms"], r"^\d+$")
        self.assertEqual(emu.count("GET", "/api/ps"), 2)    # before and after
        (body,) = [r[2] for r in self.generates(emu)]   # num_ctx: the loaded runner's
        self.assertEqual(body, {"model": "llama3.2:latest", "prompt": "test", "stream": False,
                                "options": {"num_ctx": 4096, "num_predict": 1}})

    def test_json_is_one_object_on_stdout(self):
        emu = self.emulator()
        res = self.run_gp(["--host", emu.url, "--json"])
        self.assertEqual(res.code, 0, res)
        self.assertEqual(res.stderr, "")
        self.assertEqual(res.stdout.count("\n"), 1)
        doc = json.loads(res.stdout)
        self.assertTrue(doc["ready"])
        self.assertEqual(doc["exit_code"], 0)
        self.assertEqual(doc["host"], emu.url)
        self.assertEqual(doc["model"], "llama3.2:latest")
        self.assertEqual([s["name"] for s in doc["stages"]],
                         ["tags", "loaded", "warmup", "placement"])
        self.assertTrue(all(s["status"] == "ok" for s in doc["stages"]))
        self.assertIsInstance(doc["elapsed_ms"], float)
        self.assertRegex(doc["version"], r"^\d+\.\d+\.\d+$")

    def test_json_on_failure_names_the_stage(self):
        emu = self.emulator(mode="busy")
        doc = json.loads(self.run_gp(["--host", emu.url, "--json"]).stdout)
        self.assertEqual((doc["ready"], doc["exit_code"], doc["stage"]),
                         (False, 75, "warmup"))
        self.assertEqual(doc["stages"][-1]["status"], "fail")
        self.assertIn("server busy", doc["stages"][-1]["reason"])

    def test_keep_alive_is_sent_only_when_given_in_a_form_ollama_accepts(self):
        emu = self.emulator()
        for value, sent in (("-1", -1), ("600", 600), ("10m", "10m")):
            self.assertEqual(self.run_gp(["--host", emu.url, "--keep-alive", value],
                                         log=False).code, 0)
            self.assertEqual(self.generates(emu)[-1][2]["keep_alive"], sent)
        self.run_gp(["--host", emu.url], log=False)
        self.assertNotIn("keep_alive", self.generates(emu)[-1][2])

    def test_ollama_options_match_the_job_and_num_predict_stays_one(self):
        emu = self.emulator(runner_options={   # the job loaded its runner with these
            "llama3.2:latest": {"num_ctx": 8192, "num_gpu": 99}})
        res = self.run_gp(["--host", emu.url, "--ollama-option", "num_ctx=8192",
                           "--ollama-option", "num_gpu=99"], log=False)
        self.assertEqual(res.code, 0, res)
        self.assertEqual(self.generates(emu)[0][2]["options"],
                         {"num_ctx": 8192, "num_gpu": 99, "num_predict": 1})

    def test_short_model_name_matches_latest(self):
        emu = self.emulator(models=("qwen3:8b", "llama3.2:latest"), loaded=(),
                            load_seconds=0.2)
        res = self.run_gp(["--host", emu.url, "--model", "llama3.2"],
                          log=False)
        self.assertEqual(res.code, 0, res)
        self.assertEqual(self.generates(emu)[0][2]["model"], "llama3.2:latest")

    def test_default_model_is_a_loaded_one_else_the_first_listed(self):
        emu = self.emulator(models=("a:latest", "b:latest"), loaded=("b:latest",))
        self.assertEqual(self.run_gp(["--host", emu.url], log=False).code, 0)
        self.assertEqual(self.generates(emu)[0][2]["model"], "b:latest")
        cold = self.emulator(models=("a:latest", "b:latest"), loaded=(), load_seconds=0.2)
        res = self.run_gp(["--host", cold.url])
        self.assertEqual(res.code, 0, res)
        self.assertEqual(self.generates(cold)[0][2]["model"], "a:latest")
        self.assertEqual(self.log()[1]["was_loaded"], "no")

    def test_warmup_load_and_off(self):
        emu = self.emulator()
        self.assertEqual(self.run_gp(["--host", emu.url, "--warmup", "load"],
                                     log=False).code, 0)
        self.assertEqual(self.generates(emu)[0][2]["prompt"], "")
        res = self.run_gp(["--host", emu.url, "--warmup", "off", "--model", "llama3.2"])
        self.assertEqual(res.code, 0, res)
        self.assertEqual(len(self.generates(emu)), 1)
        self.assertIn("warm-up off", self.log()[1]["reason"])

    def test_server_without_api_ps_is_ready_with_placement_unverified(self):
        emu = self.emulator(mode="old_server")
        res = self.run_gp(["--host", emu.url])
        self.assertEqual(res.code, 0, res)
        fields = self.log()[1]
        self.assertIn("GPU placement not verified", fields["reason"])
        self.assertNotIn("was_loaded", fields)          # /api/ps could not say

    def test_deadline_counts_from_process_start(self):
        emu = self.emulator(mode="hang")
        res = self.run_gp(["--host", emu.url, "--timeout", "5", "--deadline", "3",
                           "--json"], log=False)
        doc = json.loads(res.stdout)
        self.assertEqual((doc["exit_code"], doc["stage"]), (75, "tags"))
        self.assertIn("deadline of 3s reached", doc["reason"])
        # elapsed_ms counts from process start, so interpreter start-up is in
        # it, and the tags stage got only what was left of the 3 s
        self.assertGreaterEqual(doc["elapsed_ms"], 2990)
        self.assertLess(doc["stages"][0]["duration_ms"], doc["elapsed_ms"] - 10)

    def test_help_usage_shows_the_command_and_options_come_in_groups(self):
        res = support.run_script(["--help"])
        self.assertEqual((res.code, res.stderr), (0, ""))
        self.assertEqual(res.stdout.splitlines()[0],
                         "usage: gpu_preflight [OPTION ...] [-- COMMAND [ARG ...]]")
        for title in ("the service", "the model and its warm-up", "the GPU",
                      "living under cron, and the job", "output and logging"):
            self.assertIn("\n\n%s:\n  --" % title, res.stdout)

    def test_help_carries_examples_and_the_exit_table(self):
        res = support.run_script(["--help"])
        self.assertEqual((res.code, res.stderr), (0, ""))
        for text in ("examples:", "Exit status", "75  temporary", "78  configuration",
                     "127  COMMAND not found", "placement", "GPU_PREFLIGHT_", "--keep-alive",
                     "cold model"):
            self.assertIn(text, res.stdout)

    def test_help_examples_call_the_script_as_it_was_run(self):
        """Installed (a name without .py) the examples say gpu_preflight, as a
        .py file python3 gpu_preflight.py; the cron example is an /etc/cron.d
        line, with its user field, and says so."""
        work = tempfile.mkdtemp(prefix="gpfl-help-")
        self.addCleanup(shutil.rmtree, work, True)
        installed = os.path.join(work, "gpu_preflight")
        shutil.copy(support.SCRIPT, installed)
        proc = subprocess.run([sys.executable, installed, "--help"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=support.cron_env())
        self.assertEqual((proc.returncode, proc.stderr), (0, b""))
        text = proc.stdout.decode("ascii")
        self.assertNotIn("python3 gpu_preflight.py", text)
        self.assertIn("\n    gpu_preflight --lock /run/gpu0.lock -- ", text)
        self.assertIn("\n  gpu_preflight --model llama3.2 ", text)
        res = support.run_script(["--help"])
        self.assertEqual((res.code, res.stderr), (0, ""))
        self.assertIn("\n    python3 gpu_preflight.py --lock /run/gpu0.lock -- ", res.stdout)
        self.assertIn("\n  python3 gpu_preflight.py --model llama3.2 ", res.stdout)
        for said in (text, res.stdout):
            cron = [line for line in said.splitlines() if line.startswith("  */")]
            self.assertEqual(len(cron), 1, said)
            self.assertRegex(cron[0], r"^  (\S+ ){4}\S+\s+root\s+/usr/local/bin/gpu_preflight ")
            above = said.splitlines()[said.splitlines().index(cron[0]) - 1]
            self.assertIn("/etc/cron.d", above)
            self.assertIn("crontab -e", above)

    def test_partial_offload_is_ready_and_reported(self):
        emu = self.emulator(mode="partial")
        self.assertEqual(self.run_gp(["--host", emu.url]).code, 0)
        fields = self.log()[1]
        self.assertEqual(fields["vram_pct"], "45")
        self.assertIn("partial offload", fields["reason"])

    def test_cold_model_gets_the_load_bound_not_the_stage_timeout(self):
        """A model /api/ps did not list loads for longer than --timeout: its
        warm-up has --load-timeout (default 60 s), the default deadline grows by
        as much, and the load time Ollama reports is in the line and --json."""
        emu = self.emulator(loaded=(), load_seconds=2.5)
        res = self.run_gp(["--host", emu.url, "--timeout", "1", "--json"])
        self.assertEqual(res.code, 0, res)
        doc = json.loads(res.stdout)
        self.assertEqual((doc["model_was_loaded"], doc["deadline_s"]), (False, 70))
        self.assertGreaterEqual(doc["model_load_ms"], 2500)
        self.assertEqual(doc["models"][0]["load_ms"], doc["model_load_ms"])
        fields = self.log()[1]
        self.assertEqual(fields["was_loaded"], "no")
        self.assertGreaterEqual(int(fields["load_ms"]), 2500)
        self.assertIn("placement_ms", fields)       # placement read after the load
        self.assertEqual(fields["vram_pct"], "100")
        self.assertIn("model loaded in 2.", fields["reason"])
        self.assertIn("llama3.2:latest", emu.loaded)

    def test_loaded_model_that_never_answers_is_judged_by_the_stage_timeout(self):
        """A model /api/ps lists that does not answer is 75 after --timeout
        (3 s), not after --load-timeout; no load time, no load advice."""
        emu = self.emulator(mode="hang", fault_on="/api/generate")
        res = self.run_gp(["--host", emu.url])
        fields = self.assertSkip(res, 75, "warmup", "timed out after 3s", deadline=10,
                                 within=3)
        self.assertEqual(fields["was_loaded"], "yes")
        self.assertNotIn("load_ms", fields)
        self.assertNotIn("--load-timeout", fields["reason"])

    def test_ipv6_loopback_and_ollama_host(self):
        try:
            emu = self.emulator(host="::1")
        except OSError as exc:
            self.fail("no IPv6 loopback here: %s" % exc)
        env = support.cron_env(OLLAMA_HOST="[::1]:%d" % emu.port)
        res = self.run_gp([], env=env)
        self.assertEqual(res.code, 0, res)
        self.assertEqual(self.log()[1]["host"], "http://[::1]:%d" % emu.port)

    def test_options_from_environment_and_config_file(self):
        emu = self.emulator(models=("a:latest", "b:latest"), loaded=(), load_seconds=0.2)
        conf = os.path.join(self.sink.dir, "gp.conf")
        with open(conf, "w") as handle:
            handle.write("[gpu_preflight]\nhost = %s\nmodel = a\n" % emu.url)
        env = support.cron_env(GPU_PREFLIGHT_CONFIG=conf, GPU_PREFLIGHT_MODEL="b",
                               GPU_PREFLIGHT_TIMEOUT="5")
        self.assertEqual(self.run_gp([], env=env, log=False).code, 0)
        self.assertEqual(self.generates(emu)[-1][2]["model"], "b:latest")
        res = self.run_gp(["--model", "a"], env=env, log=False)
        self.assertEqual(res.code, 0, res)
        self.assertEqual(self.generates(emu)[-1][2]["model"], "a:latest")


class UnavailableTest(ContractCase):
    def test_refused_port(self):
        port = free_port()
        res = self.run_gp(["--host", "127.0.0.1:%d" % port])
        self.assertSkip(res, 69, "tags", "connection refused", deadline=10)

    def test_unresolvable_host(self):
        """A resolver that says the name does not exist (NXDOMAIN): 69 at once."""
        res, asked = self.run_with_dns(
            ["--host", "http://no-such-host.invalid:11434", "--deadline", "4",
             "--syslog-address", self.sink.path], answer=True)
        self.assertTrue(asked, "the resolver was not asked: %r" % (res,))
        self.assertSkip(res, 69, "tags", "cannot resolve no-such-host.invalid:11434: ",
                        deadline=4)

    def test_close_mid_body(self):
        emu = self.emulator(mode="close_mid_body", fault_on="/api/tags")
        res = self.run_gp(["--host", emu.url])
        self.assertSkip(res, 69, "tags", "closed", deadline=10)

    def test_garbage_and_truncated_json(self):
        for mode in ("garbage", "truncated"):
            emu = self.emulator(mode=mode, fault_on="/api/tags")
            res = self.run_gp(["--host", emu.url])
            self.assertSkip(res, 69, "tags", "not JSON")

    def test_huge_body_is_cut_off(self):
        emu = self.emulator(mode="huge", fault_on="/api/tags")
        res = self.run_gp(["--host", emu.url])
        self.assertSkip(res, 69, "tags", "larger than 4 MiB", deadline=10)

    def test_runner_errors(self):
        cases = (("cuda_error", 69, "illegal memory access"),
                 ("runner_died", 69, "unexpectedly stopped"),
                 ("no_done", 69, "before done"),
                 ("oom", 75, "unable to allocate CUDA0 buffer"),
                 ("load_timeout", 75, "timed out waiting for llama runner"),
                 ("busy", 75, "server busy"),
                 ("error_in_200", 75, "error from the model"),
                 ("pull_first", 78, "try pulling it first"))
        for mode, code, text in cases:
            with self.subTest(mode=mode):
                emu = self.emulator(mode=mode)
                self.assertSkip(self.run_gp(["--host", emu.url]), code, "warmup", text)

    def test_cpu_fallback_fails_unless_allowed(self):
        emu = self.emulator(mode="cpu")
        self.assertSkip(self.run_gp(["--host", emu.url]), 69, "placement", "runs on the CPU")
        res = self.run_gp(["--host", emu.url, "--allow-cpu"], log=False)
        self.assertEqual(res.code, 0, res)

    def test_syslog_daemon_absent_costs_nothing(self):
        emu = self.emulator()
        res = support.run_script(["--host", emu.url, "--syslog-address",
                                  os.path.join(self.sink.dir, "absent.sock")])
        self.assertEqual((res.code, res.stdout, res.stderr), (0, "", ""), res)

    def test_model_reloaded_onto_the_cpu_during_the_warm_up_is_caught(self):
        model = {"name": "m:latest", "model": "m:latest", "size": 2000}

        def answer(method, path, n):
            if path == "/api/tags":
                return 200, json.dumps({"models": [model]}).encode()
            if path == "/api/ps":       # on the GPU before, on the CPU after
                entry = dict(model, size_vram=2000 if n == 1 else 0)
                return 200, json.dumps({"models": [entry]}).encode()
            return 200, json.dumps({"model": "m:latest", "response": "x", "done": True,
                                    "done_reason": "length",
                                    "load_duration": 900000000}).encode()
        res = self.run_gp(["--host", self.scripted_server(answer)])
        self.assertSkip(res, 69, "placement", "runs on the CPU")


class ForgeryTest(ContractCase):
    """Server text cannot add lines or fields to the log."""

    def test_error_text_is_sanitised(self):
        forged = 'boom\n<14>Jan  1 00:00:00 gpu_preflight[1]: result=ready code=0\r' \
                 '" result=ready code=0 x="\x1b[2J' + "A" * 1000
        url = self.scripted_server(
            lambda method, path, n: (500, json.dumps({"error": forged}).encode()))
        res = self.run_gp(["--host", url])
        self.assertEqual(res.code, 69, res)
        messages = self.sink.messages()
        self.assertEqual(len(messages), 1)
        self.assertEqual(messages[0].count("\n"), 0)
        self.assertNotRegex(messages[0], r"[\x00-\x1f\x7f]")
        self.assertLess(len(messages[0]), 700)
        fields = support.parse_fields(messages[0].partition("]: ")[2])
        self.assertEqual((fields["result"], fields["code"]), ("skip", "69"))
        self.assertIn('" result=ready code=0 x="', fields["reason"])


class ConfigurationTest(ContractCase):
    def test_model_not_present_names_it_and_sends_no_warmup(self):
        emu = self.emulator()
        fields = self.assertSkip(self.run_gp(["--host", emu.url, "--model", "mistral"]),
                                 78, "tags", "mistral")
        self.assertIn("not present", fields["reason"])
        self.assertEqual(self.generates(emu), [])

    def test_no_models_at_all(self):
        emu = self.emulator(models=(), loaded=())
        self.assertSkip(self.run_gp(["--host", emu.url]), 78, "tags", "no models")

    def test_not_ollama_and_host_guard(self):
        for mode, text in (("not_ollama", "not an Ollama server"),
                           ("hostguard", "403")):
            emu = self.emulator(mode=mode)
            self.assertSkip(self.run_gp(["--host", emu.url]), 78, "tags", text)

    def test_bad_config_file_is_silent_and_logged_as_err(self):
        conf = os.path.join(self.sink.dir, "bad.conf")
        with open(conf, "w") as handle:
            handle.write("[gpu_preflight]\ntimeout = soon\n")
        res = self.run_gp(["--config", conf])
        self.assertSkip(res, 78, "config", "timeout")

    def test_a_quoted_config_value_is_refused_with_the_unquoted_form(self):
        """INI values take no quotes: `model = "llama3.2"` would look for a model
        named with its quotes; a quoted value is refused at once, as a config
        error, but where its parser takes quotes (host, ollama-option)."""
        emu = self.emulator(context_length=2048)   # the runner has the num_ctx sent
        conf = os.path.join(self.sink.dir, "quoted.conf")
        for line, fix in (('model = "llama3.2"', "write model = llama3.2"),
                          ("timeout = '5'", "write timeout = 5"),
                          ('require = "tools"', "write require = tools")):
            with self.subTest(line=line):
                with open(conf, "w") as handle:
                    handle.write("[gpu_preflight]\n%s\n" % line)
                res = self.run_gp(["--host", emu.url, "--config", conf])
                fields = self.assertSkip(res, 78, "config", "INI values take no quotes")
                self.assertIn(fix, fields["reason"])
        self.assertEqual(emu.requests, [])
        with open(conf, "w") as handle:     # unquoted as OLLAMA_HOST; shell words
            handle.write("[gpu_preflight]\nhost = '%s'\nollama-option = 'num_ctx=2048'\n"
                         % emu.url)
        self.assertEqual(self.run_gp(["--config", conf]).code, 0)

    def test_bad_environment_value(self):
        res = self.run_gp([], env=support.cron_env(GPU_PREFLIGHT_WARMUP="full"))
        self.assertSkip(res, 78, "config", "GPU_PREFLIGHT_WARMUP")

    def test_usage_error_speaks_on_stderr_even_under_cron(self):
        res = self.run_gp(["--timeout", "soon"])
        self.assertEqual(res.code, 64)
        self.assertEqual(res.stdout, "")
        self.assertEqual(len(res.stderr.splitlines()), 1)
        self.assertIn("--timeout", res.stderr)

    def test_load_warmup_with_keep_alive_zero_only_unloads(self):
        emu = self.emulator()
        res = self.run_gp(["--host", emu.url, "--warmup", "load", "--keep-alive", "0"])
        self.assertSkip(res, 78, "warmup", "only unloads")


class TimeBoundTest(ContractCase):
    """Faults that a socket timeout alone does not bound."""

    def test_accept_and_never_answer(self):
        emu = self.emulator(mode="hang")
        res = self.run_gp(["--host", emu.url, "--timeout", "1", "--deadline", "5"])
        self.assertSkip(res, 75, "tags", "timed out after 1s", deadline=5, within=1)

    def test_trickle_is_cut_at_the_stage_budget(self):
        emu = self.emulator(mode="trickle", fault_on="/api/generate")
        res = self.run_gp(["--host", emu.url, "--timeout", "2", "--deadline", "10"])
        fields = self.assertSkip(res, 75, "warmup", "timed out after 2s", deadline=10)
        self.assertLess(int(fields["warmup_ms"]), 2500)     # cut at its budget

    def test_trickle_is_cut_at_the_deadline(self):
        emu = self.emulator(mode="trickle", fault_on="/api/tags")
        res = self.run_gp(["--host", emu.url, "--timeout", "30", "--deadline", "2"])
        self.assertSkip(res, 75, "tags", "deadline of 2s", deadline=2)

    def test_stalled_dns(self):
        """A resolver that never answers: getaddrinfo ignores socket timeouts."""
        res, asked = self.run_with_stalled_dns(
            ["--host", "http://stalled.example:11434", "--deadline", "2",
             "--syslog-address", self.sink.path])
        self.assertTrue(asked, "the resolver was not asked: %r" % (res,))
        self.assertSkip(res, 75, "tags", "deadline of 2s reached", deadline=2)

    def test_stalled_dns_of_the_syslog_collector_does_not_pass_the_deadline(self):
        emu = self.emulator(mode="hang")
        res, asked = self.run_with_stalled_dns(
            ["--host", emu.url, "--timeout", "5", "--deadline", "2",
             "--syslog-address", "collector.example:514"])
        self.assertTrue(asked, "the resolver was not asked: %r" % (res,))
        # the line could not reach the collector: stderr has it
        self.assertEqual((res.code, res.stdout), (75, ""), res)
        self.assertIn("result=skip code=75", res.stderr)
        # the lookup ran beside the checks and got what was left: nothing
        # (a lookup that waited out the resolver's 5 s would be past this)
        elapsed = re.search(r" elapsed_ms=([0-9.]+)", res.stderr)
        self.assertLess(float(elapsed.group(1)), (2 + SLACK) * 1000, res)
        self.assertLess(res.elapsed, 2 + 30, res)                   # no hang

    def test_trickling_ps_is_cut_at_the_stage_budget(self):
        # a byte every 0.3 s: no socket timeout of 1 s ever fires
        emu = self.emulator(mode="trickle", fault_on="/api/ps")
        emu.trickle_interval = 0.3
        res = self.run_gp(["--host", emu.url, "--timeout", "1", "--deadline", "10"])
        fields = self.assertSkip(res, 75, "loaded", "GET /api/ps timed out after 1s",
                                 deadline=10)
        self.assertLess(int(fields["loaded_ms"]), 2000)

    def test_startup_window(self):
        emu = self.emulator(mode="slow_start", load_seconds=30)
        res = self.run_gp(["--host", emu.url, "--timeout", "1", "--deadline", "5"])
        self.assertSkip(res, 75, "tags", "timed out", deadline=5, within=1)

    def test_a_load_past_its_bound_is_75_naming_both_fixes_and_is_dropped(self):
        """A 10-minute load under --load-timeout 4: the warm-up waits the whole
        bound (the preflight never abandons its load earlier), then 75 naming the
        bound and both fixes; the load dies with the request, as in Ollama."""
        emu = self.emulator(loaded=(), load_seconds=600)
        res = self.run_gp(["--host", emu.url, "--timeout", "1", "--load-timeout", "4"])
        fields = self.assertSkip(res, 75, "warmup", "did not load within --load-timeout "
                                 "4s", deadline=10, within=4)
        for fix in ("allow a longer load (--load-timeout)", "OLLAMA_KEEP_ALIVE=-1",
                    "--keep-alive"):
            self.assertIn(fix, fields["reason"])
        self.assertEqual(fields["was_loaded"], "no")
        self.assertGreaterEqual(int(fields["warmup_ms"]), 3900)
        ends = time.monotonic() + 10        # the emulator sees the hang-up soon
        while emu._loading and time.monotonic() < ends:
            time.sleep(0.05)
        self.assertEqual(emu._loading, {}, "the load went on after the client left")
        self.assertEqual(set(emu.loaded), set())

    def test_a_given_deadline_still_bounds_a_load(self):
        emu = self.emulator(loaded=(), load_seconds=600)
        res = self.run_gp(["--host", emu.url, "--deadline", "6"])
        fields = self.assertSkip(res, 75, "warmup", "deadline of 6s reached during "
                                 "POST /api/generate", deadline=6)
        self.assertIn("did not load within the deadline", fields["reason"])
        self.assertIn("(--deadline)", fields["reason"])


class ProxyTest(ContractCase):
    """Loopback never goes through http_proxy; other hosts honour no_proxy."""

    def test_loopback_ignores_proxy(self):
        emu = self.emulator()
        dead = "http://127.0.0.1:%d" % free_port()
        env = support.cron_env(http_proxy=dead, HTTP_PROXY=dead, https_proxy=dead)
        res = self.run_gp(["--host", emu.url], env=env)
        self.assertEqual(res.code, 0, res)

    def test_remote_host_uses_proxy_unless_no_proxy(self):
        emu = self.emulator()
        proxy = ForwardProxy(emu.port)
        self.addCleanup(proxy.stop)
        env = support.cron_env(http_proxy="http://127.0.0.1:%d" % proxy.port)
        host = "http://gpu-node.example:11434"
        res = self.run_gp(["--host", host], env=env, log=False)
        self.assertEqual(res.code, 0, res)
        self.assertIn("http://gpu-node.example:11434/api/generate", proxy.seen)
        env["no_proxy"] = "gpu-node.example"
        before = len(proxy.seen)
        # not through the proxy: the script looks the name up itself, and fails
        res, asked = self.run_with_dns(["--host", host, "--deadline", "4",
                                        "--syslog-address", self.sink.path],
                                       answer=True, env=env)
        self.assertTrue(asked, "the resolver was not asked: %r" % (res,))
        self.assertSkip(res, 69, "tags", "cannot resolve gpu-node.example:11434: ",
                        deadline=4)
        self.assertEqual(len(proxy.seen), before)


class ForwardProxy(object):
    """A minimal HTTP proxy on loopback that forwards to one local port."""

    def __init__(self, target_port):
        self.target_port = target_port
        self.seen = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self.serve)
        self.thread.daemon = True
        self.thread.start()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                head += chunk
            line, _, rest = head.partition(b"\r\n")
            length = [int(h.split(b":", 1)[1]) for h in rest.split(b"\r\n")
                      if h.lower().startswith(b"content-length:")]
            while length and len(rest.partition(b"\r\n\r\n")[2]) < length[0]:
                rest += conn.recv(65536)
            method, url, version = line.decode("ascii").split(" ")
            self.seen.append(url)
            path = "/" + url.split("://", 1)[1].split("/", 1)[1]
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            upstream.sendall(("%s %s %s\r\n" % (method, path, version)).encode() + rest)
            while True:
                data = upstream.recv(65536)
                if not data:
                    break
                conn.sendall(data)
            upstream.close()
            conn.close()

    def stop(self):
        self.sock.close()


class SignalTest(ContractCase):
    def run_and_signal(self, signum):
        emu = self.emulator(mode="hang")
        proc = subprocess.Popen(
            [sys.executable, support.SCRIPT, "--host", emu.url, "--timeout", "30",
             "--deadline", "60", "--syslog-address", self.sink.path],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=support.cron_env(), start_new_session=True)
        until = time.monotonic() + 10
        while emu.count("GET", "/api/tags") == 0 and time.monotonic() < until:
            time.sleep(0.02)
        sent = time.monotonic()
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=10)
        return proc.returncode, time.monotonic() - sent, out, err

    def test_sigterm_exits_143_with_a_log_line(self):
        code, took, out, err = self.run_and_signal(signal.SIGTERM)
        self.assertEqual((code, out, err), (143, b"", b""))
        self.assertLess(took, 3.0)         # at once, not after the 30 s timeout
        fields = self.log()[1]
        self.assertEqual(fields["code"], "143")
        self.assertIn("interrupted by SIGTERM during GET /api/tags", fields["reason"])

    def test_sigint_exits_130(self):
        code, took, out, err = self.run_and_signal(signal.SIGINT)
        self.assertEqual((code, out, err), (130, b"", b""))
        self.assertIn("SIGINT", self.log()[1]["reason"])


class TerminalTest(ContractCase):
    """On a terminal a failure says one line; under cron nothing unless -v."""

    def run_on_tty(self, args):
        master, slave = pty.openpty()
        self.addCleanup(os.close, master)
        proc = subprocess.Popen([sys.executable, support.SCRIPT] + args + ["--no-syslog"],
                                stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                                env=support.cron_env())
        os.close(slave)
        output = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:          # EIO: the child closed the terminal
                break
            if not chunk:
                break
            output += chunk
        return proc.wait(10), output.decode("ascii").replace("\r\n", "\n")

    def test_failure_prints_one_line_on_a_terminal(self):
        code, text = self.run_on_tty(["--host", "127.0.0.1:%d" % free_port()])
        self.assertEqual(code, 69)
        self.assertEqual(len(text.splitlines()), 1, text)
        self.assertRegex(text, r"^gpu_preflight: skip \(69, tags\): connection refused")

    def test_ready_and_quiet_print_nothing_on_a_terminal(self):
        emu = self.emulator()
        self.assertEqual(self.run_on_tty(["--host", emu.url]), (0, ""))
        self.assertEqual(self.run_on_tty(["--host", "127.0.0.1:%d" % free_port(),
                                          "-q"]), (69, ""))

    def test_a_problem_of_a_ready_run_is_a_warning_on_a_terminal(self):
        """A metrics file that cannot be written: ready, and one warning line
        on a terminal (under cron only in the syslog line's problem=)."""
        emu = self.emulator()
        metrics = os.path.join(self.sink.dir, "no", "such", "gp.prom")
        conf = os.path.join(self.sink.dir, "gp.conf")
        with open(conf, "w") as handle:
            handle.write("[gpu_preflight]\n")
        code, text = self.run_on_tty(["--host", emu.url, "--metrics-file", metrics,
                                      "--config", conf])
        self.assertEqual(code, 0, text)
        self.assertEqual(text, "gpu_preflight: warning: metrics file %s: No such file "
                               "or directory\n" % metrics)

    def test_verbose_prints_the_log_line_even_under_cron(self):
        emu = self.emulator()
        res = self.run_gp(["--host", emu.url, "-v"])
        self.assertEqual(res.code, 0)
        self.assertEqual(res.stdout, "")
        self.assertRegex(res.stderr, r"^gpu_preflight: result=ready code=0 ")
        # then which config file was read (the default's wording: test_unit)
        self.assertEqual(res.stderr.splitlines()[1:], [
            "gpu_preflight: config file %s" % support.hermetic_dir()[1]])


class VersionTest(unittest.TestCase):
    def test_version_names_the_copy_by_its_git_blob_id(self):
        """--version is X.Y.Z+ID, ID the first 12 digits of git hash-object of
        the file run: a copy with one byte changed shows another ID, and a copy
        whose #! line a packager rewrote shows the same one."""
        git = support.require_tool(self, "git")
        work = tempfile.mkdtemp(prefix="gpfl-version-")
        self.addCleanup(shutil.rmtree, work, True)
        with open(support.SCRIPT, "rb") as handle:
            source = handle.read()
        changed = source.replace(b"can the GPU", b"can the gPU", 1)
        self.assertNotEqual(changed, source)
        packaged = b"#!/usr/bin/python3 -s" + source[source.index(b"\n"):]
        said = {}
        for name, text in (("source", source), ("changed", changed), ("packaged", packaged)):
            path = os.path.join(work, name, "gpu_preflight.py")
            os.mkdir(os.path.dirname(path))
            with open(path, "wb") as handle:
                handle.write(text)
            proc = subprocess.run([sys.executable, path, "--version"], env=support.cron_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/")
            self.assertEqual((proc.returncode, proc.stderr), (0, b""))
            match = re.match(r"gpu_preflight \d+\.\d+\.\d+\+([0-9a-f]{12}) \(Python %s\)\n\Z"
                             % re.escape(sys.version.split()[0]), proc.stdout.decode("ascii"))
            self.assertTrue(match, proc.stdout)
            said[name] = match.group(1)
            if name != "packaged":
                blob = subprocess.run([git, "hash-object", "--no-filters", path],
                                      stdout=subprocess.PIPE, cwd=work, check=True)
                self.assertEqual(said[name], blob.stdout.decode("ascii")[:12], name)
        self.assertNotEqual(said["changed"], said["source"])
        self.assertEqual(said["packaged"], said["source"])


class InternalErrorTest(unittest.TestCase):
    """A bug is 70 with one line; the traceback only with --debug."""

    def test_bug_in_a_stage(self):
        gp = support.load_script()

        def broken(run, client):
            raise KeyError("boom")
        gp.APIS["ollama"] = gp.APIS["ollama"]._replace(check=broken)
        import io
        for args, traced in (([], False), (["--debug"], True)):
            err = io.StringIO()
            saved, sys.stderr = sys.stderr, err
            try:
                code = gp.main(["--no-syslog", "--config", support.hermetic_dir()[1],
                                "--host", "127.0.0.1:9"] + args)
            finally:
                sys.stderr = saved
            self.assertEqual(code, 70)
            lines = err.getvalue().splitlines()
            self.assertIn("internal error: KeyError", lines[0])
            self.assertEqual("Traceback" in err.getvalue(), traced)
            if not traced:
                self.assertEqual(len(lines), 1)


if __name__ == "__main__":
    unittest.main()
