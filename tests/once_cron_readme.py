"""The README's own cron lines, as written, run by the real cron daemon.

Every line of every ```cron block in README.md is taken as written (schedule,
user, command); only a schedule of five fields or an @keyword other than
@reboot is replaced by `* * * * *`, so that the line fires at the next minute.
@reboot lines stay @reboot: cron runs them when it starts on a /run without
its crond.reboot file, which a fresh /run is. Each line goes into a file of
its own in the namespace's /etc/cron.d, after the `NAME=value` lines that
precede it in its block and `GPFL_README_LINE=<its README line number>`, so
that a job can tell which line started it.

cron runs as in test_cron.py (private mount namespace, /dev/log bound to the
test's socket, libfaketime putting cron's clock just before a minute), and in
that namespace also:
  - /usr/local is a tmpfs into which the repository's install.sh installs the
    product (`env -i PATH=/usr/bin:/bin sh install.sh --prefix /usr/local
    --no-config`), so the lines call what a user's install puts there, run by
    Debian's /usr/bin/python3 as cron's PATH finds it;
  - /etc is an overlay (the real /etc below, a tmpfs above) holding
    gpu_preflight.conf (root's, 0644, in a root-owned 0755 /etc) with
    `host = http://127.0.0.1:PORT` of the Ollama emulator;
  - /opt is a directory of the test's holding every job the lines name
    (/opt/jobs/...): each records its line number, pid and path, prints
    nothing;
  - /run is a fresh tmpfs (the lock and state files of --lock and
    --log-changes-only live there);
  - /usr/sbin/sendmail, where the machine has one, is a script that records
    what cron would mail; without it cron logs that it discards output.

Three cron starts: the emulator healthy (every line's job runs, once, nothing
printed, one `result=ready` syslog line per line, a `--` job is the
preflight's own pid), stopped (connection refused) and without the model
(not present): no job runs, nothing printed, one `result=skip` line per line.
A line with --wait that is still waiting when every other line has ended is
stopped with SIGTERM (it must not have run its job, and logs a skip).

Slow (a cron start per state) and cron-bound, so run.py runs it once per
suite run, under /usr/bin/python3. Needs root; in CI a missing tool fails.
"""

import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

import daemons
import support
import test_cron
from ollama_emu import Emulator, Model
from test_cron import (CRON_EXEC, NAMESPACE_MOUNTS, SYSLOG_RE, USER_INFO,
                       find_libfaketime, need)

README = os.path.join(support.REPO, "README.md")
INSTALL = os.path.join(support.REPO, "install.sh")
FAKE_WAIT = 40.0                # faketime: the lines run after ~4 s
REAL_WAIT = 90.0                # the real clock: up to 61 s, then the runs
GRACE = 2.0                     # after every line ended, for late lines
#: The models the README's cron lines name, as a server that has them all
#: (the agent line needs the chat model's tools and an embedding model).
README_MODELS = (Model("llama3.2:latest"), Model("qwen3:latest", "generate",
                                                  ["completion", "tools"]),
                 Model("nomic-embed-text:latest", "embed"))

MODEL_TEXT = {"ready": None, "refused": "connection refused",
              "no_model": "not present"}
CONTROL = "echo gpfl-readme-control"

KEYWORDS = ("@reboot", "@yearly", "@annually", "@monthly", "@weekly", "@daily",
            "@midnight", "@hourly")
FIELD = re.compile(r"^[0-9A-Za-z*/,-]+$")
ENV_LINE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\s*=")
CRON_JOB = re.compile(r"^\(\S+\) (CMD|END) \((?:\[\d+\] )?(.*)\)$", re.S)

# Before test_cron's mounts ($6 the repository, $7 "mta" when the machine has
# /usr/sbin/sendmail): /etc an overlay with the config on top, /opt ours.
MOUNTS_BEFORE = r"""
set -e
work=$1 repo=$6 mta=$7
mount -t tmpfs -o mode=0755 tmpfs "$work/etc"
mkdir -m 0755 "$work/etc/upper" "$work/etc/work"
cp "$work/gpu_preflight.conf" "$work/etc/upper/gpu_preflight.conf"
chmod 0644 "$work/etc/upper/gpu_preflight.conf"
mount -t overlay overlay \
    -o "lowerdir=/etc,upperdir=$work/etc/upper,workdir=$work/etc/work" /etc
mount --bind "$work/opt" /opt
"""
# After them: the product installed into a tmpfs /usr/local by install.sh.
MOUNTS_AFTER = r"""
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /usr/local
env -i PATH=/usr/bin:/bin HOME=/root LOGNAME=root SHELL=/bin/sh \
    sh "$repo/install.sh" --prefix /usr/local --no-config
if [ "$mta" = mta ]; then mount --bind "$work/sendmail" /usr/sbin/sendmail; fi
"""

