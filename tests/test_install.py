"""Black-box tests for install.sh and the fast layout it installs.

Each test copies install.sh and the real gpu_preflight.py from the repository
root into a fresh temporary directory, runs ``sh install.sh`` there as a
subprocess (into a temporary DESTDIR, or a temporary PREFIX where the command
must run), and checks the files it leaves behind, what it prints, and what
the installed command does. install.sh is given --python, a wrapper around the
interpreter running the tests (unless a test says otherwise), so the suite
checks the layout under every Python.

    python3 -m unittest -v tests/test_install.py
"""

import configparser
import fcntl
import importlib.util
import json
import marshal
import os
import re
import shlex
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import time
import unittest

import support
from ollama_emu import Emulator
from test_trust import NOBODY

REPO_ROOT = support.REPO
INSTALL_SH = os.path.join(REPO_ROOT, "install.sh")
SCRIPT = support.SCRIPT

#: The POSIX shell install.sh is run with (dash on Debian/Ubuntu).
SH = shutil.which("sh") or "/bin/sh"
#: The shell used for the syntax check (``sh -n``); dash when available.
DASH = shutil.which("dash") or SH

#: Commands install.sh needs besides the shell builtins (see main()).
INSTALL_SH_TOOLS = ("install", "cmp", "mv", "rm", "rmdir", "chmod", "cat", "ls",
                    "dirname", "grep", "sed", "id", "readlink")

#: The example keys the config must show, commented out.
EXAMPLE_KEYS = (
    "# host = http://127.0.0.1:11434",
    "# model = llama3.2",
    "# timeout = 3",
    "# deadline = 10",
    "# warmup = token",
    "# keep-alive = 10m",
    "# syslog-facility = user",
)

#: Environment variables install.sh reads; never inherited by the tests.
INSTALL_ENV_VARS = ("DESTDIR", "PREFIX", "SYSCONFDIR")

#: The cache file name Python uses for gpu_preflight.py under this interpreter.
PYC_NAME = "gpu_preflight.%s.pyc" % sys.implementation.cache_tag
#: Hash-checked pycs exist from 3.7 on (PEP 552); 3.6 writes timestamp pycs.
HASHED = sys.version_info >= (3, 7)

#: The interpreter install.sh prefers; on Debian, Python 3.11.
SYSTEM_PYTHON = "/usr/bin/python3"
#: Where install.sh looks for the system's python3 before PATH.
SYSTEM_BINDIRS = ("/usr/bin", "/usr/local/bin")

#: Slack for start-up and scheduling on a loaded 2-core machine when checking
#: that a run ended inside its deadline. Not a performance figure.
SLACK = 1.5


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def write_file(path, text, mode=None):
    with open(path, "w") as f:
        f.write(text)
    if mode is not None:
        os.chmod(path, mode)


def file_mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def tree(root):
    """Return every path under root, relative to it (dirs and files)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(found)


def launcher_text(python, lib):
    """The launcher install.sh writes (the recipes use the same text)."""
    return ("#!%s -I\n"
            "# gpu_preflight launcher: runs the installed module from its bytecode cache\n"
            "import sys\n"
            'sys.path.insert(0, "%s")\n'
            "import gpu_preflight\n"
            "sys.exit(gpu_preflight.main(started=gpu_preflight.process_started()))\n"
            % (python, lib))


def pyc_header(path):
    """(flags, code object) of a pyc written by this interpreter."""
    data = read_bytes(path)
    if HASHED:
        return int.from_bytes(data[4:8], "little"), marshal.loads(data[16:])
    return 0, marshal.loads(data[12:])


def replay(stderr, cwd):
    """Run the "+ " lines of install.sh's output as a shell script."""
    script = "set -e\n" + "".join(
        line[2:] + "\n" for line in stderr.splitlines() if line.startswith("+ "))
    proc = subprocess.run([SH, "-c", script], stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, cwd=cwd, timeout=120)
    return proc.returncode, proc.stdout


class InstallTestCase(unittest.TestCase):
    """Base: a source dir holding install.sh + gpu_preflight.py, a DESTDIR."""

    def setUp(self):
        if not os.path.isfile(SCRIPT):
            self.fail("gpu_preflight.py not found at the repository root "
                      "(%s); install.sh has nothing to install" % SCRIPT)
        self.tmp = tempfile.mkdtemp(prefix="test_install_")
        self.addCleanup(shutil.rmtree, self.tmp)
        self.srcdir = os.path.join(self.tmp, "src")
        os.mkdir(self.srcdir)
        self.install_sh = os.path.join(self.srcdir, "install.sh")
        self.source = os.path.join(self.srcdir, "gpu_preflight.py")
        shutil.copy2(INSTALL_SH, self.install_sh)
        shutil.copy2(SCRIPT, self.source)
        self.destdir = os.path.join(self.tmp, "dest")
        os.mkdir(self.destdir)
        self.set_prefix(self.destdir, "/usr/local")
        self.config = os.path.join(self.destdir, "etc/gpu_preflight.conf")
        # A bin dir first on PATH whose python3 is a wrapper around the
        # interpreter running the tests, the one run_install names with
        # --python: install.sh must look through it.
        self.pybin = os.path.join(self.tmp, "pybin")
        os.mkdir(self.pybin)
        self.python3 = os.path.join(self.pybin, "python3")
        write_file(self.python3, '#!/bin/sh\nexec "%s" "$@"\n' % sys.executable, 0o755)

    def set_prefix(self, destdir, prefix):
        """Where the files of an install into destdir + prefix lie."""
        self.lib_final = prefix.rstrip("/") + "/lib/gpu_preflight"
        root = destdir + prefix.rstrip("/")
        self.target = os.path.join(root, "bin/gpu_preflight")
        self.lib = os.path.join(root, "lib/gpu_preflight")
        self.module = os.path.join(self.lib, "gpu_preflight.py")
        self.cachedir = os.path.join(self.lib, "__pycache__")
        self.pyc = os.path.join(self.cachedir, PYC_NAME)

    def env(self, path=None, **extra):
        env = dict(os.environ)
        for name in INSTALL_ENV_VARS:
            env.pop(name, None)
        env["LC_ALL"] = "C"
        if path is None:
            path = self.pybin + os.pathsep + os.environ.get("PATH", "")
        env["PATH"] = path
        env.update(extra)
        return env

    def run_install(self, *args, **kwargs):
        """Run install.sh; return (exit status, stdout, stderr).

        DESTDIR defaults to self.destdir (pass destdir=None for none).
        --python defaults to self.python3 (python=None: install.sh chooses),
        unless args name one. hide_system_python=True runs it where
        /usr/bin/python3 and /usr/local/bin/python3 do not exist.
        Other keyword arguments go to the environment (see env()).
        """
        destdir = kwargs.pop("destdir", self.destdir)
        install_sh = kwargs.pop("install_sh", self.install_sh)
        path = kwargs.pop("path", None)
        cwd = kwargs.pop("cwd", self.tmp)
        python = kwargs.pop("python", self.python3)
        command = [SH, install_sh] + list(args)
        if python and not any(a.split("=")[0] == "--python" for a in args):
            command[2:2] = ["--python", python]
        if kwargs.pop("hide_system_python", False):
            command = self.without_system_python() + command
        env = self.env(path=path, **kwargs)
        if destdir is not None:
            env["DESTDIR"] = destdir
        proc = subprocess.run(
            command,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, universal_newlines=True,
            cwd=cwd, env=env, timeout=120)
        return proc.returncode, proc.stdout, proc.stderr

    def without_system_python(self):
        """A command prefix that runs its command in a mount namespace of its
        own where an overlay whiteout hides python3 in each SYSTEM_BINDIRS
        (its other files, python3.11 too, stay)."""
        self.need_root("mounting an overlay needs root")
        unshare = support.require_tool(self, "unshare")
        mount = support.require_tool(self, "mount")
        mounts = []
        for bindir in SYSTEM_BINDIRS:
            if os.path.isdir(bindir):
                layer = os.path.join(self.tmp, "hide" + bindir.replace("/", "_"))
                if not os.path.isdir(layer):            # a second call
                    os.mkdir(layer)
                    os.mknod(os.path.join(layer, "python3"), stat.S_IFCHR | 0o600,
                             os.makedev(0, 0))
                mounts.append("%s -t overlay overlay -o lowerdir=%s %s\n" % (
                    mount, shlex.quote("%s:%s" % (layer, bindir)), shlex.quote(bindir)))
        return [unshare, "--mount", SH, "-c",
                "set -e\n" + "".join(mounts) + 'exec "$@"\n', "sh"]

    def need_root(self, why):
        """Skip unless root; in CI fail instead."""
        if os.geteuid() == 0:
            return
        if support.IN_CI:
            self.fail(why + " (CI=true)")
        self.skipTest(why)

    def assert_ok(self, result):
        rc, out, err = result
        self.assertEqual(rc, 0, "install.sh failed:\n%s%s" % (out, err))
        return result

    def install_live(self, *args, **kwargs):
        """Install without DESTDIR into a temporary prefix (the smoke test
        runs); return install.sh's stderr. kwargs go to run_install."""
        prefix = os.path.join(self.tmp, "prefix")
        self.set_prefix("", prefix)
        return self.assert_ok(self.run_install(
            "--prefix", prefix, "--no-config", *args, destdir=None, **kwargs))[2]

    def run_as_nobody(self, args):
        """The installed command, run by another user (nobody) in cron's
        environment, from a shell as cron runs it: setpriv itself still holds
        root's capabilities when it execs, and so reaches what nobody cannot."""
        setpriv = support.require_tool(self, "setpriv")
        return subprocess.run(
            [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", SH, "-c",
             'exec "$0" "$@"', self.target] + list(args),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, universal_newlines=True, env=support.cron_env(),
            cwd="/", timeout=60)

    def private_python(self, target=None):
        """A python3 only root can reach, as a pyenv under /root (mode 0700)
        is: a link to target (the interpreter running the tests, by its real
        name: /usr/bin/python3 is a link that hide_system_python hides) in a
        directory of mode 0700 (the test's own directory opened, so that this
        one is what keeps others out). Its directory."""
        os.chmod(self.tmp, 0o755)
        private = os.path.join(self.tmp, "private")
        os.mkdir(private)
        os.chmod(private, 0o700)
        os.symlink(target or os.path.realpath(sys.executable),
                   os.path.join(private, "python3"))
        return private

    def nobodys_python3(self, dirname):
        """A python3 in a new directory dirname of the test's, owned by
        nobody, as one they left there would be: it notes the uid it ran as
        in self.ran, then runs the tests' interpreter. Its path."""
        os.chmod(self.tmp, 0o755)
        self.ran = os.path.join(self.tmp, "ran")
        bindir = os.path.join(self.tmp, dirname)
        os.mkdir(bindir)
        python = os.path.join(bindir, "python3")
        write_file(python, '#!/bin/sh\nid -u >> %s\nexec %s "$@"\n'
                   % (self.ran, sys.executable), 0o755)
        os.chown(python, 65534, 65534)
        return python

    def assert_not_ran(self):
        if os.path.exists(self.ran):
            uids = read_bytes(self.ran).decode().split()
            os.remove(self.ran)                 # for the next subtest
            self.fail("nobody's python3 ran as uid %s" % uids)

    def assert_fast_layout(self, python=sys.executable, source=SCRIPT):
        """The launcher, the module and a cache Python will use, nothing else."""
        self.assertEqual(read_bytes(self.target).decode(),
                         launcher_text(python, self.lib_final))
        self.assertEqual(file_mode(self.target), 0o755)
        self.assertEqual(read_bytes(self.module), read_bytes(source))
        self.assertEqual(file_mode(self.module), 0o644)
        self.assertEqual(sorted(os.listdir(self.lib)), ["__pycache__", "gpu_preflight.py"])
        self.assertEqual(os.listdir(self.cachedir), [PYC_NAME])
        self.assertEqual(file_mode(self.pyc), 0o644)
        flags, code = pyc_header(self.pyc)
        self.assertEqual(flags, 0b11 if HASHED else 0)      # checked-hash on 3.7+
        self.assertEqual(code.co_filename, self.lib_final + "/gpu_preflight.py")
        self.assertEqual(os.listdir(os.path.dirname(self.target)), ["gpu_preflight"])

    def run_command(self, args, python=sys.executable, flags=()):
        """Run the installed launcher through its interpreter with extra flags
        (-v shows where the module's code came from), in cron's environment."""
        proc = subprocess.run(
            [python, "-I"] + list(flags) + [self.target] + list(args),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            universal_newlines=True, env=support.cron_env(), cwd="/", timeout=60)
        return proc

    def assert_cache_used(self, stderr):
        """-v output: the module's code came from the pyc, nothing compiled."""
        source = self.module
        self.assertIn("# code object from %r\n" % self.pyc, stderr)
        self.assertNotIn("# code object from %s\n" % source, stderr)
        self.assertNotIn("# wrote %r" % self.pyc, stderr)       # 3.6
        self.assertNotIn("# created %r" % self.pyc, stderr)     # 3.7+

    def make_bin(self, name, text):
        """A bin dir holding the install.sh tools plus one fake script."""
        bindir = os.path.join(self.tmp, "fakebin")
        if not os.path.isdir(bindir):
            os.mkdir(bindir)
            for tool in INSTALL_SH_TOOLS:
                real = shutil.which(tool)
                self.assertIsNotNone(real, "%s not found on PATH" % tool)
                os.symlink(real, os.path.join(bindir, tool))
        if name is not None:
            write_file(os.path.join(bindir, name), text, 0o755)
        return bindir


