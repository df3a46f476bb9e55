"""A real Debian cron daemon runs /etc/cron.d entries that call the real script.

This proves gpu_preflight works in cron's own environment (HOME, LOGNAME,
PATH=/usr/bin:/bin and SHELL only; no TTY; C locale; Debian's /usr/bin/python3):
the job after `&&` (and in run-the-job mode the COMMAND after `--`) runs when
the service is ready and never when it is not, nothing is printed (so nothing
is mailed), and the script's one syslog line reaches /dev/log.

/usr/sbin/cron runs inside `unshare --mount --propagation private`, where:
  - /dev is a fresh tmpfs with null, zero, full, random, urandom and tty bound
    back, a private /dev/shm, and the test's datagram socket bound onto /dev/log,
    so cron's own log lines and the script's default syslog address both reach
    the test, and the real /dev is never touched;
  - /etc/gpu_preflight.conf, where the machine has one, is covered by an empty
    one (a test never reads the machine's config);
  - /etc/cron.d is a private directory holding only this test's file (so the
    machine's other cron jobs never run here, and nothing is left in the real
    /etc/cron.d), /etc/crontab an empty file, /var/spool/cron/crontabs an empty
    directory, and /run a tmpfs (cron's /run/crond.pid cannot clash with a
    cron already running on the machine);
  - libfaketime (Debian package faketime) is preloaded into cron only, with an
    offset that puts cron's clock about 5 s before a minute boundary, so the
    entries run after about 6 s instead of up to a minute. cron builds each
    job's environment from scratch, so the jobs themselves run on the real
    clock. Without libfaketime (outside CI) the test waits for the real minute.

The mounts vanish with the namespace when cron exits. All four entries are
installed at once and cron runs once per suite run (ONCE: tests/run.py runs
it in its once run, not under each interpreter). Needs root; in CI (CI=true) a missing tool fails the test.
"""

import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sysconfig
import tempfile
import time
import unittest

import support
from ollama_emu import Emulator, free_port

# Debian's interpreter: cron's PATH is /usr/bin:/bin, pyenv is not on it.
DEBIAN_PYTHON = "/usr/bin/python3"
ENTRY_FILE = "gpu-preflight-test"        # cron ignores cron.d names with a dot
FAKE_WAIT = 30.0                         # faketime: the entries run after ~3 s
REAL_WAIT = 75.0                         # the real clock: up to 61 s
GRACE = 2.0                              # after every job ended, for late lines

# Run by /bin/sh inside the new mount namespace; $1 work dir, $2 syslog socket,
# $3 cron, $4 libfaketime or "", $5 offset in seconds. NAMESPACE_MOUNTS and
# CRON_EXEC apart, so that once_cron_readme.py adds mounts of its own.
NAMESPACE_MOUNTS = r"""
set -e
work=$1 sock=$2 cron=$3 lib=$4 offset=$5
mkdir "$work/olddev"
mount --rbind /dev "$work/olddev"
mount -t tmpfs -o mode=0755,nosuid tmpfs /dev
for node in null zero full random urandom tty; do
    : > "/dev/$node"
    mount --bind "$work/olddev/$node" "/dev/$node"
done
umount -l "$work/olddev"
mkdir -m 1777 /dev/shm
ln -s /proc/self/fd /dev/fd
ln -s /proc/self/fd/0 /dev/stdin
ln -s /proc/self/fd/1 /dev/stdout
ln -s /proc/self/fd/2 /dev/stderr
: > /dev/log
mount --bind "$sock" /dev/log
mount --bind "$work/cron.d" /etc/cron.d
if [ -e /etc/crontab ]; then mount --bind "$work/crontab" /etc/crontab; fi
if [ -d /var/spool/cron/crontabs ]; then
    mount --bind "$work/spool" /var/spool/cron/crontabs
fi
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run
"""
# This test's own: the machine's config is covered (once_cron_readme.py
# plants the README's there before NAMESPACE_MOUNTS).
HIDE_CONFIG = r"""
if [ -e /etc/gpu_preflight.conf ]; then
    printf '[gpu_preflight]\n' > "$work/gpu_preflight.conf"
    mount --bind "$work/gpu_preflight.conf" /etc/gpu_preflight.conf
fi
"""
CRON_EXEC = r"""
if [ -n "$lib" ]; then
    exec /usr/bin/env LD_PRELOAD="$lib" FAKETIME="+${offset}s" "$cron" -f -L 15
fi
exec "$cron" -f -L 15
"""
NAMESPACE_SETUP = NAMESPACE_MOUNTS + HIDE_CONFIG + CRON_EXEC

# <PRI>Mmm dd hh:mm:ss TAG[PID]: MSG, as glibc's syslog() and the script send it
SYSLOG_RE = re.compile(r"^<(\d+)>[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d "
                       r"([^\s\[]+)\[(\d+)\]: (.*)$", re.S)
USER_INFO, USER_WARNING = 1 * 8 + 6, 1 * 8 + 4


