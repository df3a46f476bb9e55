"""The GPU stage against fake drivers: a fake libnvidia-ml.so.1 built from
tests/fake_nvml.c with the machine's cc, a fake nvidia-smi on PATH and a fake
amdgpu sysfs tree (tests/fakes.py). Each scenario runs the real script in
cron's environment and checks exit status, reason, figures and time.
"""

import fcntl
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import uuid

import fakes
import support
from ollama_emu import Model
from test_contract import SLACK, ContractCase, VerdictCase
from test_trust import TrustCase

#: The fakes' figures (tests/fake_nvml.c): MiB.
TOTAL, RESERVED, BUSY_USED = 143771, 542, 102400
FREE = TOTAL - RESERVED
UUID = "GPU-%s-5e1f-4c2d-9a7b-0123456789ab"


def gpu_uuid(index):
    return UUID % ("abcdef"[index] * 8)


class GpuCase(ContractCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="gpfl-gpu-")
        cls.case = unittest.TestCase()
        support.require_tool(cls.case, "cc")
        cls.lib = fakes.build_fake_nvml(cls.dir)
        os.makedirs(os.path.join(cls.dir, "old"))
        cls.old_lib = fakes.build_fake_nvml(os.path.join(cls.dir, "old"), "old")
        cls.smi_dir = os.path.join(cls.dir, "bin")
        os.makedirs(cls.smi_dir)
        fakes.write_fake_smi(cls.smi_dir)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def setUp(self):
        ContractCase.setUp(self)
        self.token = uuid.uuid4().hex      # finds leftover probe processes
        # Nothing loaded at start: the GPU stage sees the GPU as the test's mode
        # makes it; the warm-up's load puts the runner on GPU 0, where the fake
        # NVML lists it (FAKE_NVML_RUNNERS), as a real Ollama's runner would be.
        self.runners = os.path.join(self.dir, "runners-" + self.token)
        self.emu = self.emulator(loaded=(), load_seconds=0.05, gpu_file=self.runners)

    def gpu(self, args, env=(), deadline=None):
        """Run with the fakes; return (Result, the --json verdict)."""
        environ = support.cron_env(GPFL_TEST_TOKEN=self.token,
                                   **dict(dict(FAKE_NVML_RUNNERS=self.runners), **dict(env)))
        args = ["--host", self.emu.url, "--json"] + list(args)
        if deadline:
            args += ["--timeout", str(deadline / 2.0), "--deadline", str(deadline)]
        self.requests_before = len(self.emu.requests)
        res = self.run_gp(args, env=environ)
        self.assertEqual(res.stderr, "", res)
        doc = json.loads(res.stdout)
        if deadline:    # the run's own clock, from its process start: a machine
            # loaded by a second suite delayed the test's own wait by 6 s
            self.assertLess(doc["elapsed_ms"], (deadline + SLACK) * 1000, res)
            self.assertLess(res.elapsed, deadline + 30, res)    # no hang
        self.assertEqual(self.probes_left(), [], "probe left running")
        return res, doc

    # The runs of nvml() and smi() have 10 s: a placement read again after a
    # load needs more than 1 s left when the load ends, which under 4 s a
    # machine running every suite at once could miss. The hangs they meet are
    # cut by --gpu-timeout, which those tests set.
    def nvml(self, args=(), mode="free", lib=None, **env):
        env = dict(env, FAKE_NVML_MODE=mode)
        return self.gpu(["--gpu-backend", "nvml", "--nvml-lib", lib or self.lib]
                        + list(args), env, deadline=10)

    def smi(self, args=(), mode="free", **env):
        env = dict(env, FAKE_SMI_MODE=mode, PATH=self.smi_dir + ":/usr/bin:/bin")
        return self.gpu(["--gpu-backend", "nvidia-smi"] + list(args), env, deadline=10)

    def nvidia_sysfs(self, count):
        """A GPU_PREFLIGHT_ROOT whose sysfs lists count NVIDIA GPUs on buses
        0x61.. (the fakes' bus ids), each GPU's audio function and an NVSwitch."""
        root = tempfile.mkdtemp(dir=self.dir)
        for index in range(count):
            fakes.add_pci_display(root, fakes.pci_bus_id(index)[4:].lower(), "0x10de")
            fakes.add_pci_display(root, fakes.pci_bus_id(index)[4:-1].lower() + "1",
                                  "0x10de", "0x040300")
        fakes.add_pci_display(root, "0000:05:00.0", "0x10de", "0x068000")
        return root

    def probes_left(self, wait=5.0):
        """leftover_probes() once it finds none, or after wait seconds: the run
        SIGKILLs its probes as it ends but does not wait for them, so on a loaded
        machine a killed one may still be exiting; one left running stays."""
        ends = time.monotonic() + wait
        while True:
            found = self.leftover_probes()
            if not found or time.monotonic() > ends:
                return found
            time.sleep(0.05)

    def leftover_probes(self):
        """The PIDs with this test's token in their environment: the runs and
        their probes."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open("/proc/%s/environ" % pid, "rb") as handle:
                    if self.token.encode() in handle.read():
                        found.append(pid)
            except OSError:
                pass
        return found

    def assertVerdict(self, res, doc, code, text=""):
        self.assertEqual(res.code, code, res)
        self.assertEqual(doc["exit_code"], code)
        self.assertIn(text, doc["reason"])
        priority, fields = self.log()
        self.assertEqual(fields["code"], str(code))
        self.assertIn(text, fields["reason"])
        if code:
            self.assertEqual(fields["stage"], "gpu")
            self.assertEqual(self.emu.requests[self.requests_before:], [],
                             "HTTP stages ran after a GPU skip")
        return fields


class NvmlTest(GpuCase):
    def test_free_gpu_is_ready_with_v2_figures_in_json_and_log(self):
        res, doc = self.nvml(["--min-free-mib", "1000", "--max-util", "50",
                              "--max-procs", "0", "--max-temp", "80"])
        fields = self.assertVerdict(res, doc, 0)
        gpu = doc["gpu"]
        self.assertEqual((gpu["backend"], gpu["driver"]), ("nvml", "550.127.05"))
        self.assertEqual(len(gpu["gpus"]), 1)
        one = gpu["gpus"][0]
        self.assertEqual((one["uuid"], one["name"], one["total_mib"]),
                         (gpu_uuid(0), "NVIDIA H200", TOTAL))
        self.assertEqual(one["free_mib"], FREE, "free must come from the v2 call")
        self.assertEqual((one["util_pct"], one["procs"], one["temp_c"]), (0, 0, 29))
        self.assertEqual(fields["gpu_backend"], "nvml")
        self.assertIn("uuid=%s free_mib=%d total_mib=%d util_pct=0 procs=0 temp_c=29"
                      % (gpu_uuid(0), FREE, TOTAL), fields["gpu0"])
        self.assertIn("gpu_ms", fields)
        self.assertEqual(self.emu.count("POST", "/api/generate"), 1)

    def test_busy_gpu_fails_each_threshold_with_75(self):
        for flag, value, text in (
                ("--min-free-mib", "50000", "%d MiB free, limit 50000" % (FREE - BUSY_USED)),
                ("--max-util", "50", "97% busy, limit 50 (--max-util)"),
                ("--max-procs", "0", "1 compute processes, limit 0"),
                ("--max-temp", "80", "83 C, limit 80 (--max-temp)")):
            with self.subTest(flag=flag):
                self.sink.messages(wait=0.01)
                res, doc = self.nvml([flag, value], mode="busy")
                self.assertVerdict(res, doc, 75, text)

    def test_a_gpu_busy_for_many_runs_is_never_escalated(self):
        """--escalate-after: a GPU over a threshold answered (a long job holds
        it, as under Slurm); only a fault that does not answer becomes 69."""
        state = os.path.join(self.dir, "state-" + self.token)
        args = ["--max-util", "50", "--escalate-after", "2", "--state-dir", state]
        for _ in range(3):
            res, doc = self.nvml(args, mode="busy")
            self.assertVerdict(res, doc, 75, "97% busy, limit 50 (--max-util)")
            self.sink.messages(wait=0.01)
        for code in (75, 69):
            res, doc = self.gpu(["--gpu-backend", "nvml", "--nvml-lib", self.lib,
                                 "--gpu-timeout", "0.5"] + args, dict(FAKE_NVML_MODE="hang"))
            self.assertVerdict(res, doc, code, "GPU probe hung")
            self.sink.messages(wait=0.01)
        self.assertIn("(75 for 2 runs in a row since ", doc["reason"])

    def test_busy_gpu_without_thresholds_is_ready(self):
        res, doc = self.nvml(mode="busy")
        self.assertVerdict(res, doc, 0)
        self.assertEqual(doc["gpu"]["gpus"][0]["procs"], 1)

    def test_driver_not_loaded_and_version_mismatch_are_69(self):
        res, doc = self.nvml(mode="nodriver")
        self.assertVerdict(res, doc, 69, "NVIDIA driver not loaded (NVML: Driver Not Loaded "
                           "(NVML error 9))")
        self.sink.messages(wait=0.01)
        res, doc = self.nvml(mode="mismatch")
        self.assertVerdict(res, doc, 69, "versions differ")

    def test_lost_gpu_fails_need_all_but_not_need_any_or_the_other_gpu(self):
        res, doc = self.nvml(mode="lost", FAKE_NVML_COUNT="2")
        self.assertVerdict(res, doc, 69, "GPU 1: GPU is lost")
        self.assertEqual([g["free_mib"] for g in doc["gpu"]["gpus"]], [FREE, None])
        self.sink.messages(wait=0.01)
        res, doc = self.nvml(["--gpu-need", "any"], mode="lost", FAKE_NVML_COUNT="2")
        self.assertVerdict(res, doc, 0, "GPU 1 not fit: GPU is lost")
        self.sink.messages(wait=0.01)
        res, doc = self.nvml(["--gpu-id", "0"], mode="lost", FAKE_NVML_COUNT="2")
        self.assertVerdict(res, doc, 0)

    def test_every_gpu_is_probed_and_need_any_takes_one_fit(self):
        env = dict(FAKE_NVML_COUNT="3", FAKE_NVML_BUSY="0,2")
        res, doc = self.nvml(["--max-util", "50"], **env)
        self.assertVerdict(res, doc, 75, "GPU 0 (GPU-aaaaaaaa): 97% busy")
        self.assertIn("GPU 2 (GPU-cccccccc): 97% busy", doc["reason"])
        self.assertEqual([g["uuid"] for g in doc["gpu"]["gpus"]],
                         [gpu_uuid(0), gpu_uuid(1), gpu_uuid(2)])
        self.sink.messages(wait=0.01)
        res, doc = self.nvml(["--max-util", "50", "--gpu-need", "any"], **env)
        self.assertVerdict(res, doc, 0)
        self.assertEqual([g["fit"] for g in doc["gpu"]["gpus"]], [False, True, False])

    def test_selection_by_uuid_index_and_visible_devices(self):
        env = dict(FAKE_NVML_COUNT="3", FAKE_NVML_BUSY="0")
        res, doc = self.nvml(["--max-util", "50", "--gpu-id", "GPU-bbbb,2"], **env)
        self.assertVerdict(res, doc, 0)
        self.assertEqual([g["selected"] for g in doc["gpu"]["gpus"]], [False, True, True])
        self.sink.messages(wait=0.01)
        res, doc = self.nvml(["--max-util", "50"], CUDA_VISIBLE_DEVICES=gpu_uuid(1), **env)
        self.assertVerdict(res, doc, 0)
        self.sink.messages(wait=0.01)
        res, doc = self.nvml(["--max-util", "50"], NVIDIA_VISIBLE_DEVICES=gpu_uuid(0), **env)
        self.assertVerdict(res, doc, 75, "GPU 0")

    def test_visible_devices_by_index_is_not_trusted(self):
        res, doc = self.nvml(["--max-util", "50"], FAKE_NVML_COUNT="2",
                             FAKE_NVML_BUSY="0", CUDA_VISIBLE_DEVICES="1")
        self.assertVerdict(res, doc, 75, "GPU 0")
        self.assertEqual(doc["gpu"]["gpus"][0]["selected"], True)

    def test_no_gpu_matching_the_id_is_78(self):
        res, doc = self.nvml(["--gpu-id", "7"], FAKE_NVML_COUNT="2")
        self.assertVerdict(res, doc, 78, "no GPU matches 7 in --gpu-id")
        self.sink.messages(wait=0.01)
        res, doc = self.nvml(["--gpu-id", "GPU-ffff"])
        self.assertVerdict(res, doc, 78, "no GPU matches GPU-ffff")

    def test_unsupported_figure_is_null_and_noted_or_fails_when_strict(self):
        res, doc = self.nvml(["--max-util", "50", "--max-procs", "0"], mode="unsupported")
        self.assertVerdict(res, doc, 0, "util_pct unknown, procs unknown")
        one = doc["gpu"]["gpus"][0]
        self.assertEqual((one["util_pct"], one["procs"], one["temp_c"]), (None, None, None))
        self.assertEqual(one["free_mib"], FREE)
        self.sink.messages(wait=0.01)
        res, doc = self.nvml(["--max-util", "50", "--strict-gpu"], mode="unsupported")
        self.assertVerdict(res, doc, 75, "util_pct unknown (--strict-gpu)")

    def test_mig_device_is_judged_by_its_own_memory_and_processes(self):
        idle, used = ("MIG-aaaaaaaa-0000-4000-8000-00000000000%d" % n for n in (1, 0))
        res, doc = self.nvml(["--max-procs", "0", "--gpu-id", idle], mode="mig")
        self.assertVerdict(res, doc, 0)
        parent, slot0, slot1 = doc["gpu"]["gpus"]
        self.assertEqual((parent["mig"], parent["util_pct"], parent["procs"]), (True, None, 1))
        self.assertEqual((slot1["uuid"], slot1["parent"], slot1["procs"], slot1["total_mib"],
                          slot1["selected"]), (idle, gpu_uuid(0), 0, 71680, True))
        self.assertEqual((slot0["procs"], slot0["selected"]), (1, False))
        self.sink.messages(wait=0.01)
        res, doc = self.nvml(["--max-procs", "0", "--gpu-id", used], mode="mig")
        self.assertVerdict(res, doc, 75, "MIG device MIG-aaaaaaaa of GPU 0: 1 compute")
        self.sink.messages(wait=0.01)
        res, doc = self.nvml(["--min-free-mib", "100000"], mode="mig",
                             CUDA_VISIBLE_DEVICES=idle)
        self.assertVerdict(res, doc, 75, "71680 MiB free, limit 100000")

    def test_whole_mig_gpu_has_no_utilisation_and_legacy_mig_ids_select_it(self):
        legacy = "MIG-%s/1/0" % gpu_uuid(0)
        res, doc = self.nvml(["--max-util", "50", "--gpu-id", legacy], mode="mig")
        self.assertVerdict(res, doc, 0, "util_pct unknown (MIG)")
        self.assertEqual([g["selected"] for g in doc["gpu"]["gpus"]], [True, False, False])

    def test_uncorrectable_ecc_and_retired_pages_are_69(self):
        res, doc = self.nvml(mode="ecc")
        self.assertVerdict(res, doc, 69, "2 uncorrectable ECC errors")
        self.sink.messages(wait=0.01)
        res, doc = self.nvml(mode="retired")
        self.assertVerdict(res, doc, 69, "retired pages pending")

    def test_sigterm_during_the_gpu_stage_names_it_and_kills_the_probe(self):
        env = support.cron_env(FAKE_NVML_MODE="hang", GPFL_TEST_TOKEN=self.token)
        proc = subprocess.Popen(
            [sys.executable, support.SCRIPT, "--host", self.emu.url, "--nvml-lib",
             self.lib, "--gpu-backend", "nvml", "--syslog-address", self.sink.path],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env, start_new_session=True)
        ends = time.monotonic() + 20        # until the probe is forked (and hangs)
        while len(self.leftover_probes()) < 2 and time.monotonic() < ends:
            time.sleep(0.02)
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
        self.assertEqual(proc.returncode, 143)
        fields = self.log()[1]
        self.assertEqual((fields["stage"], fields["reason"]),
                         ("gpu", "interrupted by SIGTERM during the GPU probe"))
        self.assertEqual(self.probes_left(), [])

    def test_probe_holds_no_descriptor_of_the_caller(self):
        lock = os.path.join(self.dir, "held.lock")
        res, doc = self.gpu(["--gpu-backend", "nvml", "--nvml-lib", self.lib,
                             "--lock", lock, "--gpu-timeout", "1"],
                            dict(FAKE_NVML_MODE="hang"), deadline=4)
        self.assertEqual(res.code, 75)
        self.log()
        self.assertEqual(self.probes_left(), [])
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # novermin: flags; nobody holds it now
        finally:
            os.close(fd)

    def test_gpu_timeout_bounds_the_stage(self):
        res, doc = self.gpu(["--gpu-backend", "nvml", "--nvml-lib", self.lib,
                             "--gpu-timeout", "0.5", "--deadline", "6"],
                            dict(FAKE_NVML_MODE="hang"))
        self.assertVerdict(res, doc, 75, "did not answer within 0.5s")
        gpu = [s for s in doc["stages"] if s["name"] == "gpu"][0]
        self.assertLess(gpu["duration_ms"], (0.5 + SLACK) * 1000, res)   # its own clock
        self.assertLess(doc["elapsed_ms"], 6000, res)   # ended by the stage, not --deadline

    def test_nvidia_userspace_without_driver_on_an_amd_host_uses_amd(self):
        root = fakes.make_amd_sysfs(tempfile.mkdtemp(dir=self.dir),
                                    [dict(busy=3, used_mib=512, total_mib=65536)])
        res, doc = self.gpu(["--nvml-lib", self.lib], dict(
            FAKE_NVML_MODE="nodriver", GPU_PREFLIGHT_ROOT=root, FAKE_SMI_MODE="nodriver",
            PATH=self.smi_dir + ":/usr/bin:/bin"), deadline=4)
        self.assertVerdict(res, doc, 0)
        self.assertEqual(doc["gpu"]["backend"], "amd-sysfs")

    def test_a_dead_nvidia_driver_beside_an_amd_igpu_is_69_never_the_igpu(self):
        # auto leaves NVIDIA for AMD only when no NVIDIA GPU is present
        for mode, text in (("nodriver", "NVIDIA driver not loaded (NVML: Driver Not Loaded"),
                           ("mismatch", "versions differ (NVML: ")):
            for node in ("pci", "dev"):
                with self.subTest(mode=mode, node=node):
                    self.sink.messages(wait=0.01)
                    root = fakes.make_amd_sysfs(tempfile.mkdtemp(dir=self.dir), [dict(
                        busy=1, used_mib=64, total_mib=2048, name="AMD Radeon Graphics")])
                    if node == "pci":
                        fakes.add_pci_display(root, "0000:62:00.0", "0x10de")
                    else:
                        os.makedirs(os.path.join(root, "dev"))
                        open(os.path.join(root, "dev", "nvidia0"), "w").close()
                    res, doc = self.gpu(["--nvml-lib", self.lib], dict(
                        FAKE_NVML_MODE=mode, GPU_PREFLIGHT_ROOT=root, FAKE_SMI_MODE=mode,
                        PATH=self.smi_dir + ":/usr/bin:/bin"), deadline=4)
                    self.assertVerdict(res, doc, 69, text)
                    self.assertIsNone(doc["gpu"])

    def test_nvidia_gpu_present_without_nvml_or_smi_is_69(self):
        root = fakes.add_pci_display(tempfile.mkdtemp(dir=self.dir), "0000:62:00.0", "0x10de")
        fakes.make_amd_sysfs(root, [dict(busy=1, used_mib=64, total_mib=2048)])
        res, doc = self.gpu(["--gpu", "--nvml-lib", "/nonexistent/libnvidia-ml.so.1"],
                            dict(GPU_PREFLIGHT_ROOT=root), deadline=4)
        self.assertVerdict(res, doc, 69, "an NVIDIA GPU is present but neither NVML nor "
                           "nvidia-smi answered: NVML: ")

    def test_pending_row_remap_is_69(self):
        res, doc = self.nvml(mode="remap")
        self.assertVerdict(res, doc, 69, "row remapping pending")

    def test_gpus_this_user_cannot_open_are_left_out_with_a_note(self):
        res, doc = self.nvml(mode="noperm")
        self.assertVerdict(res, doc, 78, "no GPU this user may open: GPU 0: "
                           "Insufficient Permissions (NVML error 4), not checked")
        self.assertEqual(doc["gpu"]["gpus"][0]["access"], False)

    def test_hung_init_and_hung_device_call_are_75_inside_the_deadline(self):
        for mode in ("hang", "hang_device"):
            with self.subTest(mode=mode):
                self.sink.messages(wait=0.01)
                res, doc = self.nvml(["--gpu-timeout", "1"], mode=mode)
                self.assertVerdict(res, doc, 75, "GPU probe hung: NVML did not answer "
                                   "within 1s")

    def test_old_driver_without_v2_symbols_uses_v1(self):
        res, doc = self.nvml(["--max-procs", "0"], mode="busy", lib=self.old_lib)
        self.assertVerdict(res, doc, 75, "1 compute processes")
        self.assertEqual(doc["gpu"]["gpus"][0]["free_mib"], FREE - BUSY_USED - 1024)

    def test_stub_banner_does_not_corrupt_the_probe(self):
        res, doc = self.nvml(mode="stub")
        self.assertVerdict(res, doc, 69, "NVML failed: Unknown Error (NVML error 999)")

    def test_stub_library_found_by_dlopen_is_refused(self):
        stubs = os.path.join(self.dir, "cuda", "lib64", "stubs")
        os.makedirs(stubs, exist_ok=True)
        shutil.copy(self.lib, stubs)
        res, doc = self.gpu(["--gpu-backend", "nvml"], dict(LD_LIBRARY_PATH=stubs))
        self.assertVerdict(res, doc, 69, "NVML: only the CUDA toolkit's stub library")
        res = support.run_script(["--nvml-lib", os.path.join(stubs, "libnvidia-ml.so.1")])
        self.assertEqual(res.code, 64, res)
        self.assertIn("link-time stub", res.stderr)

    def test_missing_library_falls_back_to_nvidia_smi(self):
        env = dict(PATH=self.smi_dir + ":/usr/bin:/bin", FAKE_SMI_MODE="free")
        res, doc = self.gpu(["--nvml-lib", "/nonexistent/libnvidia-ml.so.1"], env)
        self.assertVerdict(res, doc, 0)
        self.assertEqual(doc["gpu"]["backend"], "nvidia-smi")

    def test_nothing_installed_is_69(self):
        root = tempfile.mkdtemp(dir=self.dir)
        res, doc = self.gpu(["--gpu", "--nvml-lib", "/nonexistent/libnvidia-ml.so.1"],
                            dict(GPU_PREFLIGHT_ROOT=root))
        self.assertVerdict(res, doc, 69, "no GPU driver found: NVML: ")
        self.assertIn("nvidia-smi not found", doc["reason"])
        self.assertIn("no AMD GPU under", doc["reason"])

    def test_expect_gpus_counts_what_the_driver_sees_not_what_is_selected(self):
        res, doc = self.nvml(["--expect-gpus", "8"], FAKE_NVML_COUNT="7")
        self.assertVerdict(res, doc, 69, "7 of 8 GPUs visible")
        res, doc = self.nvml(["--expect-gpus", "8", "--gpu-id", "0"], FAKE_NVML_COUNT="8")
        self.assertVerdict(res, doc, 0)
        res, doc = self.nvml(["--expect-gpus", "9"], FAKE_NVML_COUNT="8")
        self.assertVerdict(res, doc, 69, "8 of 9 GPUs visible")
        res, doc = self.gpu([], dict(GPU_PREFLIGHT_EXPECT_GPUS="2", FAKE_NVML_COUNT="1",
                                     GPU_PREFLIGHT_NVML_LIB=self.lib))
        self.assertVerdict(res, doc, 69, "1 of 2 GPUs visible")

    def test_expect_gpus_names_the_pci_addresses_nvml_does_not_see(self):
        root = self.nvidia_sysfs(8)
        for vf in range(3):         # a vGPU host's SR-IOV virtual functions: never NVML's
            fakes.add_pci_display(root, "0000:70:00.%d" % (vf + 4), "0x10de", "0x030200")
            os.symlink("../0000:70:00.0", os.path.join(
                root, "sys", "devices", "pci0000:00", "0000:70:00.%d" % (vf + 4), "physfn"))
        res, doc = self.nvml(["--expect-gpus", "8"], FAKE_NVML_COUNT="7",
                             GPU_PREFLIGHT_ROOT=root)
        self.assertVerdict(res, doc, 69)
        self.assertEqual(doc["reason"], "7 of 8 GPUs visible (--expect-gpus); not seen by "
                         "NVML: 0000:68:00.0")
        self.assertEqual([g["pci"] for g in doc["gpu"]["gpus"]],
                         [fakes.pci_bus_id(i) for i in range(7)])

    def test_expect_gpus_names_no_address_sysfs_does_not_list_or_a_lost_gpu_may_hold(self):
        """sysfs lists what NVML sees: the reason as without sysfs. A GPU NVML
        counts but cannot open has no bus id: the address may be its own."""
        for mode, listed in (("free", 7), ("lost", 8)):
            with self.subTest(mode=mode):
                self.sink.messages(wait=0.01)
                res, doc = self.nvml(["--expect-gpus", "8"], mode, FAKE_NVML_COUNT="7",
                                     GPU_PREFLIGHT_ROOT=self.nvidia_sysfs(listed))
                self.assertVerdict(res, doc, 69)
                self.assertEqual(doc["reason"], "7 of 8 GPUs visible (--expect-gpus)")

    def test_bad_expect_gpus_is_64_as_a_flag_and_78_from_the_environment(self):
        for bad in ("0", "-1", "x", ""):
            res = support.run_script(["--expect-gpus", bad])
            self.assertEqual(res.code, 64, res)
            self.assertIn("expect-gpus", res.stderr)
            if bad:                         # an empty variable is an unset one
                res = self.run_gp([], env=support.cron_env(GPU_PREFLIGHT_EXPECT_GPUS=bad))
                self.assertEqual(res.code, 78, res)
                self.assertIn("GPU_PREFLIGHT_EXPECT_GPUS", self.log()[1]["reason"])

    def test_gpu_enabled_from_environment(self):
        res, doc = self.gpu([], dict(GPU_PREFLIGHT_MAX_UTIL="50", FAKE_NVML_MODE="busy",
                                     GPU_PREFLIGHT_NVML_LIB=self.lib))
        self.assertVerdict(res, doc, 75, "97% busy")


class CudaTest(GpuCase):
    """The CUDA check beside NVML: a fake libcuda.so.1 (tests/fake_cuda.c) in
    the fake NVML's directory, as the driver installs both."""

    @classmethod
    def setUpClass(cls):
        GpuCase.setUpClass()
        cls.cuda_dir = os.path.join(cls.dir, "cuda")
        os.makedirs(cls.cuda_dir)
        cls.cuda_nvml = fakes.build_fake_nvml(cls.cuda_dir)
        cls.cuda = fakes.build_fake_cuda(cls.cuda_dir)

    def cuda_run(self, init="0", args=(), **env):
        """A run whose NVML is healthy and whose cuInit returns init."""
        return self.nvml(["--warmup", "off"] + list(args), lib=self.cuda_nvml,
                         FAKE_CUDA_INIT=init, **env)

    def test_healthy_cuda_is_ready(self):
        self.assertVerdict(*self.cuda_run(FAKE_NVML_COUNT="2"), code=0)

    def test_fabric_manager_not_ready_is_75(self):
        self.assertVerdict(*self.cuda_run("802"), code=75, text=(
            "CUDA: system not yet initialized (802): the fabric manager has not "
            "finished (systemctl status nvidia-fabricmanager)"))

    def test_unknown_error_is_69_with_the_remedies(self):
        self.assertVerdict(*self.cuda_run("999"), code=69, text=(
            "CUDA cannot start: error 999 (unknown error): reload the driver's unified "
            "memory module (rmmod nvidia_uvm && modprobe nvidia_uvm) or reboot"))

    def test_a_gpu_the_driver_gave_up_on_outranks_cudas_802(self):
        """A fabric that failed to register also stops cuInit with 802; the
        driver's word (69) is the verdict, not "not yet initialized" (75)."""
        self.assertVerdict(*self.cuda_run("802", FAKE_NVML_FABRIC="3:999"), code=69, text=(
            "GPU 0 (%s): NVLink fabric registration failed: Unknown Error (NVML error "
            "999) (journalctl -u nvidia-fabricmanager)" % gpu_uuid(0)[:12]))

    def test_a_failed_fabric_where_cuda_starts_is_a_problem_note(self):
        """H100 hosts without multi-node NVLink report a completed registration
        with an error while every job runs: with CUDA started on every GPU the
        run is ready, and the line says what is in doubt."""
        res, doc = self.cuda_run(FAKE_NVML_FABRIC="3:999")
        self.assertVerdict(res, doc, 0)
        self.assertIn("NVLink fabric registration failed: Unknown Error (NVML error 999) "
                      "(journalctl -u nvidia-fabricmanager), but CUDA starts on every GPU: "
                      "only NVLink between GPUs may be down", doc["problems"][0])

    def test_cuda_and_the_drivers_word_hold_when_nvidia_smi_would_answer(self):
        """Under --gpu-backend auto a CUDA or driver 69 from the NVML probe is
        the verdict: nvidia-smi, which reads neither, never overrules it."""
        env = dict(FAKE_NVML_MODE="free", FAKE_SMI_MODE="free", FAKE_CUDA_INIT="802",
                   PATH=self.smi_dir + ":/usr/bin:/bin")
        for extra, code, text in (({}, 75, "CUDA: system not yet initialized (802)"),
                                  (dict(FAKE_CUDA_INIT="999"), 69, "CUDA cannot start"),
                                  (dict(FAKE_NVML_RECOVERY_ACTION="2"), 69,
                                   "node reboot required")):
            with self.subTest(**extra):
                self.sink.messages(wait=0.01)
                res, doc = self.gpu(["--nvml-lib", self.cuda_nvml, "--warmup", "off"],
                                    dict(env, **extra), deadline=4)
                self.assertVerdict(res, doc, code, text)
                self.assertEqual(doc["gpu"]["backend"], "nvml")

    def test_count_other_than_nvml_is_69(self):
        self.assertVerdict(*self.cuda_run(FAKE_NVML_COUNT="2", FAKE_CUDA_COUNT="1"),
                           code=69, text="CUDA sees 1 GPUs, NVML 2")

    def test_a_gpu_nvml_names_lost_is_told_by_nvml_not_by_the_count(self):
        """A GPU lost, or one this user cannot open, is NVML's to name: CUDA,
        which counts it out, does not turn it into a count mismatch."""
        self.assertVerdict(*self.cuda_run(mode="lost", FAKE_NVML_COUNT="2",
                                          FAKE_CUDA_COUNT="1"), code=69, text="GPU is lost")

    def test_cuda_visible_devices_does_not_change_the_count(self):
        self.assertVerdict(*self.cuda_run(FAKE_NVML_COUNT="2", CUDA_VISIBLE_DEVICES="0"),
                           code=0)

    def test_blocked_cuinit_is_killed_as_a_hung_probe(self):
        self.assertVerdict(*self.cuda_run("block", ["--gpu-timeout", "1"]), code=75,
                           text="GPU probe hung: NVML did not answer within 1s")

    def test_cuda_check_off_skips_it(self):
        self.assertVerdict(*self.cuda_run("802", ["--cuda-check", "off"]), code=0)

    def test_without_libcuda_nvml_alone_decides(self):
        self.assertVerdict(*self.nvml(["--warmup", "off"], FAKE_CUDA_INIT="802"), code=0)

    def test_libcuda_others_could_write_is_refused(self):
        os.chmod(self.cuda, 0o666)
        try:
            res, doc = self.cuda_run("802")
        finally:
            os.chmod(self.cuda, 0o755)
        self.assertEqual(res.code, 78, res)
        self.assertIn("CUDA library %s: others could have written it: %s is writable "
                      "by group or others" % (self.cuda, self.cuda), doc["reason"])


