"""The README's command lines, run as written, under the real daemons.

Each test boots the machine's own systemd as PID 1 of a container made of
namespaces (tests/daemons.py SystemdContainer: an overlay of / with a tmpfs
on top, fresh /run, /tmp and /dev, read-only /proc/sys and /sys, its own
loopback, capabilities that reach the host's kernel dropped), so that the
README's lines run on what looks like a freshly booted Debian host: journald
behind /dev/log, Debian's cron and rsyslog units where a test starts them,
`sh install.sh` writing the real /usr/local and /etc of that container. Its
127.0.0.1:11434 is the Ollama emulator (tests/ollama_emu.py, started here in
the container's network namespace only). Nothing reaches the machine.

What is run, and what is substituted (said where it happens):
  - "Quick start": its ```sh block, line by line. `sudo sh install.sh` runs
    as written where sudo exists; where it does not (this container is
    root's already) the line runs without its `sudo `. The check line must
    print the ready line and `exit 0`. `sudoedit /etc/cron.d/gpu-batch`
    cannot be typed into by a test: the ```cron block under it is written to
    that file (root's, 0644), and Debian's cron.service, started by the
    container's systemd with libfaketime moving cron's clock (a drop-in:
    5 s before the line's next */30), runs it: the job runs, cron logs it.
    `journalctl -t gpu_preflight --since today` then runs as written and
    shows the ready lines of the run by hand and of cron's; its alternative
    `grep gpu_preflight /var/log/syslog` runs as written against Debian's
    rsyslog.service, started from the beginning as on a real host.
  - "Try it": the ```sh block's lines, as written, from the checkout, in a
    container without /etc/gpu_preflight.conf; their output (stdout and
    stderr together, as a terminal shows them) must be the ```text block's
    lines once ports, `*_ms` figures are normalised; the exit codes are its
    `exit N` lines.
  - The systemd units (```ini blocks starting "# /etc/systemd/system/"):
    written where their first line says, loaded by the real systemd, started
    with `systemctl start`: the README's ExecCondition= and ExecStart= run
    as systemd runs them. Ready: the job runs. Model missing (78) and busy
    (75, after the unit's own `--wait 45`): the unit is skipped
    (Result=exec-condition), not failed, and the job never runs. The timer's
    next run is 02:00 to 02:10 local time. No emulation of systemd's rules.
  - Install variants: `sh install.sh --prefix "$HOME/.local" --sysconfdir
    "$HOME/.config"` by a user made in the container (the tool then reads
    that config file); the packager's `DESTDIR="$pkgdir" PREFIX=/usr sh
    install.sh --python /usr/bin/python3`, its tree copied to / as a package
    manager would (module's mtime changed), run without rewriting its cache.
  - The OpenAI example `--api openai --host http://gpu1:8000 ...`: as
    written, with `gpu1` resolving to 127.0.0.1 through the container's
    /etc/hosts and the vLLM emulator (tests/openai_emu.py) on port 8000.
  - The GPU example `--gpu --min-free-mib 20000 --max-util 30`: as written,
    with the fake libnvidia-ml.so.1 (tests/fake_nvml.c) installed in the
    container's /usr/lib/<multiarch>/, where the driver's library goes; it
    lists the emulator's model runner as a process on the GPU.
  - The `GPU_PREFLIGHT_TOKEN_FILE=/etc/gpu_preflight.token ... --api auto
    --host https://llm.example.org` example: as written, with
    llm.example.org resolving to 127.0.0.1 (/etc/hosts), the test CA
    appended to the container's system bundle
    (/etc/ssl/certs/ca-certificates.crt), a certificate for that name, and
    the vLLM emulator requiring the token behind a TLS proxy on port 443;
    the token file root's 0600. A wrong token: 78, no job, no token in
    the journal.
Not run here: the `--gpu-id GPU-8f3a,1` line (no fake GPU has that UUID;
parsed by tests/test_recipes.py).

Needs root, unshare/nsenter/setpriv/pivot_root, a writable cgroup2, the
machine's systemd, cron, rsyslog, faketime, gcc; in CI a missing one fails.
Run once per suite under /usr/bin/python3 (tests/run.py).
"""

import os
import re
import select
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import time
import unittest

import daemons
import fakes
import support
import test_cron
import tls_util

