"""The README's --metrics-file, served by a real prometheus-node-exporter.

Each test starts `prometheus-node-exporter --collector.disable-defaults
--collector.textfile --collector.textfile.directory=DIR
--web.listen-address=127.0.0.1:PORT` (a free port) on a directory of its own;
the real script (under /usr/bin/python3, in cron's environment) writes
DIR/gpu_preflight.prom with --metrics-file, and /metrics is scraped with urllib:
  - ready: gpu_preflight_ready 1, _exit_code 0, _consecutive_skips 0,
    _last_run_timestamp_seconds the time of the run, _stage_duration_seconds
    one sample per stage; every sample labelled host and model;
    node_textfile_scrape_error 0;
  - skips: 75 (the emulator busy) then 69 (its runner died): ready 0, the exit
    code, consecutive skips 1 then 2, back to 0 when ready again;
  - a rewrite during scrapes: runs in a loop (ready and 75 in turn) while
    /metrics is scraped over and over: every scrape parses, scrape_error stays
    0 and each scrape shows one whole file (ready 1 exactly when exit code 0),
    because the file is replaced by a rename, never written in place;
  - the control: a file cut mid-line does show as node_textfile_scrape_error 1,
    so the checks above can fail.
Two models (--model repeated) belong in TwoModels below.
Run once per suite, under /usr/bin/python3 (tests/run.py runs once_*.py so);
under CI=true a missing node exporter fails.
"""

import os
import shutil
import tempfile
import threading
import time
import unittest

import daemons
import support
from ollama_emu import Emulator

PYTHON = "/usr/bin/python3"
FAMILIES = ("gpu_preflight_ready", "gpu_preflight_last_run_timestamp_seconds",
            "gpu_preflight_exit_code", "gpu_preflight_stage_duration_seconds",
            "gpu_preflight_consecutive_skips")
MODEL = "llama3.2"


class NodeExporterCase(unittest.TestCase):
    maxDiff = None

    @classmethod
    def setUpClass(cls):
        cls.binary = daemons.tools((daemons.NODE_EXPORTER,))[daemons.NODE_EXPORTER]
        daemons.need(os.access(PYTHON, os.X_OK), "%s is missing" % PYTHON)

    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="gpfl-prom-")
        self.addCleanup(shutil.rmtree, self.work, True)
        self.textfiles = os.path.join(self.work, "textfile")
        self.state = os.path.join(self.work, "state")
        os.mkdir(self.textfiles, 0o755)
        self.metrics = os.path.join(self.textfiles, "gpu_preflight.prom")
        # a runner that died unloads the model: reload quickly (not 5 s)
        self.emu = Emulator(mode="healthy", load_seconds=0.5).start()
        self.addCleanup(self.emu.stop)
        self.exporter = daemons.NodeExporter(self.binary, self.textfiles,
                                             os.path.join(self.work, "exporter.log"))
        self.addCleanup(self.exporter.stop)
        self.exporter.wait_ready()

    def run_gp(self, *extra):
        res = support.run_script(
            ["--host", self.emu.url, "--model", MODEL, "--metrics-file", self.metrics,
             "--state-dir", self.state, "--no-syslog"] + list(extra), python=PYTHON)
        self.assertEqual(res.stdout + res.stderr, "", res)
        return res.code

    def scrape(self):
        """One scrape, parsed; node_textfile_scrape_error must be 0 and every
        family there, each sample labelled with this check's host and model."""
        text = self.exporter.scrape()
        samples = daemons.parse_exposition(text)
        self.assertEqual(samples.get("node_textfile_scrape_error"), [({}, 0.0)],
                         self.exporter.log()[-2000:])
        self.assertEqual(samples.get("node_textfile_mtime_seconds", [({}, 0)])[0][0],
                         {"file": self.metrics})
        for family in FAMILIES:
            self.assertIn(family, samples, text)
            for labels, _ in samples[family]:
                self.assertEqual((labels.get("host"), labels.get("model")),
                                 (self.emu.url, MODEL), family)
        return samples

    def one(self, samples, family):
        self.assertEqual(len(samples[family]), 1, samples[family])
        return samples[family][0][1]

    def stages(self, samples):
        return [labels["stage"] for labels, _ in
                samples["gpu_preflight_stage_duration_seconds"]]