class DriverHealthTest(GpuCase):
    """What the driver itself says of a GPU through NVML: the recovery action
    it asks for (field 230) and the GPU's NVLink fabric registration."""

    def test_a_recovery_action_is_69_naming_it_on_that_gpu(self):
        for action, text in (("2", "GPU 1 (%s): the driver's recovery action: node reboot "
                                   "required" % gpu_uuid(1)[:12]),
                             ("1", "GPU 1 (%s): the driver's recovery action: GPU reset "
                                   "required (nvidia-smi -r -i 1)" % gpu_uuid(1)[:12]),
                             ("9", "the driver's recovery action: 9 (see nvml.h)")):
            with self.subTest(action=action):
                self.sink.messages(wait=0.01)
                res, doc = self.nvml(FAKE_NVML_COUNT="2", FAKE_NVML_RECOVERY_ACTION=action)
                self.assertVerdict(res, doc, 69, text)

    def test_a_fabric_not_registered_yet_is_75(self):
        for fabric, words in (("1", "not started"), ("2", "in progress")):
            with self.subTest(fabric=fabric):
                self.sink.messages(wait=0.01)
                res, doc = self.nvml(FAKE_NVML_FABRIC=fabric)
                self.assertVerdict(res, doc, 75, (
                    "GPU 0 (%s): NVLink fabric registration %s: the fabric manager has "
                    "not finished (systemctl status nvidia-fabricmanager)"
                    % (gpu_uuid(0)[:12], words)))

    def test_a_driver_that_knows_only_v2_of_the_fabric_info_is_read_too(self):
        res, doc = self.nvml(FAKE_NVML_FABRIC="2", FAKE_NVML_FABRIC_V2_ONLY="1")
        self.assertVerdict(res, doc, 75, "NVLink fabric registration in progress")

    def test_a_failed_fabric_registration_is_69(self):
        res, doc = self.nvml(FAKE_NVML_FABRIC="3:999")
        self.assertVerdict(res, doc, 69, "NVLink fabric registration failed: Unknown Error "
                           "(NVML error 999) (journalctl -u nvidia-fabricmanager)")

    def test_a_fabric_status_of_not_supported_is_no_fabric(self):
        """NOT_SUPPORTED (3) as the status of a completed registration: a GPU
        outside any NVLink fabric, not a failure."""
        self.assertVerdict(*self.nvml(FAKE_NVML_FABRIC="3:3"), code=0)

    def test_a_registered_fabric_and_no_action_are_ready(self):
        res, doc = self.nvml(FAKE_NVML_COUNT="2", FAKE_NVML_FABRIC="3",
                             FAKE_NVML_RECOVERY_ACTION="0")
        self.assertVerdict(res, doc, 0)

    def test_an_older_driver_without_either_is_ready(self):
        res, doc = self.nvml(lib=self.old_lib, FAKE_NVML_FABRIC="2",
                             FAKE_NVML_RECOVERY_ACTION="2")
        self.assertVerdict(res, doc, 0)

    def test_a_fabric_that_never_registers_is_escalated(self):
        """Unlike a GPU busy with others' work, a fabric still pending after N
        runs is a fault: --escalate-after makes it 69 (a drain under Slurm)."""
        args = ["--escalate-after", "2", "--state-dir",
                os.path.join(self.dir, "state-" + self.token)]
        for code in (75, 69):
            res, doc = self.nvml(args, FAKE_NVML_FABRIC="1")
            self.assertVerdict(res, doc, code, "NVLink fabric registration not started")
            self.sink.messages(wait=0.01)
        self.assertIn("(75 for 2 runs in a row since ", doc["reason"])