README = os.path.join(support.REPO, "README.md")
PYTHON = test_cron.DEBIAN_PYTHON          # the host's python3, as root's PATH finds it
OLLAMA_EMU = os.path.join(support.TESTS, "ollama_emu.py")
OPENAI_EMU = os.path.join(support.TESTS, "openai_emu.py")
COMMAND = "/usr/local/bin/gpu_preflight"
RECORD = "/var/tmp/gpfl-jobs"           # where the container's jobs note their runs
JOB = """#!/bin/sh
# a job the README names: notes that it ran, prints nothing
printf '%%s uid=%%s invocation=%%s\\n' "$0" "$(id -u)" "${INVOCATION_ID:-}" >> %s
"""
CRON_WAIT = 30.0                        # faketime: cron's line runs after ~6 s
TOKEN = "gpfl-readme-token-7f3c9a2e41"  # the bearer token of the TLS example
#: Run by the container's python3 in its network namespace: the vLLM
#: emulator (requiring TOKEN) behind a TLS proxy on 127.0.0.1:443 with a
#: certificate for llm.example.org. argv: tests dir, cert, key, token.
TLS_SERVER = r"""
import signal, sys, threading
sys.path.insert(0, sys.argv[1])
from openai_emu import OpenAIEmulator
from tls_util import TLSProxy
emu = OpenAIEmulator(flavour="vllm", token=sys.argv[4], port=0).start()
proxy = TLSProxy(emu.url, sys.argv[2], sys.argv[3], port=443).start()
print("tls vllm: %s backend=%s" % (proxy.url, emu.url))
sys.stdout.flush()
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *args: done.set())
while not done.wait(0.2):
    pass
proxy.stop()
emu.stop()
"""
USER = "gpfluser"                       # made in the container's /etc/passwd
USER_PATH = "/usr/local/bin:/usr/bin:/bin"   # Debian's PATH for a user login


def readme_text():
    with open(README) as handle:
        return handle.read()


def readme_sections():
    """{"## heading": text up to the next ## heading} of README.md."""
    text = readme_text()
    parts = re.split(r"^(## .*)$", text, flags=re.M)
    return dict((parts[i].strip(), parts[i + 1]) for i in range(1, len(parts) - 1, 2))


