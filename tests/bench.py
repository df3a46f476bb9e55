#!/usr/bin/env python3
"""Benchmark gpu_preflight against its floor and its peers, side by side.

    python3 tests/bench.py [--runs 21] [--python PATH] [--importtime]

The bench installs the command with install.sh into a temporary prefix (the
fast layout: a launcher that imports the module from its bytecode cache),
using the --python interpreter. Everything runs against the loopback Ollama
emulator (tests/ollama_emu.py) in one process, variants interleaved round by
round so that machine noise hits them alike; each figure is the median wall
time of --runs process launches, in cron's environment (PATH only). Printed:

  interpreter alone    python3 -I -c pass
  import floor         python3 -I -c "import urllib.request, json"
  no-network floor     python3 -I -c "import argparse, json, fcntl, signal,
                       socket, threading": what a reused verdict needs at least
  installed, ...       the installed command: healthy path (warm model, all
                       four stages; "+ config": also reading the example
                       config install.sh puts in /etc), refused port
                       (nothing listens), reused verdict (--share-result: a
                       ready verdict another caller left, no network), GPU
                       stage through the fake libnvidia-ml.so.1
                       (tests/fake_nvml.c, built with cc) and the fake
                       nvidia-smi
                       and one model against two (a second model
                       costs only its own warm-up request)
  copied file, ...     python3 gpu_preflight.py, compiled on every run
  curl, two calls      GET /api/tags && POST /api/generate, a shell one-liner
  requests, two calls  the seed's approach with requests (when importable)
  deadline overshoot   wall time past --deadline 1 against a server that
                       trickles a byte every 2 s, and one that never answers
  peak RSS             VmHWM of the process, for the floor and the command

Targets: installed healthy <= 1.2 x floor, its peak RSS <= the
floor's + 2 MiB; installed refused <= floor + 10 ms; installed reused verdict
<= 0.7 x floor; copied file healthy <= 1.7 x floor. Earlier ones: overshoot
< 0.25 s; the NVML stage adds < 15 ms. A benchmark, not a test: it reports.

--importtime adds (Python 3.7+), for the installed command's healthy path
(with and without the example config), refused port and reused verdict, the
modules it imports (python3 -X importtime, median of --runs): those the module
imports at start and those the run imports later (cumulative times), and
every module the import floor does not load (self times).
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
SCRIPT = os.path.join(REPO, "gpu_preflight.py")
sys.path.insert(0, TESTS)

import fakes  # noqa: E402
from ollama_emu import Emulator, Model, free_port  # noqa: E402

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

FLOOR = "import urllib.request, json"
#: What a run that sends nothing (a reused verdict) needs at least: the
#: option parser, json and flock for the state file, a socket for syslog.
NO_NETWORK = "import argparse, json, fcntl, signal, socket, threading"

#: Runs a script as __main__, then prints the process's own peak RSS (VmHWM).
#: rusage's ru_maxrss would count the pages of this (large) benchmark process
#: that the child held between fork and exec; VmHWM belongs to the new image.
#: The floor and the command run through it alike.
PEAK_RSS = """
import sys
sys.argv = sys.argv[1:]
try:
    if sys.argv[0] == "-c":
        exec(sys.argv[1])
    else:
        with open(sys.argv[0]) as handle:
            code = compile(handle.read(), sys.argv[0], "exec")
        exec(code, {"__name__": "__main__", "__file__": sys.argv[0]})
except SystemExit:
    pass
with open("/proc/self/status") as status:
    sys.stderr.write([l for l in status if l.startswith("VmHWM")][0])