class VramTruthTest(GpuCase):
    """Where the model sits, as the GPU tells it (--gpu, Ollama on this host):
    size_vram 0 is VRAM other processes hold (75) or a GPU Ollama cannot use
    (69, Ollama's own remedies); VRAM that /api/ps claims and the GPU does not
    hold is a CPU run (69)."""

    def serve(self, mode, size_mib=None, loaded=()):
        """The emulator in mode, llama3.2 (size_mib) loaded at start or not."""
        model = Model("llama3.2:latest", size=size_mib and size_mib * 1048576)
        self.emu = self.emulator(mode=mode, models=(model,), loaded=loaded,
                                 load_seconds=0.05, gpu_file=self.runners)

    def assertPlacement(self, res, doc, code, *texts):
        self.assertEqual((res.code, doc["exit_code"]), (code, code), res)
        _, fields = self.log()
        self.assertEqual(fields["stage"], "placement" if code else "-")
        for text in texts:
            self.assertIn(text, doc["reason"])
            self.assertIn(text, fields["reason"])

    def test_size_vram_0_on_a_gpu_others_fill_is_vram_held_by_others(self):
        self.serve("cpu", size_mib=60000)
        res, doc = self.nvml(mode="busy")
        self.assertPlacement(res, doc, 75, "llama3.2:latest runs on the CPU", "VRAM held by "
                             "other processes (%d MiB free, the model needs 60000 MiB)"
                             % (FREE - BUSY_USED))

    def test_size_vram_0_on_a_gpu_with_room_names_ollamas_remedies(self):
        self.serve("cpu")
        res, doc = self.nvml()
        self.assertPlacement(res, doc, 69, "the GPU has room (%d MiB free, the model needs "
                             "1925 MiB)" % FREE, "reload nvidia_uvm", "reboot",
                             "restarting ollama alone may not help")

    def test_vram_claimed_but_not_held_is_a_cpu_run(self):
        """Ollama's 100 % fallback (it cannot read the runner's buffers): the
        GPU read again after the warm-up's load, or as the GPU stage saw it."""
        for loaded in ((), None):
            with self.subTest(loaded=loaded):
                self.sink.messages(wait=0.01)
                self.serve("cpu_claims_gpu", loaded=loaded)
                res, doc = self.nvml()
                self.assertPlacement(res, doc, 69, "Ollama reports 1925 MiB in VRAM but the "
                                     "GPU holds ", "it is running on the CPU")
                self.assertEqual(self.emu.count("POST", "/api/generate"), 1)
        self.sink.messages(wait=0.01)
        res, doc = self.nvml(["--allow-cpu"])
        self.assertPlacement(res, doc, 0)

    def test_a_model_the_gpu_holds_is_ready(self):
        """Cold: the GPU is read again after the load (a second placement
        stage) and shows the runner; loaded: the GPU stage saw it already."""
        self.serve("healthy")
        res, doc = self.nvml()
        self.assertPlacement(res, doc, 0)
        self.assertEqual(doc["gpu"]["gpus"][0]["proc_mib"], 0)
        self.assertEqual([s["name"] for s in doc["stages"]].count("placement"), 2)
        self.sink.messages(wait=0.01)
        res, doc = self.nvml()
        self.assertPlacement(res, doc, 0)
        self.assertEqual(doc["gpu"]["gpus"][0]["proc_mib"], 1925)
        self.assertEqual([s["name"] for s in doc["stages"]].count("placement"), 1)

    def test_another_tenants_vram_is_not_ollamas(self):
        """On a GPU another tenant fills (100 GiB), a CPU run that /api/ps
        says is in VRAM is still a CPU run: only Ollama's runners' memory
        counts, loaded before the check or by its warm-up."""
        for loaded in ((), None):
            with self.subTest(loaded=loaded):
                self.sink.messages(wait=0.01)
                self.serve("cpu_claims_gpu", loaded=loaded)
                res, doc = self.nvml(mode="busy")
                self.assertPlacement(res, doc, 69, "Ollama reports 1925 MiB in VRAM but "
                                     "the GPU holds none", "it is running on the CPU")

    def test_a_small_model_is_not_held_by_the_drivers_reserve(self):
        """An embedding model of 274 MiB on the CPU, /api/ps claiming it in
        VRAM, on an idle GPU whose driver reserves 542 MiB: a CPU run."""
        model = Model("nomic-embed-text:latest", "embed", size=274 * 1048576)
        self.emu = self.emulator(mode="cpu_claims_gpu", models=(model,), loaded=None,
                                 load_seconds=0.05, gpu_file=self.runners)
        res, doc = self.nvml()
        self.assertPlacement(res, doc, 69, "Ollama reports 274 MiB in VRAM but the GPU "
                             "holds none")

    def test_a_model_on_a_shared_gpu_is_ready_and_read_again_after_a_reload(self):
        """Ollama's runner on a GPU another tenant also uses: ready. A loaded
        model the warm-up reloads (num_ctx differs, load_duration 1.5 s) is
        judged on the GPU read again after it, not on the GPU stage's view."""
        model = Model("llama3.2:latest", load_seconds=1.5)
        self.emu = self.emulator(models=(model,), gpu_file=self.runners)
        res, doc = self.nvml(["--ollama-option", "num_ctx=8192"], mode="busy")
        self.assertPlacement(res, doc, 0)
        self.assertEqual(len(self.emu.reloads), 1)
        self.assertGreater(doc["models"][0]["load_ms"], 1000)
        self.assertEqual([s["name"] for s in doc["stages"]].count("placement"), 2)

    def test_a_backend_without_memory_per_process_is_a_note(self):
        self.serve("cpu_claims_gpu")
        res, doc = self.smi()
        self.assertPlacement(res, doc, 0, "VRAM use not cross-checked (nvidia-smi")


