#!/usr/bin/env python3
"""Run the whole test suite under every CPython from 3.6 to 3.13 found here.

    python3 tests/run.py                 # every interpreter found
    python3 tests/run.py --python /usr/bin/python3.11 --python ...
    python3 tests/run.py --jobs 3 -k Contract

Interpreters come from --python, else GPU_PREFLIGHT_PYTHONS (space separated),
else one per minor version 3.6 to 3.13: the newest pyenv has
($PYENV_ROOT, where the pyenv on PATH lives, `pyenv root`, ~/.pyenv:
versions/3.N.P/bin/python), else a `python3.N` on PATH; else the python3
running this. Each interpreter runs
the modules tests/test*.py. The modules tests/once_*.py (slow tests with real
daemons), and the test*.py classes that say ONCE = True (what they prove does
not depend on the interpreter running the suite), run once per suite run,
beside the others, under /usr/bin/python3 (Debian's, what cron and systemd
find) when it exists, else under the newest interpreter found.

Progress: a line when an interpreter starts and ends, and one per test module
as it finishes (with the tests that failed). A run that passes still lists
every skipped test with its reason, grouped by reason; a failing run prints
that interpreter's unittest output. Under CI (CI=true) the run fails when the
oldest (3.6) or the newest (3.13) supported version is missing, and any
skipped test counts as a failure: a tool a test needs must be installed
there, not skipped. A run without -k that runs no test fails.

Sealed: run as root where unshare works (always under CI), the whole run
happens in a private mount namespace where /etc/gpu_preflight.conf is a
planted config that no test may read (it has an unknown key: a run that reads
it fails) and /dev/log is a socket this runner watches: a line that arrives
there is a failure (each test must log to its own socket). /etc and /dev are
overlays there, so nothing a test writes below them reaches the machine; and
a file a test writes in the machine's state directory (/run/gpu_preflight,
root's default --state-dir) is a failure too. Each interpreter's run has a
network namespace of its own (a loopback, nothing else), so that runs at once
never take each other's ports (the once run keeps the machine's).

The last line is "total: N passed, N failed, N skipped" (tests, a test with
a failing subtest counted once); the exit status is 0 only when nothing
failed and something passed.
"""

import argparse
import contextlib
import fnmatch
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
IN_CI = os.environ.get("CI", "").lower() == "true"
SUPPORTED = ["3.%d" % minor for minor in range(6, 14)]
EACH, ONCE = "test*.py", "once_*.py"      # per interpreter; once per run
ONCE_PYTHON = "/usr/bin/python3"
SEALED = "GPU_PREFLIGHT_TESTS_SEALED"        # set inside the sealed namespace

#: Inside a private mount namespace, before the run: /etc, /dev and /run
#: become overlays over the machine's own, with a planted config in /etc, and
#: the mounts below /dev and /run bound back in.
SEAL = r"""set -e
top=$1; shift
mount -t tmpfs -o mode=700 gpfl-sealed "$top"
mkdir "$top/etc" "$top/etc.work" "$top/dev" "$top/dev.work" "$top/host-dev" \
    "$top/run" "$top/run.work" "$top/host-run"
printf '%s\n' '# planted by tests/run.py: a test read the host config' \
    '[gpu_preflight]' 'planted-by-the-test-runner = no test may read this file' \
    > "$top/etc/gpu_preflight.conf"
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$top/etc,workdir=$top/etc.work" /etc
mount --rbind /dev "$top/host-dev"
mount -t overlay overlay -o "lowerdir=/dev,upperdir=$top/dev,workdir=$top/dev.work" /dev
for sub in pts shm mqueue hugepages; do
    if mountpoint -q "$top/host-dev/$sub"; then
        mount --rbind "$top/host-dev/$sub" "/dev/$sub"
    fi
done
mount --rbind /run "$top/host-run"
findmnt -rn -o TARGET -R /run | grep '^/run/' | sort -u > "$top/run-mounts"
mount -t overlay overlay -o "lowerdir=/run,upperdir=$top/run,workdir=$top/run.work" /run
while read -r sub; do
    mount --rbind "$top/host-run${sub#/run}" "$sub" || true
done < "$top/run-mounts"
exec "$@"
"""


# --- the child: one interpreter running one discovery, reporting events -----