"""

CRON_ENV = {"PATH": "/usr/bin:/bin"}


def timed(cmd):
    """(wall seconds, exit status) of one process, in cron's environment;
    cmd may start with NAME=VALUE items to add to that environment."""
    env = dict(CRON_ENV)
    while "=" in cmd[0]:
        env.update([cmd[0].split("=", 1)])
        cmd = cmd[1:]
    started = time.monotonic()
    code = subprocess.call(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env=env)
    return time.monotonic() - started, code


def peak_rss_mib(py, flags, argv):
    """Peak RSS of `py flags... argv...` in MiB (see PEAK_RSS)."""
    out = subprocess.run([py] + flags + ["-c", PEAK_RSS] + argv,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env=CRON_ENV).stderr
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


def install(py, work):
    """Install the command with install.sh into work/prefix, its example
    config into work/etc; their paths."""
    prefix = os.path.join(work, "prefix")
    subprocess.run(["sh", os.path.join(REPO, "install.sh"), "--prefix", prefix,
                    "--sysconfdir", os.path.join(work, "etc"), "--python", py,
                    "--quiet"], check=True, stdin=subprocess.DEVNULL, env=CRON_ENV)
    return (os.path.join(prefix, "bin", "gpu_preflight"),
            os.path.join(work, "etc", "gpu_preflight.conf"))


def import_times(py, cmd, runs):
    """Median import times (us) of `py -I -X importtime cmd...`, as
    {name: (self, cumulative, when)}: when is "start" for what the module
    gpu_preflight itself imports, "later" for what the run imports after it
    (inside functions), "" for the rest (the interpreter's own, nested ones)."""
    found = {}
    for _ in range(runs):
        err = subprocess.run([py, "-I", "-X", "importtime"] + cmd,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, env=CRON_ENV).stderr.decode()
        rows = re.findall(r"^import time:\s+(\d+) \|\s+(\d+) \|( +)(\S+)$", err, re.M)
        # a row comes after the rows of what it imported, indented one step
        # more: the module's own imports are the level-1 rows just before its
        # row, and the level-0 rows after it are what the run imported later
        children, seen_module = [], False
        for self_us, cumulative, indent, name in rows:
            level = (len(indent) - 1) // 2
            when = ""
            if level == 1:
                children.append(name)
            elif level == 0:
                if name == "gpu_preflight":
                    seen_module = True
                    for child in children:
                        found[child][2] = "start"
                elif seen_module:
                    when = "later"
                children = []
            found.setdefault(name, [[], [], ""])
            found[name][0].append(int(self_us))
            found[name][1].append(int(cumulative))
            found[name][2] = found[name][2] or when
    return dict((name, (statistics.median(s), statistics.median(c), when))
                for name, (s, c, when) in found.items())


def print_imports(name, found, floor):
    """The report of import_times: the module's own imports at start, what
    the run imports later, and every module the floor does not load."""
    def listed(items):
        return ", ".join("%s %.1f" % (n, us / 1000.0) for n, us in
                         sorted(items, key=lambda item: -item[1])) or "none"
    beyond = [(n, v[0]) for n, v in found.items() if n not in floor]
    print("imports of the installed command, %s (ms, median):" % name)
    print("  at start (cumulative): " + listed(
        [(n, v[1]) for n, v in found.items() if v[2] == "start"]))
    print("  later (cumulative):    " + listed(
        [(n, v[1]) for n, v in found.items() if v[2] == "later"]))
    print("  beyond the floor (self, %.1f in all): %s"
          % (sum(us for _, us in beyond) / 1000.0, listed(beyond)))


def version_info(py):
    out = subprocess.check_output([py, "-c", "import sys; print(sys.version_info[:3])"])
    return tuple(int(x) for x in re.findall(r"\d+", out.decode()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--importtime", action="store_true",
                        help="also list the installed command's imports")
    args = parser.parse_args(argv)
    py = args.python
    version = ".".join(str(x) for x in version_info(py))

    work = tempfile.mkdtemp(prefix="gpfl-bench-")
    runners = os.path.join(work, "runners")     # its runner on the fake GPU (NVML)
    warm = Emulator(gpu_file=runners).start()
    trickle = Emulator(mode="trickle").start()
    hang = Emulator(mode="hang").start()
    pair = Emulator(models=(Model("qwen3:latest", "generate", ["completion", "tools"]),
                            Model("nomic-embed-text:latest", "embed")),
                    loaded=("qwen3:latest", "nomic-embed-text:latest")).start()
    refused = "127.0.0.1:%d" % free_port()
    try:
        command, config = install(py, work)
        state = os.path.join(work, "state")
        gp = [command, "--no-syslog"]
        copied = [py, SCRIPT, "--no-syslog"]
        variants = [
            ("interpreter alone", [py, "-I", "-c", "pass"]),
            ("import floor", [py, "-I", "-c", FLOOR]),
            ("no-network floor", [py, "-I", "-c", NO_NETWORK]),
            ("installed, healthy", gp + ["--host", warm.url]),
            ("installed, healthy + config", gp + ["--host", warm.url,
                                                  "--config", config]),
            ("installed, refused port", gp + ["--host", refused]),
            ("installed, reused verdict", gp + [
                "--host", warm.url, "--share-result", "86400", "--state-dir", state]),
            ("installed, one of two models", gp + ["--host", pair.url, "--model", "qwen3"]),
            ("installed, two models", gp + ["--host", pair.url, "--model", "qwen3",
                                            "--model", "nomic-embed-text"]),
            ("copied file, healthy", copied + ["--host", warm.url]),
            ("copied file, refused port", copied + ["--host", refused]),
        ]
        if shutil.which("cc"):
            lib = fakes.build_fake_nvml(work)
            fakes.write_fake_smi(work)
            variants += [
                ("installed, GPU NVML", ["FAKE_NVML_RUNNERS=" + runners] + gp + [
                    "--host", warm.url, "--gpu-backend", "nvml", "--nvml-lib", lib]),
                ("installed, GPU smi", ["PATH=%s:/usr/bin:/bin" % work] + gp + [
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

        for name, cmd in variants:          # warm caches, check each works
            code = timed(cmd)[1]
            if (code != 0) != ("refused" in name):
                raise SystemExit("bench: %r exited %d; not measuring a failure"
                                 % (name, code))
        sent = {}                           # requests per run, one model and two
        for name, cmd in variants:
            if "model" in name:
                before = len(pair.requests)
                timed(cmd)
                sent[name] = [r[1] for r in pair.requests[before:]]
        fast = measure(variants, args.runs)
        slow_runs = max(3, args.runs // 4)
        slow = measure([
            ("trickle", gp + ["--host", trickle.url, "--timeout", "5", "--deadline", "1"]),
            ("never answers", gp + ["--host", hang.url, "--timeout", "5",
                                    "--deadline", "1"]),
        ], slow_runs)
        rss = [("import floor", peak_rss_mib(py, ["-I"], ["-c", FLOOR])),
               ("installed, healthy", peak_rss_mib(py, ["-I"], gp + ["--host", warm.url])),
               ("installed, refused", peak_rss_mib(py, ["-I"], gp + ["--host", refused])),
               ("copied file, healthy", peak_rss_mib(py, [], copied[1:] + [
                   "--host", warm.url]))]
        imports = {}
        if args.importtime and version_info(py) < (3, 7):
            print("bench: -X importtime needs Python 3.7+; not listing imports")
        elif args.importtime:
            imports["floor"] = import_times(py, ["-c", FLOOR], args.runs)
            for name, extra in (("healthy path", ["--host", warm.url]),
                                ("healthy path, example config", [
                                    "--host", warm.url, "--config", config]),
                                ("refused port", ["--host", refused]),
                                ("reused verdict", ["--host", warm.url, "--share-result",
                                                    "86400", "--state-dir", state])):
                imports[name] = import_times(py, gp + extra, args.runs)
    finally:
        for emu in (warm, trickle, hang, pair):
            emu.stop()
        shutil.rmtree(work, ignore_errors=True)

    floor = median_ms(fast["import floor"])
    print("gpu_preflight benchmark: Python %s (%s), medians of %d interleaved runs "
          "(overshoot: %d), loopback emulator" % (version, py, args.runs, slow_runs))
    print("%-28s %10s %8s %10s" % ("", "median ms", "x floor", "- floor"))
    for name, _ in variants:
        ms = median_ms(fast[name])
        print("%-28s %10.1f %8.2f %+10.1f" % (name, ms, ms / floor, ms - floor))
    overshoot = {}
    for name, samples in slow.items():
        overshoot[name] = statistics.median(s[0] for s in samples) - 1.0
        print("overshoot, %-17s %10.3f s past --deadline 1 (worst %.3f s, exit %s)"
              % (name, overshoot[name], max(s[0] for s in samples) - 1.0,
                 "/".join(str(c) for c in sorted(set(s[1] for s in samples)))))
    for name, mib in rss:
        print("peak RSS, %-18s %10.1f MiB" % (name, mib))
    rss = dict(rss)

    def verdict(ok):
        return "met" if ok else "MISSED"

    healthy = median_ms(fast["installed, healthy"])
    refused_ms = median_ms(fast["installed, refused port"])
    reused = median_ms(fast["installed, reused verdict"])
    copied_ms = median_ms(fast["copied file, healthy"])
    extra_rss = rss["installed, healthy"] - rss["import floor"]
    print("targets:")
    print("  installed healthy    %5.2f x floor (<= 1.20)   %s"
          % (healthy / floor, verdict(healthy <= 1.2 * floor)))
    print("  installed peak RSS   %+5.1f MiB over floor (<= 2) %s"
          % (extra_rss, verdict(extra_rss <= 2.0)))
    print("  installed refused    %+5.1f ms over floor (<= 10) %s"
          % (refused_ms - floor, verdict(refused_ms - floor <= 10.0)))
    print("  installed reused     %5.2f x floor (<= 0.70)   %s"
          % (reused / floor, verdict(reused <= 0.7 * floor)))
    print("  copied file healthy  %5.2f x floor (<= 1.70)   %s"
          % (copied_ms / floor, verdict(copied_ms <= 1.7 * floor)))
    print("  overshoot            %5.3f s (< 0.25)          %s"
          % (max(overshoot.values()), verdict(max(overshoot.values()) < 0.25)))
    one, two = (median_ms(fast["installed, %s" % n]) for n in ("one of two models",
                                                                  "two models"))
    extra = len(sent["installed, two models"]) - len(sent["installed, one of two models"])
    print("  second model         %+5.1f ms, %+d request(s) (%s) over one model"
          % (two - one, extra, ", ".join(sorted(set(sent["installed, two models"])
                                                 - set(sent["installed, one of two models"])))))
    if "installed, GPU NVML" in fast:
        nvml = median_ms(fast["installed, GPU NVML"]) - healthy
        print("  NVML stage           %+5.1f ms over healthy (< 15) %s"
              % (nvml, verdict(nvml < 15.0)))
    for name, found in imports.items():
        if name != "floor":
            print_imports(name, found, imports["floor"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