class SmiTest(GpuCase):
    def test_expect_gpus_counts_nvidia_smi_rows(self):
        res, doc = self.smi(["--expect-gpus", "3"], FAKE_SMI_COUNT="2")
        self.assertVerdict(res, doc, 69, "2 of 3 GPUs visible")
        res, doc = self.smi(["--expect-gpus", "2"], FAKE_SMI_COUNT="2")
        self.assertVerdict(res, doc, 0)

    def test_expect_gpus_names_the_pci_addresses_nvidia_smi_does_not_list(self):
        """A GPU nvidia-smi cannot read ("...for GPU1: 0000:62:00.0: GPU is
        lost") is counted, and so is its address: only 0000:64:00.0 is unseen."""
        for mode in ("free", "lost"):
            with self.subTest(mode=mode):
                self.sink.messages(wait=0.01)
                res, doc = self.smi(["--expect-gpus", "4"], mode, FAKE_SMI_COUNT="3",
                                    FAKE_SMI_LOST_INDEX="1",
                                    GPU_PREFLIGHT_ROOT=self.nvidia_sysfs(4))
                self.assertVerdict(res, doc, 69)
                self.assertEqual(doc["reason"], "3 of 4 GPUs visible (--expect-gpus); not "
                                 "seen by nvidia-smi: 0000:64:00.0")

    def test_free_gpu_and_the_exact_query_in_the_c_locale(self):
        log = os.path.join(self.dir, "smi-%s.log" % self.token)
        res, doc = self.smi(["--max-util", "50", "--max-procs", "0"], FAKE_SMI_LOG=log,
                            LANG="de_DE.UTF-8")
        self.assertVerdict(res, doc, 0)
        one = doc["gpu"]["gpus"][0]
        self.assertEqual((one["uuid"], one["free_mib"], one["total_mib"], one["util_pct"],
                          one["procs"], one["temp_c"]), (gpu_uuid(0), FREE, TOTAL, 0, 0, 29))
        with open(log) as handle:
            text = handle.read()
        self.assertIn("--format=csv,noheader,nounits", text)
        self.assertIn("--query-compute-apps=gpu_uuid,pid", text)
        self.assertIn("LC_ALL=C", text)

    def test_busy(self):
        res, doc = self.smi(["--max-procs", "0"], mode="busy")
        self.assertVerdict(res, doc, 75, "1 compute processes, limit 0")

    def test_bracketed_values_are_unknown_never_zero(self):
        for mode in ("na", "notsupported", "mig"):
            with self.subTest(mode=mode):
                self.sink.messages(wait=0.01)
                res, doc = self.smi(["--max-util", "50"], mode=mode)
                self.assertVerdict(res, doc, 0, "util_pct unknown")
                self.assertIsNone(doc["gpu"]["gpus"][0]["util_pct"])
                self.sink.messages(wait=0.01)
                res, doc = self.smi(["--max-util", "50", "--strict-gpu"], mode=mode)
                self.assertVerdict(res, doc, 75, "util_pct unknown (--strict-gpu)")

    def test_one_lost_gpu_keeps_the_process_counts_of_the_others(self):
        res, doc = self.smi(["--gpu-id", gpu_uuid(0), "--max-procs", "0"], mode="lost",
                            FAKE_SMI_COUNT="2", FAKE_SMI_BUSY="0")
        self.assertVerdict(res, doc, 75, "1 compute processes, limit 0")

    def test_lost_gpu_line_fails_need_all(self):
        # "...for GPU1: 0000:62:00.0: GPU is lost" is a selected GPU that failed
        for form in ("index", "bus"):
            with self.subTest(form=form):
                self.sink.messages(wait=0.01)
                res, doc = self.smi(mode="lost", FAKE_SMI_COUNT="2",
                                    FAKE_SMI_LOST_FORMAT=form)
                self.assertVerdict(res, doc, 69, "GPU is lost")
                self.assertEqual(len(doc["gpu"]["gpus"]), 2)
                lost = doc["gpu"]["gpus"][1]
                self.assertEqual((lost["selected"], lost["fit"], lost["uuid"]),
                                 (True, False, None))
                self.assertIn("GPU is lost", lost["error"])
                self.assertEqual(lost["index"], 1 if form == "index" else None)
        self.sink.messages(wait=0.01)
        res, doc = self.smi(["--gpu-id", "1"], mode="lost", FAKE_SMI_COUNT="2")
        self.assertVerdict(res, doc, 69, "GPU 1: GPU is lost")
        self.sink.messages(wait=0.01)
        res, doc = self.smi(["--gpu-id", "0"], mode="lost", FAKE_SMI_COUNT="2")
        self.assertVerdict(res, doc, 0)
        self.sink.messages(wait=0.01)
        res, doc = self.smi(["--gpu-id", gpu_uuid(1)], mode="lost", FAKE_SMI_COUNT="2")
        self.assertVerdict(res, doc, 69, "no GPU matches")

    def test_driver_not_loaded_and_mismatch(self):
        res, doc = self.smi(mode="nodriver")
        self.assertVerdict(res, doc, 69, "NVIDIA driver not loaded (nvidia-smi: NVIDIA-SMI "
                           "has failed")
        self.sink.messages(wait=0.01)
        res, doc = self.smi(mode="mismatch")
        self.assertVerdict(res, doc, 69, "versions differ (nvidia-smi: Failed to initialize")

    def test_hang_is_75_inside_the_deadline_and_killed(self):
        res, doc = self.smi(["--gpu-timeout", "1"], mode="hang")
        self.assertVerdict(res, doc, 75, "GPU probe hung: nvidia-smi did not answer")

    def test_not_installed_is_69(self):
        res, doc = self.gpu(["--gpu-backend", "nvidia-smi"], {})
        self.assertVerdict(res, doc, 69, "nvidia-smi not found in PATH")