def find_libfaketime():
    """libfaketime.so.1 from Debian's faketime package, or None."""
    dirs = []
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        dirs.append("/usr/lib/%s/faketime" % multiarch)
    dirs.extend(sorted(glob.glob("/usr/lib/*-linux-gnu*/faketime")))
    dirs.extend(["/usr/lib/faketime", "/usr/lib64/faketime",
                 "/usr/local/lib/faketime"])
    for folder in dirs:
        path = os.path.join(folder, "libfaketime.so.1")
        if os.path.isfile(path):
            return path
    return None


def need(testcase, ok, message):
    """Skip when a precondition is missing; in CI fail instead."""
    if ok:
        return
    if support.IN_CI:
        testcase.fail(message + " (CI=true)")
    raise unittest.SkipTest(message)


class Entry(object):
    """One /etc/cron.d line: its command runs in a subshell whose stdout and
    stderr go to a file of its own, so printing anything is visible."""

    def __init__(self, name, work, host, command, ready):
        self.name, self.host, self.ready = name, host, ready
        self.marker = os.path.join(work, name + ".marker")
        self.out = os.path.join(work, "out." + name)
        self.command = command(self.marker)
        # cron passes the line to /bin/sh; a literal % must be written \%
        self.line = ("* * * * * root ( %s ) >>%s 2>&1\n"
                     % (self.command, shlex.quote(self.out))).replace("%", "\\%")