class TestInstall(InstallTestCase):

    def test_install_creates_fast_layout_and_config(self):
        rc, out, err = self.assert_ok(self.run_install("-v"))
        self.assertEqual(out, "")
        self.assert_fast_layout()
        for path in (self.module, self.pyc):
            self.assertIn("installed: " + path + "\n", err)
        self.assertIn("installed: %s (python3: %s)\n" % (self.target, sys.executable), err)
        self.assertIn("installed: %s (example, all commented out)\n" % self.config, err)
        self.assertIn("+ install -m 0644 %s " % self.source, err)
        # compiled in a staging directory, then moved into place
        self.assertRegex(err, r"\+ %s -I -m compileall -q -f -d %s %s%s\n" % (
            re.escape(sys.executable), re.escape(self.lib_final),
            "--invalidation-mode checked-hash " if HASHED else "",
            re.escape(self.lib + "/.gpu_preflight.tmp.") + r"\d+/gpu_preflight\.py"))
        self.assertEqual(file_mode(self.config), 0o644)
        parser = configparser.ConfigParser()
        with open(self.config) as f:
            parser.read_file(f)
        self.assertEqual(parser.sections(), ["gpu_preflight"])
        # Fully commented: the section parses but sets nothing.
        self.assertEqual(parser.options("gpu_preflight"), [])
        with open(self.config) as f:
            lines = f.read().splitlines()
        for key_line in EXAMPLE_KEYS:
            self.assertIn(key_line, lines)
        precedence = [ln for ln in lines if "precedence" in ln.lower()]
        self.assertEqual(len(precedence), 1, lines)
        self.assertRegex(precedence[0],
                         r"flags > GPU_PREFLIGHT_\* environment.*> this file"
                         r" > .*defaults")
        # No temporary files are left next to the installed files.
        self.assertEqual(os.listdir(os.path.dirname(self.config)),
                         ["gpu_preflight.conf"])

    def test_a_normal_install_says_what_it_did_in_a_few_lines(self):
        """A line per file and the installed command's version, no command
        trace (install.sh printed some 30 "+ command" lines); -v adds it."""
        prefix = os.path.join(self.tmp, "prefix")
        self.set_prefix("", prefix)
        config = os.path.join(self.tmp, "etc", "gpu_preflight.conf")
        args = ("--prefix", prefix, "--sysconfdir", os.path.dirname(config))
        rc, out, err = self.assert_ok(self.run_install(*args, destdir=None, python=None))
        self.assertEqual(out, "")
        expected = [re.escape("installed: " + self.module),
                    re.escape("installed: %s/gpu_preflight." % self.cachedir) + r"\S+\.pyc",
                    re.escape("installed: %s (python3: " % self.target) + r"/\S+\)",
                    re.escape("installed: %s (example, all commented out)" % config),
                    r"gpu_preflight \d+\.\d+\.\d+\+[0-9a-f]{12} \(Python 3\.\d+\.\d+\)"]
        lines = err.splitlines()
        self.assertEqual(len(lines), len(expected), err)
        for line, pattern in zip(lines, expected):
            self.assertRegex(line, "^%s$" % pattern)
        with open(self.source, "a") as f:
            f.write("\n# local change\n")
        rc, out, err = self.assert_ok(self.run_install("-v", *args, destdir=None, python=None))
        self.assertIn("updated: %s\n" % self.module, err)
        self.assertIn("+ mv -f %s/.gpu_preflight.tmp." % self.lib, err)
        self.assertIn("+ %s --version\n" % self.target, err)

    def test_second_run_is_unchanged(self):
        self.assert_ok(self.run_install())
        old = time.time() - 10000
        paths = (self.target, self.module, self.pyc, self.config)
        for path in paths:
            if path != self.module or HASHED:   # 3.6's pyc holds the module's mtime
                os.utime(path, (old, old))
        before = [os.stat(path) for path in paths]
        rc, out, err = self.assert_ok(self.run_install("--verbose"))
        for path in (self.module, self.pyc):
            self.assertIn("unchanged: " + path + "\n", err)
        self.assertIn("unchanged: %s (python3: %s)\n" % (self.target, sys.executable), err)
        self.assertIn("kept existing config: " + self.config, err)
        self.assertNotIn("+ ", err)  # nothing was run
        after = [os.stat(path) for path in paths]
        self.assertEqual([(s.st_ino, s.st_mtime) for s in after],
                         [(s.st_ino, s.st_mtime) for s in before])

    def test_modified_source_updates_module_and_cache(self):
        self.assert_ok(self.run_install())
        launcher_inode = os.stat(self.target).st_ino
        with open(self.source, "a") as f:
            f.write("\n# local change\n")
        rc, out, err = self.assert_ok(self.run_install())
        self.assertIn("updated: " + self.module, err)
        self.assertIn("updated: " + self.pyc, err)
        self.assertIn("unchanged: " + self.target, err)
        self.assertEqual(os.stat(self.target).st_ino, launcher_inode)
        self.assert_fast_layout(source=self.source)
        # the cache matches the new source (as Python's own loader checks it)
        rc, out, err = self.assert_ok(self.run_install())
        self.assertIn("unchanged: " + self.pyc, err)

    def test_upgrade_from_the_single_file_layout(self):
        # what the previous install.sh left: the whole script as the command
        os.makedirs(os.path.dirname(self.target))
        shutil.copy(SCRIPT, self.target)
        os.chmod(self.target, 0o755)
        rc, out, err = self.assert_ok(self.run_install("--no-config"))
        self.assertIn("updated: %s (python3: %s; was the whole script, now a launcher of %s)"
                      % (self.target, sys.executable, self.lib_final), err)
        self.assert_fast_layout()
        self.assertEqual(tree(self.destdir), [
            "usr", "usr/local", "usr/local/bin", "usr/local/bin/gpu_preflight",
            "usr/local/lib", "usr/local/lib/gpu_preflight",
            "usr/local/lib/gpu_preflight/__pycache__",
            "usr/local/lib/gpu_preflight/__pycache__/" + PYC_NAME,
            "usr/local/lib/gpu_preflight/gpu_preflight.py"])

    def test_cache_of_another_interpreter_is_removed(self):
        self.assert_ok(self.run_install())
        stale = [os.path.join(self.cachedir, name) for name in (
            "gpu_preflight.cpython-35.pyc", "gpu_preflight.cpython-399.pyc",
            PYC_NAME.replace(".pyc", ".opt-1.pyc"))]
        for path in stale:
            shutil.copy(self.pyc, path)
        unrelated = os.path.join(self.cachedir, "other.cpython-36.pyc")
        write_file(unrelated, "")
        rc, out, err = self.assert_ok(self.run_install())
        for path in stale:
            self.assertIn("removed: %s\n" % path, err)
            self.assertFalse(os.path.exists(path))
        self.assertIn("unchanged: " + self.pyc, err)
        self.assertEqual(sorted(os.listdir(self.cachedir)),
                         sorted([PYC_NAME, "other.cpython-36.pyc"]))

    def test_invalid_cache_is_rewritten(self):
        self.assert_ok(self.run_install())
        good = read_bytes(self.pyc)
        # a cache of another source text: what an interrupted install leaves
        with open(self.pyc, "wb") as f:
            f.write(good[:8] + b"\0" * 8 + good[16:] if HASHED else
                    good[:4] + b"\0" * 8 + good[12:])
        rc, out, err = self.assert_ok(self.run_install())
        self.assertIn("updated: " + self.pyc, err)
        self.assert_fast_layout()
        self.assertIn("unchanged: " + self.pyc, self.assert_ok(self.run_install())[2])

    def test_interpreter_change_rewrites_launcher_and_cache(self):
        # install with a python3 whose cache tag differs (a fake one at first:
        # --no-python-check names it without running it), then the real one
        other = os.path.join(self.tmp, "other", "python3")
        os.makedirs(os.path.dirname(other))
        self.assert_ok(self.run_install("--no-python-check", "--python", other))
        self.assertEqual(read_bytes(self.target).decode(),
                         launcher_text(other, self.lib_final))
        self.assertEqual(os.listdir(self.cachedir), [])
        rc, out, err = self.assert_ok(self.run_install())
        self.assertIn("updated: " + self.target, err)
        self.assertIn("installed: " + self.pyc, err)
        self.assert_fast_layout()

    def test_destdir_cache_is_valid_at_the_final_path(self):
        # a package: built into a staging root, then unpacked at PREFIX
        final = os.path.join(self.tmp, "final")
        stage = os.path.join(self.tmp, "stage")
        self.assert_ok(self.run_install("--prefix", final, "--no-config",
                                        destdir=stage))
        self.set_prefix(stage, final)
        self.assertNotIn(stage, read_bytes(self.target).decode())
        self.assertNotIn(stage.encode(), read_bytes(self.pyc))
        os.rename(stage + final, final)
        self.set_prefix("", final)
        self.assert_fast_layout()
        if HASHED:      # a packager that resets timestamps changes nothing
            os.utime(self.module, (1e9, 1e9))
        pyc_before = read_bytes(self.pyc), os.stat(self.pyc).st_mtime
        proc = self.run_command(["--version"], flags=["-v"])
        self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
        self.assertRegex(proc.stdout, r"^gpu_preflight \d+\.\d+\.\d+")
        self.assert_cache_used(proc.stderr)
        self.assertEqual((read_bytes(self.pyc), os.stat(self.pyc).st_mtime), pyc_before)
        # install.sh at the final path agrees: nothing to redo
        rc, out, err = self.assert_ok(self.run_install(
            "--prefix", final, "--no-config", destdir=None))
        for path in (self.module, self.pyc):
            self.assertIn("unchanged: " + path + "\n", err)
        self.assertIn("unchanged: %s (python3: %s)\n" % (self.target, sys.executable), err)

    def test_existing_config_is_never_touched(self):
        os.makedirs(os.path.dirname(self.config))
        custom = "[gpu_preflight]\nmodel = mine\n# operator notes\n"
        write_file(self.config, custom, 0o600)
        old = time.time() - 10000
        os.utime(self.config, (old, old))
        rc, out, err = self.assert_ok(self.run_install())
        self.assertIn("kept existing config: " + self.config, err)
        self.assertEqual(read_bytes(self.config), custom.encode())
        self.assertEqual(file_mode(self.config), 0o600)
        self.assertEqual(os.stat(self.config).st_mtime, old)
        self.assertTrue(os.path.isfile(self.target))

    def test_existing_config_symlink_is_kept(self):
        os.makedirs(os.path.dirname(self.config))
        os.symlink("/nonexistent/gpu_preflight.conf", self.config)
        rc, out, err = self.assert_ok(self.run_install())
        self.assertIn("kept existing config: " + self.config, err)
        self.assertEqual(os.readlink(self.config),
                         "/nonexistent/gpu_preflight.conf")

    def test_no_config_skips_config(self):
        rc, out, err = self.assert_ok(self.run_install("--no-config"))
        self.assertTrue(os.path.isfile(self.target))
        self.assertFalse(os.path.lexists(os.path.dirname(self.config)))
        self.assertNotIn("gpu_preflight.conf", err)

    def test_quiet_prints_nothing(self):
        rc, out, err = self.assert_ok(self.run_install("--quiet", python=None))
        self.assertEqual((out, err), ("", ""))
        self.assertTrue(os.path.isfile(self.target))
        self.assertTrue(os.path.isfile(self.config))