def module_of(test):
    """The test module a test (or a fixture's error holder) belongs to."""
    if test.__class__.__module__ == "unittest.loader":     # import failed
        return getattr(test, "_testMethodName", "?")
    if test.__class__.__name__ == "_ErrorHolder":   # "setUpClass (mod.Class)"
        match = re.search(r"\(([^).\s]+)", test.description)
        return match.group(1) if match else "?"
    return test.__class__.__module__


class Tracking(unittest.TextTestResult):
    """TextTestResult that also sends, as JSON lines on `events`, one event
    per test module when it is done and one at the end with the totals, the
    skips with their reasons and the tests that failed."""

    events = None

    def __init__(self, *args, **kwargs):
        super(Tracking, self).__init__(*args, **kwargs)
        self.order, self.modules = [], {}
        self.current, self.flags = None, set()

    def send(self, **event):
        self.events.write(json.dumps(event) + "\n")
        self.events.flush()

    def bucket(self, module):
        """The module's counts; a module touched first ends every earlier one."""
        if module not in self.modules:
            for name in self.order:
                self.flush(name)
            self.order.append(module)
            self.modules[module] = {"passed": 0, "failed": 0, "skipped": 0,
                                    "failures": [], "skips": [],
                                    "started": time.time(), "done": False}
        counts = self.modules[module]
        counts["done"] = False          # a late fixture error: reported again
        return counts

    def flush(self, module):
        counts = self.modules[module]
        if not counts["done"]:
            counts["done"] = True
            self.send(event="module", module=module, passed=counts["passed"],
                      failed=counts["failed"], skipped=counts["skipped"],
                      failures=counts["failures"], skips=counts["skips"],
                      seconds=time.time() - counts["started"])

    def outside(self, test):
        """A fixture's error or skip, not the running test's (setUpClass...)."""
        parent = getattr(test, "test_case", test)  # a subtest's own test
        return self.current is None or parent is not self.current

    def startTest(self, test):
        super(Tracking, self).startTest(test)
        self.bucket(module_of(test))
        self.current, self.flags = test, set()

    def stopTest(self, test):
        super(Tracking, self).stopTest(test)
        counts = self.bucket(module_of(test))
        if "fail" in self.flags:
            counts["failed"] += 1
            counts["failures"].append(test.id())
        elif "skip" in self.flags:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
        self.current = None

    def fail_outside(self, test):
        counts = self.bucket(module_of(test))
        counts["failed"] += 1
        counts["failures"].append(test.id())

    def addError(self, test, err):
        super(Tracking, self).addError(test, err)
        if self.outside(test):
            self.fail_outside(test)
        else:
            self.flags.add("fail")

    def addFailure(self, test, err):
        super(Tracking, self).addFailure(test, err)
        if self.outside(test):
            self.fail_outside(test)
        else:
            self.flags.add("fail")

    def addSubTest(self, test, subtest, err):
        super(Tracking, self).addSubTest(test, subtest, err)
        if err is not None:
            self.flags.add("fail")

    def addUnexpectedSuccess(self, test):
        super(Tracking, self).addUnexpectedSuccess(test)
        self.flags.add("fail")

    def addSkip(self, test, reason):
        super(Tracking, self).addSkip(test, reason)
        counts = self.bucket(module_of(test))
        counts["skips"].append((test.id(), reason))
        if self.outside(test):         # a whole class or module skipped
            counts["skipped"] += 1
        else:
            self.flags.add("skip")

    def stopTestRun(self):
        super(Tracking, self).stopTestRun()
        for name in self.order:
            self.flush(name)
        self.send(event="end")


def flatten(suite):
    for test in suite:
        if isinstance(test, unittest.TestSuite):
            for inner in flatten(test):
                yield inner
        else:
            yield test


def selected(test, patterns):
    """unittest's own -k rule (3.7+): a pattern without * matches anywhere."""
    if test.__class__.__module__ == "unittest.loader":
        return True                     # an import error is always shown
    for pattern in patterns:
        if "*" not in pattern:
            pattern = "*%s*" % pattern
        if fnmatch.fnmatchcase(test.id(), pattern):
            return True
    return False


def once_only(test):
    """A test of a test*.py module whose class says ONCE = True: what it
    proves does not depend on the interpreter the suite runs (it runs the
    machine's /usr/bin/python3 or only a shell), so it runs once per suite
    run, in the once run, not under each interpreter."""
    return getattr(test, "ONCE", False) is True