def blocks(text):
    """[(info string, body)] of the fenced blocks in text, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)  # novermin


def section_blocks(heading):
    sections = readme_sections()
    if heading not in sections:
        raise AssertionError("README.md has no section %r" % heading)
    return blocks(sections[heading])


def command_lines(body):
    """The non-empty, non-comment lines of a ```sh block."""
    return [line for line in body.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def read_line(proc, timeout, what):
    """The first line proc prints (stdout), within timeout s."""
    ends_at = time.monotonic() + timeout
    data = b""
    while b"\n" not in data:
        left = ends_at - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            raise AssertionError("%s printed nothing within %ss: %r" % (what, timeout, data))
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            raise AssertionError("%s exited %s: %r" % (what, proc.wait(), data))
        data += chunk
    return data.split(b"\n", 1)[0].decode("utf-8", "replace")


def read_bytes(path):
    with open(path, "rb") as handle:
        return handle.read()


def stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout:
        proc.stdout.close()


class ContainerCase(unittest.TestCase):
    """A fresh container per test."""

    maxDiff = None

    def setUp(self):
        daemons.need(os.geteuid() == 0, "the container needs root")
        for tool in ("unshare", "nsenter", "setpriv", "pivot_root", "mount"):
            daemons.need(shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin"),
                         "%s (util-linux) is not installed" % tool)
        daemons.need(os.access(daemons.SYSTEMD, os.X_OK),
                     "%s is not installed (Debian package systemd)" % daemons.SYSTEMD)
        daemons.need(os.access(PYTHON, os.X_OK), "%s is not installed" % PYTHON)
        parent = daemons.cgroup2_dir()
        daemons.need(parent is not None and os.access(parent, os.W_OK),
                     "no writable cgroup2 directory (the container's cgroup goes there)")
        self.work = tempfile.mkdtemp(prefix="gpfl-readme-ctr-")
        self.addCleanup(shutil.rmtree, self.work, True)
        os.chmod(self.work, 0o755)
        self.container = daemons.SystemdContainer(self.work)
        self.addCleanup(self.container.close)
        self.container.start()

    # -- running things in the container

    def line(self, text, env=None, cwd=support.REPO, timeout=120):
        """A README command line, as written, through /bin/sh: (status, output)."""
        return self.container.run(["/bin/sh", "-c", text], env=env, cwd=cwd,
                                  timeout=timeout, check=False, status=True)

    def sh(self, script, **kwargs):
        return self.container.sh(script, **kwargs)

    def ollama(self, *args):
        """The Ollama emulator on 127.0.0.1:11434 of the container (unless
        --port is given): its process, with .url."""
        args = list(args)
        if "--port" not in args:
            args = ["--port", "11434"] + args
        return self.server([PYTHON, OLLAMA_EMU] + args, "ollama emulator")

    def server(self, argv, name):
        """An emulator (argv) in the container's network namespace, stopped
        at cleanup: its process once it printed "NAME: URL ...", with .url."""
        proc = subprocess.Popen(self.container.netns_argv(argv), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd="/",
                                start_new_session=True)
        self.addCleanup(stop, proc)
        first = read_line(proc, 15, name)
        match = re.match(r"^%s: (https?://\S+) " % name, first)
        self.assertTrue(match, first)
        proc.url = match.group(1)
        return proc

    def write(self, inside, text, mode=0o644):
        """A root-owned file in the container (its directories made 0755)."""
        path = self.container.path(inside)
        folder = os.path.dirname(path)
        if not os.path.isdir(folder):
            os.makedirs(folder, 0o755)
        with open(path, "w") as handle:
            handle.write(text)
        os.chown(path, 0, 0)
        os.chmod(path, mode)

    def read(self, inside):
        path = self.container.path(inside)
        if not os.path.exists(path):
            return None
        with open(path) as handle:
            return handle.read()

    def job(self, inside):
        self.write(inside, JOB % shlex.quote(RECORD), 0o755)

    def runs(self, inside):
        """The runs RECORD noted for the job at `inside`."""
        return [line for line in (self.read(RECORD) or "").splitlines()
                if line.split(" ", 1)[0] == inside]

    def install(self):
        """The product installed as the Quick start installs it."""
        status, out = self.line(sudo_less(self.quick_start_lines()[0], self.has_sudo()))
        self.assertEqual(status, 0, out)
        return out

    def has_sudo(self):
        return self.line("command -v sudo")[0] == 0

    @staticmethod
    def quick_start_lines():
        found = [body for info, body in section_blocks("## Quick start") if info == "sh"]
        if not found:
            raise AssertionError("no ```sh block under ## Quick start")
        return command_lines(found[0])

    def journal(self, *args):
        return self.container.run(["journalctl", "--no-pager"] + list(args), check=False)


def sudo_less(line, has_sudo):
    """The line, or without its leading `sudo ` where sudo is absent: the
    container's shell is root's already (the only change to any line)."""
    if line.startswith("sudo ") and not has_sudo:
        return line[len("sudo "):]
    return line


def fields_of(line):
    """key=value fields of a gpu_preflight log line (after its "TAG[pid]: ")."""
    return support.parse_fields(line.split(": ", 1)[1] if ": result=" in line else line)