class CronTest(unittest.TestCase):
    maxDiff = None
    ONCE = True     # cron runs Debian's python3 whatever runs the suite: once a run

    def test_cron_runs_the_job_only_when_ready(self):
        need(self, os.geteuid() == 0, "a real cron test needs root")
        cron = support.require_tool(self, "cron", "/usr/sbin/cron")
        unshare = support.require_tool(self, "unshare", "/usr/bin/unshare")
        support.require_tool(self, "mount", "/usr/bin/mount")
        need(self, os.access(DEBIAN_PYTHON, os.X_OK),
             "%s (Debian's python3) is not installed" % DEBIAN_PYTHON)
        try:
            lib = support.require_tool(self, "faketime (libfaketime.so.1)",
                                       find_libfaketime())
        except unittest.SkipTest:       # outside CI: wait for the real minute
            lib = None
        probe = subprocess.call([unshare, "--mount", "--propagation", "private",
                                 "true"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        need(self, probe == 0, "cannot create a mount namespace (unshare --mount)")

        work = tempfile.mkdtemp(prefix="gpfl-cron-")
        self.addCleanup(shutil.rmtree, work, True)
        for folder in ("cron.d", "spool"):
            os.mkdir(os.path.join(work, folder))
        open(os.path.join(work, "crontab"), "w").close()
        sink = support.SyslogSink()
        self.addCleanup(sink.close)
        ready_emu = Emulator(mode="healthy").start()
        self.addCleanup(ready_emu.stop)
        run_emu = Emulator(mode="healthy").start()
        self.addCleanup(run_emu.stop)

        script = shlex.quote(support.SCRIPT)

        def preflight(host, tail):
            return lambda marker: "%s %s --host %s %s" % (
                DEBIAN_PYTHON, script, shlex.quote(host), tail(shlex.quote(marker)))

        refused = ["127.0.0.1:%d" % free_port() for _ in range(2)]
        while refused[0] == refused[1]:
            refused[1] = "127.0.0.1:%d" % free_port()
        and_touch = lambda marker: "&& touch " + marker
        run_touch = lambda marker: "-- /usr/bin/touch " + marker
        entries = [
            Entry("ready", work, ready_emu.url, preflight(ready_emu.url, and_touch), True),
            Entry("failed", work, "http://" + refused[0],
                  preflight(refused[0], and_touch), False),
            Entry("run", work, run_emu.url, preflight(run_emu.url, run_touch), True),
            Entry("run-failed", work, "http://" + refused[1],
                  preflight(refused[1], run_touch), False),
        ]
        # A control entry that prints, to show that cron's "discarding output"
        # line would be seen; only where no MTA would mail it for real.
        control = None
        if not os.path.exists("/usr/sbin/sendmail"):
            control = "echo gpu-preflight-cron-control"
        path = os.path.join(work, "cron.d", ENTRY_FILE)
        with open(path, "w") as handle:
            for entry in entries:
                handle.write(entry.line)
            if control:
                handle.write("* * * * * root %s\n" % control)
        os.chmod(path, 0o644)           # root-owned, else cron ignores it

        # Put cron's clock ~5 s before a minute boundary: cron must be set up
        # and running by then, on a machine loaded by the other interpreters.
        offset = int(round((55.0 - time.time()) % 60.0)) if lib else 0
        cron_log = open(os.path.join(work, "cron.out"), "wb")
        self.addCleanup(cron_log.close)
        started = time.monotonic()
        proc = subprocess.Popen(
            [unshare, "--mount", "--propagation", "private", "/bin/sh", "-c",
             NAMESPACE_SETUP, "sh", work, sink.path, cron, lib or "", str(offset)],
            stdin=subprocess.DEVNULL, stdout=cron_log, stderr=subprocess.STDOUT,
            cwd="/", start_new_session=True)
        self.addCleanup(self.stop_cron, proc)

        received = []                   # (pri, tag, pid, msg)
        raw = []

        def drain(wait):
            for datagram in sink.messages(wait):
                raw.append(datagram)
                match = SYSLOG_RE.match(datagram)
                if match:
                    received.append((int(match.group(1)), match.group(2),
                                     int(match.group(3)), match.group(4)))

        def cron_lines():
            return [(pid, msg) for pri, tag, pid, msg in received if tag == "CRON"]

        def job_pids(entry):
            """cron's pids for the entry's runs: 'CRON[pid]: (root) CMD (...)'."""
            return [pid for pid, msg in cron_lines()
                    if msg.startswith("(root) CMD (") and entry.marker in msg]

        def ended(text):
            return any(msg.startswith("(root) END (") and text in msg
                       for pid, msg in cron_lines())

        def script_lines(entry):
            return [(pri, tag, pid, msg) for pri, tag, pid, msg in received
                    if tag == "gpu_preflight"
                    and support.parse_fields(msg).get("host") == entry.host]

        deadline = started + (FAKE_WAIT if lib else REAL_WAIT)
        while time.monotonic() < deadline:
            drain(0.2)
            if proc.poll() is not None:
                break
            if (all(ended(e.marker) and script_lines(e) for e in entries)
                    and (control is None or ended(control))):
                time.sleep(GRACE)
                drain(0.2)
                break
        waited = time.monotonic() - started
        self.stop_cron(proc)
        drain(0.1)

        cron_log.flush()
        with open(os.path.join(work, "cron.out"), "rb") as handle:
            cron_said = handle.read().decode("ascii", "replace")
        diagnosis = "\nafter %.1f s (faketime %s, offset %+d s); cron printed %r;" \
                    " syslog got:\n%s" % (waited, lib or "absent", offset, cron_said,
                                           "\n".join(raw))
        self.assertTrue(any(tag == "cron" for pri, tag, pid, msg in received),
                        "cron did not start or its /dev/log is not ours" + diagnosis)

        if control:
            with self.subTest(entry="control"):
                pids = [pid for pid, msg in cron_lines()
                        if msg.startswith("(root) CMD (") and control in msg]
                self.assertEqual(len(pids), 1, "the control entry did not run once"
                                 + diagnosis)
                self.assertIn((pids[0], "(CRON) info (No MTA installed, "
                                        "discarding output)"),
                              cron_lines(), "cron's discarding line not seen for output"
                              + diagnosis)

        for entry in entries:
            with self.subTest(entry=entry.name):
                pids = job_pids(entry)
                self.assertEqual(len(pids), 1, "cron did not run %r once" % entry.line
                                 + diagnosis)
                self.assertTrue(ended(entry.marker), "the job did not end" + diagnosis)
                about_output = [msg for pid, msg in cron_lines()
                                if pid == pids[0] and "output" in msg]
                self.assertEqual(about_output, [], "cron had output to mail/discard")
                printed = None
                if os.path.exists(entry.out):
                    with open(entry.out, "rb") as handle:
                        printed = handle.read()
                self.assertEqual(printed, b"", "the job printed something")
                failures = [msg for pid, msg in cron_lines()
                            if pid == pids[0] and "failed with exit status" in msg]

                lines = script_lines(entry)
                self.assertEqual(len(lines), 1, "want one syslog line for host=%s"
                                 % entry.host + diagnosis)
                pri, tag, pid, msg = lines[0]
                fields = support.parse_fields(msg)
                if entry.ready:
                    self.assertTrue(os.path.exists(entry.marker),
                                    "the job did not run although ready" + diagnosis)
                    self.assertEqual((pri, fields["result"], fields["code"]),
                                     (USER_INFO, "ready", "0"), msg)
                    self.assertEqual(failures, [], diagnosis)
                else:
                    self.assertFalse(os.path.exists(entry.marker),
                                     "the job ran although not ready" + diagnosis)
                    self.assertEqual((pri, fields["result"], fields["code"]),
                                     (USER_WARNING, "skip", "69"), msg)
                    self.assertEqual(len(failures), 1, diagnosis)
                    self.assertTrue(failures[0].endswith(
                        " failed with exit status 69)"), failures[0])

        self.assertGreaterEqual(ready_emu.count("POST", "/api/generate"), 1)
        self.assertGreaterEqual(run_emu.count("POST", "/api/generate"), 1)

    @staticmethod
    def stop_cron(proc):
        """Stop cron (its pid is proc's: sh exec'd it) and any job left over."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        try:                            # jobs still running in its session
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        # libfaketime's shared-memory files, should any reach the real /dev/shm
        for name in ("faketime_shm_%d" % proc.pid, "sem.faketime_sem_%d" % proc.pid):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass


if __name__ == "__main__":
    unittest.main()
