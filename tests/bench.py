#!/usr/bin/env python3
"""Benchmark gpu_preflight.py against its floor and its peers, side by side.

    python3 tests/bench.py [--runs 21] [--python PATH]

Everything runs against the loopback Ollama emulator (tests/ollama_emu.py)
in one process, variants interleaved round by round so that machine noise
hits them alike; each figure is the median wall time of --runs process
launches (and the peak RSS of the script's own runs). Printed:

  healthy path       gpu_preflight.py, warm model, all four stages
  import floor       python3 -c "import urllib.request, json"
  curl, two calls    GET /api/tags && POST /api/generate, as a shell one-liner
  requests, two      the seed's approach with requests (when importable),
                     sending the correct native body
  refused port       gpu_preflight.py against a port nothing listens on
  deadline overshoot wall time past --deadline 1 against a server that
                     trickles a byte every 2 s, and one that never answers
  GPU stage, NVML    the healthy path with --gpu against the fake
                     libnvidia-ml.so.1 (tests/fake_nvml.c, built with cc)
  GPU stage, smi     the same through the fake nvidia-smi (a sh script)
  shared verdict     --share-result: a ready verdict another caller left is
                     reused without touching the network

Targets (issue 2): healthy <= 1.3 x floor; refused <= floor + 30 ms;
overshoot < 0.25 s; peak RSS < 20 MiB. Issue 3: the NVML stage adds < 15 ms
(the fake's own init costs nothing). Issue 4: the shared verdict costs at most
floor + 5 ms. A benchmark, not a test: it reports.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(TESTS), "gpu_preflight.py")
sys.path.insert(0, TESTS)

import fakes  # noqa: E402
from ollama_emu import Emulator, free_port  # noqa: E402

BODY = json.dumps({"model": "llama3.2:latest", "prompt": "test", "stream": False,
                   "options": {"num_predict": 1}})

REQUESTS_SEED = """
import sys, requests
base = sys.argv[1]
r = requests.get(base + "/api/tags", timeout=3); r.raise_for_status()
r = requests.post(base + "/api/generate", timeout=3, json={"model": "llama3.2:latest",
    "prompt": "test", "stream": False, "options": {"num_predict": 1}})
r.raise_for_status()
"""


#: Runs a script as __main__, then prints the process's own peak RSS (VmHWM).
#: rusage's ru_maxrss would count the pages of this (large) benchmark process
#: that the child held between fork and exec; VmHWM belongs to the new image.
PEAK_RSS = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit:
    pass
with open("/proc/self/status") as status:
    sys.stderr.write([l for l in status if l.startswith("VmHWM")][0])
"""


def timed(cmd):
    """(wall seconds, exit status) of one process, in cron's environment;
    cmd may start with NAME=VALUE items to add to that environment."""
    env = {"PATH": "/usr/bin:/bin"}
    while "=" in cmd[0]:
        env.update([cmd[0].split("=", 1)])
        cmd = cmd[1:]
    started = time.monotonic()
    code = subprocess.call(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env=env)
    return time.monotonic() - started, code