class TestDryRun(InstallTestCase):

    def test_dry_run_writes_nothing_and_replays_as_the_install(self):
        rc, out, err = self.assert_ok(self.run_install("--dry-run"))
        self.assertEqual(tree(self.destdir), [])
        for path in (self.module, self.pyc):
            self.assertIn("would install: " + path + "\n", err)
        self.assertIn("would install: %s (python3: %s)\n" % (self.target, sys.executable), err)
        self.assertIn("would install: %s (example" % self.config, err)
        self.assertIn("+ install -d -m 0755 %s\n" % self.lib, err)
        self.assertIn("+ mv -f ", err)
        # the "+ " lines, run as a script, make what a real install makes
        self.assertEqual(replay(err, self.tmp), (0, ""))
        self.assert_fast_layout()
        replayed = dict((p, read_bytes(os.path.join(self.destdir, p)))
                        for p in tree(self.destdir)
                        if os.path.isfile(os.path.join(self.destdir, p)))
        shutil.rmtree(self.destdir)
        os.mkdir(self.destdir)
        self.assert_ok(self.run_install())
        self.assertEqual(sorted(replayed), [p for p in tree(self.destdir)
                                            if os.path.isfile(os.path.join(self.destdir, p))])
        for path, data in replayed.items():
            if not path.endswith(".pyc"):   # marshal output is not byte-stable
                self.assertEqual(read_bytes(os.path.join(self.destdir, path)), data, path)

    def test_dry_run_quiet_still_prints_commands(self):
        rc, out, err = self.assert_ok(
            self.run_install("--dry-run", "--quiet"))
        self.assertEqual(tree(self.destdir), [])
        self.assertIn("+ install -m 0644 ", err)
        self.assertIn("+ cat > ", err)
        self.assertNotIn("would install", err)

    def test_dry_run_leaves_existing_install_alone(self):
        self.assert_ok(self.run_install())
        with open(self.source, "a") as f:
            f.write("\n# local change\n")
        before = tree(self.destdir)
        rc, out, err = self.assert_ok(self.run_install("--dry-run"))
        self.assertIn("would update: " + self.module, err)
        self.assertIn("would update: " + self.pyc, err)
        self.assertIn("unchanged: " + self.target, err)
        self.assertEqual(read_bytes(self.module), read_bytes(SCRIPT))
        self.assertEqual(tree(self.destdir), before)

    def test_dry_run_uninstall_shows_and_replays_the_removal(self):
        self.assert_ok(self.run_install())
        before = tree(self.destdir)
        rc, out, err = self.assert_ok(self.run_install("--dry-run", "--uninstall"))
        for path in (self.target, self.module, self.pyc):
            self.assertIn("+ rm -f %s\n" % path, err)
        self.assertIn("+ rmdir %s\n+ rmdir %s\n" % (self.cachedir, self.lib), err)
        self.assertEqual(tree(self.destdir), before)
        self.assertEqual(replay(err, self.tmp), (0, ""))
        self.assertEqual(tree(self.destdir), [
            "etc", "etc/gpu_preflight.conf", "usr", "usr/local", "usr/local/bin",
            "usr/local/lib"])