class ReadyAndSkips(NodeExporterCase):
    def test_ready(self):
        before = time.time()
        self.assertEqual(self.run_gp(), 0)
        after = time.time()
        samples = self.scrape()
        self.assertEqual(self.one(samples, "gpu_preflight_ready"), 1)
        self.assertEqual(self.one(samples, "gpu_preflight_exit_code"), 0)
        self.assertEqual(self.one(samples, "gpu_preflight_consecutive_skips"), 0)
        stamp = self.one(samples, "gpu_preflight_last_run_timestamp_seconds")
        self.assertTrue(before - 1 <= stamp <= after + 1, (before, stamp, after))
        # node_exporter orders samples by label values
        self.assertEqual(sorted(self.stages(samples)),
                         ["loaded", "placement", "tags", "warmup"])
        for labels, value in samples["gpu_preflight_stage_duration_seconds"]:
            self.assertTrue(0 <= value < 10, (labels, value))
        self.assertEqual(os.stat(self.metrics).st_mode & 0o777, 0o644)

    def test_skips_75_then_69_count_up_and_ready_resets(self):
        for mode, code, skips, stage in (("busy", 75, 1, "warmup"),
                                         ("runner_died", 69, 2, "warmup"),
                                         ("healthy", 0, 0, None)):
            self.emu.mode = mode
            self.assertEqual(self.run_gp(), code, mode)
            samples = self.scrape()
            self.assertEqual(self.one(samples, "gpu_preflight_ready"), int(code == 0), mode)
            self.assertEqual(self.one(samples, "gpu_preflight_exit_code"), code, mode)
            self.assertEqual(self.one(samples, "gpu_preflight_consecutive_skips"), skips,
                             mode)
            if stage:   # the stages run until the one that failed
                self.assertEqual(self.stages(samples)[-1:], [stage], mode)

    def test_a_torn_file_would_show_as_a_scrape_error(self):
        """The control: a file cut mid-line is what an in-place write can
        expose; node_exporter reports it, so the checks here can fail."""
        self.assertEqual(self.run_gp(), 0)
        with open(self.metrics) as handle:
            text = handle.read()
        with open(os.path.join(self.textfiles, "torn.prom"), "w") as handle:
            handle.write(text[:len(text) // 2 + 7])
        samples = daemons.parse_exposition(self.exporter.scrape())
        self.assertEqual(samples["node_textfile_scrape_error"], [({}, 1.0)])


class RewriteDuringScrapes(NodeExporterCase):
    RUNS = 24

    def test_every_scrape_sees_one_whole_file(self):
        self.assertEqual(self.run_gp(), 0)
        codes, failure = [], []

        def runs():
            try:
                for i in range(self.RUNS):
                    self.emu.mode = "busy" if i % 2 else "healthy"
                    codes.append(self.run_gp())
            except BaseException as exc:    # reported by the main thread
                failure.append(exc)

        thread = threading.Thread(target=runs)
        thread.start()
        scrapes, stamps, seen = 0, set(), set()
        try:
            while thread.is_alive():
                samples = self.scrape()
                ready = self.one(samples, "gpu_preflight_ready")
                code = self.one(samples, "gpu_preflight_exit_code")
                self.assertEqual(ready, int(code == 0), samples)
                self.assertIn(code, (0, 75))
                self.assertEqual(self.stages(samples)[-1:] if code else
                                 sorted(self.stages(samples)),
                                 ["warmup"] if code else
                                 ["loaded", "placement", "tags", "warmup"])
                stamps.add(self.one(samples, "gpu_preflight_last_run_timestamp_seconds"))
                seen.add(code)
                scrapes += 1
        finally:
            thread.join()
        self.assertEqual(failure, [])
        self.assertEqual(codes, [75 if i % 2 else 0 for i in range(self.RUNS)])
        # the file really changed under the scrapes, many times
        self.assertGreaterEqual(scrapes, self.RUNS, scrapes)
        self.assertGreaterEqual(len(stamps), self.RUNS // 2, (scrapes, len(stamps)))
        self.assertEqual(seen, set([0, 75]))
        self.assertEqual(sorted(os.listdir(self.textfiles)), ["gpu_preflight.prom"],
                         "temporary files left in the textfile directory")


class TwoModels(NodeExporterCase):
    """The case of --model repeated goes here: one run checking two
    models writes one file whose every family carries a sample per model
    (label model=...), and node_textfile_scrape_error stays 0. scrape()
    checks the labels of one model; give it the expected set when it lands.
    No test until then (a placeholder would skip, and CI counts a skip as a
    failure)."""


if __name__ == "__main__":
    unittest.main()