class QuickStartTest(ContainerCase):

    def test_quick_start_line_by_line_on_a_fresh_host(self):
        lines = self.quick_start_lines()
        kinds = [("install", r"^(sudo )?sh install\.sh\b"),
                 ("check", r"^/usr/local/bin/gpu_preflight .*; echo \"exit \$\?\""),
                 ("edit", r"^sudoedit /etc/cron\.d/\S+"),
                 ("journal", r"^journalctl -t gpu_preflight\b")]
        self.assertEqual(len(lines), len(kinds), lines)
        for line, (kind, pattern) in zip(lines, kinds):
            self.assertRegex(line, pattern, "the Quick start's %s line" % kind)
        install, check, edit, journal = lines
        syslog_line = re.search(r"# or: (grep gpu_preflight /var/log/syslog)$", journal)
        self.assertTrue(syslog_line, journal)

        # a real host's syslog daemon, from the beginning (Debian's unit)
        support.require_tool(self, "rsyslogd", "/usr/sbin/rsyslogd")
        self.sh("systemctl start rsyslog.service")
        self.ollama()

        with self.subTest(line=install):
            has_sudo = self.has_sudo()
            status, out = self.line(sudo_less(install, has_sudo))
            self.assertEqual(status, 0, out)
            self.assertRegex(out, r"(?m)^gpu_preflight \S+ \(Python \S+\)$", out)
            launcher = self.read(COMMAND)
            self.assertTrue(launcher and launcher.startswith("#!/usr/bin/python3 -I\n"),
                            "root's python3 is Debian's: %r" % launcher)
            self.assertIn("[gpu_preflight]", self.read("/etc/gpu_preflight.conf") or "")

        with self.subTest(line=check):
            status, out = self.line(check)
            self.assertEqual(status, 0, out)
            printed = out.splitlines()
            self.assertEqual(printed[-1], "exit 0", out)
            ready = [l for l in printed if l.startswith("gpu_preflight: result=")]
            self.assertEqual(len(ready), 1, out)
            fields = fields_of(ready[0])
            self.assertEqual((fields["result"], fields["code"], fields["host"],
                              fields["model"]),
                             ("ready", "0", "http://127.0.0.1:11434", "llama3.2:latest"), out)
            self.assertIn("gpu_preflight: config file /etc/gpu_preflight.conf", printed)

        with self.subTest(line=edit):
            # sudoedit needs someone to type: the cron block below it goes in
            cron_file = edit.split()[1]
            cron_blocks = [body for info, body in section_blocks("## Quick start")
                           if info == "cron"]
            self.assertEqual(len(cron_blocks), 1, "the Quick start's ```cron block")
            self.assertTrue(cron_blocks[0].startswith("# %s:" % cron_file),
                            "the cron block names %s first" % cron_file)
            entry = [l for l in command_lines(cron_blocks[0])]
            self.assertEqual(len(entry), 1, cron_blocks[0])
            job = re.search(r"&& (/\S+)$", entry[0]).group(1)
            self.job(job)
            self.write(cron_file, cron_blocks[0])
            self.run_cron_until(job, entry[0])

        with self.subTest(line=journal):
            status, out = self.line(journal)
            self.assertEqual(status, 0, out)
            ready = [l for l in out.splitlines()
                     if re.match(r"^\w{3} [ \d]\d \d\d:\d\d:\d\d \S+ gpu_preflight\[\d+\]: "
                                 r"result=ready code=0 ", l)]
            self.assertEqual(len(ready), 2, "the run by hand and cron's:\n" + out)

        with self.subTest(line=syslog_line.group(1)):
            status, out = self.line(syslog_line.group(1))
            self.assertEqual(status, 0, out)
            ready = [l for l in out.splitlines()
                     if re.search(r" gpu_preflight\[\d+\]: result=ready code=0 ", l)]
            self.assertEqual(len(ready), 2, "the run by hand and cron's:\n" + out)

    def run_cron_until(self, job, entry):
        """Debian's cron.service, its clock 5 s before the next :00 or :30
        (libfaketime, in a drop-in); wait until it ran `job` once."""
        lib = support.require_tool(self, "faketime (libfaketime.so.1)",
                                   test_cron.find_libfaketime())
        support.require_tool(self, "cron", "/usr/sbin/cron")
        now = time.time()
        local = now + time.localtime(now).tm_gmtoff
        offset = int(round((1795.0 - local % 1800.0) % 1800.0))
        self.write("/etc/systemd/system/cron.service.d/gpfl-faketime.conf",
                   "[Service]\nEnvironment=LD_PRELOAD=%s FAKETIME=+%ds\n" % (lib, offset))
        self.sh("systemctl daemon-reload && systemctl start cron.service")
        try:
            daemons.wait_for("cron to run %s" % job, lambda: self.runs(job), CRON_WAIT)
        except AssertionError as exc:
            raise AssertionError("%s\nentry: %s\ncron's journal:\n%s" % (
                exc, entry, self.journal("-u", "cron.service")))
        time.sleep(1.0)
        self.assertEqual(len(self.runs(job)), 1, self.read(RECORD))
        cron_said = self.journal("-u", "cron.service", "-o", "cat")
        self.assertRegex(cron_said, r"\(root\) CMD \(\s*%s\)" % re.escape(
            entry.split(None, 6)[6]), "cron ran the line as written")


