"""Files root reads configuration or secrets from, or loads code from, are
trusted only when no one else could have written them.

The model is OpenSSH's StrictModes: the file and every directory above it are
owned by root (or, not running as root, by the user or root) and writable by
no one else; a sticky world-writable directory such as /tmp is fine above an
entry that passes; a symlink is judged by its owner, its directory and what it
points to. Each test plants a file as another user (uid 65534, nobody) or
leaves it writable by others, runs the real script as root in cron's
environment, and asserts 78 naming the file and the fix, and that nothing was
sent, read or loaded. A library whose constructor leaves a marker file proves
that a refused NVML library never ran a byte as root, and that an accepted one
did (so the check can fail). Needs root (chown); CI runs as root.
"""

import json
import os
import shutil
import stat
import subprocess
import tempfile
import unittest

import fakes
import support
from test_contract import ContractCase

NOBODY = 65534

#: A libnvidia-ml.so.1 stand-in whose constructor proves it was loaded.
PLANTED_C = r"""
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void)
{
    const char *path = getenv("PLANTED_MARKER");
    int fd = path ? open(path, O_CREAT | O_WRONLY, 0600) : -1;
    if (fd >= 0)
        close(fd);
}
"""


class TrustCase(ContractCase):
    def setUp(self):
        ContractCase.setUp(self)
        if os.geteuid() != 0:
            self.skipTest("planting files as another user needs root")
        self.dir = tempfile.mkdtemp(prefix="gpfl-trust-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.emu = self.emulator()
        self.marker = os.path.join(self.dir, "planted-ran")

    def path(self, *parts):
        return os.path.join(self.dir, *parts)

    def write(self, path, text, mode=0o644, uid=0):
        with open(path, "w") as handle:
            handle.write(text)
        os.chmod(path, mode)
        os.chown(path, uid, uid)
        return path

    def mkdir(self, path, mode=0o755, uid=0):
        os.mkdir(path)
        os.chmod(path, mode)
        os.chown(path, uid, uid)
        return path

    def planted_lib(self, directory, uid=0, mode=0o755):
        support.require_tool(self, "cc")
        source = self.write(self.path("planted.c"), PLANTED_C)
        lib = os.path.join(directory, "libnvidia-ml.so.1")
        subprocess.check_call([fakes.find_compiler(), "-shared", "-fPIC", "-o", lib, source])
        os.chmod(lib, mode)
        os.chown(lib, uid, uid)
        return lib

    def config(self, text, directory=None, **kwargs):
        return self.write(os.path.join(directory or self.dir, "gp.conf"),
                          "[gpu_preflight]\nhost = %s\n%s" % (self.emu.url, text), **kwargs)

    def refused(self, args, text, env=None, stage="config"):
        res = self.run_gp(args, env=support.cron_env(PLANTED_MARKER=self.marker,
                                                     **(env or {})))
        fields = self.assertSkip(res, 78, stage, text)
        self.assertEqual(self.emu.requests, [], "a request went out")
        self.assertFalse(os.path.exists(self.marker), "the planted library ran as root")
        return fields


class ConfigFileTest(TrustCase):
    def test_a_config_file_another_user_owns_is_refused_and_its_library_never_loaded(self):
        lib = self.planted_lib(self.mkdir(self.path("lib")))
        conf = self.config("nvml-lib = %s\n" % lib, uid=NOBODY)
        fields = self.refused(["--config", conf], "config file %s: others could have "
                              "written it: %s is owned by uid 65534" % (conf, conf))
        self.assertIn("chown root %s" % conf, fields["reason"])

    def test_a_config_file_others_can_write_is_refused(self):
        conf = self.config("gpu = yes\n", mode=0o666)
        self.refused(["--config", conf], "is writable by group or others (mode 0666): "
                     "chmod go-w %s" % conf)
        conf = self.config("gpu = yes\n", mode=0o620)
        self.sink.messages(wait=0.01)
        self.refused(["--config", conf], "(mode 0620)")

    def test_a_directory_above_that_others_can_write_is_refused_unless_sticky(self):
        open_dir = self.mkdir(self.path("open"), 0o777)
        conf = self.config("", directory=open_dir)
        self.refused(["--config", conf], "%s is writable by group or others (mode 0777)"
                     % open_dir)
        sticky = self.mkdir(self.path("sticky"), 0o1777)
        conf = self.config("", directory=sticky)
        res = self.run_gp(["--config", conf])
        self.assertEqual(res.code, 0, res)

    def test_a_symlink_another_user_planted_is_refused(self):
        conf = self.config("", mode=0o600)
        theirs = self.mkdir(self.path("theirs"), uid=NOBODY)
        link = os.path.join(theirs, "gp.conf")
        os.symlink(conf, link)
        self.refused(["--config", link], "%s is owned by uid 65534" % theirs)
        os.lchown(link, NOBODY, NOBODY)
        mine = self.mkdir(self.path("mine"))
        mylink = os.path.join(mine, "gp.conf")
        os.symlink(link, mylink)             # root's link to the planted link
        self.sink.messages(wait=0.01)
        self.refused(["--config", mylink], "owned by uid 65534")

    def test_a_symlink_root_made_is_followed(self):
        conf = self.config("timeout = 2\n", mode=0o600)
        mine = self.mkdir(self.path("mine"))
        os.symlink(os.path.join("..", "gp.conf"), os.path.join(mine, "gp.conf"))
        res = self.run_gp(["--config", os.path.join(mine, "gp.conf")])
        self.assertEqual(res.code, 0, res)


class TokenFileTest(TrustCase):
    def test_a_token_file_reached_through_another_users_symlink_is_never_sent(self):
        secret = self.write(self.path("root-only"), "root-secret-contents\n", mode=0o600)
        theirs = self.mkdir(self.path("theirs"), uid=NOBODY)
        link = os.path.join(theirs, "token")
        os.symlink(secret, link)
        os.lchown(link, NOBODY, NOBODY)
        fields = self.refused(["--host", self.emu.url, "--token-file", link],
                              "cannot read token file %s: others could have written it"
                              % link)
        self.assertNotIn("root-secret", fields["reason"])

    def test_a_token_file_another_user_owns_is_refused(self):
        token = self.write(self.path("token"), "abc\n", mode=0o600, uid=NOBODY)
        self.refused(["--host", self.emu.url, "--token-file", token],
                     "owned by uid 65534")

    def test_a_dotdot_after_a_symlink_is_judged_where_the_kernel_goes(self):
        # --token-file DIR/link/../token: os.path.abspath() drops "link/..",
        # so the check passes root's DIR/token while the kernel opens the
        # token beside the link's target, in another user's directory
        secret = self.write(self.path("root-only"), "root-secret-contents\n", 0o600)
        theirs = self.mkdir(self.path("theirs"), uid=NOBODY)
        sub = self.mkdir(os.path.join(theirs, "sub"), uid=NOBODY)
        os.symlink(secret, os.path.join(theirs, "token"))
        os.lchown(os.path.join(theirs, "token"), NOBODY, NOBODY)
        etc = self.mkdir(self.path("etc"))
        os.symlink(sub, os.path.join(etc, "current"))        # root's own link
        self.write(os.path.join(etc, "token"), "roots-token\n", 0o600)
        server = support.ScriptedServer(self, lambda method, path, token: (
            401, json.dumps({"error": "got " + token}).encode("ascii"), []))
        path = os.path.join(etc, "current", "..", "token")
        with open(path) as handle:
            self.assertEqual(handle.read(), "root-secret-contents\n")   # the premise
        res = self.run_gp(["--api", "openai", "--host", server.url, "--token-file", path,
                           "--json"], env=support.cron_env())
        self.assertNotIn("root-secret-contents", server.seen, "root sent its secret")
        self.assertEqual(res.code, 78, res)
        self.assertIn("others could have written it", json.loads(res.stdout)["reason"])


class CafileTest(TrustCase):
    def test_a_ca_file_another_user_owns_is_refused(self):
        ca = self.write(self.path("ca.pem"), "not read\n", uid=NOBODY)
        self.refused(["--host", "https://127.0.0.1:9", "--cafile", ca],
                     "cannot use --cafile %s: others could have written it" % ca)


class NvmlLibraryTest(TrustCase):
    def gpu_args(self, *extra):
        return ["--host", self.emu.url, "--gpu-backend", "nvml"] + list(extra)

    def test_an_nvml_library_others_could_write_is_never_loaded(self):
        for uid, mode, text in ((NOBODY, 0o755, "owned by uid 65534"),
                                (0, 0o775, "writable by group or others (mode 0775)")):
            with self.subTest(uid=uid, mode=mode):
                self.sink.messages(wait=0.01)
                lib = self.planted_lib(tempfile.mkdtemp(dir=self.dir), uid, mode)
                self.refused(self.gpu_args("--nvml-lib", lib), "NVML library %s: others "
                             "could have written it" % lib, stage="gpu")

    def test_a_library_found_by_the_search_in_another_users_directory_is_never_loaded(self):
        theirs = self.mkdir(self.path("theirs"), uid=NOBODY)
        self.planted_lib(theirs)
        self.refused(self.gpu_args(), "NVML library %s/libnvidia-ml.so.1: others could "
                     "have written it: %s is owned by uid 65534" % (theirs, theirs),
                     env=dict(LD_LIBRARY_PATH=theirs), stage="gpu")

    def test_a_library_name_without_a_path_is_refused_and_nothing_loaded(self):
        """--nvml-lib libnvidia-ml.so.1: dlopen, given a bare name, searches
        LD_LIBRARY_PATH, so judging the file of that name in the working
        directory (here root's, trusted) would let root run the constructor of
        a library nobody owns. A path that is not absolute is refused at once:
        64 for the flag, 78 from the environment."""
        cwd = self.mkdir(self.path("cwd"))
        self.write(os.path.join(cwd, "libnvidia-ml.so.1"), "")
        theirs = self.mkdir(self.path("theirs"), uid=NOBODY)
        self.planted_lib(theirs, uid=NOBODY)
        text = "'libnvidia-ml.so.1': give the library's absolute path"
        env = support.cron_env(PLANTED_MARKER=self.marker, LD_LIBRARY_PATH=theirs)
        res = self.run_gp(self.gpu_args("--nvml-lib", "libnvidia-ml.so.1"), env, cwd=cwd)
        self.assertFalse(os.path.exists(self.marker), "the planted library ran as root")
        self.assertEqual(res.code, 64, res)
        self.assertIn("--nvml-lib: " + text, res.stderr)
        self.sink.messages(wait=0.01)
        env["GPU_PREFLIGHT_NVML_LIB"] = "libnvidia-ml.so.1"
        res = self.run_gp(self.gpu_args(), env, cwd=cwd)
        self.assertFalse(os.path.exists(self.marker), "the planted library ran as root")
        self.assertSkip(res, 78, "config", "GPU_PREFLIGHT_NVML_LIB: " + text)

    def test_a_trusted_library_is_loaded(self):
        lib = self.planted_lib(self.mkdir(self.path("lib")))
        res = self.run_gp(self.gpu_args("--nvml-lib", lib),
                          env=support.cron_env(PLANTED_MARKER=self.marker))
        self.assertTrue(os.path.exists(self.marker), "the marker proves nothing")
        self.assertEqual(res.code, 69, res)     # no NVML symbols in it


class LockFileTest(TrustCase):
    def test_a_lock_another_user_created_first_is_refused(self):
        sticky = self.mkdir(self.path("lock"), 0o1777)
        lock = self.write(os.path.join(sticky, "gpu0.lock"), "", uid=NOBODY)
        res = self.run_gp(["--host", self.emu.url, "--lock", lock, "--", "/bin/true"])
        self.assertSkip(res, 78, "lock", "lock file %s is owned by uid 65534 (nobody)"
                        % lock)
        os.chown(lock, 0, 0)
        res = self.run_gp(["--host", self.emu.url, "--lock", lock, "--", "/bin/true"])
        self.assertEqual(res.code, 0, res)

    def test_a_hard_link_at_the_lock_path_is_refused_and_its_file_left_alone(self):
        """A lock path that is another name of a root file (a hard link in a
        sticky directory to /etc/passwd, say) was chmod-ed 0600 and locked;
        now 78, the file untouched. nobody plants the link where
        fs.protected_hardlinks=0 lets it; where that is 1 (the usual default)
        root makes it: the tool must not use it, whoever made it."""
        os.chmod(self.dir, 0o755)               # nobody may reach the target
        target = self.write(self.path("passwd"), "root:x:0:0::/root:/bin/sh\n")
        lock = os.path.join(self.mkdir(self.path("lock"), 0o1777), "gpu0.lock")
        setpriv = support.require_tool(self, "setpriv")
        if subprocess.call([setpriv, "--reuid=%d" % NOBODY, "--regid=%d" % NOBODY,
                            "--clear-groups", "/bin/ln", target, lock],
                           stderr=subprocess.DEVNULL) != 0:
            os.link(target, lock)               # protected_hardlinks refused nobody
        res = self.run_gp(["--host", self.emu.url, "--lock", lock, "--", "/bin/true"])
        self.assertSkip(res, 78, "lock", "lock file %s: it has 2 names (a hard link" % lock)
        self.assertEqual(stat.S_IMODE(os.stat(target).st_mode), 0o644)

    def test_another_user_cannot_hold_roots_lock_in_a_root_only_directory(self):
        # a lock root creates 0644 could be opened read-only and flocked by
        # any user, and every root run would be 75 "locked by another job"
        lock = self.path("gpu0.lock")          # self.dir: root's, 0700
        os.chmod(self.dir, 0o755)
        res = self.run_gp(["--host", self.emu.url, "--lock", lock, "--", "/bin/true"])
        self.assertEqual(res.code, 0, res)
        self.sink.messages(wait=0.01)
        setpriv = support.require_tool(self, "setpriv")     # exec, not a fork of this
        holder = subprocess.Popen(
            [setpriv, "--reuid=%d" % NOBODY, "--regid=%d" % NOBODY, "--clear-groups",
             "/usr/bin/python3", "-c", "import fcntl, os, sys, time\n"
             "try:\n    fd = os.open(sys.argv[1], os.O_RDONLY)\n"
             "except OSError:\n    print('refused'); sys.exit(0)\n"
             "fcntl.flock(fd, fcntl.LOCK_EX); print('held'); sys.stdout.flush()\n"
             "time.sleep(30)", lock],
            stdout=subprocess.PIPE)
        self.addCleanup(holder.wait)
        self.addCleanup(holder.kill)
        said = holder.stdout.readline().decode().strip()
        res = self.run_gp(["--host", self.emu.url, "--lock", lock, "--", "/bin/true"])
        self.assertEqual(said, "refused")
        if res.code != 0:       # what the run logged says why (69 seen, rarely, in CI)
            self.fail("%r, logged: %r" % (res, self.sink.messages(wait=0.5)))


class NotRootTest(TrustCase):
    """Not running as root: the user's own files and root's are trusted."""

    def run_as(self, uid, args):
        os.chmod(self.dir, 0o755)
        script = self.path("gpu_preflight.py")
        shutil.copy(support.SCRIPT, script)
        proc = subprocess.Popen(
            support.prepared(["/usr/bin/python3", script, "--no-syslog", "--json"] + args,
                             uid=uid),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            env=support.cron_env(), cwd="/")
        out, err = proc.communicate(timeout=30)
        return proc.returncode, out.decode(), err.decode()

    def test_the_users_own_and_roots_files_pass_anothers_do_not(self):
        for uid, code in ((NOBODY, 0), (0, 0), (1, 78)):
            with self.subTest(owner=uid):
                conf = self.config("timeout = 2\n", uid=uid)
                status, out, err = self.run_as(NOBODY, ["--config", conf])
                self.assertEqual(status, code, (out, err))
                if code:
                    self.assertIn("owned by uid 1 (daemon), not by this user or root",
                                  out)


class NvidiaSmiTrustTest(TrustCase):
    def test_an_nvidia_smi_others_could_write_is_never_run_as_root(self):
        # PATH's nvidia-smi is judged as LD_LIBRARY_PATH's NVML is
        theirs = self.mkdir(self.path("bin"), uid=NOBODY)
        smi = self.write(os.path.join(theirs, "nvidia-smi"), "#!/bin/sh\n: > \"%s\"\n"
                         "echo '0, GPU-x, NVIDIA H200, 00000000:61:00.0, 143771, 0, "
                         "143229, 0, 29'\n" % self.marker, 0o755, uid=NOBODY)
        res = self.run_gp(["--host", self.emu.url, "--gpu-backend", "nvidia-smi"],
                          env=support.cron_env(PATH=theirs + ":/usr/bin:/bin"))
        self.assertFalse(os.path.exists(self.marker), "%s ran as root" % smi)
        self.assertSkip(res, 78, "gpu", "others could have written it")


class MetricsFileTrustTest(TrustCase):
    def test_the_metrics_file_is_not_written_where_another_user_redirects_it(self):
        # Debian: /var/lib/prometheus is the prometheus user's, node-exporter
        # below it root's; that user swaps node-exporter for a symlink
        os.chmod(self.dir, 0o755)
        prom = self.mkdir(self.path("prometheus"), uid=NOBODY)
        self.mkdir(os.path.join(prom, "node-exporter"))
        victim = self.mkdir(self.path("victim"))
        subprocess.check_call(support.prepared(
            ["sh", "-c", 'mv "$0/node-exporter" "$0/old" && ln -s "$1" "$0/node-exporter"',
             prom, victim], uid=NOBODY))
        metrics = os.path.join(prom, "node-exporter", "gpu_preflight.prom")
        res = self.run_gp(["--host", self.emu.url, "--metrics-file", metrics])
        self.assertEqual(res.code, 0, res)
        self.assertEqual(os.listdir(victim), [], "root wrote through nobody's symlink")


class StateDirTrustTest(TrustCase):
    def test_no_state_under_a_directory_another_user_owns(self):
        # root with a user's XDG_RUNTIME_DIR (su without -): that user can swap
        # the state directory between the check and the read (a race that
        # plants a ready verdict); root must keep no state below it
        # (root's fallback, /run/gpu_preflight, is a tmpfs of this run's own)
        runtime = self.mkdir(self.path("run-user-1000"), 0o700, uid=NOBODY)
        unshare = support.require_tool(self, "unshare")
        res = support.run_script(
            ["--host", self.emu.url, "--share-result", "60", "--syslog-address",
             self.sink.path], env=support.cron_env(XDG_RUNTIME_DIR=runtime,
                                                   GPU_PREFLIGHT_STATE_DIR=None),
            wrapper=(unshare, "--mount", "--propagation", "private", "/bin/sh", "-c",
                     'mount -t tmpfs none /run && exec "$@"', "sh"))
        self.assertEqual(res.code, 0, res)
        self.assertEqual(os.listdir(runtime), [], "state kept under nobody's directory")


if __name__ == "__main__":
    unittest.main()
