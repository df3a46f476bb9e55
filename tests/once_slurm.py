"""The README's Slurm recipe, run by a real Slurm 22.05 (slurmctld, slurmd, munge).

HealthCheckTest: the README's health-check script (the ```sh block holding
"HealthCheckProgram", taken from README.md as it stands, not retyped) is
slurmd's HealthCheckProgram, run every 2 s. It calls /usr/local/bin/gpu_preflight
(a copy of gpu_preflight.py, mode 0755), which finds the Ollama emulator, the
fake NVIDIA driver and the syslog socket through /etc/gpu_preflight.conf: slurmd
runs the program with SLURMD_NODENAME alone in its environment, so a file is the
only way a site configures it. The GPU scenario is which fake libnvidia-ml.so.1
the configured path links to (one build per mode, FAKE_NVML_DEFAULT_MODE).
  - healthy GPU: the node stays in service; srun and sbatch jobs run;
  - a GPU threshold not met (exit 75): the node stays in service; jobs run;
  - driver not loaded (exit 69): the node is drained, reason "gpu_preflight: "
    and the tool's reason cut; a job submitted then stays pending, and the next
    healthy check resumes the node and the job runs;
  - a node an admin drained ("maintenance") stays drained through healthy checks;
  - a bug (exit 70, planted in the installed copy) leaves the node in service
    and its line in slurmd's log;
  - a bad config value (exit 78) leaves the node in service, and drains it
    once the script says DRAIN_ON_78=yes;
  - every check's wall time under slurmd (its RPC to the script's end, from
    slurmd's own log) is well inside HealthCheckProgram's 60 s limit.
The node's name differs from the host name (slurmd -N), as on clusters whose
NodeName is not `hostname -s`.

PrologTest: the README's advice for a Prolog (the GPU stage and no warm-up
only: gpu_preflight --gpu --warmup off) run as slurmd's Prolog: a ready GPU lets
the job run; a busy GPU (75) drains the node ("Prolog error") and the batch job
is requeued held, which is why the README keeps the preflight out of the Prolog.

Everything runs in a private mount namespace (tests/daemons.py): an overlay
over /etc (gpu_preflight.conf, slurm/, munge/ with a key of its own), a tmpfs
over /run, a temp directory bound onto /usr/local; daemons on free loopback
ports, stopped by PID. Root only; under CI=true a missing tool fails.
Run once per suite, under /usr/bin/python3 (tests/run.py runs once_*.py so).
"""

import os
import re
import shutil
import sys
import tempfile
import time
import unittest

import daemons
import fakes
import support
from ollama_emu import Emulator

HEALTH_INTERVAL = 2             # HealthCheckInterval here (the README: 300)
HEALTH_LIMIT = 60.0             # slurmd kills a HealthCheckProgram after 60 s
FAKE_DIR = "lib/gpfl-fake-nvml"  # under /usr/local
MODES = ("free", "busy", "nodriver")
SITE_CONF = """[gpu_preflight]
# what a site sets once for every caller: here the emulator, the fake
# driver, a GPU threshold and the test's syslog socket
host = %(host)s
gpu-backend = nvml
nvml-lib = /usr/local/%(fake)s/libnvidia-ml.so.1
max-util = 50
syslog-address = %(sock)s
"""
SYSLOG_RE = re.compile(r"^<\d+>[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d gpu_preflight\[\d+\]: (.*)$",
                       re.S)


def readme_health_check():
    """(path, text) of the README's HealthCheckProgram script."""
    with open(os.path.join(support.REPO, "README.md")) as handle:
        text = handle.read()
    blocks = [body for info, body in re.findall(r"^```(\w*)\n(.*?)^```$", text,  # novermin
                                                re.M | re.S)
              if info == "sh" and "HealthCheckProgram" in body]
    assert len(blocks) == 1, "README: %d sh blocks name HealthCheckProgram" % len(blocks)
    path = re.search(r"^# (/\S+) \(HealthCheckProgram=", blocks[0], re.M)
    assert path, "README: the health-check script does not name its path"
    return path.group(1), blocks[0]