class TryItTest(ContainerCase):

    def test_try_it_prints_what_the_readme_shows(self):
        found = section_blocks("## Try it (no GPU needed)")
        kinds = [info for info, body in found]
        self.assertEqual(kinds[:2], ["sh", "text"], "a ```sh block, then its ```text")
        lines = command_lines(found[0][1])
        expected = found[1][1].splitlines()
        self.assertTrue(lines, found)
        # a fresh host: no config file (the text block says so)
        self.sh("rm -f /etc/gpu_preflight.conf")
        for line in lines:
            with self.subTest(line=line):
                ends = [i for i, text in enumerate(expected) if re.match(r"^exit \d+$", text)]
                self.assertTrue(ends, "no `exit N` line left in the ```text block")
                want, expected = expected[:ends[0] + 1], expected[ends[0] + 1:]
                status, out = self.line(line, timeout=60)
                # the `exit N` line is the README's own `echo "exit $?"`: exact
                self.assertEqual(normalise(out.splitlines()), normalise(want), out)
                self.assertEqual(status, 0, out)
        self.assertEqual(expected, [], "```text lines without a command")


def normalise(lines):
    """Lines with what varies from run to run replaced: ports, *_ms figures."""
    out = []
    for line in lines:
        line = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", line)
        line = re.sub(r"\b(\w+_ms)=\d+", r"\1=N", line)
        out.append(line)
    return out


class UnitsTest(ContainerCase):

    def units(self):
        found = [(body.split("\n", 1)[0][2:], body)
                 for info, body in blocks(readme_text())
                 if info == "ini" and body.startswith("# /etc/systemd/system/")]
        self.assertEqual(sorted(os.path.basename(path) for path, _ in found),
                         ["gpu-nightly.service", "gpu-nightly.timer"])
        return dict((os.path.basename(path), (path, body)) for path, body in found)

    def readme_status_words(self):
        """The `...` in the README's "(`systemctl status` shows `A` and `B`)"."""
        text = " ".join(readme_text().split())
        match = re.search(r"\(`systemctl status` shows ((?:`[^`]+`(?: and |, )?)+)\)", text)
        self.assertTrue(match, "the README's sentence on what systemctl status shows")
        return re.findall(r"`([^`]+)`", match.group(1))

    def start_unit(self, name):
        """systemctl start NAME: (status, seconds, the unit's properties)."""
        started = time.monotonic()
        status, out = self.container.run(["systemctl", "start", name], check=False,
                                         status=True, timeout=120)
        took = time.monotonic() - started
        props = dict(line.split("=", 1) for line in self.container.run(
            ["systemctl", "show", name, "-p", "Result", "-p", "ActiveState",
             "-p", "ConditionResult", "-p", "ExecMainStatus"]).splitlines() if "=" in line)
        props["status"] = self.container.run(["systemctl", "status", "--no-pager", name],
                                             check=False)
        props["start_output"] = out
        return status, took, props

    def test_units_run_as_systemd_runs_them(self):
        units = self.units()
        service_path, service = units["gpu-nightly.service"]
        timer_path, timer = units["gpu-nightly.timer"]
        lines = dict(re.findall(r"^(Exec\w+)=(.*)$", service, re.M))
        self.assertEqual(sorted(lines), ["ExecCondition", "ExecStart"], service)
        job = shlex.split(lines["ExecStart"])[0]
        self.install()
        self.job(job)
        self.write(service_path, service)
        self.write(timer_path, timer)
        self.sh("systemctl daemon-reload")
        self.assertEqual(self.container.run(["systemctl", "show", "gpu-nightly.service",
                                             "-p", "TimeoutStartUSec", "--value"]).strip(),
                         "6h", "TimeoutStartSec= bounds the whole start")

        # the timer first, as on a host: it holds the service, whose last
        # result `systemctl status` then shows (an unreferenced unit is
        # unloaded, its result with it)
        with self.subTest(unit="gpu-nightly.timer"):
            self.sh("systemctl enable --now gpu-nightly.timer")
            props = dict(line.split("=", 1) for line in self.container.run(
                ["systemctl", "show", "gpu-nightly.timer", "-p", "Triggers",
                 "-p", "NextElapseUSecRealtime", "-p", "ActiveState"]).splitlines())
            self.assertEqual((props["Triggers"], props["ActiveState"]),
                             ("gpu-nightly.service", "active"), props)
            when = re.search(r" (\d\d):(\d\d):\d\d ", props["NextElapseUSecRealtime"])
            self.assertTrue(when, props)
            minutes = int(when.group(1)) * 60 + int(when.group(2))
            self.assertTrue(120 <= minutes <= 130, "OnCalendar=02:00 with up to 10 min "
                            "RandomizedDelaySec: %r" % props)

        with self.subTest(state="ready"):
            emu = self.ollama()
            status, took, props = self.start_unit("gpu-nightly.service")
            self.assertEqual(status, 0, props)
            self.assertEqual((props["Result"], props["ExecMainStatus"]), ("success", "0"),
                             props)
            runs = self.runs(job)
            self.assertEqual(len(runs), 1, "ExecStart= ran once: %r" % runs)
            self.assertRegex(runs[0], r" uid=0 invocation=[0-9a-f]{32}$",
                             "run by systemd (INVOCATION_ID)")
            ready = [l for l in self.journal("-t", "gpu_preflight", "-o", "cat").splitlines()
                     if l.startswith("result=ready code=0 ")]
            self.assertEqual(len(ready), 1, props)
            stop(emu)

        for state, args, code in (("model missing", ["--model", "other:latest"], 78),
                                  ("busy", ["--mode", "busy"], 75)):
            with self.subTest(state=state):
                emu = self.ollama(*args)
                status, took, props = self.start_unit("gpu-nightly.service")
                stop(emu)
                # ExecCondition= 1..254: skipped, not failed; ExecStart= never ran
                self.assertEqual(status, 0, props)
                self.assertEqual((props["Result"], props["ActiveState"]),
                                 ("exec-condition", "inactive"), props)
                self.assertEqual(len(self.runs(job)), 1, "the job ran although skipped")
                self.assertRegex(props["status"], r"ExecCondition=%s \(code=exited, "
                                 r"status=%d(/\w+)?\)" % (re.escape(lines["ExecCondition"]),
                                                         code), props["status"])
                failed = self.container.run(["systemctl", "is-failed",
                                             "gpu-nightly.service"], check=False)
                self.assertEqual(failed.strip(), "inactive", "skipped, not failed")
                last = self.journal("-t", "gpu_preflight", "-o", "cat").splitlines()[-1]
                fields = fields_of(last)
                self.assertEqual((fields["result"], fields["code"]), ("skip", str(code)),
                                 last)
                if code == 75:          # the unit's own --wait 45 rode it out first
                    for shown in self.readme_status_words():
                        self.assertIn(shown, props["status"], "the README says "
                                      "`systemctl status` shows it")
                    self.assertGreater(int(fields.get("attempts", "1")), 1, last)
                    self.assertTrue(40 < took < 65, "took %.1f s: %s" % (took, last))
                said = self.journal("-u", "gpu-nightly.service", "-o", "cat")
                self.assertIn("Skipped due to 'exec-condition'", said)