class TestUninstall(InstallTestCase):

    def test_uninstall_removes_everything_but_the_config(self):
        self.assert_ok(self.run_install())
        config_bytes = read_bytes(self.config)
        rc, out, err = self.assert_ok(self.run_install("--uninstall"))
        for path in (self.target, self.module, self.pyc):
            self.assertIn("removed: " + path + "\n", err)
        self.assertFalse(os.path.lexists(self.target))
        self.assertFalse(os.path.lexists(self.lib))
        self.assertEqual(read_bytes(self.config), config_bytes)
        self.assertIn("kept config: " + self.config, err)
        rc, out, err = self.assert_ok(self.run_install("--uninstall", "-v"))
        self.assertIn("not installed: " + self.target, err)
        self.assertNotIn("+ ", err)
        self.assertTrue(os.path.isfile(self.config))

    def test_uninstall_keeps_a_directory_holding_other_files(self):
        self.assert_ok(self.run_install("--no-config"))
        other = os.path.join(self.cachedir, "gpu_preflight.cpython-312.pyc")
        write_file(other, "")                   # another interpreter's cache: ours
        notes = os.path.join(self.lib, "NOTES")  # an operator's file: not ours
        write_file(notes, "keep me\n")
        rc, out, err = self.assert_ok(self.run_install("--uninstall", "-v"))
        self.assertIn("removed: " + other, err)
        self.assertEqual(sorted(os.listdir(self.lib)), ["NOTES"])
        self.assertIn("+ rmdir %s\n" % self.cachedir, err)
        self.assertNotIn("rmdir %s\n" % self.lib, err)

    def test_uninstall_removes_the_single_file_layout(self):
        os.makedirs(os.path.dirname(self.target))
        shutil.copy(SCRIPT, self.target)
        rc, out, err = self.assert_ok(self.run_install("--uninstall"))
        self.assertIn("removed: " + self.target, err)
        self.assertFalse(os.path.lexists(self.target))

    def test_uninstall_needs_no_source_and_no_python(self):
        self.assert_ok(self.run_install())
        os.remove(self.source)
        rc, out, err = self.assert_ok(self.run_install(
            "--uninstall", path=self.make_bin(None, "")))
        self.assertFalse(os.path.lexists(self.target))
        self.assertFalse(os.path.lexists(self.lib))


class TestInstalledCommand(InstallTestCase):
    """The installed launcher, run the way cron runs it."""

    def test_version_and_a_healthy_check_from_crons_environment(self):
        err = self.install_live("-v")
        self.assertIn("+ %s --version\n" % self.target, err)  # install.sh's smoke test
        self.assertRegex(err, r"(?m)^gpu_preflight \d+\.\d+\.\d+")
        emu = Emulator().start()
        self.addCleanup(emu.stop)
        with support.SyslogSink() as sink:
            results = []
            for args in (["--version"], ["--host", emu.url, "--json",
                                         "--syslog-address", sink.path]):
                proc = subprocess.run(
                    ["env", "-i", "PATH=/usr/bin:/bin", "GPU_PREFLIGHT_CONFIG="
                     + support.hermetic_dir()[1], self.target] + args,
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, universal_newlines=True, cwd="/",
                    timeout=60)
                results.append(proc)
            logged = sink.messages()
        version, check = results
        self.assertEqual((version.returncode, version.stderr), (0, ""))
        self.assertEqual(version.stdout.split()[:1], ["gpu_preflight"])
        self.assertIn("Python %d.%d.%d" % sys.version_info[:3], version.stdout)
        source = subprocess.run([sys.executable, SCRIPT, "--version"], env=support.cron_env(),
                                stdout=subprocess.PIPE, universal_newlines=True)
        self.assertRegex(source.stdout, r"^gpu_preflight \S+\+[0-9a-f]{12} ")
        self.assertEqual(version.stdout, source.stdout, "the installed copy is another")
        self.assertEqual(check.returncode, 0, check.stderr)
        doc = json.loads(check.stdout)
        self.assertEqual((doc["exit_code"], doc["result"]), (0, "ready"))
        self.assertEqual(len(logged), 1, logged)
        self.assertIn("result=ready", logged[0])
        self.assertEqual(emu.count("POST", "/api/generate"), 1)
        # and it ran from the cache: the pyc was neither rewritten nor added to
        self.assertEqual(os.listdir(self.cachedir), [PYC_NAME])
        proc = self.run_command(["--version"], flags=["-v"])
        self.assert_cache_used(proc.stderr)

    def test_deadline_counts_from_process_start(self):
        """Interpreter start-up is inside the deadline, as for the script.

        The command runs under a virtual environment of this interpreter
        whose site-packages holds a .pth file that sleeps DELAY seconds: site
        runs it during interpreter start-up (also under -I), inside the
        process the kernel started, before the launcher's first line. A
        deadline counted from process start leaves the first stage only
        DEADLINE - DELAY; a launcher that let main() start the clock would
        give it the whole DEADLINE, and run DELAY past it (checked below
        with such a launcher, so the test shows it can fail).
        """
        delay, deadline = 2.0, 4.0      # the rest of start-up has 2 s, on a loaded machine
        venv = os.path.join(self.tmp, "venv")
        subprocess.check_call([sys.executable, "-m", "venv", "--without-pip", venv])
        python = os.path.join(venv, "bin", "python")
        site = subprocess.check_output(
            [python, "-I", "-c", "import site; print(site.getsitepackages()[0])"],
            universal_newlines=True).strip()
        # site may see the same directory twice (lib and lib64): sleep once
        write_file(os.path.join(site, "slow_start.pth"),
                   "import sys, time; hasattr(sys, '_slow') or "
                   "(setattr(sys, '_slow', 1), time.sleep(%r))\n" % delay)
        self.install_live("--python", python)
        self.assertTrue(read_bytes(self.target).startswith(
            ("#!%s -I\n" % python).encode()))
        emu = Emulator(mode="hang").start()
        self.addCleanup(emu.stop)
        args = ["--host", emu.url, "--timeout", "30", "--deadline", str(deadline),
                "--json", "--no-syslog"]

        def run(command):
            started = time.monotonic()
            proc = subprocess.run(
                [command] + args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, universal_newlines=True,
                env=support.cron_env(), cwd="/", timeout=60)
            doc = json.loads(proc.stdout)
            return time.monotonic() - started, doc

        elapsed, doc = run(self.target)
        self.assertEqual((doc["exit_code"], doc["stage"]), (75, "tags"), doc)
        self.assertIn("deadline of %gs reached" % deadline, doc["reason"])
        tags_ms = doc["stages"][0]["duration_ms"]
        self.assertLess(tags_ms, (deadline - delay) * 1000 + 700, doc)
        self.assertGreaterEqual(doc["elapsed_ms"], deadline * 1000 - 10, doc)
        self.assertLess(doc["elapsed_ms"], (deadline + SLACK) * 1000, doc)
        self.assertLess(elapsed, deadline + 30)     # no hang
        # the control: the same launcher without started= overshoots by DELAY
        naive = os.path.join(self.tmp, "naive_launcher")
        write_file(naive, read_bytes(self.target).decode().replace(
            "main(started=gpu_preflight.process_started())", "main()"), 0o755)
        elapsed, doc = run(naive)
        self.assertGreaterEqual(doc["stages"][0]["duration_ms"], (deadline - delay) * 1000 + 700)
        self.assertGreaterEqual(elapsed, deadline + delay)

    def test_failing_smoke_test_is_an_error(self):
        write_file(self.source, "import sys\n"
                                "def process_started():\n    return 0.0\n"
                                "def main(argv=None, started=None):\n"
                                "    sys.stderr.write('broken\\n')\n    return 3\n")
        prefix = os.path.join(self.tmp, "prefix")
        rc, out, err = self.run_install(
            "--prefix", prefix, "--no-config", destdir=None)
        self.assertEqual(rc, 1)
        self.assertIn("--version' failed", err)
        self.assertIn("broken", err)

    def test_no_smoke_test_with_destdir(self):
        rc, out, err = self.assert_ok(self.run_install("-v"))
        self.assertNotIn("--version", err)