class AmdTest(GpuCase):
    def amd(self, cards, args=()):
        root = fakes.make_amd_sysfs(tempfile.mkdtemp(dir=self.dir), cards)
        return self.gpu(["--gpu-backend", "amd-sysfs"] + list(args),
                        dict(GPU_PREFLIGHT_ROOT=root), deadline=4)

    def test_idle_card_figures(self):
        res, doc = self.amd([dict(busy=3, used_mib=512, total_mib=65536, temp_c=45,
                                  unique_id="0123456789abcdef", name="AMD Instinct MI210")],
                            ["--max-util", "50", "--min-free-mib", "1000"])
        self.assertVerdict(res, doc, 0)
        one = doc["gpu"]["gpus"][0]
        self.assertEqual((one["index"], one["uuid"], one["name"], one["free_mib"],
                          one["total_mib"], one["util_pct"], one["temp_c"], one["procs"]),
                         (0, "0123456789abcdef", "AMD Instinct MI210", 65024, 65536, 3, 45,
                          None))

    def test_busy_card_and_unreadable_load(self):
        res, doc = self.amd([dict(busy=95, used_mib=512, total_mib=65536)],
                            ["--max-util", "50"])
        self.assertVerdict(res, doc, 75, "95% busy")
        self.sink.messages(wait=0.01)
        res, doc = self.amd([dict(busy=0, used_mib=512, total_mib=65536, busy_text="")],
                            ["--max-util", "50"])
        self.assertVerdict(res, doc, 0, "util_pct unknown")

    def test_only_nvidia_cards_in_sysfs_is_69(self):
        res, doc = self.amd([dict(busy=0, used_mib=0, total_mib=1024, vendor="0x10de")])
        self.assertVerdict(res, doc, 69, "no AMD GPU under")