def child(args):
    os.set_inheritable(args.events, False)   # no test's daemon may hold it
    Tracking.events = os.fdopen(args.events, "w")
    loader = unittest.TestLoader()
    tests = flatten(loader.discover(TESTS, pattern=args.discover, top_level_dir=TESTS))
    if args.discover == EACH:
        tests = [t for t in tests if not once_only(t)]
    else:                               # the once run takes them in
        tests = list(tests) + [t for t in flatten(loader.discover(
            TESTS, pattern=EACH, top_level_dir=TESTS)) if once_only(t)]
    suite = unittest.TestSuite(tests)
    if args.pattern:
        suite = unittest.TestSuite(t for t in tests if selected(t, args.pattern))
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=1,
                                     resultclass=Tracking)
    return 0 if runner.run(suite).wasSuccessful() else 1


# --- the parent: find interpreters, run them all at once, report ----------

def version_of(python):
    """'3.N.P' of an interpreter, or None when it does not run."""
    try:
        out = subprocess.check_output(
            [python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
            stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.decode().strip()


def pyenv_roots():
    roots = []
    if os.environ.get("PYENV_ROOT"):
        roots.append(os.environ["PYENV_ROOT"])
    pyenv = shutil.which("pyenv")
    if pyenv:                           # ROOT/bin/pyenv -> ROOT/libexec/pyenv
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(pyenv))))
        try:
            roots.append(subprocess.check_output(
                [pyenv, "root"], stdin=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, timeout=30).decode().strip())
        except (OSError, subprocess.SubprocessError):
            pass
    roots.append(os.path.expanduser("~/.pyenv"))
    unique = []
    for root in roots:
        if root and os.path.realpath(root) not in [os.path.realpath(r) for r in unique]:
            unique.append(root)
    return unique


def find_pythons():
    """{interpreter: version}, one per supported minor version."""
    listed = os.environ.get("GPU_PREFLIGHT_PYTHONS", "").split()
    if listed:
        return dict((p, version_of(p)) for p in listed)
    roots = pyenv_roots()
    found = {}
    for minor in SUPPORTED:
        candidates = []                 # (patch, path), pyenv's first
        for root in roots:
            for path in glob.glob(os.path.join(root, "versions", minor + ".*",
                                               "bin", "python")):
                match = re.match(r"^%s\.(\d+)$" % re.escape(minor),
                                 os.path.basename(os.path.dirname(os.path.dirname(path))))
                if match:
                    candidates.append((int(match.group(1)), path))
        candidates.sort(reverse=True)
        on_path = shutil.which("python" + minor)
        if on_path:
            candidates.append((-1, on_path))
        for _, path in candidates:      # a pyenv shim may not run: next
            version = version_of(path)
            if version and version.rsplit(".", 1)[0] == minor:
                found[path] = version
                break
    return found or {sys.executable: version_of(sys.executable)}


def version_key(version):
    return tuple(int(x) for x in re.findall(r"\d+", version or "0"))


class Run(object):
    """One interpreter running one discovery pattern in a child process."""

    def __init__(self, label, python, version, pattern):
        self.label, self.python, self.version = label, python, version
        self.pattern = pattern
        self.passed = self.failed = self.skipped = 0
        self.skips, self.failures, self.output = [], [], ""
        self.modules = {}               # the latest event of each module
        self.ended, self.seconds, self.code = False, 0.0, None


class Reporter(object):
    def __init__(self, width):
        self.lock, self.started, self.width = threading.Lock(), time.time(), width

    def say(self, run, text):
        with self.lock:
            print("[%4d s] %-*s %s" % (time.time() - self.started, self.width,
                                       run.label, text))
            sys.stdout.flush()


def own_network(cmd):
    """cmd in a network namespace of its own with only its loopback, when
    sealed: the interpreters run at once, and a port one of them freed for a
    "connection refused" case must never become another's server (it did:
    a 401 where the test wanted the refusal). The once run stays in the
    machine's: slurmctld does not start in such a namespace."""
    ip = shutil.which("ip") or "/usr/sbin/ip"
    if not is_sealed() or not os.access(ip, os.X_OK) or ONCE in cmd:
        return cmd
    return [shutil.which("unshare") or "/usr/bin/unshare", "--net", "/bin/sh", "-c",
            '"$1" link set lo up && shift && exec "$@"', "netns", ip] + cmd