class TestOptions(InstallTestCase):

    def test_help(self):
        rc, out, err = self.run_install("--help")
        self.assertEqual(rc, 0)
        self.assertTrue(out.startswith("Usage:"), out)
        for option in ("--dry-run", "--python PATH", "--uninstall", "--no-python-check"):
            self.assertIn(option, out)
        self.assertEqual(err, "")
        self.assertEqual(tree(self.destdir), [])
        rc, out2, err = self.run_install("-h")
        self.assertEqual((rc, out2), (0, out))

    def test_unknown_option_is_usage_error(self):
        rc, out, err = self.run_install("--bogus")
        self.assertEqual(rc, 2)
        self.assertEqual(out, "")
        self.assertIn("unknown option: --bogus", err)
        self.assertIn("Usage:", err)
        self.assertEqual(tree(self.destdir), [])
        rc, out, err = self.run_install("stray")
        self.assertEqual(rc, 2)
        self.assertIn("Usage:", err)

    def test_missing_option_argument_is_usage_error(self):
        for option in ("--prefix", "--sysconfdir", "--destdir", "--python"):
            with self.subTest(option=option):
                rc, out, err = self.run_install(option)
                self.assertEqual(rc, 2)
                self.assertEqual(out, "")
                self.assertIn("option %s requires an argument" % option, err)
                self.assertIn("Usage:", err)
        self.assertEqual(tree(self.destdir), [])

    def test_bad_prefix_is_usage_error(self):
        for prefix, message in (("usr/local", "PREFIX must be an absolute path"),
                                ('/opt/a"b', "PREFIX must not contain a quote")):
            rc, out, err = self.run_install("--prefix", prefix)
            self.assertEqual(rc, 2)
            self.assertIn(message, err)
        self.assertEqual(tree(self.destdir), [])

    def test_missing_source_fails_clearly(self):
        os.remove(self.source)
        rc, out, err = self.run_install()
        self.assertEqual(rc, 1)
        self.assertIn("install.sh: error: gpu_preflight.py not found", err)
        self.assertIn(self.source, err)
        self.assertEqual(tree(self.destdir), [])

    def test_prefix_flag_and_env(self):
        self.assert_ok(self.run_install("--prefix", "/opt/gp/", "--no-config"))
        self.set_prefix(self.destdir, "/opt/gp")
        self.assert_fast_layout()
        self.assertEqual(tree(self.destdir)[:1], ["opt"])
        self.assert_ok(self.run_install("--no-config", PREFIX="/opt/envprefix"))
        self.set_prefix(self.destdir, "/opt/envprefix")
        self.assert_fast_layout()
        self.assert_ok(self.run_install("--prefix=/opt/flag", "--no-config",
                                        PREFIX="/opt/env"))
        self.assertTrue(os.path.isdir(os.path.join(self.destdir, "opt/flag")))
        self.assertFalse(os.path.lexists(os.path.join(self.destdir, "opt/env")))

    def test_sysconfdir_flag_and_env(self):
        self.assert_ok(self.run_install("--sysconfdir", "/etc/flag"))
        self.assertTrue(os.path.isfile(
            os.path.join(self.destdir, "etc/flag/gpu_preflight.conf")))
        self.assert_ok(self.run_install(SYSCONFDIR="/srv/conf"))
        self.assertTrue(os.path.isfile(
            os.path.join(self.destdir, "srv/conf/gpu_preflight.conf")))

    def test_destdir_flag(self):
        other = os.path.join(self.tmp, "other")
        self.assert_ok(self.run_install("--destdir", other, destdir=None))
        self.set_prefix(other, "/usr/local")
        self.assert_fast_layout()
        self.assertEqual(tree(self.destdir), [])

    def test_python_flag_names_the_interpreter(self):
        # no python3 on PATH at all: --python alone says which to use
        fakebin = self.make_bin(None, "")
        self.assert_ok(self.run_install("--python", sys.executable, path=fakebin))
        self.assert_fast_layout()


