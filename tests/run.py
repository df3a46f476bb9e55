#!/usr/bin/env python3
"""Run the whole test suite under every CPython from 3.6 to 3.13 found here.

    python3 tests/run.py                 # every interpreter found
    python3 tests/run.py --python /usr/bin/python3.11 --python ...
    python3 tests/run.py --jobs 3 -k Contract

Interpreters come from --python, else GPU_PREFLIGHT_PYTHONS (space separated),
else /root/.pyenv/versions/3.N*/bin/python for N = 6..13, else python3 alone.
Under CI (CI=true) the run fails when the oldest (3.6) or the newest (3.13)
supported version is missing, and any skipped test counts as a failure: a
tool a test needs must be installed there, not skipped.

The last line is "total: N passed, N failed, N skipped"; the exit status is 0
only when nothing failed.
"""

import argparse
import glob
import os
import re
import subprocess
import sys
import threading
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
IN_CI = os.environ.get("CI", "").lower() == "true"
SUPPORTED = ["3.%d" % minor for minor in range(6, 14)]


def find_pythons():
    """One interpreter per supported minor version, oldest first."""
    listed = os.environ.get("GPU_PREFLIGHT_PYTHONS", "").split()
    if listed:
        return listed
    found = []
    for version in SUPPORTED:
        paths = sorted(glob.glob("/root/.pyenv/versions/%s.*/bin/python" % version))
        if paths:
            found.append(paths[-1])
    return found or [sys.executable]


def version_of(python):
    out = subprocess.check_output(
        [python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"])
    return out.decode().strip()


def run_one(python, pattern, results, lock):
    """Run unittest discovery under one interpreter; record its counts."""
    cmd = [python, "-W", "error::DeprecationWarning", "-m", "unittest", "discover",
           "-s", TESTS, "-t", TESTS, "-v"]
    if pattern:                 # unittest -k exists from Python 3.7 on
        cmd += ["-k", pattern]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = proc.communicate()[0].decode("utf-8", "replace")
    took = time.monotonic() - started
    ran = re.findall(r"^Ran (\d+) tests? in", output, re.M)
    total = int(ran[-1]) if ran else 0
    tail = output.strip().splitlines()[-1] if output.strip() else ""
    counts = dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", tail))
    failed = counts.get("failures", 0) + counts.get("errors", 0) + \
        counts.get("unexpected_successes", 0)
    skipped = counts.get("skipped", 0)
    if proc.returncode != 0 and failed == 0:
        failed = 1              # the runner itself broke (import error...)
    with lock:
        results.append((python, total - failed - skipped, failed, skipped, took,
                         proc.returncode, output))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", help="interpreter to use")
    parser.add_argument("--jobs", type=int, default=2,
                        help="interpreters run at once (default 2)")
    parser.add_argument("-k", dest="pattern",
                        help="only tests matching this (Python 3.7+ only)")
    args = parser.parse_args(argv)

    pythons = args.python or find_pythons()
    versions = dict((p, version_of(p)) for p in pythons)
    if args.pattern:
        old = [p for p in pythons if versions[p].startswith("3.6.")]
        for python in old:
            print("skipping Python %s: its unittest has no -k" % versions[python])
        pythons = [p for p in pythons if p not in old]
    missing = []
    if IN_CI:
        have = set(v.rsplit(".", 1)[0] for v in versions.values())
        missing = [v for v in (SUPPORTED[0], SUPPORTED[-1]) if v not in have]
    print("interpreters: %s" % ", ".join(versions[p] for p in pythons))
    sys.stdout.flush()

    results, lock, queue = [], threading.Lock(), list(pythons)

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                python = queue.pop(0)
            run_one(python, args.pattern, results, lock)

    threads = [threading.Thread(target=worker) for _ in range(max(1, args.jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    passed = failed = skipped = 0
    def by_version(result):
        return tuple(int(x) for x in versions[result[0]].split("."))

    for python, ok, bad, skip, took, code, output in sorted(results, key=by_version):
        if bad or (skip and IN_CI):
            print(output)
        print("python %-8s %4d passed, %d failed, %d skipped  (%.0f s)"
              % (versions[python], ok, bad, skip, took))
        passed, failed, skipped = passed + ok, failed + bad, skipped + skip
    for version in missing:
        print("CI: no Python %s interpreter found; the suite must run on it" % version)
    if IN_CI and skipped:
        print("CI: %d test(s) skipped; under CI a missing tool is a failure" % skipped)
        failed += skipped
        skipped = 0
    failed += len(missing)
    print("total: %d passed, %d failed, %d skipped" % (passed, failed, skipped))
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