def execute(run, patterns, reporter):
    """Run one child, printing its module events as they come."""
    reporter.say(run, "started (%s)" % run.python)
    cmd = own_network([run.python, "-W", "error::DeprecationWarning",
                       os.path.abspath(__file__), "--child", "--discover", run.pattern])
    for pattern in patterns or ():
        cmd += ["-k", pattern]
    started = time.time()
    read_fd, write_fd = os.pipe()
    with tempfile.TemporaryFile() as log:
        try:
            proc = subprocess.Popen(cmd + ["--events", str(write_fd)], cwd=REPO,
                                    stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, pass_fds=(write_fd,))
        except OSError as exc:
            os.close(read_fd)
            os.close(write_fd)
            run.failed, run.output = 1, "cannot start %s: %s\n" % (run.python, exc)
            reporter.say(run, "did not start: %s" % exc)
            return
        os.close(write_fd)
        with os.fdopen(read_fd, "r") as events:
            for line in events:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == "module":
                    text = "%-24s %3d passed, %d failed, %d skipped  %4.0f s" % (
                        event["module"], event["passed"], event["failed"],
                        event["skipped"], event["seconds"])
                    if event["failures"]:
                        text += "  FAILED: " + " ".join(event["failures"])
                    reporter.say(run, text)
                    run.modules[event["module"]] = event
                elif event.get("event") == "end":
                    run.ended = True
        run.code = proc.wait()
        run.seconds = time.time() - started
        log.seek(0)
        run.output = log.read().decode("utf-8", "replace")
    for event in run.modules.values():
        run.passed += event["passed"]
        run.failed += event["failed"]
        run.skipped += event["skipped"]
        run.failures.extend(event["failures"])
        run.skips.extend(tuple(skip) for skip in event["skips"])
    if not run.ended:                   # the child broke (crash, import error)
        run.failed += 1
        run.failures.append("%s exited %s before its tests ended"
                            % (run.label, run.code))
    elif run.code != 0 and run.failed == 0:
        run.failed = 1
        run.failures.append("%s exited %s" % (run.label, run.code))
    if run.passed + run.failed + run.skipped == 0 and not patterns:
        run.failed = 1
        run.failures.append("%s ran no tests" % run.label)
    reporter.say(run, "finished: %d passed, %d failed, %d skipped  (%.0f s)"
                 % (run.passed, run.failed, run.skipped, run.seconds))


def where(labels, runs):
    everywhere = set(run.label for run in runs if run.pattern == EACH)
    if set(labels) == everywhere and len(everywhere) > 1:
        return "every interpreter"
    return ", ".join(labels)


def report(runs):
    """Every skipped test with its reason, grouped by reason; every failure."""
    by_reason, failed = {}, {}
    for run in runs:
        for test, reason in run.skips:
            by_reason.setdefault(reason, {}).setdefault(test, []).append(run.label)
        for test in run.failures:
            failed.setdefault(test, []).append(run.label)
    if by_reason:
        print("skipped (%d), by reason:" % sum(len(labels) for tests in by_reason.values()
                                                for labels in tests.values()))
        for reason in sorted(by_reason):
            print("  %s" % reason)
            for test in sorted(by_reason[reason]):
                print("    %s  (%s)" % (test, where(by_reason[reason][test], runs)))
    if failed:
        print("failed (%d):" % sum(len(labels) for labels in failed.values()))
        for test in sorted(failed):
            print("  %s  (%s)" % (test, where(failed[test], runs)))


def seal(argv):
    """Run this runner again inside the sealed namespace; its exit status,
    or None when it cannot be sealed here (not root, no unshare)."""
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    if os.geteuid() != 0 or not os.access(unshare, os.X_OK):
        return None
    top = tempfile.mkdtemp(prefix="gpfl-sealed-")
    try:
        return subprocess.call(
            [unshare, "--mount", "--propagation", "private", "/bin/sh", "-c", SEAL,
             "seal", top, sys.executable, os.path.abspath(__file__)] + argv,
            env=dict(os.environ, **{SEALED: top}))
    finally:
        os.rmdir(top)


def is_sealed():
    """Whether this runner is inside its sealed namespace: the variable names
    a directory that is the seal's tmpfs here, with the planted config in it
    (a variable alone may be inherited, and LogWatch replaces /dev/log)."""
    top = os.environ.get(SEALED, "")
    return top.startswith("/") and os.path.ismount(top) and os.path.isfile(
        os.path.join(top, "etc", "gpu_preflight.conf"))