class TestPythonCheck(InstallTestCase):

    FAKE_OLD_PYTHON = (
        "#!/bin/sh\n"
        "# A python3 that is too old: fails the version check.\n"
        'case "$*" in\n'
        "  *version_info*) exit 1 ;;\n"
        "  *) echo 3.5.10 ;;\n"
        "esac\n"
    )

    def test_too_old_python_fails_with_hint(self):
        # no system python3: python3 on PATH is the one install.sh finds
        fakebin = self.make_bin("python3", self.FAKE_OLD_PYTHON)
        rc, out, err = self.run_install(
            path=fakebin + os.pathsep + "/usr/bin:/bin", python=None,
            hide_system_python=True)
        self.assertEqual(rc, 1, err)
        self.assertIn("install.sh: error: %s/python3 is Python 3.5.10; 3.6 or newer "
                      "is required" % fakebin, err)
        self.assertIn("dnf install python3", err)
        self.assertIn("zypper install python3", err)
        self.assertIn("apt-get install python3", err)
        self.assertIn("--python /path/to/python3", err)
        self.assertEqual(tree(self.destdir), [])

    def test_missing_python_fails_with_hint(self):
        # PATH holds only the tools install.sh needs, and the system none:
        # no python3 at all.
        fakebin = self.make_bin(None, "")
        rc, out, err = self.run_install(path=fakebin, python=None, hide_system_python=True)
        self.assertEqual(rc, 1, err)
        self.assertIn("install.sh: error: python3 not found (not in /usr/bin, "
                      "/usr/local/bin or on PATH)\n", err)
        self.assertIn("dnf install python3", err)
        self.assertEqual(tree(self.destdir), [])
        rc, out, err = self.run_install("--python", "/nonexistent/python3", path=fakebin)
        self.assertEqual(rc, 1, err)
        self.assertIn("install.sh: error: /nonexistent/python3 not found", err)

    def test_no_python_check_runs_no_python(self):
        fakebin = self.make_bin("python3", self.FAKE_OLD_PYTHON)
        python = os.path.join(fakebin, "python3")
        # the python3 found on PATH may be a pyenv shim or a wrapper that picks
        # an interpreter at run time: without running it, --python must say
        rc, out, err = self.run_install("--no-python-check", python=None,
                                        path=fakebin + os.pathsep + "/usr/bin:/bin")
        self.assertEqual(rc, 2, err)
        self.assertIn("--no-python-check needs --python PATH", err)
        self.assertEqual(tree(self.destdir), [])
        rc, out, err = self.assert_ok(self.run_install(
            "--no-python-check", "--python", python,
            path=fakebin + os.pathsep + "/usr/bin:/bin"))
        self.assertIn("no bytecode cache (--no-python-check)", err)
        self.assertEqual(read_bytes(self.target).decode(),
                         launcher_text(python, self.lib_final))
        self.assertEqual(read_bytes(self.module), read_bytes(SCRIPT))
        # no cache, but its directory: the first run must not create it with
        # its own umask (0777 under umask 000)
        self.assertEqual(os.listdir(self.cachedir), [])
        self.assertEqual(file_mode(self.cachedir), 0o755)
        # for a build host without the target's Python: --python is taken as is
        rc, out, err = self.assert_ok(self.run_install(
            "--no-python-check", "--python", "/usr/bin/python3.99", path=fakebin))
        self.assertTrue(read_bytes(self.target).startswith(b"#!/usr/bin/python3.99 -I\n"))
        rc, out, err = self.run_install("--no-python-check", "--python", "python3")
        self.assertEqual(rc, 1)
        self.assertIn("'python3' is not absolute", err)

    def test_root_prefers_the_system_python_every_user_can_run(self):
        """As root with a private python3 first on PATH (pyenv under /root),
        the command names /usr/bin/python3, and another user can run it.
        install.sh named the private one: every other user got "Permission
        denied" (126), or ld.so's error, and no one was warned."""
        self.need_root("a private interpreter is private to root")
        self.assertTrue(os.access(SYSTEM_PYTHON, os.X_OK),
                        "this test needs the system's %s" % SYSTEM_PYTHON)
        private = self.private_python()
        err = self.install_live(python=None, path=private + os.pathsep + "/usr/bin:/bin")
        self.assertTrue(read_bytes(self.target).startswith(b"#!/usr/bin/python3 -I\n"),
                        read_bytes(self.target)[:80])
        self.assertIn("installed: %s (python3: %s)\n" % (self.target, SYSTEM_PYTHON), err)
        proc = self.run_as_nobody(["--version"])
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertRegex(proc.stdout, r"^gpu_preflight \d+\.\d+\.\d+\+[0-9a-f]{12} \(Python 3\.")

    def test_root_refuses_a_python_others_cannot_run(self):
        """With no system python3, the private one found on PATH is refused
        in one line that names the directory keeping others out and the
        fix; nothing is installed."""
        private = self.private_python()
        fakebin = self.make_bin(None, "")
        rc, out, err = self.run_install(python=None, path=private + os.pathsep + fakebin,
                                        hide_system_python=True)
        self.assertEqual(rc, 1, err)
        self.assertEqual(err.splitlines(), [
            "install.sh: error: other users cannot run %s/python3 (%s is drwx------); "
            "install a python3 in /usr/bin, or name one they can run with --python PATH "
            "(--python %s/python3 to use this one anyway)" % (private, private, private)])
        self.assertEqual(tree(self.destdir), [])

    def test_root_warns_for_a_named_python_others_cannot_run(self):
        """--python naming the private one installs it, with one warning on
        stderr, even under --quiet; the warning is true: nobody cannot run
        the command."""
        self.need_root("a private interpreter is private to root")
        python = os.path.join(self.private_python(), "python3")
        warning = ("install.sh: warning: other users cannot run %s (%s is drwx------): "
                   "the command will fail for them\n" % (python, os.path.dirname(python)))
        err = self.install_live("--python", python)
        self.assertEqual([line for line in err.splitlines(True) if "warning" in line],
                         [warning])
        self.assertTrue(read_bytes(self.target).startswith(("#!%s -I\n" % python).encode()))
        self.assertNotEqual(self.run_as_nobody(["--version"]).returncode, 0)
        self.assertEqual(self.install_live("--python", python, "--quiet"), warning)

    def test_root_follows_each_link_to_a_python_others_cannot_run(self):
        """--python naming a link to a link in a directory closed to others,
        that one to the system's python3, draws the warning naming that
        directory, for an absolute link and a relative one; the warning is
        true: nobody gets "Permission denied" (126). Only the directories of
        the named path and of the last one were checked: no word was said."""
        self.need_root("a private interpreter is private to root")
        private = self.private_python(os.path.realpath(SYSTEM_PYTHON))
        bindir = os.path.join(self.tmp, "bin")
        os.mkdir(bindir)
        os.symlink(os.path.join(private, "python3"), os.path.join(bindir, "python3"))
        os.symlink("../private/python3", os.path.join(bindir, "relative"))
        for name in ("python3", "relative"):
            with self.subTest(link=name):
                python = os.path.join(bindir, name)
                err = self.install_live("--python", python)
                self.assertEqual(
                    [line for line in err.splitlines() if "warning" in line],
                    ["install.sh: warning: other users cannot run %s (%s is drwx------): "
                     "the command will fail for them" % (python, private)])
                proc = self.run_as_nobody(["--version"])
                self.assertEqual(proc.returncode, 126, proc.stderr)
                self.assertIn("Permission denied", proc.stderr)

    def test_root_runs_the_python_as_nobody_to_see_that_it_starts(self):
        """Where modes do not tell (here an ACL denies nobody a copy of the
        system's python3 in an open directory; a libpython or a standard
        library closed to others would do the same), install.sh runs the
        interpreter as nobody, and warns with what went wrong. It judged by
        modes alone, and installed a command nobody cannot run."""
        self.need_root("only root can run a python3 as nobody")
        support.require_tool(self, "setpriv")
        os.chmod(self.tmp, 0o755)
        python = os.path.join(self.tmp, "python3")
        shutil.copy2(os.path.realpath(SYSTEM_PYTHON), python)
        # a POSIX ACL (the xattr's binary form, as setfacl writes it): the
        # owner rwx, user nobody nothing, the group, mask and others r-x
        entries = ((0x01, 7, 0xFFFFFFFF), (0x02, 0, 65534), (0x04, 5, 0xFFFFFFFF),
                   (0x10, 5, 0xFFFFFFFF), (0x20, 5, 0xFFFFFFFF))
        os.setxattr(python, "system.posix_acl_access", struct.pack("<I", 2) + b"".join(
            struct.pack("<HHI", *entry) for entry in entries))
        self.assertEqual(stat.S_IMODE(os.stat(python).st_mode), 0o755)
        err = self.install_live("--python", python)
        self.assertRegex(err, r"(?m)^install\.sh: warning: other users cannot run %s "
                         r"\(as uid 65534 it fails: sh: .*Permission denied\): the "
                         r"command will fail for them$" % re.escape(python))
        self.assertEqual(self.run_as_nobody(["--version"]).returncode, 126)

    def test_root_never_runs_a_python3_from_the_working_directory(self):
        """An empty entry on PATH means the working directory, where "command
        -v python3" found nobody's python3 and install.sh ran it as root. Only
        absolute PATH entries count: with none holding a python3, install.sh
        says python3 was not found, and ran nothing."""
        self.need_root("the working directory's python3 ran as root")
        workdir = os.path.dirname(self.nobodys_python3("work"))
        os.chmod(workdir, 0o777)
        fakebin = self.make_bin(None, "")
        for args in ((), ("--python", "python3")):
            with self.subTest(args=args):
                rc, out, err = self.run_install(*args, python=None, cwd=workdir,
                                                path=os.pathsep + fakebin,
                                                hide_system_python=True)
                self.assert_not_ran()
                self.assertEqual(rc, 1, err)
                self.assertIn("install.sh: error: python3 not found", err)
                self.assertEqual(tree(self.destdir), [])

    def test_root_runs_no_python_another_user_could_change(self):
        """As root, even into a DESTDIR, install.sh refuses before running it
        a python3 that another user owns: named by --python, reached through a
        link of root's, or found on PATH. It ran each as root to learn its
        version (and checked only the one it installed, and only without
        DESTDIR)."""
        self.need_root("another user's python3 ran as root")
        python = self.nobodys_python3("theirs")
        link = os.path.join(self.tmp, "python3")
        os.symlink(python, link)
        refusal = ("install.sh: error: %s is owned by uid 65534, not root: another user "
                   "could change what root runs (the interpreter %%s)" % python)
        fakebin = self.make_bin(None, "")
        for args, kwargs, named in (
                (("--python", python), {}, python),
                (("--python", link), {}, link),
                ((), {"path": os.path.dirname(python) + os.pathsep + fakebin,
                      "hide_system_python": True}, python)):
            with self.subTest(named=named, args=args):
                rc, out, err = self.run_install(*args, python=None, **kwargs)
                self.assert_not_ran()
                self.assertEqual(rc, 1, err)
                self.assertEqual(err.splitlines()[0], refusal % named)
                self.assertEqual(tree(self.destdir), [])

    def test_no_python_check_still_warns_for_a_python_others_cannot_run(self):
        """--no-python-check runs no Python, but the modes on the way to the
        one it names are still read: a private one draws the warning (there
        was none); one absent here, for another host, draws none."""
        self.need_root("a private interpreter is private to root")
        private = self.private_python()
        python = os.path.join(private, "python3")
        rc, out, err = self.assert_ok(self.run_install("--no-python-check", "--python", python))
        self.assertIn("install.sh: warning: other users cannot run %s (%s is drwx------): "
                      "the command will fail for them\n" % (python, private), err)
        rc, out, err = self.assert_ok(self.run_install(
            "--no-python-check", "--python", "/usr/bin/python3.99"))
        self.assertNotIn("warning", err)

    def test_python_check_also_runs_in_dry_run(self):
        fakebin = self.make_bin("python3", self.FAKE_OLD_PYTHON)
        rc, out, err = self.run_install("--dry-run", python=os.path.join(fakebin, "python3"))
        self.assertEqual(rc, 1)
        self.assertIn("dnf install python3", err)


class TestChecksum(InstallTestCase):

    def setUp(self):
        InstallTestCase.setUp(self)
        support.require_tool(self, "sha256sum")

    def sha256(self, path):
        import hashlib
        return hashlib.sha256(read_bytes(path)).hexdigest()

    def test_matching_sha256sums_passes(self):
        write_file(os.path.join(self.srcdir, "SHA256SUMS"),
                   "%s  gpu_preflight.py\n%s  install.sh\n"
                   % (self.sha256(self.source), self.sha256(self.install_sh)))
        rc, out, err = self.assert_ok(self.run_install())
        self.assertIn("checksum ok: ", err)
        self.assertTrue(os.path.isfile(self.target))

    def test_mismatching_sha256sums_fails(self):
        write_file(os.path.join(self.srcdir, "SHA256SUMS"),
                   "%s  gpu_preflight.py\n" % ("0" * 64))
        rc, out, err = self.run_install()
        self.assertEqual(rc, 1)
        self.assertIn("checksum mismatch", err)
        self.assertEqual(tree(self.destdir), [])