class SmiStatusTest(TrustCase):
    """What nvidia-smi's output and exit status say about the GPU."""

    def setUp(self):
        TrustCase.setUp(self)
        self.smi_dir = self.mkdir(self.path("smi"))
        fakes.write_fake_smi(self.smi_dir)

    def test_a_lost_gpu_named_by_gpu_id_is_69_also_in_the_older_bus_format(self):
        env = support.cron_env(PATH=self.smi_dir + ":/usr/bin:/bin", FAKE_SMI_MODE="lost",
                               FAKE_SMI_COUNT="2", FAKE_SMI_LOST_FORMAT="bus")
        res = self.run_gp(["--host", self.emu.url, "--gpu-backend", "nvidia-smi",
                           "--gpu-id", "1"], env=env)
        self.assertSkip(res, 69, "gpu", "GPU is lost")

    def test_the_exit_of_an_nvidia_smi_that_lingers_is_waited_for(self):
        # the output ends, the process exits a moment later (as a driver
        # tearing a GPU down can make it): its status must still count
        os.rename(os.path.join(self.smi_dir, "nvidia-smi"),
                  os.path.join(self.smi_dir, "real-smi"))
        self.write(os.path.join(self.smi_dir, "nvidia-smi"),
                   '#!/bin/sh\n"$(dirname "$0")/real-smi" "$@"; rc=$?\n'
                   'exec 1>&-\nsleep 1\nexit $rc\n', 0o755)
        env = support.cron_env(PATH=self.smi_dir + ":/usr/bin:/bin", FAKE_SMI_MODE="busy")
        res = self.run_gp(["--host", self.emu.url, "--gpu-backend", "nvidia-smi",
                           "--max-procs", "0", "--gpu-timeout", "4"], env=env)
        self.assertSkip(res, 75, "gpu", "1 compute processes, limit 0 (--max-procs)")