class LogWatch(threading.Thread):
    """The sealed namespace's /dev/log: every line a test sent there."""

    def __init__(self):
        threading.Thread.__init__(self, daemon=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink("/dev/log")       # the overlay's: the machine's stays
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("/dev/log")
        self.lines = []
        self.start()

    def run(self):
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            self.lines.append(data.decode("ascii", "replace"))

    def check(self):
        """A failure line per line that arrived (after a moment for stragglers),
        and one per file written in the machine's state directory."""
        time.sleep(0.2)
        state = os.path.join(os.environ[SEALED], "run", "gpu_preflight")
        return ["a test wrote to the host's /dev/log: %r" % line[:300]
                for line in self.lines] + [
            "a test wrote in the host's state directory: /run/gpu_preflight/%s" % name
            for name in (sorted(os.listdir(state)) if os.path.isdir(state) else ())]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--child" not in argv and not is_sealed():
        code = seal(argv)
        if code is not None:
            return code
        print("not sealed (needs root and unshare): the host's /etc/gpu_preflight.conf "
              "and /dev/log are not guarded in this run")
        if IN_CI:
            print("CI: the suite must run sealed")
            return 1
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", help="interpreter to use")
    parser.add_argument("--jobs", type=int,
                        help="interpreters run at once (default: all of them and "
                             "the once run; their tests mostly wait on sockets)")
    parser.add_argument("-k", dest="pattern", action="append",
                        help="only tests whose id matches (unittest's -k rule)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--discover", default=EACH, help=argparse.SUPPRESS)
    parser.add_argument("--events", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)

    if args.python:
        versions = dict((p, version_of(p)) for p in args.python)
    else:
        versions = find_pythons()
    pythons = sorted(versions, key=lambda p: version_key(versions[p]))
    runs = []
    for python in pythons:
        if versions[python] is None:
            print("%s does not run" % python)
            run = Run(python, python, None, EACH)
            run.failed, run.failures = 1, ["%s does not run" % python]
            runs.append(run)
            continue
        runs.append(Run(versions[python], python, versions[python], EACH))
    watch = LogWatch() if is_sealed() else None
    good = [p for p in pythons if versions[p]]
    once_modules = sorted(os.path.basename(p)[:-3]
                          for p in glob.glob(os.path.join(TESTS, ONCE)))
    once = None
    if once_modules:
        once_python = ONCE_PYTHON if os.access(ONCE_PYTHON, os.X_OK) \
            else (good[-1] if good else sys.executable)
        version = version_of(once_python)
        once = Run("once %s" % version, once_python, version, ONCE)
    missing = []
    if IN_CI:
        have = set(versions[p].rsplit(".", 1)[0] for p in good)
        missing = [v for v in (SUPPORTED[0], SUPPORTED[-1]) if v not in have]

    print("interpreters: %s" % ", ".join(versions[p] or p for p in pythons))
    if watch:
        print("sealed: /etc/gpu_preflight.conf planted, /dev/log and "
              "/run/gpu_preflight watched")
    if once:
        print("once per run, under %s (%s): %s"
              % (once.python, once.version, ", ".join(once_modules)))
    sys.stdout.flush()

    # The once run first, so its daemons run beside the interpreters.
    queue = ([once] if once else []) + [r for r in runs if r.version]
    everything = ([once] if once else []) + runs
    reporter = Reporter(max(len(r.label) for r in everything))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                run = queue.pop(0)
            execute(run, args.pattern, reporter)

    threads = [threading.Thread(target=worker)
               for _ in range(max(1, args.jobs or len(queue)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    ordered = runs + ([once] if once else [])
    for run in ordered:
        if run.failed or (run.skipped and IN_CI):
            print("\n===== %s (%s): unittest output =====" % (run.label, run.python))
            print(run.output.rstrip())
    print("")
    report(ordered)
    passed = failed = skipped = 0
    for run in ordered:
        print("%-*s %4d passed, %d failed, %d skipped  (%.0f s)"
              % (reporter.width + 7, "python " + run.label if run.pattern == EACH
                 else run.label, run.passed, run.failed, run.skipped, run.seconds))
        passed, failed, skipped = (passed + run.passed, failed + run.failed,
                                   skipped + run.skipped)
    leaks = watch.check() if watch else []
    for leak in leaks:
        print(leak)
    failed += len(leaks)
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