class TestInstallShStatic(unittest.TestCase):
    """Static checks on install.sh itself; no gpu_preflight.py needed."""

    ONCE = True     # no Python runs: tests/run.py runs these once per suite run

    def test_shellcheck(self):
        shellcheck = support.require_tool(self, "shellcheck")
        proc = subprocess.run(
            [shellcheck, "-s", "sh", INSTALL_SH],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            universal_newlines=True, timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stdout)

    def test_sh_syntax(self):
        proc = subprocess.run(
            [DASH, "-n", INSTALL_SH],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            universal_newlines=True, timeout=60)
        self.assertEqual(proc.returncode, 0, proc.stdout)

    def test_shape(self):
        with open(INSTALL_SH) as f:
            text = f.read()
        lines = text.splitlines()
        self.assertEqual(lines[0], "#!/bin/sh")
        self.assertIn("set -eu", lines)
        # main first, the helpers below it (as rustup-init.sh)
        functions = re.findall(r"^(\w+)\(\) \{$", text, re.M)
        self.assertEqual(functions[0], "main")
        # A truncated download must run nothing: main is called last.
        self.assertEqual(lines[-1], 'main "$@"')
        self.assertTrue(text.endswith('main "$@"\n'))

    def test_each_function_names_its_own_variables_with_its_own_prefix(self):
        """POSIX sh has no local: a function's own variables are _xx_name, xx
        its alone, so a call never overwrites its caller's (install.sh says so
        once, at the top); what functions share is UPPERCASE."""
        with open(INSTALL_SH) as f:
            text = f.read()
        owner = {}
        for name, body in re.findall(r"^(\w+)\(\) \{\n(.*?)^\}$", text, re.M | re.S):  # novermin
            own = set(re.findall(r"(?<![\w$])(_[a-z0-9_]*)=", body)
                      + re.findall(r"\bfor (_\w+) in", body)
                      + [v for line in re.findall(r"\bread -r ([\w ]+)", body)
                         for v in line.split() if v != "_"])
            for variable in sorted(own):
                with self.subTest(function=name, variable=variable):
                    match = re.match(r"^_([a-z]+)_[a-z0-9_]+$", variable)
                    self.assertTrue(match, "not _xx_name")
                    self.assertEqual(owner.setdefault(match.group(1), name), name,
                                     "the prefix of another function")
        self.assertGreater(len(owner), 10)


class TestInstallPaths(InstallTestCase):
    """DESTDIR, PREFIX and install paths install.sh must refuse or get right."""

    def run_in(self, cwd, args, timeout=30, **env):
        """install.sh with these arguments from cwd, without DESTDIR in the
        environment unless given; (status, stderr). A hang fails the test."""
        try:
            proc = subprocess.run(
                [SH, self.install_sh, "--python", self.python3] + list(args),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                env=self.env(**env), timeout=timeout)
        except subprocess.TimeoutExpired:
            self.fail("install.sh %s did not finish within %ds" % (
                " ".join(str(a) for a in args), timeout))
        return proc.returncode, proc.stderr.decode("utf-8", "replace")

    def test_relative_destdir_installs_below_the_working_directory(self):
        # make DESTDIR=pkg install: a relative staging root with no slash
        # must not send check_writable's parent walk round forever ("pkg" ->
        # "pkg"); a hang fails the test (run_in's timeout)
        for args, env in (([], {"DESTDIR": "pkg"}), (["--destdir", "pkg"], {})):
            shutil.rmtree(os.path.join(self.tmp, "pkg"), ignore_errors=True)
            rc, err = self.run_in(self.tmp, args + ["--no-config"], timeout=20, **env)
            self.assertEqual(rc, 0, err)
            self.set_prefix(os.path.join(self.tmp, "pkg"), "/usr/local")
            self.assert_fast_layout()

    def test_a_directory_at_an_install_path_is_an_error(self):
        # mv -f TMP DIR would move the file into DIR and report "installed"
        for name in ("launcher", "module"):
            with self.subTest(path=name):
                shutil.rmtree(self.destdir)
                os.mkdir(self.destdir)
                path = self.target if name == "launcher" else self.module
                os.makedirs(path)
                rc, out, err = self.run_install("--no-config")
                self.assertEqual(rc, 1, err)
                self.assertIn(path, err)
                self.assertEqual(os.listdir(path), [])
                self.assertNotIn("installed: " + path, err)
                self.assertNotIn("updated: " + path, err)

    def test_a_prefix_python_cannot_read_makes_no_broken_launcher(self):
        # PREFIX goes into the launcher as a Python string: a carriage return
        # ends its line, a byte that is not UTF-8 makes the file unreadable
        for prefix in (b"/opt/cr\rx", b"/opt/lat\xe9"):
            with self.subTest(prefix=prefix):
                shutil.rmtree(self.destdir)
                os.mkdir(self.destdir)
                proc = subprocess.run(
                    [SH, self.install_sh, "--prefix", prefix, "--no-config"],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, cwd=self.tmp, timeout=120,
                    env=self.env(DESTDIR=self.destdir))
                launcher = os.path.join(self.destdir.encode() + prefix, b"bin/gpu_preflight")
                if proc.returncode == 2:        # refused as a usage error: fine
                    self.assertFalse(os.path.lexists(launcher))
                    continue
                self.assertEqual(proc.returncode, 0, proc.stderr)
                try:
                    compile(read_bytes(launcher), "gpu_preflight", "exec")
                except SyntaxError as exc:
                    self.fail("install.sh exited 0 but its launcher is not Python: %s" % exc)


#: A module with the launcher's two entry points that is not gpu_preflight.
FAKE_MODULE = ("import sys\n"
               "def process_started():\n    return 0.0\n"
               "def main(argv=None, started=None):\n"
               "    sys.stdout.write('FAKE, not the installed module\\n')\n"
               "    return 0\n")