JOB = """#!/bin/sh
# A job named in the README's cron lines: records that it ran, prints nothing.
printf '%%s %%s %%s\\n' "${GPFL_README_LINE:-?}" "$$" "$0" >> %s
"""
SENDMAIL = """#!/bin/sh
# what cron would mail
{ printf 'sendmail %%s\\n' "$*"; cat; } >> %s
"""


class CronLine(object):
    """One line of a ```cron block: README line number, schedule, user, command."""

    def __init__(self, number, text, env):
        self.number, self.text, self.env = number, text, list(env)
        if text.startswith("@"):
            parts = text.split(None, 2)
            if len(parts) < 3 or parts[0] not in KEYWORDS:
                raise ValueError("README.md:%d: not a cron line: %r" % (number, text))
            self.schedule, self.user, self.command = parts[0], parts[1], parts[2]
        else:
            parts = text.split(None, 6)
            if len(parts) < 7 or not all(FIELD.match(f) for f in parts[:5]):
                raise ValueError("README.md:%d: not a cron line (five schedule "
                                 "fields, user, command): %r" % (number, text))
            self.schedule, self.user = " ".join(parts[:5]), parts[5]
            self.command = parts[6]
        self.reboot = self.schedule == "@reboot"
        words = shlex.split(self.command)
        self.program = words[0]
        self.waits = "--wait" in words or any(w.startswith("--wait=") for w in words)
        after = re.search(r"&&\s*(\S+)", self.command)
        self.run_mode = after is None and "--" in words
        if after:
            self.job = after.group(1)
        elif self.run_mode:
            self.job = words[words.index("--") + 1]
        else:
            raise ValueError("README.md:%d: no job after `&&` or `--`: %r" % (number, text))

    def entry(self):
        """This line's /etc/cron.d file: its block's NAME=value lines, its
        number, the line with a schedule that fires now."""
        schedule = "@reboot" if self.reboot else "* * * * *"
        return "".join(e + "\n" for e in self.env) + "GPFL_README_LINE=%d\n%s %s %s\n" % (
            self.number, schedule, self.user, self.command)

    def __repr__(self):
        return "README.md:%d %r" % (self.number, self.text)


def readme_cron_lines(path=README):
    """Every line of every ```cron block, comments and blank lines left out."""
    lines, env, inside = [], [], False
    with open(path) as handle:
        for number, raw in enumerate(handle, 1):
            text = raw.strip()
            if not inside:
                if text == "```cron":
                    inside, env = True, []
                continue
            if text == "```":
                inside = False
            elif not text or text.startswith("#"):
                continue
            elif ENV_LINE.match(text):
                env.append(text)
            else:
                lines.append(CronLine(number, text, env))
    return lines