class SmiOutputTest(VerdictCase):
    def test_an_nvidia_smi_figure_too_large_for_a_float_is_not_70(self):
        """nvidia-smi printing a 400-digit memory.free (a broken driver or
        wrapper) is a verdict, not 70: int(float(text)) of it raises
        OverflowError."""
        smi_dir = os.path.join(self.dir, "bin")
        os.makedirs(smi_dir)
        os.chmod(smi_dir, 0o755)
        smi = os.path.join(smi_dir, "nvidia-smi")
        with open(smi, "w") as handle:
            handle.write("#!/bin/sh\ncase \"$1\" in\n--query-gpu=*) echo \"0, GPU-abc, "
                         "Fake, 00000000:01:00.0, 81920, 1, %s, 5, 40\";;\n*) echo "
                         "\"GPU-abc, 123\";;\nesac\n" % ("9" * 400))
        os.chmod(smi, 0o755)
        url = self.scripted_server(support.ready_answer)
        res = self.run_gp(["--host", url, "--deadline", "3", "--gpu-backend", "nvidia-smi"],
                          env=support.cron_env(PATH=smi_dir + ":/usr/bin:/bin"))
        self.assertNotInternal(res, deadline=3)


def run_odd(args, env=None, ignored=(), wrapper=()):
    """support.run_script() with every signal at its default action but
    those ignored, behind a wrapper command if one is given."""
    return support.run_script(args, env, wrapper=support.prepared(list(wrapper), ignored))