class TestInstallIntegrity(InstallTestCase):
    """The installed module, its cache and their modes are what install.sh
    wrote, and a failed install or a second one leaves them so."""

    def plant_foreign_cache(self):
        """Replace the installed cache with one Python loads for the module
        (its own check passes) but compiled from FAKE_MODULE."""
        final = self.lib_final + "/gpu_preflight.py"
        code = marshal.dumps(compile(FAKE_MODULE, final, "exec"))
        if HASHED:      # PEP 552 unchecked-hash pyc: Python never reads the source
            header = (1).to_bytes(4, "little") + b"\0" * 8
        else:           # a timestamp pyc that names the module's mtime and size
            info = os.stat(self.module)
            header = ((int(info.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
                      + (info.st_size & 0xFFFFFFFF).to_bytes(4, "little"))
        with open(self.pyc, "wb") as f:
            f.write(importlib.util.MAGIC_NUMBER + header + code)

    def test_a_cache_of_other_code_is_rewritten(self):
        self.install_live()
        self.plant_foreign_cache()
        self.assertIn("FAKE", self.run_command(["--version"]).stdout)  # Python loads it
        err = self.install_live()
        self.assertIn("updated: " + self.pyc, err)
        proc = self.run_command(["--version"])
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertRegex(proc.stdout, r"^gpu_preflight \d+\.\d+\.\d+")

    def test_a_failed_byte_compile_keeps_the_working_install(self):
        # a truncated or broken gpu_preflight.py: the installed module is
        # replaced only once compileall has passed, so the command still works
        self.install_live()
        with open(self.source, "a") as f:
            f.write("\ndef broken(:\n")
        prefix = os.path.join(self.tmp, "prefix")
        rc, out, err = self.run_install("--prefix", prefix, "--no-config", destdir=None)
        self.assertEqual(rc, 1, err)
        self.assertEqual(read_bytes(self.module), read_bytes(support.SCRIPT))
        proc = self.run_command(["--version"])
        self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
        self.assertRegex(proc.stdout, r"^gpu_preflight \d+\.\d+\.\d+")

    def test_no_first_run_makes_a_cache_directory_others_can_write(self):
        # README's packager line: DESTDIR=... --no-python-check ships no
        # __pycache__; Python creates it on the first run as root with mode
        # 0777 & ~umask: under umask 000 it must not be world-writable, or
        # any user could rename an unchecked-hash pyc over root's cache
        final = os.path.join(self.tmp, "final")
        stage = os.path.join(self.tmp, "stage")
        self.assert_ok(self.run_install("--prefix", final, "--no-config",
                                        "--no-python-check", "--python", sys.executable,
                                        destdir=stage))
        os.rename(stage + final, final)
        self.set_prefix("", final)
        first_run_as_root = support.prepared([self.target, "--version"], umask=0o000)
        proc = subprocess.run(
            first_run_as_root,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=support.cron_env(), cwd="/", timeout=60)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        for path in (self.lib, self.cachedir):
            if os.path.isdir(path):
                self.assertEqual(os.stat(path).st_mode & 0o022, 0,
                                 "%s is writable by group or others" % path)

    def test_a_second_install_repairs_modes_and_owners(self):
        # "unchanged" is judged by every file's mode and owner, not the
        # module's mode only: running install.sh again is how one repairs a
        # world-writable launcher, cache or cache directory, or a module
        # another user owns
        self.install_live()
        os.chmod(self.target, 0o777)
        os.chmod(self.pyc, 0o666)
        os.chmod(self.cachedir, 0o777)
        if os.geteuid() == 0:
            os.chown(self.module, NOBODY, NOBODY)
        self.install_live()
        for path in (self.target, self.pyc, self.cachedir, self.lib, self.module):
            info = os.stat(path)
            self.assertEqual(info.st_mode & 0o022, 0,
                             "%s is writable by group or others" % path)
            self.assertEqual(info.st_uid, os.geteuid(), path)


class TestRootInstallTrust(InstallTestCase):
    """What root's cron runs must be code only root can change (the rule
    gpu_preflight applies to its config, token and NVML library)."""

    def setUp(self):
        InstallTestCase.setUp(self)
        if os.geteuid() != 0:
            self.skipTest("planting directories as another user needs root")
        os.chmod(self.tmp, 0o755)

    def test_root_refuses_a_prefix_another_user_can_write(self):
        prefix = os.path.join(self.tmp, "opt")
        os.makedirs(os.path.join(prefix, "lib"))
        os.chown(os.path.join(prefix, "lib"), NOBODY, NOBODY)   # nobody can swap lib/gpu_preflight
        rc, out, err = self.run_install("--prefix", prefix, "--no-config", destdir=None)
        self.assertEqual(rc, 1, err)
        self.assertIn(os.path.join(prefix, "lib"), err)
        self.assertFalse(os.path.lexists(os.path.join(prefix, "bin", "gpu_preflight")))

    def test_root_refuses_an_interpreter_another_user_can_change(self):
        # a venv (or pyenv, conda) that nobody owns: a .pth file they drop
        # into its site-packages runs in root's every run, -I or not
        venv = os.path.join(self.tmp, "venv")
        subprocess.check_call([sys.executable, "-m", "venv", "--without-pip", venv])
        for dirpath, dirnames, filenames in os.walk(venv):
            for name in [dirpath] + [os.path.join(dirpath, n) for n in filenames]:
                os.lchown(name, NOBODY, NOBODY)
        prefix = os.path.join(self.tmp, "prefix")
        rc, out, err = self.run_install("--prefix", prefix, "--no-config",
                                        "--python", os.path.join(venv, "bin", "python"),
                                        destdir=None)
        self.assertEqual(rc, 1, err)
        self.assertIn(venv, err)
        self.assertFalse(os.path.lexists(os.path.join(prefix, "bin", "gpu_preflight")))


#: Runs gpu_preflight as the launcher does (imported from a directory put
#: first on sys.path, main() with the process start), then writes to argv[1]
#: the names of the modules loaded after interpreter start-up (what site and
#: a .pth file of this interpreter load is not gpu_preflight's doing).
DRIVER = r"""
import sys
before = set(sys.modules)
import json
out, lib = sys.argv[1], sys.argv[2]
sys.path.insert(0, lib)
import gpu_preflight
code = 70
try:
    code = gpu_preflight.main(sys.argv[3:], started=gpu_preflight.process_started())
finally:
    with open(out, "w") as handle:
        json.dump(sorted(set(sys.modules) - before), handle)
sys.exit(code)
"""


#: Module families a run that sends nothing must not load: the
#: HTTP client and what it pulls in, hashing, the INI parser, ctypes.
NETWORK = ("urllib", "http", "ssl", "_ssl", "email")
HASHING = ("hashlib", "_hashlib")
CONFIGPARSER = ("configparser",)
CTYPES = ("ctypes", "_ctypes")


class TestLazyImports(unittest.TestCase):
    """What each kind of run imports, as the installed command runs it."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="gpfl-lazy-")
        cls.lib = os.path.join(cls.tmp, "lib")
        os.mkdir(cls.lib)
        shutil.copy(support.SCRIPT, cls.lib)
        cls.emu = Emulator().start()

    @classmethod
    def tearDownClass(cls):
        cls.emu.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        self.dir = tempfile.mkdtemp(dir=self.tmp)
        self.state = os.path.join(self.dir, "state")
        self.sink = support.SyslogSink()
        self.addCleanup(self.sink.close)

    def imports(self, args, code, env=None):
        """Run the driver; check the exit status; the modules it loaded."""
        out = os.path.join(self.dir, "modules.json")
        proc = subprocess.run(
            [sys.executable, "-I", "-B", "-c", DRIVER, out, self.lib] + list(args),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=support.cron_env(**(env or {})), cwd="/", timeout=60)
        self.assertEqual(proc.returncode, code, proc.stderr.decode("ascii", "replace"))
        with open(out) as handle:
            return json.load(handle), proc.stdout.decode("ascii")

    def assert_none_of(self, modules, *families):
        names = set(name for family in families for name in family)
        self.assertEqual([m for m in modules if m.split(".")[0] in names], [])

    def verdict_args(self):
        return ["--host", self.emu.url, "--share-result", "600", "--state-dir", self.state,
                "--syslog-address", self.sink.path, "--json"]

    def reused(self, extra=(), env=None):
        """A ready verdict left by a first run; the modules the second loaded."""
        first = support.run_script(self.verdict_args() + list(extra),
                                   env=support.cron_env(**(env or {})))
        self.assertEqual(first.code, 0, first)
        modules, out = self.imports(self.verdict_args() + list(extra), 0, env)
        self.assertTrue(json.loads(out)["reused"], out)
        return modules

    def test_help_version_and_usage_errors_load_nothing_extra(self):
        """--version hashes the file (its git blob id) and so loads hashlib;
        nothing else of these loads the network, hashing, configparser or ctypes."""
        for args, code in ((["--help"], 0), (["--version"], 0), (["--bogus"], 64)):
            with self.subTest(args=args):
                modules, _ = self.imports(args, code)
                self.assert_none_of(modules, NETWORK, CONFIGPARSER, CTYPES)
                if args != ["--version"]:
                    self.assert_none_of(modules, HASHING)

    def test_a_configuration_error_loads_nothing_extra(self):
        modules, _ = self.imports(["--no-syslog"], 78, {"GPU_PREFLIGHT_TIMEOUT": "abc"})
        self.assert_none_of(modules, NETWORK, HASHING, CONFIGPARSER, CTYPES)
        bad = os.path.join(self.dir, "bad.conf")
        write_file(bad, "[gpu_preflight]\nbogus = 1\n")
        modules, _ = self.imports(["--no-syslog", "--config", bad], 78)
        self.assert_none_of(modules, NETWORK, HASHING, CTYPES)   # configparser: it has settings

    def test_a_lock_conflict_loads_nothing_extra(self):
        lock = os.path.join(self.dir, "lock")
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)  # novermin: flags
        self.addCleanup(os.close, fd)
        fcntl.flock(fd, fcntl.LOCK_EX)
        modules, _ = self.imports(["--host", self.emu.url, "--lock", lock,
                                   "--syslog-address", self.sink.path], 75)
        self.assert_none_of(modules, NETWORK, HASHING, CONFIGPARSER, CTYPES)

    def test_a_reused_verdict_loads_nothing_extra(self):
        # without a token, state_key() takes no digest: no hashlib
        self.assert_none_of(self.reused(), NETWORK, HASHING, CONFIGPARSER, CTYPES)

    def test_a_reused_verdict_with_the_example_config_loads_no_configparser(self):
        example = os.path.join(self.dir, "example.conf")
        write_file(example, "# all commented, as install.sh writes it\n"
                            "[gpu_preflight]\n# host = http://127.0.0.1:11434\n")
        modules = self.reused(["--config", example])
        self.assert_none_of(modules, NETWORK, CONFIGPARSER, CTYPES)

    def test_a_reused_verdict_with_a_token_loads_no_urllib(self):
        # hashlib is fair (the token's digest names the state); add_secret()
        # makes the percent-encoded forms of the token without urllib.parse
        modules = self.reused(env={"GPU_PREFLIGHT_TOKEN": "s3cret-token-value"})
        self.assert_none_of(modules, NETWORK, CONFIGPARSER, CTYPES)

    def test_the_healthy_path_loads_no_configparser_or_ctypes(self):
        modules, out = self.imports(["--host", self.emu.url, "--json",
                                     "--syslog-address", self.sink.path], 0)
        self.assertEqual(json.loads(out)["result"], "ready", out)
        self.assertIn("urllib.request", modules)        # the control: it did send
        self.assert_none_of(modules, CONFIGPARSER, CTYPES)


if __name__ == "__main__":
    unittest.main()