class InstallVariantsTest(ContainerCase):

    def readme_variant(self, pattern):
        text = " ".join(readme_text().split())
        match = re.search(pattern, text)
        self.assertTrue(match, pattern)
        return match.group(1)

    def test_not_root_install_into_home_and_the_tool_reads_that_config(self):
        line = self.readme_variant(r"Not root: `(sh install\.sh [^`]*)`")
        self.sh("useradd --create-home --shell /bin/sh %s" % USER)
        home = "/home/" + USER
        env = {"HOME": home, "PATH": USER_PATH, "LOGNAME": USER, "USER": USER,
               "SHELL": "/bin/sh", "LANG": "C.UTF-8"}

        def as_user(text):
            return self.container.run(
                ["runuser", "-u", USER, "--", "/usr/bin/env", "-i"] +
                ["%s=%s" % item for item in sorted(env.items())] + ["/bin/sh", "-c", text],
                cwd=support.REPO, check=False, status=True)

        # install.sh's own hint for a user who cannot write /usr/local
        status, out = as_user("sh install.sh")
        self.assertEqual(status, 1, out)
        self.assertIn("    " + line + "\n", out, "install.sh's hint is the README's line")

        status, out = as_user(line)
        self.assertEqual(status, 0, out)
        for path in (home + "/.local/bin/gpu_preflight",
                     home + "/.local/lib/gpu_preflight/gpu_preflight.py",
                     home + "/.config/gpu_preflight.conf"):
            info = os.stat(self.container.path(path))
            self.assertNotEqual(info.st_uid, 0, path)
        # the tool reads that file: its host is the only one that answers
        emu = self.ollama("--port", "0")
        config = self.container.path(home + "/.config/gpu_preflight.conf")
        with open(config, "a") as handle:
            handle.write("host = %s\n" % emu.url)
        status, out = as_user('"$HOME/.local/bin/gpu_preflight" -v; echo "exit $?"')
        self.assertEqual(out.splitlines()[-1], "exit 0", out)
        self.assertIn("gpu_preflight: config file %s/.config/gpu_preflight.conf" % home, out)
        self.assertIn(" host=%s " % emu.url, out)

    def test_packagers_destdir_line_installs_a_tree_whose_cache_is_used(self):
        line = self.readme_variant(r"Packagers: `(DESTDIR=[^`]*)`")
        pkgdir = "/var/tmp/pkg"
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "HOME": "/root", "LANG": "C.UTF-8", "pkgdir": pkgdir}
        status, out = self.line(line, env=env)
        self.assertEqual(status, 0, out)
        tree = sorted(os.path.relpath(os.path.join(folder, name), self.container.path(pkgdir))
                      for folder, _, names in os.walk(self.container.path(pkgdir))
                      for name in names)
        tag = self.sh("/usr/bin/python3 -c 'import sys; print(sys.implementation.cache_tag)'")
        self.assertEqual(tree, sorted([
            "etc/gpu_preflight.conf", "usr/bin/gpu_preflight",
            "usr/lib/gpu_preflight/gpu_preflight.py",
            "usr/lib/gpu_preflight/__pycache__/gpu_preflight.%s.pyc" % tag.strip()]))
        # unpacked as a package manager would, the module's mtime its own
        self.sh("cp -a %s/. / && touch -d 2020-01-02 /usr/lib/gpu_preflight/gpu_preflight.py"
                % pkgdir)
        pyc = self.container.path("/usr/lib/gpu_preflight/__pycache__/gpu_preflight.%s.pyc"
                                  % tag.strip())
        before = (read_bytes(pyc), os.stat(pyc).st_mtime_ns)
        self.ollama()
        status, out = self.line("/usr/bin/gpu_preflight --model llama3.2 -v")
        self.assertEqual(status, 0, out)
        self.assertEqual((read_bytes(pyc), os.stat(pyc).st_mtime_ns), before,
                         "the cache was rewritten: it was not valid at the final path")


