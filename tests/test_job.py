"""Living under cron and systemd: run-the-job mode, --lock, --wait, --jitter,
--share-result (single flight), --metrics-file and --log-changes-only, all
driving the real script as a subprocess against the loopback emulator.
"""

import glob
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import support
from ollama_emu import Emulator, free_port
from test_contract import SLACK, ContractCase
from test_trust import NOBODY, TrustCase


class JobCase(ContractCase):
    def setUp(self):
        ContractCase.setUp(self)
        self.dir = tempfile.mkdtemp(prefix="gpfl-job-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.state = os.path.join(self.dir, "state")

    def path(self, name):
        return os.path.join(self.dir, name)

    def start(self, args, env=None, umask=0o022, ignored=()):
        """The script as a cron job in the background: a Popen. It starts
        with every signal at its default action but `ignored`, however the
        suite itself was started."""
        return subprocess.Popen(
            support.prepared([sys.executable, support.SCRIPT, "--syslog-address",
                              self.sink.path] + args, ignored, umask),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env or support.cron_env(), cwd="/", start_new_session=True)

    def finish(self, proc, timeout=30):
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out.decode("ascii"), err.decode("ascii")


class RunTheJobTest(JobCase):
    JOB_SHOWS = ('echo "$$"; ls /proc/$$/fd; '
                 'exec grep -E "^Sig(Ign|Blk)" /proc/self/status')

    def run_job_showing_signals(self, emu, ignored=()):
        """Run the job that prints its pid, descriptors and SigIgn/SigBlk,
        the script started with `ignored` ignored; (pid, fds, {Sig..: mask})."""
        proc = self.start(["--host", emu.url, "--", "/bin/sh", "-c", self.JOB_SHOWS],
                          ignored=ignored)
        code, out, err = self.finish(proc)
        self.assertEqual((code, err), (0, ""), out)
        lines = out.split("\n")[:-1]
        masks = dict(line.split(":\t") for line in lines[-2:])
        self.assertEqual(sorted(masks), ["SigBlk", "SigIgn"], out)
        self.assertEqual(lines[0], str(proc.pid), "the job must be the same process")
        return sorted(lines[1:-2], key=int), masks

    def test_ready_execs_the_job_with_its_pid_status_and_default_signals(self):
        emu = self.emulator()
        fds, masks = self.run_job_showing_signals(emu)
        self.assertEqual(masks, {"SigBlk": support.sig_mask([]),
                                 "SigIgn": support.sig_mask([])},
                         "signals (SIGPIPE, SIGINT) left ignored or blocked for the job")
        self.assertEqual(fds, ["0", "1", "2"],
                         "a descriptor of the preflight leaked into the job")
        priority, fields = self.log()
        self.assertEqual(fields["result"], "ready")
        res = self.run_gp(["--host", emu.url, "--", "/bin/sh", "-c", "exit 7"])
        self.assertEqual(res.code, 7, res)

    def test_the_job_does_not_inherit_the_token(self):
        # a secret goes no further than it must
        emu = self.emulator()
        out = self.path("env")
        env = support.cron_env(GPU_PREFLIGHT_TOKEN="gpfl-secret-token-1234",
                               GPU_PREFLIGHT_TIMEOUT="2", JOB_SETTING="kept")
        res = self.run_gp(["--host", emu.url, "--", "/bin/sh", "-c", "env > " + out],
                          env=env)
        self.assertEqual(res.code, 0, res)
        with open(out) as handle:
            seen = handle.read().splitlines()
        self.assertIn("JOB_SETTING=kept", seen)
        self.assertIn("GPU_PREFLIGHT_TIMEOUT=2", seen)
        self.assertFalse([line for line in seen if "gpfl-secret" in line], seen)
        self.assertFalse([line for line in seen if line.startswith("LC_")], seen)

    def test_the_job_keeps_signals_the_script_found_ignored(self):
        # nohup ignores SIGHUP, a shell's background job SIGINT and SIGQUIT:
        # the job keeps them (and SIGTERM) ignored. SIGPIPE, ignored by the
        # starter as well and by Python for itself, is the default again.
        emu = self.emulator()
        kept = [signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM]
        fds, masks = self.run_job_showing_signals(emu, kept + [signal.SIGPIPE])
        self.assertEqual(masks, {"SigBlk": support.sig_mask([]),
                                 "SigIgn": support.sig_mask(kept)})
        self.assertEqual(self.log()[1]["result"], "ready")

    def test_a_script_without_shebang_runs_under_sh(self):
        emu = self.emulator()
        script = self.path("job")
        with open(script, "w") as handle:
            handle.write("echo ran-by-sh\n")
        os.chmod(script, 0o755)
        res = self.run_gp(["--host", emu.url, "--", script])
        self.assertEqual((res.code, res.stdout), (0, "ran-by-sh\n"), res)

    def test_signals_go_to_the_job(self):
        emu = self.emulator()
        marker = self.path("started")
        proc = self.start(["--host", emu.url, "--", "/bin/sh", "-c",
                           'touch %s; exec sleep 30' % marker])
        end = time.monotonic() + 10
        while not os.path.exists(marker) and time.monotonic() < end:
            time.sleep(0.02)
        time.sleep(0.1)
        os.kill(proc.pid, signal.SIGTERM)
        code, out, err = self.finish(proc)
        self.assertEqual(code, -signal.SIGTERM, (out, err))

    def test_the_job_never_runs_on_any_failure(self):
        marker = self.path("ran")
        busy = self.emulator(mode="busy")
        cases = [
            (["--host", "127.0.0.1:%d" % free_port()], 69, "connection refused"),
            (["--host", busy.url], 75, "503 server busy"),
            (["--host", busy.url, "--model", "absent"], 78, "not present"),
            (["--host", busy.url, "--config", self.path("missing.conf")], 78,
             "cannot read config file"),
            (["--host", "127.0.0.1:%d" % free_port(), "--gpu-backend", "nvml",
              "--nvml-lib", "/nonexistent.so"], 69, "no GPU driver found"),
        ]
        for args, code, text in cases:
            with self.subTest(args=args):
                res = self.run_gp(args + ["--", "/usr/bin/touch", marker])
                self.assertEqual(res.code, code, res)
                self.assertIn(text, self.log()[1]["reason"])
                self.assertFalse(os.path.exists(marker), "the job ran after a skip")

    def test_command_not_found_or_not_executable(self):
        emu = self.emulator()
        plain = self.path("plain")
        open(plain, "w").close()
        for command, code, text in ((["no-such-command-gpfl"], 127, "command not found"),
                                    ([plain], 126, "permission denied"),
                                    ([self.dir], 126, "permission denied")):
            with self.subTest(command=command):
                res = self.run_gp(["--host", emu.url, "--"] + command)
                self.assertEqual(res.code, code, res)
                self.assertEqual(res.stderr.count("\n"), 1, res)
                self.assertIn(text, res.stderr)
                self.assertEqual(self.log()[1]["stage"], "command")
        self.assertEqual(emu.requests, [], "checks ran for a job that cannot start")

    def test_dash_dash_without_a_command_is_a_usage_error(self):
        res = support.run_script(["--"])
        self.assertEqual(res.code, 64, res)
        self.assertIn("must be followed by the COMMAND", res.stderr)


class LockTest(JobCase):
    def test_second_run_with_the_same_lock_gets_75_at_once(self):
        emu = self.emulator(mode="cold", load_seconds=4)    # the second must come in it
        lock = self.path("gpu.lock")
        first = self.start(["--host", emu.url, "--timeout", "6", "--lock", lock])
        support.wait_for_flock([lock])
        res = self.run_gp(["--host", emu.url, "--lock", lock, "--deadline", "3"])
        self.assertEqual(res.code, 75, res)
        self.assertEqual(self.finish(first)[0], 0)
        messages = self.sink.messages()
        self.assertInTime(res, 3, support.parse_fields(
            [m for m in messages if "code=75" in m][0].partition("]: ")[2]))
        self.assertTrue(any('reason="locked by another job (%s)"' % lock in m
                            for m in messages), messages)
        mode = stat.S_IMODE(os.stat(lock).st_mode)
        self.assertEqual(mode, 0o600)       # no one else may open, so hold, it

    def test_the_job_holds_the_lock_until_it_ends(self):
        emu = self.emulator()
        lock = self.path("gpu.lock")
        marker = self.path("job-started")
        release = self.path("release")      # the job runs until the test says
        job = self.start(["--host", emu.url, "--lock", lock, "--", "/bin/sh", "-c",
                          ': > "$0"; while [ ! -e "$1" ]; do sleep 0.05; done', marker,
                          release])
        end = time.monotonic() + 30
        while not os.path.exists(marker) and time.monotonic() < end:
            time.sleep(0.02)
        try:
            during = self.run_gp(["--host", emu.url, "--lock", lock])
        finally:
            with open(release, "w"):
                pass
        self.assertEqual(during.code, 75, during)
        self.assertEqual(self.finish(job)[0], 0)
        after = self.run_gp(["--host", emu.url, "--lock", lock])
        self.assertEqual(after.code, 0, after)

    def test_a_symlink_at_the_lock_path_is_not_followed(self):
        emu = self.emulator()
        target = self.path("victim")
        lock = self.path("gpu.lock")
        os.symlink(target, lock)
        res = self.run_gp(["--host", emu.url, "--lock", lock])
        self.assertEqual(res.code, 78, res)
        self.assertIn("a symlink, not followed", self.log()[1]["reason"])
        self.assertFalse(os.path.exists(target))

    def test_a_user_refused_a_lock_is_told_where_a_users_lock_can_go(self):
        """Not root, a lock in a directory only root can write (/run, here a
        root-owned 0755 one): 78, Permission denied and where it can go."""
        if os.geteuid() != 0:
            self.skipTest("running as another user needs root")
        setpriv = support.require_tool(self, "setpriv")
        python = support.require_tool(self, "python3", "/usr/bin/python3")  # nobody runs it
        os.chmod(self.dir, 0o755)
        conf = self.path("gp.conf")
        with open(conf, "w") as handle:
            handle.write("[gpu_preflight]\n")
        emu = self.emulator()
        proc = subprocess.run(
            [setpriv, "--reuid=%d" % NOBODY, "--regid=%d" % NOBODY, "--clear-groups",
             python, support.SCRIPT, "--host", emu.url, "--config", conf, "--no-syslog",
             "--json", "--lock", self.path("gpu.lock"), "--", "/bin/true"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=support.cron_env(), cwd="/", timeout=60)
        self.assertEqual((proc.returncode, proc.stderr), (78, b""), proc)
        doc = json.loads(proc.stdout.decode("ascii"))
        self.assertEqual(doc["stage"], "lock", doc)
        self.assertIn("Permission denied: as a non-root user put the lock in "
                      "$XDG_RUNTIME_DIR or a directory of your own", doc["reason"])
        self.assertFalse(os.path.exists(self.path("gpu.lock")))

    def test_lock_mode_ignores_the_umask(self):
        emu = self.emulator()
        lock = self.path("gpu.lock")
        proc = self.start(["--host", emu.url, "--no-syslog", "--lock", lock, "--",
                           "/bin/true"], umask=0o000)
        self.assertEqual(self.finish(proc)[0], 0)
        # 0600: flock needs only a read, so a lock others can open they can hold
        self.assertEqual(stat.S_IMODE(os.lstat(lock).st_mode), 0o600)

    def test_lock_conflicts_are_logged_once_with_log_changes_only(self):
        emu = self.emulator()
        lock = self.path("gpu.lock")
        args = ["--host", emu.url, "--lock", lock, "--state-dir", self.state,
                "--log-changes-only", "--metrics-file", self.path("m.prom")]
        self.assertEqual(self.run_gp(args).code, 0)
        self.assertEqual(len(self.sink.messages()), 1)
        release = self.path("release")      # the job holds the lock until then
        started = self.path("started")      # written once the check became the job
        job = self.start(args + ["--", "/bin/sh", "-c", ': > "$1"; while [ ! -e "$0" ]; '
                                 'do sleep 0.05; done', release, started])
        support.wait_for_flock([lock])
        waited = time.monotonic()           # its metrics and state written before it
        while not os.path.exists(started):
            self.assertLess(time.monotonic() - waited, 30, "the job never started")
            time.sleep(0.02)
        self.sink.messages(wait=0.2)
        with open(self.path("m.prom")) as handle:
            before = handle.read()
        for _ in range(2):
            self.assertEqual(self.run_gp(args).code, 75)
        lines = self.sink.messages(wait=0.3)
        self.assertEqual(len(lines), 1, lines)
        self.assertIn("locked by another job", lines[0])
        open(release, "w").close()
        with open(self.path("m.prom")) as handle:
            self.assertEqual(handle.read(), before, "a lock conflict rewrote the metrics")
        self.assertEqual(self.finish(job)[0], 0)


    def test_a_lock_conflict_never_hides_the_next_real_verdict(self):
        # verdicts that say nothing about the service (a lock held)
        # are compared only with each other, never with the service's
        emu = self.emulator()
        lock = self.path("gpu.lock")
        args = ["--host", emu.url, "--lock", lock, "--state-dir", self.state,
                "--log-changes-only"]
        self.assertEqual(self.run_gp(args).code, 0)
        self.assertEqual(len(self.sink.messages()), 1)
        emu.mode = "busy"
        job = self.start(args + ["--", "/bin/sleep", "3"])
        self.assertEqual(self.finish(job)[0], 75)         # busy: logged, no job
        self.assertIn("server busy", self.sink.messages()[0])
        emu.mode = "healthy"
        release = self.path("release")      # the job holds the lock until then
        job = self.start(args + ["--", "/bin/sh", "-c",
                                 'while [ ! -e "$0" ]; do sleep 0.05; done', release])
        self.assertIn("result=ready", self.sink.messages(wait=20)[0])
        for _ in range(2):
            self.assertEqual(self.run_gp(args).code, 75)
        lines = self.sink.messages(wait=0.3)
        self.assertEqual(len(lines), 1, lines)
        self.assertIn("locked by another job", lines[0])
        open(release, "w").close()
        self.assertEqual(self.finish(job)[0], 0)
        emu.mode = "busy"
        self.assertEqual(self.run_gp(args).code, 75)      # real 75 after a lock's 75
        lines = self.sink.messages(wait=0.3)
        self.assertEqual(len(lines), 1, "the real 75 after a lock conflict was not logged")
        self.assertIn("server busy", lines[0])


class WaitTest(JobCase):
    def test_wait_succeeds_when_the_service_comes_up_late(self):
        port = free_port()
        late = Emulator(port=port)
        timer = threading.Timer(3.0, late.start)
        timer.start()
        self.addCleanup(late.stop)
        self.addCleanup(timer.cancel)
        res = self.run_gp(["--host", "127.0.0.1:%d" % port, "--wait", "30"])
        self.assertEqual(res.code, 0, res)
        self.assertGreater(res.elapsed, 2.5)
        fields = self.log()[1]
        self.assertInTime(res, 3 + 8, fields)       # backoff 1, 2, 4 with jitter
        self.assertGreaterEqual(int(fields["attempts"]), 2)

    def test_wait_against_a_service_that_never_answers_ends_at_the_deadline(self):
        emu = self.emulator(mode="hang")
        res = self.run_gp(["--host", emu.url, "--wait", "30", "--timeout", "1",
                           "--deadline", "4"])
        self.assertEqual(res.code, 75, res)
        self.assertGreaterEqual(res.elapsed, 2.5)
        self.assertGreaterEqual(len(emu.requests), 2, "one request per attempt, afresh")
        # The last attempt ends at the deadline, or (its pause is random, and a
        # loaded machine late) by its own timeout with too little left to retry.
        fields = self.log()[1]
        self.assertInTime(res, 4, fields)
        reason = fields["reason"]
        if reason.startswith("deadline"):
            self.assertIn("deadline of 4s reached during GET /api/tags (attempt ", reason)
            self.assertIn(": GET /api/tags timed out after 1s)", reason,
                          "the reason of the attempt before the deadline's is kept")
        else:
            self.assertEqual(reason, "GET /api/tags timed out after 1s")

    def test_wait_does_not_retry_a_configuration_error(self):
        emu = self.emulator()
        res = self.run_gp(["--host", emu.url, "--model", "absent", "--wait", "30"])
        self.assertEqual(res.code, 78, res)
        self.assertLess(support.own_seconds(res, self.log()[1]), 5, "no pause, no retry")
        self.assertEqual(emu.count("GET", "/api/tags"), 1)

    def test_jitter_is_bounded_by_the_deadline(self):
        """--jitter 600 under --deadline 6 pauses at most until one --timeout
        (3 s) is left, and that is enough for the check (with --timeout 1 the
        check had 1 s, which a loaded machine missed)."""
        emu = self.emulator()
        res = self.run_gp(["--host", emu.url, "--jitter", "600", "--deadline", "6",
                           "--timeout", "3"])
        self.assertEqual(res.code, 0, res)
        self.assertInTime(res, 6, self.log()[1])


class ShareResultTest(JobCase):
    def shared(self, emu, *extra):
        return ["--host", emu.url, "--share-result", "60", "--state-dir", self.state,
                "--no-syslog"] + list(extra)

    def crowd(self, args, n=20):
        procs = [self.start(args) for _ in range(n)]
        return [self.finish(p, timeout=60) for p in procs]

    def test_twenty_simultaneous_callers_send_one_warmup(self):
        emu = self.emulator(mode="cold", load_seconds=1.5)
        results = self.crowd(self.shared(emu, "--timeout", "10", "--json"))
        self.assertEqual([r[0] for r in results], [0] * 20, results)
        self.assertEqual(emu.count("POST", "/api/generate"), 1)
        reused = [json.loads(r[1])["reused"] for r in results]
        self.assertEqual(reused.count(False), 1)

    def test_a_failing_service_fails_every_caller(self):
        emu = self.emulator(mode="hang")
        results = self.crowd(self.shared(emu, "--timeout", "3", "--deadline", "12"))
        self.assertEqual([r[0] for r in results], [75] * 20, results)
        self.assertLessEqual(len(emu.requests), 3, "callers must wait, not send")

    def test_a_fresh_ready_verdict_is_reused_without_the_network_until_it_ages(self):
        """Reused within --share-result 30; checked again once older than 1 s
        (--share-result is not part of the check: the same state file)."""
        emu = self.emulator()
        args = ["--host", emu.url, "--state-dir", self.state, "--share-result", "30"]
        self.assertEqual(self.run_gp(args).code, 0)
        self.log()
        sent = len(emu.requests)
        res = self.run_gp(args)
        self.assertEqual(res.code, 0, res)
        self.assertEqual(len(emu.requests), sent, "a reused verdict touched the network")
        fields = self.log()[1]
        self.assertEqual(fields["shared"], "reused")
        self.assertRegex(fields["reason"], r"^reused verdict of pid \d+, [\d.]+s old: ")
        time.sleep(1.1)
        self.assertEqual(self.run_gp(args[:-1] + ["1"]).code, 0)
        self.assertGreater(len(emu.requests), sent)

    def test_jitter_keeps_a_single_warmup(self):
        emu = self.emulator(mode="cold", load_seconds=1.0)
        results = self.crowd(self.shared(emu, "--timeout", "10", "--jitter", "2"), n=10)
        self.assertEqual([r[0] for r in results], [0] * 10, results)
        self.assertEqual(emu.count("POST", "/api/generate"), 1)

    def test_a_waiter_waits_out_a_cold_load_past_the_default_deadline(self):
        """A caller arriving while another's check loads the model (12 s, past
        the default 10 s deadline) waits as long as that load may take, and
        reuses its ready verdict: both 0, one warm-up (before: the waiter was 75
        "deadline of 10s reached waiting for another caller's check")."""
        emu = self.emulator(mode="cold", load_seconds=12)
        args = self.shared(emu, "--load-timeout", "30", "--json")
        first = self.start(args)
        support.wait_for_flock(lambda: glob.glob(os.path.join(self.state, "*.lock")))
        second = self.start(args)
        results = [self.finish(p, timeout=90) for p in (first, second)]
        self.assertEqual([r[0] for r in results], [0, 0], results)
        self.assertEqual(emu.count("POST", "/api/generate"), 1)
        self.assertEqual([json.loads(r[1])["reused"] for r in results], [False, True])

    def test_a_waiter_with_wait_time_checks_again_after_a_failure(self):
        port = free_port()
        hang = Emulator(mode="hang", port=port).start()
        healthy = Emulator(port=port)
        self.addCleanup(healthy.stop)
        self.addCleanup(hang.stop)
        args = ["--host", "127.0.0.1:%d" % port, "--share-result", "60",
                "--state-dir", self.state, "--timeout", "2.5"]     # the waiter comes in it
        first = self.start(args + ["--no-syslog"])
        support.wait_for_flock(lambda: glob.glob(os.path.join(self.state, "*.lock")))
        waiter = self.start(args + ["--wait", "20", "--json"])
        self.assertEqual(self.finish(first)[0], 75)
        hang.stop()
        healthy.start()
        code, out, err = self.finish(waiter)
        self.assertEqual(code, 0, (out, err))
        self.assertFalse(json.loads(out)["reused"], "the waiter took the failure")

    def test_a_state_file_of_wrong_types_is_ignored(self):
        emu = self.emulator()
        args = ["--host", emu.url, "--state-dir", self.state, "--share-result", "60",
                "--log-changes-only"]
        self.assertEqual(self.run_gp(args).code, 0)
        self.log()
        (name,) = [n for n in os.listdir(self.state) if n.endswith(".json")]
        for bad in ('{"skips": "3", "code": 0, "time": 1}', '{"code": false, "time": 1}',
                    '{"time": "yesterday", "code": 0}', '[1, 2]', 'garbage'):
            with self.subTest(state=bad):
                with open(os.path.join(self.state, name), "w") as handle:
                    handle.write(bad)
                res = self.run_gp(args)
                self.assertEqual((res.code, res.stderr), (0, ""), res)
                self.assertNotEqual(self.log()[1].get("shared"), "reused")

    def test_a_failure_is_not_reused_by_a_later_caller(self):
        emu = self.emulator(mode="busy")
        args = ["--host", emu.url, "--state-dir", self.state, "--share-result", "60",
                "--no-syslog"]
        self.assertEqual(self.run_gp(args).code, 75)
        self.assertEqual(self.run_gp(args).code, 75)
        self.assertEqual(emu.count("POST", "/api/generate"), 2)

    def test_different_checks_do_not_share(self):
        emu = self.emulator(models=("a:latest", "b:latest"), loaded=("a:latest", "b:latest"))
        base = ["--host", emu.url, "--state-dir", self.state, "--share-result", "60",
                "--no-syslog"]
        self.assertEqual(self.run_gp(base + ["--model", "a"]).code, 0)
        self.assertEqual(self.run_gp(base + ["--model", "b"]).code, 0)
        self.assertEqual(emu.count("POST", "/api/generate"), 2)

    def test_a_state_directory_others_can_write_is_not_trusted(self):
        emu = self.emulator()
        os.mkdir(self.state)
        os.chmod(self.state, 0o777)
        args = ["--host", emu.url, "--state-dir", self.state, "--share-result", "60"]
        res = self.run_gp(args)
        self.assertEqual(res.code, 0, res)
        self.assertIn("state not kept", self.log()[1]["problem"])
        self.assertEqual(os.listdir(self.state), [])


class LogChangesOnlyTest(JobCase):
    def test_only_changes_are_logged_and_recovery_counts_the_skips(self):
        port = free_port()
        args = ["--host", "127.0.0.1:%d" % port, "--state-dir", self.state,
                "--log-changes-only"]
        emu = Emulator(port=port).start()
        self.assertEqual(self.run_gp(args).code, 0)
        self.assertEqual(len(self.sink.messages()), 1)
        self.assertEqual(self.run_gp(args).code, 0)
        self.assertEqual(self.sink.messages(wait=0.3), [], "an unchanged verdict logged")
        emu.stop()
        self.assertEqual(self.run_gp(args).code, 69)
        self.assertEqual(len(self.sink.messages()), 1)
        self.assertEqual(self.run_gp(args).code, 69)
        self.assertEqual(self.sink.messages(wait=0.3), [])
        emu = Emulator(port=port).start()
        self.addCleanup(emu.stop)
        self.assertEqual(self.run_gp(args).code, 0)
        self.assertIn("recovered after 2 skips", self.log()[1]["reason"])


class EscalateAfterTest(JobCase):
    def test_75s_of_one_stage_become_69_and_only_real_verdicts_count(self):
        import fcntl
        emu = self.emulator(mode="hang")
        lock = self.path("gpu.lock")
        args = ["--host", emu.url, "--timeout", "1", "--state-dir", self.state,
                "--lock", lock, "--escalate-after", "3"]

        def verdict(mode, code):
            emu.mode = mode
            res = self.run_gp(args)
            self.assertEqual(res.code, code, res)
            return self.log()[1]

        self.assertEqual(verdict("hang", 75)["stage"], "tags")
        verdict("hang", 75)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)  # novermin: flags, not a type
        fcntl.flock(fd, fcntl.LOCK_EX)          # another job holds the lock
        self.assertIn("locked by another job", verdict("hang", 75)["reason"])
        os.close(fd)
        line = verdict("hang", 69)
        self.assertEqual(line["stage"], "tags")
        self.assertRegex(line["reason"], r"^GET /api/tags timed out.* \(75 for 3 runs in a "
                         r"row since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ: treated as unavailable\)$")
        self.assertIn("4 runs in a row", verdict("hang", 69)["reason"])
        verdict("healthy", 0)                   # ready: the streak ends
        verdict("hang", 75)
        verdict("hang", 75)
        self.assertEqual(verdict("busy", 75)["stage"], "warmup")   # a new streak
        verdict("busy", 75)
        self.assertIn("75 for 3 runs", verdict("busy", 69)["reason"])


class LogChangesAfterConfigErrorTest(JobCase):
    def test_the_first_good_run_after_a_config_error_is_logged(self):
        emu = self.emulator()
        conf = self.path("gp.conf")
        args = ["--host", emu.url, "--state-dir", self.state, "--log-changes-only",
                "--config", conf]
        with open(conf, "w") as handle:
            handle.write("[gpu_preflight]\n")
        self.assertEqual(self.run_gp(args).code, 0)
        self.assertEqual(len(self.sink.messages()), 1)
        with open(conf, "w") as handle:
            handle.write("[gpu_preflight]\ntimeout = soon\n")
        for _ in range(2):
            self.assertEqual(self.run_gp(args).code, 78)
        self.assertEqual(len(self.sink.messages()), 1, "an unchanged error logged twice")
        with open(conf, "w") as handle:
            handle.write("[gpu_preflight]\n")
        self.assertEqual(self.run_gp(args).code, 0)
        self.assertEqual(self.log()[1]["result"], "ready")


#: One sample line of the text format: name{labels} value (no timestamp).
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{((?:[a-zA-Z_][a-zA-Z0-9_]*="'
                     r'(?:[^"\\\n]|\\[\\"n])*",?)*)\} (\S+)$')


def strict_parse(text):
    """The text format, strictly: {family: [(labels text, value)]}.

    HELP and TYPE before a family's samples, each family one contiguous
    group, no timestamps, escaped label values, a final newline.
    """
    assert text.endswith("\n"), "no final newline"
    families, current = {}, None
    for line in text[:-1].split("\n"):
        if line.startswith("# HELP "):
            name = line.split(" ")[2]
            assert name not in families, "family %s twice" % name
            families[name], current = [], name
        elif line.startswith("# TYPE "):
            assert line.split(" ")[2:] == [current, "gauge"], line
        else:
            match = _SAMPLE.match(line)
            assert match, "bad sample line %r" % line
            assert match.group(1) == current, "sample outside its family: %r" % line
            float(match.group(3))
            families[current].append((match.group(2), match.group(3)))
    return families


class MetricsTest(JobCase):
    def test_a_model_name_with_control_characters_is_written_without_them(self):
        """The file is 0644 and an admin cats it: a server-listed model name
        (no --model) carries no escape sequence, carriage return or C1 byte."""
        name = "evil\u001b]0;owned\u0007\u001b[2J\r\u009bX:latest"
        listed = json.dumps({"models": [{"name": name, "model": name, "size": 10,
                                         "size_vram": 10}]}).encode()
        url = self.scripted_server(lambda method, path, calls: {
            "/api/tags": (200, listed), "/api/ps": (200, listed),
            "/api/generate": (200, json.dumps({"model": name, "response": "!",
                                               "done": True}).encode())}.get(
            path, (404, b"404 page not found")))
        metrics = self.path("gpu.prom")
        res = self.run_gp(["--host", url, "--state-dir", self.state,
                           "--metrics-file", metrics])
        self.assertEqual(res.code, 0, res)
        with open(metrics, "rb") as handle:
            text = handle.read()
        self.assertIn(b'model="evil ]0;owned [2J X:latest"', text)
        self.assertEqual(re.findall(rb"[\x00-\x09\x0b-\x1f\x7f]|\xc2[\x80-\x9f]", text), [])

    def test_metrics_file_is_valid_atomic_readable_and_counts_skips(self):
        metrics = self.path("gpu.prom")
        emu = self.emulator()
        args = ["--state-dir", self.state, "--metrics-file", metrics, "--no-syslog"]
        self.assertEqual(self.run_gp(["--host", emu.url] + args).code, 0)
        first = os.stat(metrics)
        self.assertEqual(stat.S_IMODE(first.st_mode), 0o644)
        old = os.open(metrics, os.O_RDONLY)     # a rename leaves this one unlinked
        self.addCleanup(os.close, old)
        with open(metrics) as handle:
            text = handle.read()
        families = strict_parse(text)
        self.assertEqual(sorted(families), sorted(
            "gpu_preflight_" + n for n in ("ready", "last_run_timestamp_seconds",
                                           "exit_code", "stage_duration_seconds",
                                           "consecutive_skips", "model_warmup_seconds")))
        labels = 'host="%s",model=""' % emu.url
        self.assertEqual(families["gpu_preflight_ready"], [(labels, "1")])
        stages = [l for l, _ in families["gpu_preflight_stage_duration_seconds"]]
        self.assertEqual(stages, [labels + ',stage="%s"' % s
                                  for s in ("tags", "loaded", "warmup", "placement")])

        refused = "127.0.0.1:%d" % free_port()
        for skips in (1, 2):
            self.assertEqual(self.run_gp(["--host", refused] + args).code, 69)
        with open(metrics) as handle:
            families = strict_parse(handle.read())
        labels = 'host="http://%s",model=""' % refused
        self.assertEqual(families["gpu_preflight_consecutive_skips"], [(labels, "2")])
        self.assertEqual(families["gpu_preflight_exit_code"], [(labels, "69")])
        self.assertEqual(os.fstat(old).st_nlink, 0, "written in place, not renamed over")
        self.assertEqual(sorted(os.listdir(self.dir)), ["gpu.prom", "state"],
                         "temporary files left behind")

    def test_labels_are_the_configured_model_whatever_the_verdict(self):
        metrics = self.path("gpu.prom")
        emu = self.emulator()
        for host, code in ((emu.url, 0), ("127.0.0.1:%d" % free_port(), 69)):
            proc = self.start(["--host", host, "--model", "llama3.2", "--metrics-file",
                               metrics, "--state-dir", self.state], umask=0o077)
            self.assertEqual(self.finish(proc)[0], code)
            self.assertEqual(stat.S_IMODE(os.stat(metrics).st_mode), 0o644)
            with open(metrics) as handle:
                families = strict_parse(handle.read())
            self.assertTrue(families["gpu_preflight_ready"][0][0].endswith(
                ',model="llama3.2"'), families)

    def test_prometheus_own_parser_accepts_the_file(self):
        metrics = self.path("gpu.prom")
        emu = self.emulator()
        res = self.run_gp(["--host", emu.url, "--metrics-file", metrics, "--no-syslog",
                           "--state-dir", self.state])
        self.assertEqual(res.code, 0, res)
        with open(metrics) as handle:
            self.check_with_prometheus_client(handle.read())

    def test_metrics_file_in_a_missing_directory_is_reported_not_fatal(self):
        emu = self.emulator()
        res = self.run_gp(["--host", emu.url, "--metrics-file", self.path("no/such.prom"),
                           "--state-dir", self.state])
        self.assertEqual(res.code, 0, res)
        self.assertIn("metrics file", self.log()[1]["problem"])

    def check_with_prometheus_client(self, text):
        """Prometheus's own parser (prometheus-client, in CI's tool venv)."""
        python = os.environ.get("PROMETHEUS_PYTHON", "")
        if not python:
            message = "PROMETHEUS_PYTHON (a Python with prometheus-client) is not set"
            if support.IN_CI:
                self.fail(message + " (CI=true: .ci/run must install it)")
            self.skipTest(message)
        code = ("import sys\nfrom prometheus_client.parser import "
                "text_string_to_metric_families as parse\n"
                "for f in parse(sys.stdin.read()):\n"
                "    print(f.name, f.type, len(f.samples))\n")
        out = subprocess.run([python, "-c", code], input=text.encode(),
                             stdout=subprocess.PIPE, check=True).stdout.decode()
        self.assertEqual(sorted(out.split("\n")[:-1]), [
            "gpu_preflight_consecutive_skips gauge 1", "gpu_preflight_exit_code gauge 1",
            "gpu_preflight_last_run_timestamp_seconds gauge 1",
            "gpu_preflight_model_warmup_seconds gauge 1",
            "gpu_preflight_ready gauge 1", "gpu_preflight_stage_duration_seconds gauge 4"])


class LogChangesOnlyTransitionTest(TrustCase):
    def test_a_job_that_did_not_start_is_logged_after_unchanged_ready_verdicts(self):
        job = self.write(self.path("job.sh"), "#!/nonexistent/interpreter\n", 0o755)
        args = ["--host", self.emu.url, "--log-changes-only", "--state-dir",
                self.path("state"), "--"]
        for _ in range(2):
            self.assertEqual(self.run_gp(args + ["/bin/true"]).code, 0)
        self.sink.messages(wait=0.2)
        res = self.run_gp(args + [job])
        self.assertEqual(res.code, 127, res)
        lines = self.sink.messages()
        self.assertEqual(len(lines), 1, "the job that did not start was not logged: %r"
                         % (lines,))
        self.assertIn("stage=command", lines[0])

    def test_the_ready_after_a_fixed_config_error_is_logged(self):
        # a broken file drops its values, so the 78 is kept under another
        # state key; the ready after the fix compares with the old ready
        conf = self.path("gp.conf")
        good = "[gpu_preflight]\nhost = %s\ntimeout = 2\n" % self.emu.url
        args = ["--config", conf, "--log-changes-only", "--state-dir", self.path("state")]
        for text, code in ((good, 0), (good + "bogus = 1\n", 78), (good, 0)):
            self.sink.messages(wait=0.01)
            self.write(conf, text)
            self.assertEqual(self.run_gp(args).code, code)
        lines = self.sink.messages()
        self.assertEqual(len(lines), 1, "the recovery from the config error was not logged")
        self.assertIn("result=ready", lines[0])


class ShareResultDeadlineTest(TrustCase):
    def test_a_waiter_does_not_take_a_skip_caused_by_another_callers_deadline(self):
        """The first caller's --deadline 2 ends its check inside the 3 s load:
        a 75 of its own deadline, which a waiter with 30 s checks again (0).
        The first holds the flight lock from its start to its deadline; with
        --deadline 1, on a loaded machine, that window was too short to see."""
        emu = self.emulator(loaded=(), load_seconds=3.0)
        state = self.path("state")
        common = ["--host", emu.url, "--model", "llama3.2", "--timeout", "10",
                  "--share-result", "60", "--state-dir", state, "--no-syslog"]
        first = subprocess.Popen([sys.executable, support.SCRIPT] + common
                                 + ["--deadline", "2"], env=support.cron_env(),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.addCleanup(first.wait)
        support.wait_for_flock(     # the first caller's check is in flight
            lambda: glob.glob(os.path.join(state, "*.lock")))
        res = self.run_gp(common + ["--deadline", "30"], log=False)
        self.assertEqual(res.code, 0, res)


if __name__ == "__main__":
    unittest.main()