class SlurmCase(unittest.TestCase):
    """One cluster per class; conf_lines() and etc_files() add to it."""

    maxDiff = None
    cluster = emu = sink = None

    @classmethod
    def setUpClass(cls):
        daemons.require_namespaces()
        daemons.tools(daemons.SLURM_TOOLS + ("cc",))
        daemons.need(os.access("/usr/bin/python3", os.X_OK),
                     "/usr/bin/python3 (what slurmd's /usr/bin/env finds) is missing")
        cls.work = daemons.root_dir(tempfile.mkdtemp(prefix="gpfl-slurm-"))
        try:
            cls.build()
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def build(cls):
        usr_local = daemons.root_dir(os.path.join(cls.work, "usr-local"))
        bin_dir = daemons.root_dir(os.path.join(usr_local, "bin"))
        shutil.copyfile(support.SCRIPT, os.path.join(bin_dir, "gpu_preflight"))
        os.chmod(os.path.join(bin_dir, "gpu_preflight"), 0o755)
        fake = daemons.root_dir(os.path.join(usr_local, FAKE_DIR))
        for mode in MODES:
            folder = daemons.root_dir(os.path.join(fake, "modes", mode))
            fakes.build_fake_nvml(folder, default_mode=mode)
        cls.fake_link = os.path.join(fake, "libnvidia-ml.so.1")
        cls.set_gpu("free")
        cls.sink = support.SyslogSink()
        cls.lines = []
        cls.emu = Emulator(mode="healthy").start()
        etc = {"gpu_preflight.conf": (SITE_CONF % {
            "host": cls.emu.url, "fake": FAKE_DIR, "sock": cls.sink.path}, 0o644)}
        etc.update(cls.etc_files())
        cls.cluster = daemons.SlurmCluster(cls.work, etc, usr_local, cls.conf_lines())
        cls.cluster.start()
        cls.jobs = daemons.root_dir(os.path.join(cls.work, "jobs"))

    @classmethod
    def tearDownClass(cls):
        if cls.cluster is not None:
            cls.cluster.close()
        if cls.emu is not None:
            cls.emu.stop()
        if cls.sink is not None:
            cls.sink.close()
        shutil.rmtree(cls.work, ignore_errors=True)

    @classmethod
    def set_gpu(cls, mode):
        """Point the configured libnvidia-ml.so.1 at the fake of this mode
        (an atomic rename of a symlink, as the real library is one)."""
        tmp = cls.fake_link + ".new"
        os.symlink(os.path.join("modes", mode, "libnvidia-ml.so.1"), tmp)
        os.replace(tmp, cls.fake_link)

    def verdicts(self):
        """Every gpu_preflight syslog line so far, parsed."""
        for message in self.sink.messages(wait=0.05):
            match = SYSLOG_RE.match(message)
            self.assertTrue(match, "not gpu_preflight's syslog format: %r" % message)
            self.lines.append(support.parse_fields(match.group(1)))
        return self.lines

    def wait_verdicts(self, since, code, count, timeout):
        """count syslog lines after the first `since` with exit code `code`
        (any other code in between fails); returns them."""
        def enough():
            new = self.verdicts()[since:]
            wrong = [v for v in new if v.get("code") != str(code)]
            # a check that began before the scenario changed may still report
            # the old verdict: only the first new line may differ
            self.assertLessEqual(len(wrong), 1 if wrong == new[:1] else 0, new)
            right = [v for v in new if v.get("code") == str(code)]
            return right if len(right) >= count else None
        return daemons.wait_for("%d check(s) with exit %d" % (count, code), enough, timeout)

    def submit(self, name):
        """sbatch a job that leaves a marker file; (job id, marker path)."""
        marker = os.path.join(self.jobs, name)
        return self.cluster.sbatch("touch %s" % marker), marker

    def wait_ran(self, job_id, marker, timeout=30):
        daemons.wait_for("job %s to run" % job_id, lambda: os.path.exists(marker), timeout)

    def settled(self, what):
        """The node's state once no job is on it: a job stays allocated a while
        after its marker appears, then completing while slurmd reports its end
        (longer when loaded: "allocated" failed an idle check, and RESUME on a
        node still completing is "Invalid node state specified")."""
        return daemons.wait_for(what, lambda: (lambda s: s if s[0] not in (
            "allocated", "mixed", "completing") else None)(self.cluster.state()), 30)