class ExamplesTest(ContainerCase):

    def example(self, pattern):
        found = [line for info, body in blocks(readme_text()) if info == "sh"
                 for line in command_lines(body) if re.search(pattern, line)]
        self.assertEqual(len(found), 1, pattern)
        return found[0]

    def test_openai_line_as_written_with_gpu1_on_loopback(self):
        line = self.example(r"--api openai --host http://gpu1:8000 ")
        model = re.search(r"--model (\S+)", line).group(1)
        job = re.search(r"&& (/\S+)$", line).group(1)
        self.install()
        self.job(job)
        with open(self.container.path("/etc/hosts"), "a") as handle:
            handle.write("127.0.0.1 gpu1\n")        # the container's name for the server
        emu = self.server([PYTHON, OPENAI_EMU, "--flavour", "vllm", "--port", "8000",
                           "--model", model], "openai emulator")
        status, out = self.line(line)
        self.assertEqual((status, out), (0, ""))
        self.assertEqual(len(self.runs(job)), 1)
        stop(emu)
        emu = self.server([PYTHON, OPENAI_EMU, "--flavour", "vllm", "--port", "8000",
                           "--model", "other-model"], "openai emulator")
        status, out = self.line(line)
        self.assertEqual(status, 78, out)
        self.assertEqual(len(self.runs(job)), 1, "the job ran although the model is absent")
        said = [fields_of(l) for l in self.journal("-t", "gpu_preflight", "-o", "cat")
                .splitlines()]
        self.assertEqual([(f["result"], f["api"], f["host"]) for f in said],
                         [("ready", "openai", "http://gpu1:8000"),
                          ("skip", "openai", "http://gpu1:8000")], said)

    def test_tls_token_auto_line_as_written_with_a_ca_in_the_system_store(self):
        line = self.example(r"--api auto --host https://llm\.example\.org ")
        token_file = re.match(r"^GPU_PREFLIGHT_TOKEN_FILE=(\S+) ", line).group(1)
        job = re.search(r"&& (/\S+)$", line).group(1)
        openssl = support.require_tool(self, "openssl")
        ca = tls_util.make_test_ca(os.path.join(self.work, "ca"))
        cert, key = self.named_cert(openssl, ca, "llm.example.org")
        self.install()
        self.job(job)
        # the container's name for the server, and its CA in the system store
        # (Debian's bundle, which OpenSSL's default paths name)
        with open(self.container.path("/etc/hosts"), "a") as handle:
            handle.write("127.0.0.1 llm.example.org\n")
        with open(self.container.path("/etc/ssl/certs/ca-certificates.crt"), "a") as handle:
            handle.write(read_bytes(ca["ca"]).decode("ascii"))
        self.write(token_file, TOKEN + "\n", 0o600)
        self.server([PYTHON, "-c", TLS_SERVER, support.TESTS, cert, key, TOKEN], "tls vllm")
        status, out = self.line(line)
        self.assertEqual((status, out), (0, ""))
        self.assertEqual(len(self.runs(job)), 1)
        self.write(token_file, "not-" + TOKEN + "\n", 0o600)
        status, out = self.line(line)
        self.assertEqual(status, 78, out)
        self.assertEqual(len(self.runs(job)), 1, "the job ran with a token refused")
        said = [fields_of(l) for l in self.journal("-t", "gpu_preflight", "-o", "cat")
                .splitlines()]
        self.assertEqual([(f["result"], f["code"], f.get("api"), f["host"]) for f in said],
                         [("ready", "0", "openai", "https://llm.example.org:443"),
                          ("skip", "78", "openai", "https://llm.example.org:443")], said)
        self.assertIn("check the token", said[1]["reason"])
        self.assertNotIn(TOKEN[:8], self.journal("-t", "gpu_preflight"))

    def named_cert(self, openssl, ca, name):
        """(cert, key) for DNS name `name`, signed by the test CA."""
        folder = ca["dir"]
        ext = os.path.join(folder, "named.cnf")
        with open(ext, "w") as handle:
            handle.write("basicConstraints = critical, CA:FALSE\n"
                         "keyUsage = critical, digitalSignature\n"
                         "extendedKeyUsage = serverAuth\n"
                         "subjectAltName = DNS:%s\n"
                         "subjectKeyIdentifier = hash\n"
                         "authorityKeyIdentifier = keyid\n" % name)
        key, csr, cert = [os.path.join(folder, "named." + ext_) for ext_ in
                          ("key", "csr", "pem")]
        for argv in (["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
                      "-out", key],
                     ["req", "-new", "-key", key, "-subj", "/CN=%s" % name, "-out", csr],
                     ["x509", "-req", "-in", csr, "-CA", ca["ca"], "-CAkey", ca["ca_key"],
                      "-set_serial", "10", "-days", "30", "-sha256", "-extfile", ext,
                      "-out", cert]):
            proc = subprocess.Popen([openssl] + argv, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            out = proc.communicate()[0]
            self.assertEqual(proc.returncode, 0, out)
        return cert, key

    def test_gpu_line_as_written_with_the_fake_driver_library(self):
        line = self.example(r"gpu_preflight --gpu --min-free-mib ")
        job = re.search(r"&& (/\S+)$", line).group(1)
        support.require_tool(self, "cc", shutil.which("cc") or shutil.which("gcc"))
        runners = "/run/fake-gpu-runners"   # the emulator's runners on GPU 0, as NVML lists them
        lib = fakes.build_fake_nvml(os.path.join(self.work, "nvml"), default_mode="free",
                                    default_runners=runners)
        multiarch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
        with open(lib, "rb") as handle:
            self.write_bytes("/usr/lib/%s/libnvidia-ml.so.1" % multiarch, handle.read())
        self.install()
        self.job(job)
        self.ollama("--gpu-file", self.container.path(runners))
        status, out = self.line(line)
        self.assertEqual((status, out), (0, ""))
        self.assertEqual(len(self.runs(job)), 1)
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "HOME": "/root", "FAKE_NVML_MODE": "busy"}   # the fake GPU's state
        status, out = self.line(line, env=env)
        self.assertEqual(status, 75, out)
        self.assertEqual(len(self.runs(job)), 1, "the job ran although the GPU is busy")
        said = [fields_of(l) for l in self.journal("-t", "gpu_preflight", "-o", "cat")
                .splitlines()]
        self.assertEqual([(f["result"], f["code"], f.get("gpu_backend")) for f in said],
                         [("ready", "0", "nvml"), ("skip", "75", "nvml")], said)

    def write_bytes(self, inside, data):
        path = self.container.path(inside)
        with open(path, "wb") as handle:
            handle.write(data)
        os.chown(path, 0, 0)
        os.chmod(path, 0o644)


if __name__ == "__main__":
    unittest.main()