def peak_rss_mib(py, argv):
    """Peak RSS of `py argv...` in MiB (see PEAK_RSS)."""
    out = subprocess.run([py, "-c", PEAK_RSS] + argv, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin"}).stderr
    return int(out.decode().split()[-2]) / 1024.0


def measure(variants, runs):
    """Run each variant `runs` times, interleaved; return name -> samples."""
    samples = dict((name, []) for name, _ in variants)
    for _ in range(runs):
        for name, cmd in variants:
            samples[name].append(timed(cmd))
    return samples


def median_ms(samples):
    return statistics.median(s[0] for s in samples) * 1000.0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    py = args.python
    version = subprocess.check_output(
        [py, "-c", "import sys; print(sys.version.split()[0])"]).decode().strip()

    work = tempfile.mkdtemp(prefix="gpfl-bench-")
    floor_file = os.path.join(work, "floor.py")
    with open(floor_file, "w") as handle:
        handle.write("import urllib.request, json\n")
    warm = Emulator().start()
    trickle = Emulator(mode="trickle").start()
    hang = Emulator(mode="hang").start()
    refused = "127.0.0.1:%d" % free_port()
    gp = [py, SCRIPT, "--no-syslog"]
    variants = [
        ("healthy path", gp + ["--host", warm.url]),
        ("import floor", [py, "-c", "import urllib.request, json"]),
        ("refused port", gp + ["--host", refused]),
        ("shared verdict", gp + ["--host", warm.url, "--share-result", "86400",
                                 "--state-dir", os.path.join(work, "state")]),
    ]
    if shutil.which("cc"):
        lib = fakes.build_fake_nvml(work)
        fakes.write_fake_smi(work)
        variants += [
            ("GPU stage, NVML", gp + ["--host", warm.url, "--gpu-backend", "nvml",
                                      "--nvml-lib", lib]),
            ("GPU stage, smi", ["PATH=%s:/usr/bin:/bin" % work] + gp + [
                "--host", warm.url, "--gpu-backend", "nvidia-smi"])]
    curl = shutil.which("curl")
    if curl:
        variants.append(("curl, two calls", [
            "/bin/sh", "-c", '%s -sf --max-time 3 "$0/api/tags" >/dev/null && '
            '%s -sf --max-time 3 -d "$1" "$0/api/generate" >/dev/null' % (curl, curl),
            warm.url, BODY]))
    has_requests = subprocess.call([py, "-c", "import requests"],
                                   stderr=subprocess.DEVNULL) == 0
    if has_requests:
        variants.append(("requests, two calls", [py, "-c", REQUESTS_SEED, warm.url]))

    try:
        for name, cmd in variants:          # warm caches, check each works
            code = timed(cmd)[1]
            if (code != 0) != (name == "refused port"):
                raise SystemExit("bench: %r exited %d; not measuring a failure"
                                 % (name, code))
        fast = measure(variants, args.runs)
        slow_runs = max(3, args.runs // 4)
        slow = measure([
            ("trickle", gp + ["--host", trickle.url, "--timeout", "5", "--deadline", "1"]),
            ("never answers", gp + ["--host", hang.url, "--timeout", "5",
                                    "--deadline", "1"]),
        ], slow_runs)
        rss = {"gpu_preflight.py, healthy": peak_rss_mib(py, gp[1:] + ["--host", warm.url]),
               "gpu_preflight.py, refused": peak_rss_mib(py, gp[1:] + ["--host", refused]),
               "import floor": peak_rss_mib(py, [floor_file])}
    finally:
        for emu in (warm, trickle, hang):
            emu.stop()
        shutil.rmtree(work, ignore_errors=True)

    floor = median_ms(fast["import floor"])
    print("gpu_preflight benchmark: Python %s, medians of %d interleaved runs "
          "(overshoot: %d), loopback emulator" % (version, args.runs, slow_runs))
    print("%-24s %10s %8s" % ("", "median ms", "x floor"))
    healthy = median_ms(fast["healthy path"])
    for name, _ in variants:
        ms = median_ms(fast[name])
        print("%-24s %10.1f %8.2f%s" % (name, ms, ms / floor, "   %+.1f ms over healthy"
                                        % (ms - healthy) if name.startswith("GPU") else ""))
    overshoot = {}
    for name, samples in slow.items():
        overshoot[name] = statistics.median(s[0] for s in samples) - 1.0
        print("overshoot, %-13s %10.3f s past --deadline 1 (worst %.3f s, exit %s)"
              % (name, overshoot[name], max(s[0] for s in samples) - 1.0,
                 "/".join(str(c) for c in sorted(set(s[1] for s in samples)))))
    for name, mib in rss.items():
        print("peak RSS, %-25s %5.1f MiB" % (name, mib))
    refused_ms = median_ms(fast["refused port"])
    print("shared verdict - floor %+.1f ms (<= 5)" % (median_ms(fast["shared verdict"]) - floor))
    print("targets: healthy/floor %.2f (<= 1.30); refused - floor %+.1f ms (<= 30); "
          "overshoot %.3f s (< 0.25); peak RSS %.1f MiB (< 20)"
          % (healthy / floor, refused_ms - floor, max(overshoot.values()),
             max(rss["gpu_preflight.py, healthy"], rss["gpu_preflight.py, refused"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
