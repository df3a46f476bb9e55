"""What tests/once_ansible.py, once_puppet.py and once_salt.py share.

Each of those applies the README's recipes for one configuration-management
tool, as written (the fenced blocks are read from README.md, never retyped),
with the real tool, and then proves what the recipe deployed:

  - the files: byte-identical to gpu_preflight.py, with the recipe's modes,
    owned by root; the fast layout's launcher as install.sh writes it, and
    its __pycache__ directory made 0755 by the recipe (as install.sh does);
  - `/usr/local/bin/gpu_preflight --version` runs in cron's environment
    (env -i PATH=/usr/bin:/bin), and in the fast layout leaves the bytecode
    cache beside the module;
  - a second apply changes nothing;
  - the cron entry it wrote is run by the real cron daemon: the job runs (and
    holds the lock named in the entry) when the Ollama emulator is ready, and
    does not run when nothing answers (exit 69 in cron's log).

README blocks are found by their first line: "# <Tool> ...: the plain copy",
"...: the fast layout ...", "...: the cron entry ...".

Nothing on the machine changes: every step runs in a private mount namespace
(`unshare --mount --propagation private`) in which /usr/local, /opt and
/etc/cron.d are bind mounts of directories under a temp dir ("the host") and
/run is a tmpfs. The tools' own state goes to the temp dir too. The cron run
also has a private network namespace (only its own loopback), so the
recipe's entry runs unchanged against Ollama's default address
127.0.0.1:11434: the emulator listens there inside that namespace for the
"ready" run, and nothing does for the "refused" run. cron itself is set up by
tests/test_cron.py's NAMESPACE_SETUP (private /dev with the test's syslog
socket as /dev/log, libfaketime putting cron's clock 5 s before the entry's
next minute).
"""

import glob
import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
import time

import support
import test_cron
from test_recipes import readme_blocks

DEBIAN_PYTHON = test_cron.DEBIAN_PYTHON
COMMAND = "/usr/local/bin/gpu_preflight"
MODULE_DIR = "/usr/local/lib/gpu_preflight"
MODULE = MODULE_DIR + "/gpu_preflight.py"
CACHE_DIR = MODULE_DIR + "/__pycache__"
CRON_FILE = "/etc/cron.d/gpu-batch"
JOB = "/opt/jobs/batch.sh"
OLLAMA_PORT = 11434              # Ollama's default, in the cron run's own netns
CRON_WAIT = 30.0                 # faketime: the entry runs after about 6 s
STEP_TIMEOUT = 300               # one apply of a recipe

# Run by /bin/sh in a new mount namespace: $1 the host dir, then the command.
HOST_SETUP = r"""
set -e
host=$1
shift
mount --bind "$host/usr-local" /usr/local
mount --bind "$host/opt" /opt
mount --bind "$host/cron.d" /etc/cron.d
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run
exec "$@"
"""

# Run by /bin/sh in a new mount and network namespace, before test_cron's
# NAMESPACE_SETUP ($8) makes the rest and execs cron. $1 host dir, $2 syslog
# socket, $3 cron, $4 libfaketime, $5 offset, $6 ip, $7 the emulator's Python
# or "" for no emulator, $9 ollama_emu.py, ${10} its port.
CRON_SETUP = r"""
set -e
host=$1
mount --bind "$host/usr-local" /usr/local
mount --bind "$host/opt" /opt
"$6" link set lo up
if [ -n "$7" ]; then
    "$7" "$9" --port "${10}" >"$host/emulator.out" 2>&1 &
    tries=0
    until grep -q '^ollama emulator: http' "$host/emulator.out"; do
        tries=$((tries + 1))
        if [ "$tries" -gt 100 ]; then
            echo "the emulator did not start:" >&2
            cat "$host/emulator.out" >&2
            exit 1
        fi
        sleep 0.1
    done
fi
exec /bin/sh -c "$8" sh "$1" "$2" "$3" "$4" "$5"
"""


def recipes(tool):
    """{"plain": text, "fast": text, "cron": text} of the README blocks whose
    first line is "# TOOL ...: the plain copy" and so on."""
    found = {}
    kinds = (("plain", ": the plain copy"), ("fast", ": the fast layout"),
             ("cron", ": the cron entry"))
    for info, body in readme_blocks():
        first = body.split("\n", 1)[0]
        if not re.match(r"# %s\b" % tool, first):
            continue
        for kind, words in kinds:
            if words in first:
                if kind in found:
                    raise AssertionError("two README blocks for %s %s" % (tool, kind))
                found[kind] = body
    missing = [kind for kind, _ in kinds if kind not in found]
    if missing:
        raise AssertionError("README.md has no %s block for %s (first line "
                             "'# %s ...: the plain copy' etc.)" % (missing, tool, tool))
    return found