class HealthCheckTest(SlurmCase):
    timings = []

    @classmethod
    def conf_lines(cls):
        cls.script_path = readme_health_check()[0]
        return ["HealthCheckProgram=%s" % cls.script_path,
                "HealthCheckInterval=%d" % HEALTH_INTERVAL]

    @classmethod
    def etc_files(cls):
        path, text = readme_health_check()
        assert path.startswith("/etc/"), path
        return {path[len("/etc/"):]: (text, 0o755)}

    @classmethod
    def tearDownClass(cls):
        if cls.cluster is not None:
            runs = cls.cluster.health_check_runs()
            if runs:
                took = sorted(t for t, _ in runs)
                sys.stderr.write("\nslurm health check wall time over %d runs: min %.3f s, "
                                 "median %.3f s, max %.3f s\n" % (
                                     len(took), took[0], took[len(took) // 2], took[-1]))
        super(HealthCheckTest, cls).tearDownClass()

    def setUp(self):
        state = self.settled("the node free of the jobs of the test before")
        if state[0] != "idle":
            self.cluster.resume()

    def tearDown(self):
        self.set_gpu("free")

    def assert_in_service(self):
        state, reason = self.cluster.state()     # completing: a job's epilog runs
        self.assertIn(state, ("idle", "mixed", "allocated", "completing"), (state, reason))
        self.assertEqual(reason, "none")

    def test_1_healthy_gpu_keeps_the_node_in_service(self):
        since = len(self.verdicts())
        ready = self.wait_verdicts(since, 0, 3, 6 * HEALTH_INTERVAL + 10)
        self.assertEqual(ready[-1]["result"], "ready")
        self.assertEqual(ready[-1]["gpu_backend"], "nvml")
        self.assertEqual(ready[-1]["host"], self.emu.url)
        self.assert_in_service()
        out = self.cluster.run(["srun", "-N1", "-t1", "--immediate=30", "/bin/echo",
                                "srun-ran"], timeout=60)
        self.assertIn("srun-ran", out)
        job_id, marker = self.submit("healthy")
        self.wait_ran(job_id, marker)
        self.assert_in_service()

    def test_2_busy_gpu_75_keeps_the_node_in_service(self):
        since = len(self.verdicts())
        self.set_gpu("busy")
        busy = self.wait_verdicts(since, 75, 3, 6 * HEALTH_INTERVAL + 10)
        self.assertEqual(busy[-1]["stage"], "gpu")
        self.assertIn("busy, limit 50 (--max-util)", busy[-1]["reason"])
        self.assert_in_service()           # two whole checks ended before the third
        job_id, marker = self.submit("busy")
        self.wait_ran(job_id, marker)
        self.assert_in_service()

    def wait_slurmd_log(self, text, timeout=15):
        """Wait for slurmd to log text: it logs a health check's output after
        the program exits, and the syslog line the test waited on comes first."""
        daemons.wait_for("slurmd to log %r" % text,
                         lambda: text in self.cluster.log("slurmd.log"), timeout)

    def wait_state(self, what, states, timeout=15):
        """The node's (state, reason) once its state is one of states."""
        return daemons.wait_for(what, lambda: (
            lambda s: s if s[0] in states else None)(self.cluster.state()), timeout)

    def test_3_driver_not_loaded_drains_the_node_and_ready_resumes_it(self):
        since = len(self.verdicts())
        self.set_gpu("nodriver")
        failed = self.wait_verdicts(since, 69, 1, 6 * HEALTH_INTERVAL + 10)
        self.assertEqual(failed[0]["stage"], "gpu")
        self.assertIn("driver not loaded", failed[0]["reason"].lower())
        state = self.wait_state("the node drained", ("drained", "draining"))
        # the tool's reason, its first 60 characters (all of them safe here)
        self.assertEqual(state[1], "gpu_preflight: " + failed[0]["reason"][:60])
        shown = self.cluster.run(["scontrol", "show", "node", self.cluster.NODE])
        self.assertRegex(shown, r"State=IDLE\+DRAIN ")
        self.assertIn("Reason=gpu_preflight: NVIDIA driver not loaded", shown)
        self.wait_slurmd_log("health_check failed: rc:69 output:gpu_preflight exit 69: "
                             "drained " + self.cluster.NODE)

        job_id, marker = self.submit("drained")
        ends_at = time.monotonic() + 2 * HEALTH_INTERVAL + 4   # scheduler passes
        while time.monotonic() < ends_at:
            job = self.cluster.job(job_id)
            self.assertEqual(job.get("JobState"), "PENDING", job)
            self.assertFalse(os.path.exists(marker), "a job ran on a drained node")
            time.sleep(0.5)

        # The script resumes a node it drained itself at the next ready check.
        self.set_gpu("free")
        self.wait_state("the node resumed by a ready check", ("idle", "mixed", "allocated"),
                        4 * HEALTH_INTERVAL + 10)
        self.wait_ran(job_id, marker)

    def test_5_a_node_an_admin_drained_stays_drained_after_ready(self):
        self.addCleanup(self.cluster.resume)
        self.cluster.run(["scontrol", "update", "NodeName=%s" % self.cluster.NODE,
                          "State=DRAIN", "Reason=maintenance"])
        since = len(self.verdicts())
        self.wait_verdicts(since, 0, 3, 6 * HEALTH_INTERVAL + 10)
        self.assertEqual(self.cluster.state(), ("drained", "maintenance"))
        # A failed check leaves the admin's reason alone (scontrol would replace
        # it, and the next ready check would then resume the node).
        self.addCleanup(self.set_gpu, "free")
        self.set_gpu("nodriver")
        since = len(self.verdicts())
        self.wait_verdicts(since, 69, 2, 6 * HEALTH_INTERVAL + 10)
        self.assertEqual(self.cluster.state(), ("drained", "maintenance"))
        self.wait_slurmd_log("gpu_preflight exit 69: %s drained for another reason, left "
                             "as it is" % self.cluster.NODE)
        self.set_gpu("free")
        since = len(self.verdicts())
        self.wait_verdicts(since, 0, 2, 6 * HEALTH_INTERVAL + 10)
        self.assertEqual(self.cluster.state(), ("drained", "maintenance"))

    def test_6_a_bug_70_leaves_the_node_in_service(self):
        # A real 70 comes only from a bug: plant one in the installed copy, as
        # test_contract.InternalErrorTest does in-process (Ollama's stages raise).
        installed = os.path.join(self.work, "usr-local", "bin", "gpu_preflight")
        with open(support.SCRIPT) as handle:
            text = handle.read()
        tail = '\nif __name__ == "__main__":'
        self.assertEqual(text.count(tail), 1)
        buggy = text.replace(tail, "\ndef planted(run, client):\n"
                             "    raise KeyError('planted')\n\n\n"
                             "APIS['ollama'] = APIS['ollama']._replace(check=planted)\n"
                             + tail)
        with open(installed + ".new", "w") as handle:
            handle.write(buggy)
        os.chmod(installed + ".new", 0o755)
        os.replace(installed + ".new", installed)
        self.addCleanup(shutil.copyfile, support.SCRIPT, installed)
        since = len(self.verdicts())
        bugs = self.wait_verdicts(since, 70, 3, 6 * HEALTH_INTERVAL + 10)
        self.assertIn("internal error: KeyError", bugs[-1]["reason"])
        self.assert_in_service()
        self.wait_slurmd_log("error: health_check failed: rc:70 output:gpu_preflight: skip "
                             "(70): internal error: KeyError: 'planted'\ngpu_preflight exit "
                             "70: %s left as it is\n" % self.cluster.NODE)
        job_id, marker = self.submit("bug")
        self.wait_ran(job_id, marker)

    def replace_etc(self, path, text, mode):
        """Replace /etc/PATH in the cluster's namespace (a rename: whole files
        only); returns the old text."""
        full = "/proc/%d/root/etc/%s" % (self.cluster.namespace.holder.pid, path)
        with open(full) as handle:
            old = handle.read()
        daemons.write_file(full + ".new", text, mode)
        os.replace(full + ".new", full)
        return old

    def test_7_a_config_error_78_drains_only_by_the_admins_choice(self):
        # an Ollama without models (78, "pull one"), the site's file otherwise
        # as it was (its syslog address too: a file that does not parse would
        # send the line to /dev/log)
        empty = Emulator(mode="healthy", models=()).start()
        self.addCleanup(empty.stop)
        with open("/proc/%d/root/etc/gpu_preflight.conf" % self.cluster.namespace.holder.pid) \
                as handle:
            conf = handle.read()
        self.assertEqual(conf.count("\nhost = %s\n" % self.emu.url), 1)
        self.replace_etc("gpu_preflight.conf", conf.replace(
            "\nhost = %s\n" % self.emu.url, "\nhost = %s\n" % empty.url), 0o644)
        self.addCleanup(self.replace_etc, "gpu_preflight.conf", conf, 0o644)
        since = len(self.verdicts())
        failed = self.wait_verdicts(since, 78, 3, 6 * HEALTH_INTERVAL + 10)
        self.assertIn("no models", failed[-1]["reason"])
        self.assert_in_service()
        self.wait_slurmd_log("gpu_preflight exit 78: %s left as it is" % self.cluster.NODE)

        path, script = readme_health_check()
        self.assertEqual(script.count("\nDRAIN_ON_78=no "), 1)
        old = self.replace_etc(path[len("/etc/"):], script.replace(
            "\nDRAIN_ON_78=no ", "\nDRAIN_ON_78=yes "), 0o755)
        self.addCleanup(self.replace_etc, path[len("/etc/"):], old, 0o755)
        state = self.wait_state("the node drained for 78", ("drained", "draining"),
                                4 * HEALTH_INTERVAL + 10)
        self.assertEqual(state[1][:41], "gpu_preflight: the server has no models: ")

    def test_4_every_check_ends_well_inside_the_60s_limit(self):
        runs = self.cluster.health_check_runs()
        self.assertGreaterEqual(len(runs), 3, self.cluster.log("slurmd.log")[-3000:])
        # the script exits with gpu_preflight's status after a drain or a bug
        self.assertEqual([rc for _, rc in runs if rc not in (0, 69, 70, None)], [])
        slowest = max(t for t, _ in runs)
        # --deadline 50 bounds gpu_preflight; scontrol is quick: 55 s is slack
        self.assertLess(slowest, 55.0, runs)
        elapsed = [int(v["elapsed_ms"]) for v in self.verdicts()]
        self.assertLess(max(elapsed), 50000, elapsed)


PROLOG = """#!/bin/sh
# The README's advice, taken at its word: in a Prolog, the GPU stage and
# no warm-up only. A non-zero exit drains the node and requeues the job held.
exec /usr/local/bin/gpu_preflight --gpu --warmup off -q
"""


class PrologTest(SlurmCase):
    def idle_again(self):
        """The node's state once its job has ended."""
        return self.settled("the node idle after its job")

    @classmethod
    def conf_lines(cls):
        return ["Prolog=/etc/slurm/prolog.sh"]

    @classmethod
    def etc_files(cls):
        return {"slurm/prolog.sh": (PROLOG, 0o755)}

    def test_prolog_runs_jobs_when_ready_and_a_busy_gpu_drains_the_node(self):
        job_id, marker = self.submit("prolog-ready")
        self.wait_ran(job_id, marker)
        self.assertEqual(self.verdicts()[-1]["code"], "0")
        self.assertEqual(self.idle_again(), ("idle", "none"))

        self.set_gpu("busy")
        self.addCleanup(self.set_gpu, "free")
        job_id, marker = self.submit("prolog-busy")
        state = daemons.wait_for("the node drained by the Prolog", lambda: (
            lambda s: s if s[0] in ("drained", "draining") else None)(
                self.cluster.state()), 30)
        self.assertEqual(state[1], "Prolog error")
        self.assertEqual(self.verdicts()[-1]["code"], "75")
        job = daemons.wait_for("the job requeued held", lambda: (
            lambda j: j if j.get("Reason") == "launch_failed_requeued_held" else None)(
                self.cluster.job(job_id)), 15)
        self.assertEqual((job["JobState"], job["Priority"]), ("PENDING", "0"), job)
        self.assertFalse(os.path.exists(marker), "the job ran although its Prolog failed")

        self.set_gpu("free")
        self.cluster.resume()
        # a requeued job becomes eligible only ~2 min later: bring that forward
        self.cluster.run(["scontrol", "update", "JobId=%s" % job_id, "StartTime=now"])
        self.cluster.run(["scontrol", "release", job_id])
        self.wait_ran(job_id, marker)
        self.assertEqual(self.idle_again(), ("idle", "none"))


if __name__ == "__main__":
    unittest.main()