class ProbeHostTest(VerdictCase):
    """The forked GPU probe under a parent that leaves the process odd: stdio
    closed, many descriptors open, SIGCHLD ignored, no /proc. Each run has
    --deadline 10: up to three interpreters start in its process (a wrapper
    execs into it) before the probe and four requests; the bugs these catch
    end in 69 or 70 at once, or in 75 after the 5 s --gpu-timeout."""

    def test_the_gpu_probe_with_stdio_descriptors_closed(self):
        """Started with two of 0, 1, 2 closed, os.pipe() returns two of them:
        the forked probe must not dup2() /dev/null over its own write end
        (then "AMD sysfs probe died (exit 0)", 69); the run is ready."""
        url = self.scripted_server(support.ready_answer)
        env = support.cron_env(GPU_PREFLIGHT_ROOT=self.amd_root())
        for closed in ((0, 1), (1, 2), (0, 2)):
            with self.subTest(closed=closed):
                self.sink.messages(wait=0.01)
                proc = subprocess.Popen(support.prepared(
                    [sys.executable, support.SCRIPT, "--host", url, "--deadline", "10",
                     "--gpu-backend", "amd-sysfs", "--syslog-address", self.sink.path],
                    closed=closed), env=env, cwd="/", start_new_session=True)
                self.assertEqual(proc.wait(30), 0)
                fields = self.log()[1]
                self.assertEqual(fields["result"], "ready")
                self.assertLess(float(fields["elapsed_ms"]), (10 + SLACK) * 1000)

    def test_the_gpu_probe_with_more_than_1024_descriptors_open(self):
        """A parent that leaks descriptors (RLIMIT_NOFILE above 1024, as in
        many containers): the probe's output is read without select.select,
        whose "filedescriptor out of range" would make every GPU backend 70."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and hard < 1200:
            self.skipTest("RLIMIT_NOFILE hard limit %d < 1200" % hard)
        url = self.scripted_server(support.ready_answer)
        leak = ("import os, resource, sys\n"
                "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
                "resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))\n"
                "for _ in range(1100):\n"
                "    os.set_inheritable(os.open('/dev/null', os.O_RDONLY), True)\n"
                "os.execv(sys.argv[1], sys.argv[1:])\n")
        res = run_odd(["--host", url, "--deadline", "10", "--gpu-backend", "amd-sysfs",
                       "--syslog-address", self.sink.path],
                      env=support.cron_env(GPU_PREFLIGHT_ROOT=self.amd_root()),
                      wrapper=(sys.executable, "-c", leak))
        self.assertInTime(res, 10, self.assertReady(res))

    def test_nvidia_smi_with_sigchld_ignored(self):
        """A parent that ignores SIGCHLD (inherited across exec): children
        are reaped by the kernel and waitpid() fails with ECHILD, which must
        not read as "GPU probe hung: nvidia-smi did not exit" (75 on every
        run); the run is ready."""
        smi_dir = os.path.join(self.dir, "bin")
        fakes.write_fake_smi(smi_dir)
        os.chmod(smi_dir, 0o755)
        url = self.scripted_server(support.ready_answer)
        res = run_odd(["--host", url, "--deadline", "10", "--gpu-backend", "nvidia-smi",
                       "--syslog-address", self.sink.path],
                      env=support.cron_env(PATH=smi_dir + ":/usr/bin:/bin"),
                      ignored=(signal.SIGCHLD,))
        self.assertReady(res)

    def test_the_gpu_probe_without_proc(self):
        """No /proc (a chroot, a minimal container): the forked child closes
        its descriptors without listing /proc/self/fd (which would raise before
        it probes anything: "AMD sysfs probe died (exit 70)", 69)."""
        unshare = support.require_tool(self, "unshare")
        if os.geteuid() != 0:
            self.skipTest("needs root to mount over /proc in a mount namespace")
        url = self.scripted_server(support.ready_answer)
        res = run_odd(["--host", url, "--deadline", "10", "--gpu-backend", "amd-sysfs",
                       "--syslog-address", self.sink.path],
                      env=support.cron_env(GPU_PREFLIGHT_ROOT=self.amd_root()),
                      wrapper=(unshare, "--mount", "--propagation", "private", "/bin/sh",
                               "-c", 'mount -t tmpfs none /proc && exec "$@"', "sh"))
        self.assertReady(res)


if __name__ == "__main__":
    unittest.main()