def read(path):
    with open(path, "rb") as handle:
        return handle.read()


def install_sh_launcher(work):
    """The launcher install.sh writes for /usr/local and /usr/bin/python3,
    or None where install.sh installs a plain copy (no launcher)."""
    script = os.path.join(support.REPO, "install.sh")
    if b"launcher()" not in read(script):
        return None
    dest = os.path.join(work, "install-sh")
    proc = subprocess.run(
        ["sh", script, "--destdir", dest, "--prefix", "/usr/local",
         "--python", DEBIAN_PYTHON, "--no-config", "--quiet"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise AssertionError("install.sh failed: %r" % proc.stdout)
    return read(os.path.join(dest, "usr/local/bin/gpu_preflight"))


class Host(object):
    """A fresh host's /usr/local (bin and lib, empty), /opt and /etc/cron.d,
    as directories under one temp dir that the namespaces mount."""

    def __init__(self, testcase):
        self.testcase = testcase
        self.dir = tempfile.mkdtemp(prefix="gpfl-cfg-")
        testcase.addCleanup(shutil.rmtree, self.dir, True)
        for sub in ("usr-local/bin", "usr-local/lib", "opt/jobs", "cron.d", "spool",
                    "state"):
            os.makedirs(os.path.join(self.dir, sub))
        os.chmod(self.dir, 0o755)
        open(os.path.join(self.dir, "crontab"), "w").close()
        self.marker = os.path.join(self.dir, "batch.ran")

    def path(self, system_path):
        """Where a path of the deployed host lies in the temp dir."""
        for prefix, sub in (("/usr/local/", "usr-local/"), ("/opt/", "opt/"),
                            ("/etc/cron.d/", "cron.d/")):
            if system_path.startswith(prefix):
                return os.path.join(self.dir, sub + system_path[len(prefix):])
        raise ValueError(system_path)

    def run(self, argv, env, timeout=STEP_TIMEOUT):
        """Run argv with the host's paths mounted; (status, output text)."""
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
             HOST_SETUP, "sh", self.dir] + list(argv),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=env, cwd=self.dir, start_new_session=True)
        try:
            out = proc.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out = proc.communicate()[0]
            raise AssertionError("%s did not finish in %d s: %s" % (
                argv[0], timeout, out.decode("utf-8", "replace")[-3000:]))
        return proc.returncode, out.decode("utf-8", "replace")

    def write_job(self, lock):
        """/opt/jobs/batch.sh: notes that it ran and whether LOCK was held."""
        script = ("#!/bin/sh\n"
                  "if /usr/bin/flock -n %s true; then held=no; else held=yes; fi\n"
                  "echo \"ran lock-held=$held\" >>%s\n" % (
                      shlex.quote(lock), shlex.quote(self.marker)))
        path = self.path(JOB)
        with open(path, "w") as handle:
            handle.write(script)
        os.chmod(path, 0o755)

    def run_cron(self, ready):
        """Start cron on this host (emulator on 127.0.0.1:11434 when ready),
        wait until the entry has run; (cron lines, script lines, diagnosis)."""
        testcase = self.testcase
        lib = support.require_tool(testcase, "faketime (libfaketime.so.1)",
                                   test_cron.find_libfaketime())
        cron = support.require_tool(testcase, "cron", "/usr/sbin/cron")
        ip = support.require_tool(testcase, "ip", "/usr/sbin/ip")       # iproute2
        if os.path.exists(self.marker):
            os.unlink(self.marker)
        olddev = os.path.join(self.dir, "olddev")   # NAMESPACE_SETUP's, left empty
        if os.path.isdir(olddev):
            os.rmdir(olddev)
        sink = support.SyslogSink()
        testcase.addCleanup(sink.close)
        # Debian's python3 runs the emulator: /usr/local is the host's there
        emulator = DEBIAN_PYTHON if ready else ""
        # cron's clock 5 s before the next local :00 or :30 (the entry's */30):
        # the set-up below (an emulator, mounts, cron) must end before it
        now = time.time()
        local = now + time.localtime(now).tm_gmtoff
        offset = int(round((1795.0 - local % 1800.0) % 1800.0))
        log_path = os.path.join(self.dir, "cron.out")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                ["unshare", "--mount", "--net", "--propagation", "private",
                 "/bin/sh", "-c", CRON_SETUP, "sh", self.dir, sink.path, cron, lib,
                 str(offset), ip, emulator, test_cron.NAMESPACE_SETUP,
                 os.path.join(support.TESTS, "ollama_emu.py"), str(OLLAMA_PORT)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd="/", start_new_session=True)
        testcase.addCleanup(test_cron.CronTest.stop_cron, proc)
        received, raw = [], []
        started = time.monotonic()

        def drain(wait):
            for datagram in sink.messages(wait):
                raw.append(datagram)
                match = test_cron.SYSLOG_RE.match(datagram)
                if match:
                    received.append((int(match.group(1)), match.group(2),
                                     int(match.group(3)), match.group(4)))

        def cron_lines():
            return [(pid, msg) for pri, tag, pid, msg in received if tag == "CRON"]

        def script_lines():
            return [(pri, msg) for pri, tag, pid, msg in received
                    if tag == "gpu_preflight"]

        while time.monotonic() < started + CRON_WAIT:
            drain(0.2)
            if proc.poll() is not None:
                break
            if script_lines() and any(msg.startswith("(root) END (") and COMMAND in msg
                                      for pid, msg in cron_lines()):
                time.sleep(test_cron.GRACE)
                drain(0.2)
                break
        waited = time.monotonic() - started
        test_cron.CronTest.stop_cron(proc)
        drain(0.1)
        diagnosis = "\nafter %.1f s (offset %+d s); cron printed %r; syslog got:\n%s" % (
            waited, offset, read(log_path).decode("utf-8", "replace"), "\n".join(raw))
        return cron_lines(), script_lines(), diagnosis


