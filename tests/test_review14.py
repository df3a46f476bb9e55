"""Regression tests from a hostile review of issue 14 (the fast layout).

Each test reproduces one finding of that review of install.sh and of the lazy
imports in gpu_preflight.py: a relative DESTDIR that hangs install.sh, a
directory at an install path that swallows the file while install.sh reports
it installed, a cache Python would load whose code is not the module's kept as
"unchanged", a failed byte-compile that leaves the working install broken, a
first run under umask 000 that creates a world-writable __pycache__, a second
install that leaves world-writable files or a module another user owns as
"unchanged", a PREFIX that makes a launcher Python cannot read, root
installing into a directory or under an interpreter another user controls,
and a run that sends nothing but still imports hashlib or urllib. They fail on
the code the review looked at and pass once each finding is fixed. The two
ownership tests need root (they plant directories as uid 65534, nobody), like
test_trust.

    cd tests && python3 -m unittest -v test_review14
"""

import fcntl
import importlib.util
import json
import marshal
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import support
from ollama_emu import Emulator
from test_install import HASHED, SH, InstallTestCase, read_bytes, write_file

NOBODY = 65534

#: A module with the launcher's two entry points that is not gpu_preflight.
FAKE_MODULE = ("import sys\n"
               "def process_started():\n    return 0.0\n"
               "def main(argv=None, started=None):\n"
               "    sys.stdout.write('FAKE, not the installed module\\n')\n"
               "    return 0\n")


class TestInstallReview14(InstallTestCase):

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
        # sent check_writable's parent walk round forever ("pkg" -> "pkg");
        # the second form runs only once the first no longer hangs
        for args, env in (([], {"DESTDIR": "pkg"}), (["--destdir", "pkg"], {})):
            shutil.rmtree(os.path.join(self.tmp, "pkg"), ignore_errors=True)
            rc, err = self.run_in(self.tmp, args + ["--no-config"], timeout=20, **env)
            self.assertEqual(rc, 0, err)
            self.set_prefix(os.path.join(self.tmp, "pkg"), "/usr/local")
            self.assert_fast_layout()

    def test_a_directory_at_an_install_path_is_an_error(self):
        # mv -f TMP DIR moves the file into DIR; install.sh said "installed"
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
        # a truncated or broken gpu_preflight.py: the module was replaced
        # before compileall failed, so the installed command stopped working
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
        # 0777 & ~umask, so a run under umask 000 made it world-writable and
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
        # "unchanged" looked at the module's mode only: a world-writable
        # launcher, cache or cache directory, or a module another user owns,
        # stayed so, though running install.sh again is how one repairs it
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

#: Module families a run that sends nothing must not load (issue 14): the
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
        for args, code in ((["--help"], 0), (["--version"], 0), (["--bogus"], 64)):
            with self.subTest(args=args):
                modules, _ = self.imports(args, code)
                self.assert_none_of(modules, NETWORK, HASHING, CONFIGPARSER, CTYPES)

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
        # state_key() imports hashlib for the token's digest even without one
        self.assert_none_of(self.reused(), NETWORK, HASHING, CONFIGPARSER, CTYPES)

    def test_a_reused_verdict_with_the_example_config_loads_no_configparser(self):
        example = os.path.join(self.dir, "example.conf")
        write_file(example, "# all commented, as install.sh writes it\n"
                            "[gpu_preflight]\n# host = http://127.0.0.1:11434\n")
        modules = self.reused(["--config", example])
        self.assert_none_of(modules, NETWORK, CONFIGPARSER, CTYPES)

    def test_a_reused_verdict_with_a_token_loads_no_urllib(self):
        # hashlib is fair (the token's digest names the state); add_secret()
        # imports urllib.parse for the percent-encoded forms of the token
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