def processes_in(namespace):
    """{pid: (argv, environ)} of the processes in a mount namespace."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.readlink("/proc/%s/ns/mnt" % name) != namespace:
                continue
            with open("/proc/%s/cmdline" % name, "rb") as handle:
                argv = handle.read().split(b"\0")
            with open("/proc/%s/environ" % name, "rb") as handle:
                environ = handle.read().split(b"\0")
        except OSError:
            continue
        found[int(name)] = ([a.decode("utf-8", "replace") for a in argv if a],
                            [e.decode("utf-8", "replace") for e in environ if e])
    return found


class Observed(object):
    """What one cron start produced."""

    def __init__(self):
        self.received, self.raw = [], []    # (pri, tag, pid, msg); datagrams
        self.records, self.killed = [], {}  # (line, pid, path); pid -> line
        self.mailed, self.cron_said, self.diagnosis = "", "", ""

    def drain(self, sink, wait):
        for datagram in sink.messages(wait):
            self.raw.append(datagram)
            match = SYSLOG_RE.match(datagram)
            if match:
                self.received.append((int(match.group(1)), match.group(2),
                                      int(match.group(3)), match.group(4)))

    def cron(self):
        return [(pid, msg) for pri, tag, pid, msg in self.received if tag == "CRON"]

    def jobs(self, what):
        """(cron's pid, command) of cron's `(user) WHAT ([shell pid] command)`."""
        found = []
        for pid, msg in self.cron():
            match = CRON_JOB.match(msg)
            if match and match.group(1) == what:
                found.append((pid, match.group(2)))
        return found

    def count(self, what, command):
        return sum(1 for pid, text in self.jobs(what) if text == command)

    def pids(self, command):
        return [pid for pid, text in self.jobs("CMD") if text == command]

    def verdicts(self):
        """(pri, pid, fields) of the product's own syslog lines."""
        return [(pri, pid, support.parse_fields(msg))
                for pri, tag, pid, msg in self.received if tag == "gpu_preflight"]


class ReadmeCronTest(unittest.TestCase):
    maxDiff = None

    @classmethod
    def setUpClass(cls):
        cls.lines = readme_cron_lines()

    def test_the_readme_has_cron_lines_that_name_programs_by_absolute_path(self):
        # cron's PATH is /usr/bin:/bin; install.sh installs into /usr/local/bin.
        self.assertTrue(self.lines, "no ```cron block with a line in README.md")
        for line in self.lines:
            with self.subTest(line=line.number):
                self.assertTrue(os.path.isabs(line.program), line)
                self.assertTrue(os.path.isabs(line.job), line)

    def test_healthy_every_line_runs_its_job_once_silently_and_logs_ready(self):
        emu = Emulator(mode="healthy", models=README_MODELS, loaded=(
            "llama3.2:latest", "qwen3:latest", "nomic-embed-text:latest")).start()
        self.addCleanup(emu.stop)
        seen = self.run_cron(emu.url, "ready")
        d = seen.diagnosis
        ran = {}
        for number, pid, path in seen.records:
            ran.setdefault(number, []).append((pid, path))
        verdicts = seen.verdicts()
        ready_pids = set(pid for pri, pid, fields in verdicts)
        for line in self.lines:
            with self.subTest(line=line.number):
                self.assertEqual([path for pid, path in ran.get(str(line.number), [])],
                                 [line.job], "%r: its job did not run once" % line + d)
                if line.run_mode:       # exec: the job is the preflight's process
                    self.assertIn(ran[str(line.number)][0][0], ready_pids,
                                  "%r: the job is not the preflight's pid" % line + d)
        self.assertEqual(sorted(ran), sorted(str(line.number) for line in self.lines), d)
        self.assertEqual(len(verdicts), len(self.lines), "one syslog line per run" + d)
        for pri, pid, fields in verdicts:
            self.assertEqual((pri, fields.get("result"), fields.get("code")),
                             (USER_INFO, "ready", "0"), d)
        self.assertGreaterEqual(emu.count("POST", "/api/generate"), 1)

    def test_stopped_service_no_job_runs_and_each_line_logs_a_skip(self):
        emu = Emulator(mode="healthy").start()
        url = emu.url
        emu.stop()                      # connection refused from now on
        self.check_skips(self.run_cron(url, "refused"), "refused")

    def test_model_missing_no_job_runs_and_each_line_logs_a_skip(self):
        emu = Emulator(mode="healthy", models=("other:latest",)).start()
        self.addCleanup(emu.stop)
        self.check_skips(self.run_cron(emu.url, "no_model"), "no_model")

    def check_skips(self, seen, state):
        d = seen.diagnosis
        self.assertEqual(seen.records, [], "a job ran although not ready" + d)
        verdicts = seen.verdicts()
        self.assertEqual(len(verdicts), len(self.lines), "one syslog line per run" + d)
        # a line that shares a --lock with one still waiting finds it locked
        allowed = [MODEL_TEXT[state]] + (["locked by another job"] if seen.killed else [])
        for pri, pid, fields in verdicts:
            self.assertEqual(fields.get("result"), "skip", d)
            self.assertNotEqual(fields.get("code"), "0", d)
            if pid in seen.killed:      # SIGTERM during --wait: interrupted
                self.assertEqual(fields.get("code"), "143", d)
                self.assertIn("interrupted by SIGTERM", fields.get("reason", ""), d)
                continue
            self.assertTrue(any(text in fields.get("reason", "") for text in allowed),
                            "reason %r, want one of %r" % (fields.get("reason"), allowed) + d)

    # -- one cron start

    def run_cron(self, host, state):
        """Start cron with the README's lines against `host`; return what it did."""
        self.assertTrue(self.lines, "no ```cron block with a line in README.md")
        need(self, os.geteuid() == 0, "a real cron test needs root")
        cron = support.require_tool(self, "cron", "/usr/sbin/cron")
        unshare = support.require_tool(self, "unshare", "/usr/bin/unshare")
        support.require_tool(self, "mount", "/usr/bin/mount")
        need(self, os.access("/usr/bin/python3", os.X_OK),
             "/usr/bin/python3 (what cron's PATH finds) is not installed")
        need(self, os.path.isdir("/opt") and os.path.isdir("/usr/local"),
             "/opt and /usr/local must exist to be mounted over")
        try:
            lib = support.require_tool(self, "faketime (libfaketime.so.1)",
                                       find_libfaketime())
        except unittest.SkipTest:       # outside CI: wait for the real minute
            lib = None

        work = tempfile.mkdtemp(prefix="gpfl-readme-")
        self.addCleanup(shutil.rmtree, work, True)
        os.chmod(work, 0o755)
        for folder in ("cron.d", "spool", "opt", "etc"):
            os.mkdir(os.path.join(work, folder), 0o755)
        open(os.path.join(work, "crontab"), "w").close()
        with open(os.path.join(work, "gpu_preflight.conf"), "w") as handle:
            handle.write("[gpu_preflight]\nhost = %s\n" % host)
        record = os.path.join(work, "ran")
        for line in self.lines:
            self.assertTrue(line.job.startswith("/opt/"),
                            "%r: the test provides jobs under /opt only" % line)
            job = os.path.join(work, "opt", line.job[len("/opt/"):])
            if not os.path.isdir(os.path.dirname(job)):
                os.makedirs(os.path.dirname(job), 0o755)
            with open(job, "w") as handle:
                handle.write(JOB % shlex.quote(record))
            os.chmod(job, 0o755)
            path = os.path.join(work, "cron.d", "readme-line-%d" % line.number)
            with open(path, "w") as handle:
                handle.write(line.entry())
            os.chmod(path, 0o644)       # root's, not writable by others
        control = state == "ready"      # shows that output would be seen
        if control:
            with open(os.path.join(work, "cron.d", "control"), "w") as handle:
                handle.write("* * * * * root %s\n" % CONTROL)
        mta = os.path.exists("/usr/sbin/sendmail")
        mailed = os.path.join(work, "mailed")
        with open(os.path.join(work, "sendmail"), "w") as handle:
            handle.write(SENDMAIL % shlex.quote(mailed))
        os.chmod(os.path.join(work, "sendmail"), 0o755)

        sink = support.SyslogSink()
        self.addCleanup(sink.close)
        # cron's clock ~4 s before a minute boundary: @reboot lines run at once
        offset = int(round((56.0 - time.time()) % 60.0)) if lib else 0
        cron_log = open(os.path.join(work, "cron.out"), "wb")
        self.addCleanup(cron_log.close)
        started = time.monotonic()
        proc = subprocess.Popen(support.prepared(
            [unshare, "--mount", "--propagation", "private", "/bin/sh", "-c",
             MOUNTS_BEFORE + NAMESPACE_MOUNTS + MOUNTS_AFTER + CRON_EXEC, "sh",
             work, sink.path, cron, lib or "", str(offset), support.REPO,
             "mta" if mta else ""]),
            stdin=subprocess.DEVNULL, stdout=cron_log, stderr=subprocess.STDOUT,
            cwd="/", start_new_session=True)
        held = []       # cron's own mount namespace, once it has unshared one

        def hold():
            if held or proc.poll() is not None:
                return
            try:
                name, fd = daemons.open_namespace(proc.pid)
            except OSError:
                return
            if name == os.readlink("/proc/self/ns/mnt"):    # not unshared yet
                os.close(fd)
            else:
                held.append((name, fd))

        def stop():     # at the end and on cleanup: kills only by a name held
            hold()
            test_cron.CronTest.stop_cron(proc)
            while held:
                name, fd = held.pop()
                for pid in processes_in(name):  # jobs left in it
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                os.close(fd)
        self.addCleanup(stop)

        seen = Observed()
        by_command = {}
        for line in self.lines:
            by_command[line.command] = by_command.get(line.command, 0) + 1

        def ended(command):
            return seen.count("END", command) >= by_command[command]

        def waiting():
            """{README line: pid} of preflights of --wait lines still running."""
            if not held:
                return {}
            found = {}
            for pid, (argv, environ) in processes_in(held[0][0]).items():
                marks = [e.split("=", 1)[1] for e in environ
                         if e.startswith("GPFL_README_LINE=")]
                if marks and any(a.endswith("/gpu_preflight") for a in argv[:3]):
                    found[int(marks[0])] = pid
            return found

        deadline = started + (FAKE_WAIT if lib else REAL_WAIT)
        while time.monotonic() < deadline:
            seen.drain(sink, 0.2)
            if proc.poll() is not None:
                break
            hold()
            open_lines = [l for l in self.lines if not ended(l.command)]
            if not open_lines and (not control or seen.count("END", CONTROL)):
                time.sleep(GRACE)
                seen.drain(sink, 0.2)
                break
            if state != "ready" and all(l.waits for l in open_lines):
                # every line still open waits: all the others have ended
                alive = waiting()
                open_numbers = set(l.number for l in open_lines)
                if open_numbers <= set(alive) and not seen.killed:
                    time.sleep(1.0)     # into a --wait pause
                    for number in open_numbers:
                        seen.killed[alive[number]] = number
                        os.kill(alive[number], signal.SIGTERM)
        waited = time.monotonic() - started
        stop()
        seen.drain(sink, 0.1)

        cron_log.flush()
        with open(os.path.join(work, "cron.out"), "rb") as handle:
            seen.cron_said = handle.read().decode("utf-8", "replace")
        if os.path.exists(mailed):
            with open(mailed, "rb") as handle:
                seen.mailed = handle.read().decode("utf-8", "replace")
        if os.path.exists(record):
            with open(record) as handle:
                seen.records = [tuple(l.split(" ", 2)) for l in handle.read().splitlines()]
        seen.records = [(n, int(pid), path) for n, pid, path in seen.records]
        seen.diagnosis = (
            "\n[%s] after %.1f s (faketime %s, offset %+d s); SIGTERM sent to %r;"
            "\nentries:\n%s\nnamespace setup and cron printed:\n%s\nmailed: %r"
            "\nsyslog got:\n%s" % (
                state, waited, lib or "absent", offset, seen.killed,
                "".join(l.entry() for l in self.lines), seen.cron_said,
                seen.mailed, "\n".join(seen.raw)))

        d = seen.diagnosis
        self.assertTrue(any(tag == "cron" for pri, tag, pid, msg in seen.received),
                        "cron did not start or its /dev/log is not ours" + d)
        for line in self.lines:
            self.assertEqual(len(seen.pids(line.command)), by_command[line.command],
                             "cron did not run %r once" % line + d)
            self.assertTrue(ended(line.command), "%r did not end" % line + d)
        # nothing printed, so nothing mailed: only the control line's output
        readme_pids = set(p for line in self.lines for p in seen.pids(line.command))
        discarded = [pid for pid, msg in seen.cron() if "discarding output" in msg]
        printed = sorted(set(text for pid, text in seen.jobs("CMD")
                             if pid in discarded and pid in readme_pids))
        self.assertEqual(printed, [], "README lines printed something (cron mails "
                         "it where an MTA is installed)" + d)
        self.assertNotIn("gpu_preflight", seen.mailed, d)
        if control:
            control_pids = seen.pids(CONTROL)
            self.assertEqual(len(control_pids), 1, d)
            if mta:
                self.assertIn("gpfl-readme-control", seen.mailed, d)
            else:
                self.assertEqual(discarded, control_pids, "cron's discarding line "
                                 "not seen for the control line's output" + d)
        return seen


if __name__ == "__main__":
    unittest.main()