class DeployChecks(object):
    """The checks, for a unittest.TestCase that also defines:

    TOOL        the README's name for the tool ("Ansible", "Puppet", "Salt")
    prepare()   find the tool (support.require_tool); return anything apply needs
    apply(host, tool, text)
                apply the recipe text (the README blocks joined) to host;
                return (changed, output): changed is True when the tool says
                it changed something, False when it says nothing changed;
                fail the test when the tool reports an error.
    """

    maxDiff = None

    def test_plain_copy(self):
        self.deploy("plain")

    def test_fast_layout(self):
        self.deploy("fast")

    def deploy(self, layout):
        test_cron.need(self, os.geteuid() == 0, "deploying to system paths needs root")
        for name in ("unshare", "mount"):
            support.require_tool(self, name)
        test_cron.need(self, os.access(DEBIAN_PYTHON, os.X_OK),
                       "%s (Debian's python3) is not installed" % DEBIAN_PYTHON)
        tool = self.prepare()
        blocks = recipes(self.TOOL)
        text = blocks[layout] + "\n" + blocks["cron"]
        host = Host(self)
        source = read(support.SCRIPT)

        changed, output = self.apply(host, tool, text)
        self.assertTrue(changed, "the first apply changed nothing:\n" + output)

        with self.subTest(step="files"):
            if layout == "plain":
                self.assert_file(host, COMMAND, 0o755, source)
                self.assertEqual(sorted(os.listdir(host.path("/usr/local/lib"))), [])
            else:
                self.assert_file(host, MODULE, 0o644, source)
                # the cache directory too, empty until the first run: else
                # that run creates it with its own umask (0777 under umask 000)
                self.assert_dir(host, MODULE_DIR, ["__pycache__", "gpu_preflight.py"])
                self.assert_dir(host, CACHE_DIR, [])
                launcher = read(host.path(COMMAND))
                self.assert_file(host, COMMAND, 0o755, launcher)
                self.assertTrue(launcher.startswith(b"#!" + DEBIAN_PYTHON.encode() + b" -I\n"),
                                launcher)
                self.assertIn(b'sys.path.insert(0, "%s")\n' % MODULE_DIR.encode(), launcher)
                expected = install_sh_launcher(host.dir)
                if expected is not None:        # install.sh's fast layout
                    self.assertEqual(launcher, expected,
                                     "the recipe's launcher differs from install.sh's")
        entry = self.cron_entry(host)           # the cron run below needs it

        with self.subTest(step="runs in cron's environment"):
            status, out = host.run(["/usr/bin/env", "-i", "PATH=/usr/bin:/bin", COMMAND,
                                    "--version"], env=support.cron_env())
            proc = subprocess.run([DEBIAN_PYTHON, support.SCRIPT, "--version"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.assertEqual((status, out), (0, proc.stdout.decode()))
            if layout == "fast":
                caches = glob.glob(host.path(CACHE_DIR + "/gpu_preflight.*.pyc"))
                self.assertEqual(len(caches), 1, "no bytecode cache after a run as root")

        changed, output = self.apply(host, tool, text)
        with self.subTest(step="second apply"):
            self.assertFalse(changed, "the second apply changed something:\n" + output)
            if layout == "plain":
                self.assert_file(host, COMMAND, 0o755, source)
            else:
                self.assert_file(host, MODULE, 0o644, source)

        lock = self.entry_lock(entry)
        host.write_job(lock)
        for ready in (True, False):
            with self.subTest(step="cron", ready=ready):
                self.check_cron_run(host, ready)

    def assert_file(self, host, path, mode, content):
        info = os.lstat(host.path(path))
        self.assertTrue(stat.S_ISREG(info.st_mode), path + " is not a regular file")
        self.assertEqual((oct(stat.S_IMODE(info.st_mode)), info.st_uid, info.st_gid),
                         (oct(mode), 0, 0), path)
        self.assertTrue(read(host.path(path)) == content,
                        "%s is not byte-identical to what was meant" % path)

    def assert_dir(self, host, path, names):
        """path: a directory, mode 0755, owned by root, holding names."""
        info = os.lstat(host.path(path))
        self.assertTrue(stat.S_ISDIR(info.st_mode), path + " is not a directory")
        self.assertEqual((oct(stat.S_IMODE(info.st_mode)), info.st_uid, info.st_gid),
                         (oct(0o755), 0, 0), path)
        self.assertEqual(sorted(os.listdir(host.path(path))), names, path)

    def cron_entry(self, host):
        """The one entry of the cron.d file the recipe wrote (a root-owned
        0644 file, else cron ignores it), with its lines split."""
        self.assertEqual(os.listdir(host.path("/etc/cron.d/")),
                         [os.path.basename(CRON_FILE)])
        info = os.stat(host.path(CRON_FILE))
        self.assertEqual((oct(stat.S_IMODE(info.st_mode)), info.st_uid),
                         (oct(0o644), 0), CRON_FILE)
        text = read(host.path(CRON_FILE)).decode()
        self.assertTrue(text.endswith("\n"), "cron ignores a last line without \\n")
        lines = [line for line in text.split("\n") if line and not line.startswith("#")]
        self.assertEqual(len(lines), 1, text)
        words = lines[0].split(None, 6)
        self.assertEqual(words[5], "root", lines[0])
        command = shlex.split(words[6])
        self.assertEqual(command[0], COMMAND, "cron's PATH has no /usr/local/bin")
        self.assertEqual(command[-2:], ["--", JOB], lines[0])
        return command

    def entry_lock(self, command):
        """The --lock of the entry: in /run, where only root creates files."""
        self.assertIn("--lock", command)
        lock = command[command.index("--lock") + 1]
        self.assertEqual(os.path.dirname(lock), "/run",
                         "a lock in a world-writable directory can be taken by anyone")
        return lock

    def check_cron_run(self, host, ready):
        cron_lines, script_lines, diagnosis = host.run_cron(ready)
        runs = [pid for pid, msg in cron_lines
                if msg.startswith("(root) CMD (") and COMMAND in msg]
        self.assertEqual(len(runs), 1, "cron did not run the entry once" + diagnosis)
        ends = [msg for pid, msg in cron_lines
                if pid == runs[0] and msg.startswith("(root) END (")]
        self.assertEqual(len(ends), 1, "the job did not end" + diagnosis)
        printed = [msg for pid, msg in cron_lines if pid == runs[0] and "output" in msg]
        self.assertEqual(printed, [], "the job printed something" + diagnosis)
        failed = [msg for pid, msg in cron_lines
                  if pid == runs[0] and "failed with exit status" in msg]
        self.assertEqual(len(script_lines), 1, "want one gpu_preflight line" + diagnosis)
        pri, msg = script_lines[0]
        fields = support.parse_fields(msg)
        self.assertEqual(fields.get("host"), "http://127.0.0.1:%d" % OLLAMA_PORT, msg)
        ran = read(host.marker).decode() if os.path.exists(host.marker) else None
        if ready:
            self.assertEqual((pri, fields.get("result"), fields.get("code")),
                             (test_cron.USER_INFO, "ready", "0"), msg)
            self.assertEqual(ran, "ran lock-held=yes\n",
                             "the job did not run (with the lock) although ready" + diagnosis)
            self.assertEqual(failed, [], diagnosis)
        else:
            self.assertEqual((pri, fields.get("result"), fields.get("code")),
                             (test_cron.USER_WARNING, "skip", "69"), msg)
            self.assertIsNone(ran, "the job ran although nothing answered" + diagnosis)
            self.assertEqual(len(failed), 1, diagnosis)
            self.assertTrue(failed[0].endswith(" failed with exit status 69)"), failed[0])


def tool_path(testcase, name, variable):
    """The tool named by $VARIABLE (.ci/run exports it), else on PATH, else
    in the CI's virtual environment; fail under CI=true when missing."""
    given = os.environ.get(variable, "").strip()
    if given:
        return support.require_tool(testcase, name, given)
    venv = os.path.join(os.environ.get("TMPDIR", "/tmp"), "gpu_preflight-ci-venv",
                        "bin", name)
    found = shutil.which(name) or (venv if os.path.exists(venv) else None)
    return support.require_tool(testcase, name, found)

