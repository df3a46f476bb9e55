#!/usr/bin/env python3
"""gpu_preflight - can the GPU inference service do work right now?

Run it in front of a GPU job; the job starts only when the service answered:

    python3 gpu_preflight.py && /opt/jobs/nightly.sh
    python3 gpu_preflight.py --lock /run/gpu0.lock -- /opt/jobs/nightly.sh

It checks in stages, each bounded by --timeout (the warm-up of a model not
loaded yet by --load-timeout) and all together by --deadline (counted from
process start, whatever the server or the driver does):

    gpu        (--gpu) NVML, nvidia-smi or amdgpu sysfs: driver, memory, load
    tags       GET  /api/tags       Ollama is up and the model is present
    loaded     GET  /api/ps         was the model loaded already?
    show       POST /api/show       what the model can do, if /api/tags won't say
    warmup     POST /api/generate   one token from the model: the GPU answers
               POST /api/embed      one vector from an embedding model
    placement  GET  /api/ps         the model sits in VRAM, not on the CPU; its context
  or, with --api openai (vLLM, llama-server):
    health, models                  GET /health (--health-path), GET /v1/models
    sleep                           GET /is_sleeping: a vLLM asleep is not woken
    completion, chat or embedding   POST /v1/completions, /v1/chat/completions
                                    or /v1/embeddings: a token or a vector
    props                           GET /props: llama-server's context (--min-context)

Exit status (1..254 only, so systemd's ExecCondition= skips and never fails):

     0  ready: the job may run (with -- COMMAND: the job's own status)
    64  usage error: bad flag or flag value
    69  unavailable: refused, reset, HTTP error, runner died, GPU lost, no driver
    70  internal error (a bug): one line, a traceback only with --debug
    75  temporary: timed out, busy, loading, GPU memory contended, locked
    78  configuration: bad config or value, model not present, bad token or cert
   126  COMMAND not executable      127  COMMAND not found
   130  interrupted by SIGINT       143  interrupted by SIGTERM

Every run writes one line to syslog (ident gpu_preflight). Each long option can
also be set as GPU_PREFLIGHT_<NAME> in the environment or as a key in the
[gpu_preflight] section of /etc/gpu_preflight.conf; flags win over the
environment, the environment over the file. Python 3.6+, standard library only.

The file, top to bottom, one section each:
  the contract     exit statuses, defaults, and the exceptions that end a run
  main             parse, set up and check, finish; the attempt loop, the watchdog
  Ollama           tags, loaded, show, warm-up, placement; its answers judged
  OpenAI           health, models, a completion, chat or embedding
  the APIs         what differs between them, one record each
  HTTP client      urllib, no proxy on loopback; failures classified
  the GPU stage    NVML, nvidia-smi, AMD sysfs probes; the verdict on the GPUs
  under cron       the job, the lock, the shared verdict, metrics
  the report       one list of facts for the syslog line and --json
  configuration    the options table and its parsers: flags > env > file
  files            what root reads or writes, trusted and bounded
"""

#: The release, raised by hand when one is made; --version adds the file's
#: git blob id to tell copies apart (see blob_id()).
__version__ = "0.1.0"

import argparse
import collections
import contextlib
import errno
import json
import os
import re
import select
import signal
import socket
import stat
import sys
import threading
import time


# ---- The contract: exit statuses and defaults -------------------------------

#: Exit statuses (BSD sysexits), the only ones the script returns; and, when
#: COMMAND cannot run, the shell's.
EX_OK = 0
EX_USAGE = 64
EX_UNAVAILABLE = 69
EX_SOFTWARE = 70
EX_TEMPFAIL = 75
EX_CONFIG = 78
EX_NOEXEC, EX_NOTFOUND = 126, 127

#: The name in messages, the syslog ident, the config section, the env prefix.
PROG = "gpu_preflight"
ENV_PREFIX = "GPU_PREFLIGHT_"

#: Read when it exists and no --config or GPU_PREFLIGHT_CONFIG names another.
DEFAULT_CONFIG = "/etc/gpu_preflight.conf"

#: Where Ollama listens when neither flags, env, file nor OLLAMA_HOST say.
DEFAULT_HOST = "http://127.0.0.1:11434"

#: Socket timeout of each stage, and the bound of the whole run (seconds).
DEFAULT_TIMEOUT, DEFAULT_DEADLINE = 3.0, 10.0

#: The bound of the warm-up of a model /api/ps did not list (seconds): a load
#: takes seconds to minutes, and Ollama aborts it when the client gives up.
DEFAULT_LOAD_TIMEOUT = 60.0

#: The GPU stage's own limit: NVML without persistence mode takes 1-3 s a GPU.
DEFAULT_GPU_TIMEOUT = 5.0

#: The GPU thresholds: (option, figure, unit, True when the figure must be
#: at least the threshold, else at most). Any of them implies --gpu.
GPU_LIMITS = (("min_free_mib", "free_mib", " MiB free", True),
              ("max_util", "util_pct", "% busy", False),
              ("max_procs", "procs", " compute processes", False),
              ("max_temp", "temp_c", " C", False))

#: Where shared verdicts live (--state-dir): $XDG_RUNTIME_DIR/gpu_preflight,
#: /run/gpu_preflight for root, else a private directory in /tmp.
STATE_SUBDIR = "gpu_preflight"
ROOT_STATE_DIR = "/run/gpu_preflight"

#: The driver's NVML library, by the name dlopen knows it.
NVML_NAME = "libnvidia-ml.so.1"

#: The prompt of every warm-up: one token is generated from it, or one vector.
WARMUP_PROMPT = "test"

#: The most characters of a reason (a log value), and of a server's text in it.
REASON_MAX, SERVER_TEXT_MAX = 1000, 200

#: Largest answer read from a stage, and largest file read (bytes).
MAX_BODY, MAX_CONFIG = 4 * 1024 * 1024, 64 * 1024

#: Whether an option defines the check (--share-result shares a verdict only
#: when all of these are the same) or only how it runs and reports.
CHECK, HOW_IT_RUNS = "check", "how"

#: The stages, as the log's stage= names them, and what each sends.
STAGE_WHAT = {
    "gpu": "the GPU probe", "api": "GET /api/version",
    "tags": "GET /api/tags", "loaded": "GET /api/ps", "show": "POST /api/show",
    "warmup": "POST /api/generate", "placement": "GET /api/ps",
    "health": "GET /health", "models": "GET /v1/models",
    "completion": "POST /v1/completions", "chat": "POST /v1/chat/completions",
    "embedding": "POST /v1/embeddings", "props": "GET /props",
    "sleep": "GET /is_sleeping",
}

#: A decimal number, as flags and nvidia-smi write one.
_NUMBER = r"^[-+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)$"


# How a run ends early: each exception carries its exit status or its signal.

class UsageError(Exception):
    """A bad flag or flag value: exit 64 with a message on stderr."""


class ConfigError(Exception):
    """A bad config file, environment value or OLLAMA_HOST: exit 78."""


class Fail(Exception):
    """A stage ended the run: exit status, reason, and the HTTP status and message if any."""

    def __init__(self, code, reason, stage=None, status=None, detail=None, busy=False):
        Exception.__init__(self, reason)
        self.code, self.reason, self.stage = code, reason, stage
        self.status, self.detail = status, detail
        self.busy = busy            # a 75 of a GPU in use by others: it answered


class TimedOut(Exception):
    """A socket timed out; the stage turns it into a reason with context."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; BaseException so no handler swallows it."""
    signum = property(lambda self: self.args[0])


class _ParserExit(Exception):
    """argparse finished (--help, --version, a usage error) with this status."""
    status = property(lambda self: self.args[0])


# ---- main and the attempt loop: supervision, deadline, signals --------------

def main(argv=None, started=None):
    """Parse, check, report; the exit status (nothing else exits). started is
    the monotonic() time the deadline counts from; a caller that imports the
    module and passes none starts the clock now."""
    started = time.monotonic() if started is None else started
    previous = _set_signals(_raise_interrupt)
    if previous:                # probes are waited for: an ignored SIGCHLD reaps them
        previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in (0, 1, 2):        # a closed one would be the next pipe's, and a
        try:                    # probe's /dev/null would then overwrite it
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)
    try:
        ns, command = parse_command_line(sys.argv[1:] if argv is None else list(argv))
        run, shared, job = set_up_and_check(ns, command, started)
        return finish(run, shared, job, previous)
    except _ParserExit as exc:      # --help, --version, or a usage error said
        return exc.status
    except Interrupted as exc:      # while parsing, before a run existed
        return 128 + exc.signum
    except Exception as exc:        # a bug before a run existed
        emit("stderr", "%s: %s\n" % (PROG, internal_error(exc)))
        if "--debug" in (sys.argv if argv is None else argv):
            emit("stderr", _traceback())
        return EX_SOFTWARE
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def parse_command_line(args):
    """(options as given, COMMAND after -- or None); a usage error ends the run (64)."""
    command = args[args.index("--") + 1:] if "--" in args else None
    args = args[:args.index("--")] if command is not None else args
    try:
        if any(a == "--token" or a.startswith("--token=") for a in args):
            raise UsageError("there is no --token: a token on the command line is "
                             "shown to every user by ps; use --token-file or "
                             "GPU_PREFLIGHT_TOKEN")
        ns = build_parser(invoked_as(sys.argv[0] if sys.argv else "")).parse_args(args)
        if ns.verbose and ns.quiet:
            raise UsageError("-v/--verbose and -q/--quiet exclude each other")
        if command == []:
            raise UsageError("'--' must be followed by the COMMAND to run")
        try:
            unique_models([name for part in ns.model or () for name in part])
        except ValueError as exc:
            raise UsageError("argument --model: %s" % exc)
    except UsageError as exc:
        emit("stderr", "%s: error: %s (see --help)\n" % (PROG, sanitise(exc, REASON_MAX)))
        raise _ParserExit(EX_USAGE)
    return ns, command


def set_up_and_check(ns, command, started):
    """Configuration, COMMAND, lock, then the checks: (Attempt, shared state, the job)."""
    forget_secrets()            # of an earlier run in this process
    opts, problem = configure(ns, os.environ)
    run, shared, path, lock_fd = Attempt(opts, started), None, None, None
    try:
        try:
            if problem:
                raise Fail(EX_CONFIG, problem, "config")
            opts.token = read_token(opts, os.environ)
            opts.tls_context = tls_context(opts)
        finally:                    # state even for a configuration error
            shared = Shared.open(run)
        if command:
            path = find_command(command[0], os.environ)
        if opts.lock:
            lock_fd = take_lock(opts.lock)
        run = check_until_ready(run, shared)
    except Fail as exc:
        run.decide(exc.code, exc.stage, exc.reason, exc.busy)
    except Interrupted as exc:
        run = getattr(exc, "run", run)
        run.interrupt(exc.signum, getattr(exc, "stage", None) or run.current)
    except Exception as exc:
        run.crashed(exc)
    return run, shared, Job(path, command, lock_fd)


#: What runs on a ready verdict: the COMMAND's resolved path and its argv (None:
#: no command), and the --lock descriptor it inherits (None: no lock).
Job = collections.namedtuple("Job", "path command lock_fd")


def finish(run, shared, job, previous):
    """Keep the state, report, and on a ready verdict become the job; else the exit status."""
    late = []                       # a signal now must not be lost, nor cut the report
    _set_signals(lambda signum, frame: late.append(signum))
    kill_probes(run)
    keep_state(run, shared)
    report(run)
    if late:                        # after a ready verdict: the job must not start
        run.job_failed(128 + late[0], "interrupted by %s after the verdict"
                       % signal.Signals(late[0]).name)
    elif job.command and run.code == EX_OK:
        run.job_failed(*exec_job(job, previous))
    else:
        return run.code
    report(run)                     # a second line: the job did not start
    return run.code


def internal_error(exc):
    return "internal error: %s: %s" % (type(exc).__name__, sanitise(exc))


#: --wait: the first pause between attempts, doubled up to the last, and the
#: least time left before the deadline for which another attempt is made.
WAIT_FIRST, WAIT_MOST, MIN_ATTEMPT = 1.0, 15.0, 0.5


def check_until_ready(run, shared):
    """The checks (or a shared verdict), retried under --wait: the Attempt of the verdict."""
    opts = run.opts
    share = shared is not None and opts.share_result
    try:
        state = shared.reusable(None) if share else None
        if state is None and opts.jitter:
            time.sleep(max(0.0, min(opts.jitter * _random(), run.deadline_at
                                    - time.monotonic() - opts.timeout)))
        if state is None and share:
            state = shared.wait_for_other_check(run)     # then look again
        if state is not None:
            run.reuse(state)
            if state["code"] == EX_OK or retry_time(run) <= 0:
                return run
            run = run.next_attempt()
        pause = WAIT_FIRST
        while True:
            try:
                if opts.gpu:
                    check_gpu(run)      # forks: first, while few threads exist
                start_lookup(run)
                if run.code is None:
                    supervise(run, check_inference)
            except Fail as exc:
                run.decide(exc.code, exc.stage, exc.reason, exc.busy)
            left = retry_time(run)
            if run.code not in (EX_UNAVAILABLE, EX_TEMPFAIL) or left <= 0:
                return run
            time.sleep(min(left, pause * (0.75 + 0.5 * _random())))
            pause = min(pause * 2, WAIT_MOST)
            kill_probes(run)
            run = run.next_attempt()
    except Interrupted as exc:
        exc.run = run
        raise


def retry_time(run):
    """How long --wait may pause before another attempt (none with under MIN_ATTEMPT left)."""
    return min(run.started + (run.opts.wait or 0) - time.monotonic(),
               run.deadline_at - time.monotonic() - MIN_ATTEMPT)


def _random():
    """A number in [0, 1) without importing random (it costs 2 ms)."""
    return int.from_bytes(os.urandom(4), "big") / 2.0 ** 32


def check_inference(run):
    """The HTTP stages of the API in use (--api); returns the ready reason."""
    opts = run.opts
    client = Client(opts.host, opts.api, opts.token, opts.tls_context)
    if opts.api == "auto":
        run.api = client.api = check_api(run, client)
    return api_rules(run.api).check(run, client)


class Stage(object):
    """The stage under way: name, start, budget's end, what it sends, the model
    it warms, and its own time limit."""

    def __init__(self, name, started, ends_at, optional, what, model, limit):
        self.name, self.started, self.ends_at = name, started, ends_at
        self.optional, self.what, self.model = optional, what, model
        self.limit = limit          # its own bound: --timeout, --load-timeout ...


class Attempt(object):
    """One preflight: options, clock, finished stages and the verdict."""

    def __init__(self, opts, started, attempt=1, lookup=None, before=None):
        self.opts = opts
        self.attempt = attempt      # --wait: which attempt this is
        self.reused = None          # --share-result: the state reused, if any
        # What was not done or not checked (state, metrics, TLS, context): logged
        # with every verdict (its log key is problem=) and --json's "problems", carried
        # across --wait's attempts. ready_notes below are said only when ready.
        self.problems = before.problems if before else []
        self.before = before and before.reason     # --wait: the last attempt's reason
        self.cut = False            # ended by this caller's own --deadline
        self.unchanged = False      # --log-changes-only: same verdict as last time
        if opts.insecure and before is None:
            self.problems.append("TLS certificates not verified (--insecure)")
        self.started = started      # --wait: a load's room in the deadline stays
        self.deadline_at = before.deadline_at if before else started + opts.deadline
        self.stages = []            # dicts: name, status, duration_ms, reason
        self.current = None         # the Stage under way, if any
        self.model = (opts.model or [None])[0]     # the first model, once chosen
        self.models = []            # Model records, one per model checked
        self.vram_pct = None        # share of the first model in VRAM after warm-up
        self.ready_notes = []       # facts added to a ready verdict's reason
        self.api = opts.api         # ollama or openai (auto: once detected)
        self.code, self.stage, self.reason = None, None, ""    # the verdict, set once
        self.busy = False           # the verdict's 75 says the GPU is in use, not broken
        self.trace = None           # traceback text of an internal error
        self.lookup = lookup        # Lookup of a UDP syslog host, if any
        self.gpu = None             # what the GPU stage found (--json "gpu")
        self.children = []          # GPU probes not reaped yet (pids = pgids)
        self.wake = threading.Event()   # set when a stage starts or ends
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def step(self, name, timeout=None, optional=False, what=None, model=None):
        """Run a stage; its budget is min(timeout or --timeout, time left), a
        warm-up's --load-timeout when its model may load (may_load).
        what: the request, when not STAGE_WHAT's; model: the one it warms."""
        now = time.monotonic()
        left = self.deadline_at - now
        what = (what or STAGE_WHAT[name]) + (" for %s" % model.name if model else "")
        if left <= 0:
            raise Fail(EX_TEMPFAIL, self.cut_by_deadline("before " + what), name)
        loads = name == "warmup" and model is not None and may_load(model)
        limit = timeout or (self.opts.load_timeout if loads else self.opts.timeout)
        stage = Stage(name, now, now + min(limit, left), optional, what, model, limit)
        budget = stage.ends_at - now
        self.current = stage
        self.wake.set()
        try:
            yield budget
        except TimedOut:
            reason = self.timeout_reason(stage)
            self._record(stage, "unknown" if optional else "fail", reason)
            raise Fail(EX_TEMPFAIL, reason, name)
        except Fail as exc:
            self._record(stage, "unknown" if optional else "fail", exc.reason)
            exc.stage = exc.stage or name
            raise
        except Interrupted as exc:  # in the main thread: the GPU stage
            self._record(stage, "fail", "interrupted")
            exc.stage = stage
            raise
        else:
            self._record(stage, "ok", "")
        finally:
            if self.current is stage:
                self.current = None
            self.wake.set()

    def _record(self, stage, status, reason, code=None):
        """Record a finished stage, and with code the verdict, unless decided."""
        with self._lock:
            if self.code is not None:
                return
            ms = (time.monotonic() - stage.started) * 1000.0
            self.stages.append({"name": stage.name, "status": status,
                                "duration_ms": round(ms, 1), "reason": reason})
            if stage.model:
                self.stages[-1]["model"] = stage.model.name
                if status == "fail":        # --json says why per model
                    stage.model.reason = reason
            if code is not None:
                self.code, self.stage, self.reason = code, stage.name, reason
                self.wake.set()

    def decide(self, code, stage, reason, busy=False):
        with self._lock:
            if self.code is None:
                self.code, self.stage, self.reason, self.busy = code, stage, reason, busy
                self.wake.set()

    def reuse(self, state):
        """The verdict of another caller's check (--share-result)."""
        self.reused, self.model = state, state.get("model") or self.model
        self.decide(state["code"], state.get("stage"), "reused verdict of pid %s, %.1fs "
                    "old: %s" % (state.get("pid"), time.time() - state["time"],
                                 state.get("reason", "")))

    def interrupt(self, signum, stage):
        """The verdict of SIGINT or SIGTERM (stage: the Stage cut), over any other."""
        with self._lock:
            if stage:
                where = " during " + stage.what
            elif self.code is None:
                where = ""
            else:                   # --wait: between two attempts
                where = " while waiting to retry (%s)" % self.reason
            self.code, self.stage = 128 + signum, stage and stage.name
            self.reason = "interrupted by %s%s" % (signal.Signals(signum).name, where)
            self.wake.set()

    def escalate(self, reason):
        """--escalate-after: a 75 seen too many runs in a row is 69."""
        with self._lock:
            self.code, self.reason = EX_UNAVAILABLE, reason

    def crashed(self, exc):
        """The verdict of a bug (70): one line, the traceback kept for --debug."""
        self.trace = _traceback()
        self.decide(EX_SOFTWARE, self.current and self.current.name, internal_error(exc))

    def job_failed(self, code, why):
        """The job did not start after a ready verdict: that is the verdict, and news."""
        with self._lock:
            self.code, self.stage, self.reason, self.ready_notes = code, "command", why, []
            self.unchanged = False

    def deadline_s(self):
        """The bound of this run: --deadline, or its default with room for loads."""
        return round(self.deadline_at - self.started, 3)

    def make_room_for_loads(self, cold):
        """A default --deadline grows by --load-timeout for each of cold models
        to load or reload (a --deadline given stays the bound)."""
        if self.opts.deadline_default:
            self.deadline_at = max(self.deadline_at, self.started + self.opts.deadline
                                   + cold * self.opts.load_timeout)

    def cut_by_deadline(self, when):
        """The reason of a run that --deadline cut (when: where it was)."""
        self.cut = True
        return "deadline of %gs reached %s" % (self.deadline_s(), when)

    def timeout_reason(self, stage):
        """Why a stage ran out of time, its own bound or the deadline; for a
        model that was not loaded, or that the warm-up's num_ctx reloads, which
        bound its load missed and the fixes."""
        cut = stage.ends_at - stage.started < stage.limit - 1e-3    # by the deadline
        if cut:
            text = self.cut_by_deadline("during " + stage.what)
            if self.before:
                text += " (attempt %d; attempt %d: %s)" % (self.attempt, self.attempt - 1,
                                                          self.before)
        else:
            text = "%s timed out after %gs" % (stage.what, stage.limit)
        if stage.name == "warmup" and stage.model.was_loaded is False:
            bound, flag = "--load-timeout %gs" % stage.limit, "--load-timeout"
            if cut:
                bound, flag = "the deadline", "--deadline"
            text += ("; model %s was not loaded and did not load within %s (Ollama "
                     "drops a load when the client gives up): allow a longer load "
                     "(%s) or keep the model loaded on the server (OLLAMA_KEEP_ALIVE=-1 "
                     "for ollama serve, or --keep-alive 1h)" % (
                         stage.model.name, bound, flag))
        elif stage.name == "warmup" and stage.model.reload:
            text += ("; reload: %s, so Ollama reloads %s and drops the load when the "
                     "client gives up: send the job's num_ctx (--ollama-option) or "
                     "allow a longer load (%s)" % (stage.model.reload, stage.model.name,
                                                   "--deadline" if cut else "--load-timeout"))
        return text

    @contextlib.contextmanager
    def timing(self, model):
        """Time every warm-up request of one model (its warmup_ms)."""
        started = time.monotonic()
        try:
            yield
        finally:
            model.warmup_ms = round((time.monotonic() - started) * 1000.0, 1)

    def expire(self, stage):    # the watchdog's verdict on a stage past its budget
        self._record(stage, "fail", self.timeout_reason(stage), EX_TEMPFAIL)

    def next_attempt(self):
        """The Attempt of the next try under --wait (a reused verdict was none)."""
        return Attempt(self.opts, self.started, attempt=1 if self.reused else self.attempt + 1,
                   lookup=self.lookup, before=self)


#: How long past a stage's budget the watchdog lets the socket timeout speak
#: first; longer for an optional stage (its timeout a note, the watchdog's a skip).
STAGE_GRACE, OPTIONAL_GRACE = 0.05, 0.25


def supervise(run, work):
    """Run work(run) in a daemon thread, abandoned when its stage's budget or
    the deadline runs out: a socket timeout bounds no trickle nor DNS stall."""
    def target():
        try:
            reason = work(run)
            run.decide(EX_OK, None, reason)
        except Fail as exc:
            run.decide(exc.code, exc.stage, exc.reason, exc.busy)
        except Exception as exc:
            run.crashed(exc)

    worker = threading.Thread(target=target, name="gpu_preflight-check")
    worker.daemon = True
    worker.start()
    while run.code is None:
        run.wake.clear()
        stage = run.current
        grace = stage and (OPTIONAL_GRACE if stage.optional else STAGE_GRACE)
        limit = run.deadline_at if stage is None else min(stage.ends_at + grace, run.deadline_at)
        left = limit - time.monotonic()
        if left > 0:
            run.wake.wait(left)
        elif stage is not None and run.current is stage:
            run.expire(stage)
        elif time.monotonic() >= run.deadline_at:
            run.decide(EX_TEMPFAIL, None, run.cut_by_deadline("between stages"))
    return run.code


def _traceback():
    import traceback            # only now: it costs 2 ms
    return traceback.format_exc()


def _raise_interrupt(signum, frame):
    _set_signals(signal.SIG_IGN)    # a second signal must not cut the report
    raise Interrupted(signum)


def _set_signals(handler):
    if threading.current_thread() is not threading.main_thread():
        return {}
    return dict((s, signal.signal(s, handler)) for s in (signal.SIGINT, signal.SIGTERM))


def process_started():
    """monotonic() at the time this process started (Linux /proc), or now."""
    now = time.monotonic()
    try:
        with open("/proc/self/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as handle:
            uptime = float(handle.read().split()[0])
        age = uptime - int(fields[19]) / float(os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return now
    return now - min(max(age, 0.0), 5.0)


# ---- Ollama: tags -> loaded -> show -> warmup -> placement ------------------

def check_service(run, client):
    """Ollama's stages, in order; returns the ready reason or raises Fail."""
    opts = run.opts
    with run.step("tags") as budget:
        listed = model_list(client.json("GET", "/api/tags", budget), "/api/tags")
        if not listed and not opts.model:
            raise Fail(EX_CONFIG, "the server has no models: pull one "
                       "(ollama pull NAME) and name it with --model")
        if opts.model:
            choose_models(run, listed, opts.model, "present on the server", "it has")
            judge_cloud(run)
    if opts.warmup != "off" or not opts.model or opts.min_context:
        running = None
        try:
            with run.step("loaded", optional=True) as budget:
                running = running_models(run, client, budget)
        except Fail as exc:
            run.ready_notes.append("loaded models unknown (%s)" % exc.reason)
        if not opts.model:          # one already loaded, else the first local one listed
            loaded = [find_model(_name(m), [_name(e) for e in listed]) for m in running or ()]
            first = [e for e in listed if not is_cloud(_name(e), e)] or listed
            choose_models(run, listed, [n for n in loaded if n][:1] or [_name(first[0])])
            judge_cloud(run)
        for model in run.models:
            model.was_loaded = None if running is None or model.cloud else bool(
                entries_of(model, running))
            read_context(run, model, (entries_of(model, running or ()) or [{}])[0],
                         "context_length", "GET /api/ps")
            model.reload = model.was_loaded and num_ctx_differs(
                model.context_length, runner_options(opts, model).get("num_ctx"))
        if opts.warmup != "off":
            run.make_room_for_loads(sum(may_load(m) for m in run.models))
    if opts.require or opts.warmup != "off" or opts.min_context:
        ollama_kinds(run, client)
        check_requirements(run)
    if opts.warmup == "off":
        check_context(run)
        return "service up, %s present (warm-up off)" % model_names(run)
    for model in run.models:    # one after another: a load can take the GPU
        with run.timing(model):
            if model.kind != "embed" and ollama_generate(run, client, model):
                model.kind = "generate"
            else:
                model.kind = "embed"
                ollama_embed(run, client, model)
    check_requirements(run, observed=True)
    local = local_models(run)
    judged = not opts.allow_cpu or opts.min_vram_pct
    if local and (judged or len(local) > 1 or opts.min_context):
        with run.step("placement") as budget:   # a reload may land elsewhere
            running = running_models(run, client, budget)
            if running is None:
                run.ready_notes.append("GPU placement not verified")
            else:
                check_placement(run, running)
        check_vram_held(run)
    check_context(run)
    return answered(run)


class Model(object):
    """One model the preflight checks: its name, the server's list entry for
    it and whether it runs on ollama.com, then what each stage finds out
    (None: not known). The --json "models" list shows the fields as_dict()
    names."""

    __slots__ = ("name", "entry", "cloud", "kind", "capabilities", "unreadable",
                 "warmup_ms", "resident", "size", "size_vram", "was_loaded", "reload",
                 "load_ms", "context_length", "context_bad", "reason")

    def __init__(self, name, entry, cloud=False):
        self.name, self.entry, self.cloud = name, entry, cloud
        self.kind = self.capabilities = self.unreadable = self.warmup_ms = None
        self.resident = self.size = self.size_vram = self.was_loaded = None
        self.reload = self.load_ms = self.context_length = self.context_bad = None
        self.reason = ""        # why this model is not fit, once a stage says

    def as_dict(self):
        """The fields the --json "models" list shows, by name, in its order."""
        return dict((key, getattr(self, key)) for key in (
            "name", "kind", "capabilities", "warmup_ms", "resident", "size_vram",
            "was_loaded", "load_ms", "cloud", "context_length", "reason"))


def choose_models(run, listed, wanted, where=None, listing=None):
    """run.models: the entries of listed (the server's model list) that mean
    the names wanted, in that order (an unlisted Ollama NAME:cloud too); Fail
    (78) naming every one missing."""
    names = [_name(e) for e in listed]
    ollama = api_rules(run.api).ollama
    found = [find_model(w, names) or (w if ollama and is_cloud(w, {}) else None)
             for w in wanted]       # NAME:cloud runs unpulled (Ollama 0.17.6 on)
    missing = [sanitise(w) for w, f in zip(wanted, found) if f is None]
    if missing:
        subject = "model %s is not" % missing[0]
        if len(missing) > 1:
            subject = "models %s are not" % ", ".join(missing)
        raise Fail(EX_CONFIG, "%s %s%s; %s: %s" % (
            subject, where, missing_hint(missing, names, ollama),
            listing, sanitise(", ".join(names[:10]) or "no models")))
    entries = [listed[names.index(n)] if n in names else {"name": n} for n in found]
    run.models = [Model(n, e, ollama and is_cloud(n, e)) for n, e in zip(found, entries)]
    run.model = found[0]


#: The most listed names a missing one is compared with (a server may list
#: 80,000: the comparison must not cost the stage its time).
MAX_HINTED = 500


def missing_hint(missing, names, pull):
    """' (did you mean NAME?)' for the missing names close to a listed one (a
    typo), and ' (ollama pull NAME)' for the others when pull."""
    import difflib              # only here: a name is missing
    short = [n[:-len(":latest")] if n.endswith(":latest") else n for n in names]
    typos, unknown = [], []
    for name in missing:
        near = [s for s in short if abs(len(s) - len(name)) <= 3]    # a typo's length
        match = difflib.get_close_matches(name, near[:MAX_HINTED], 1)
        if not match:
            unknown.append(name)
        elif match[0]:                  # a listed ":latest" is an empty name
            typos.append(match[0])
    said = []
    if typos:
        said.append("did you mean %s?" % " / ".join(typos))
    if pull and unknown:
        said.append("ollama pull %s" % " / ".join(unknown))
    if not said:
        return ""
    return " (%s)" % sanitise("; ".join(said))


def find_model(wanted, names):
    """The listed name meaning model wanted (the exact one first), or None."""
    found = [n for n in names if n == wanted] or [n for n in names if same_model(n, wanted)]
    return found[0] if found else None


#: A reference Ollama sends to ollama.com, pulled or not: NAME:cloud or
#: NAME:TAG-cloud (internal/modelref parseSourceSuffix: after the last colon).
_CLOUD_REF = r"(?i):([^:/]*-)?cloud\s*$"


def is_cloud(name, entry):
    """Whether Ollama runs this model on ollama.com, not on this host: its
    /api/tags entry has a remote_host (Ollama 0.12 on), or its name asks for it."""
    return bool(entry.get("remote_host")) or re.search(_CLOUD_REF, name) is not None


def may_load(model):
    """Whether a model's warm-up may take a load's time (--load-timeout): /api/ps
    did not list it, its warm-up's num_ctx reloads it, or it runs on ollama.com,
    which may queue or cold-start it."""
    return model.was_loaded is False or bool(model.reload) or model.cloud


def judge_cloud(run):
    """Fail (78) for a cloud model unless --allow-cloud: its answer comes from
    ollama.com and proves nothing of this host's GPU; allowed, a note says so."""
    cloud = [m.name for m in run.models if m.cloud]
    named = sanitise(", ".join(cloud))
    if cloud and not run.opts.allow_cloud:
        said = "is an Ollama cloud model (runs", "it"
        if len(cloud) > 1:
            said = "are Ollama cloud models (run", "them"
        raise Fail(EX_CONFIG, "%s %s on ollama.com, not on this host's GPU): name a "
                   "local model, or pass --allow-cloud to accept %s" % ((named,) + said),
                   "tags")
    if cloud:
        run.ready_notes.append("%s ran on ollama.com (Ollama cloud), not on this GPU" % named)


def local_models(run):
    """The models that run on this host: placement is judged for these alone."""
    return [m for m in run.models if not m.cloud]


def entries_of(model, running):
    """The /api/ps entries of this model: by name or digest (tags of one blob: one runner)."""
    digest = model.entry.get("digest")
    return [m for m in running if same_model(_name(m), model.name) or (
        isinstance(digest, str) and digest and m.get("digest") == digest)]


def model_names(run):
    return ", ".join(m.name for m in run.models)


def answered(run):
    """The reason of a ready verdict: what each model answered."""
    said = []
    for model in run.models:
        what = "the load" if run.opts.warmup == "load" else "a token"
        if model.kind == "embed":
            what = "a vector"
        said.append("%s %s" % (model.name, what))
    if len(said) == 1:
        return said[0].replace(" ", " answered ", 1)
    return "%d models answered: %s" % (len(said), ", ".join(said))


def ollama_kinds(run, client):
    """Each model's kind and capabilities, before anything is sent to it: in
    /api/tags (Ollama 0.30+), else POST /api/show (0.6.4+), else unknown."""
    for model in run.models:
        caps = capabilities(model.entry, "GET /api/tags", "tags")
        if caps is None and "capabilities" not in model.entry:
            try:
                with run.step("show", optional=True, model=model) as budget:
                    caps = capabilities(client.json("POST", "/api/show", budget, {
                        "model": model.name, "name": model.name},
                        about=model.name), "POST /api/show")
            except Fail as exc:     # a --require on this model cannot be judged
                model.unreadable = exc
                run.ready_notes.append("capabilities of %s unknown (%s)"
                                       % (model.name, exc.reason))
        if caps is not None:        # "embedding" alone: an embedding model
            model.capabilities = caps
            model.kind = "generate" if "completion" in caps or \
                "embedding" not in caps else "embed"


def capabilities(doc, what, stage=None):
    """The capability names a server declares in doc, or None (not said)."""
    caps = doc.get("capabilities")
    if caps is None:
        return None
    if not isinstance(caps, list) or not all(isinstance(c, str) for c in caps):
        raise Fail(EX_UNAVAILABLE, "%s: not a valid answer: capabilities is not a list "
                   "of names" % what, stage)
    return caps


def check_requirements(run, observed=False):
    """--require (CAP of every generative model, MODEL=CAP of one): Fail (78)
    naming what is lacking; a problem noted for a server that declares none.
    observed: after the warm-ups, hold completion and embedding to the kind
    each model showed (OpenAI servers' only word on it)."""
    require = run.opts.require
    strays = [t for t, _ in require if t and not any(
        same_model(t, m.name) for m in run.models)]
    if strays:
        raise Fail(EX_CONFIG, "--require names %s, which is not a model this check warms "
                   "(--model)" % ", ".join(sanitise(t) for t in strays), "require")
    if any(not t for t, _ in require) and all(m.kind == "embed" for m in run.models):
        raise Fail(EX_CONFIG, "--require %s asks the generative models, and none of %s "
                   "is one" % (",".join(c for t, cs in require if not t for c in cs),
                               model_names(run)), "require")
    lacking, unknown = [], []
    for model in run.models:
        wanted = sorted(set(cap for target, caps in require for cap in caps
                            if (same_model(target, model.name) if target
                                else model.kind != "embed")))
        have = model.capabilities
        if observed:
            have = ["completion" if model.kind == "generate" else "embedding"]
            wanted = [c for c in wanted if c in ("completion", "embedding")]
        elif wanted and have is None and model.unreadable:
            raise Fail(model.unreadable.code, "the capabilities of %s could not be "
                       "read, so --require cannot be checked: %s" % (
                           model.name, model.unreadable.reason), "require")
        elif wanted and have is None:
            unknown.append(model.name)
            continue
        missing = [c for c in wanted if c not in have]
        if missing and observed:
            lacking.append("%s answered as a model of %s, not %s" % (
                model.name, have[0], ", ".join(missing)))
        elif missing:
            lacking.append("%s lacks %s (it declares %s)" % (
                model.name, ", ".join(missing), ", ".join(have) or "none"))
    if lacking:
        raise Fail(EX_CONFIG, "the job's --require is not met: %s; use a model that "
                   "declares it" % "; ".join(sanitise(l) for l in lacking), "require")
    if unknown and not observed:
        run.problems.append("capabilities not checked: the server declares none for %s "
                            "(Ollama before 0.6.4, or an OpenAI-compatible server)"
                            % ", ".join(sanitise(n) for n in unknown))


#: Ollama's refusal to generate with an embedding model, as every release words it.
_EMBEDDING_REFUSAL = r"(?i)(does not support generate|embedding models do not support)"


def ollama_generate(run, client, model):
    """POST /api/generate: one token (or only the load); False from an embedding model."""
    opts = run.opts
    options = runner_options(opts, model)
    payload = ollama_payload(opts, model, dict(options, num_predict=1), stream=False,
                             prompt=WARMUP_PROMPT if opts.warmup == "token" else "")
    what = "POST /api/generate for %s" % model.name
    with run.step("warmup", model=model) as budget:
        try:
            answer = client.call("POST", "/api/generate", budget, payload, model.name)
        except Fail as exc:
            if model.kind is None and re.search(_EMBEDDING_REFUSAL, exc.detail or ""):
                return False
            raise
        try:
            final, error = parse_generate(answer)
        except ValueError as exc:
            raise not_json(what, answer, exc)
        if error is not None:
            raise model_error(what, error)
        if final.get("done") is not True:
            raise Fail(EX_UNAVAILABLE, "%s: answer ended before done (the model "
                       "stopped mid-answer)" % what)
        if final.get("done_reason") == "unload":
            raise Fail(EX_CONFIG, "--warmup load with keep-alive 0 only unloads the "
                       "model: nothing was loaded or run")
        load_ns = whole_number(final, "load_duration", what)
        model.load_ms = load_ms(load_ns)
        judge_load(run, model, load_ns, options)
    return True


def load_ms(load_ns):
    """Ollama's load_duration (ns; absent from a load-only answer) in ms, or None."""
    return None if load_ns is None else round(load_ns / 1e6, 1)


def runner_options(opts, model):
    """The warm-up's runner options: the job's (--ollama-option) and, for a
    model already loaded, its runner's num_ctx unless the job names one.
    Ollama reloads a runner whose options differ from a request's, num_ctx
    included (server/sched.go needsReload compares api.Runner), and a request
    without num_ctx asks for the server's default; /api/ps context_length is
    the runner's per-sequence num_ctx, the very value compared (PsHandler and
    needsReload divide by OLLAMA_NUM_PARALLEL alike in 0.10 and 0.11; the
    runner holds it per sequence from 0.12; llm/llama_server.go ContextLength)."""
    options = dict(opts.ollama_option)
    if model.was_loaded and model.context_length and "num_ctx" not in options:
        options["num_ctx"] = model.context_length
    return options


def judge_load(run, model, load_ns, options):
    """A warm-up's load_duration: a note of a load over 1 s, and a problem
    when the model was loaded before (the warm-up reloaded the job's runner)."""
    if not load_ns or load_ns <= 1e9:
        return
    run.ready_notes.append("model loaded in %.1fs (%s)" % (load_ns / 1e9, model.name))
    if model.was_loaded:
        run.problems.append(reload_problem(model.name, load_ns / 1e9,
                                           model.context_length, options.get("num_ctx")))


def reload_problem(name, seconds, loaded, sent):
    """Why a warm-up reloaded a loaded model: num_ctx where the numbers show it
    (the runner's context against the one sent), else the runner options."""
    differed = num_ctx_differs(loaded, sent) or (
        "its runner options (num_ctx, num_batch, num_gpu, ...) differ from the "
        "loaded runner's, or the runner had died")
    return ("warm-up reloaded %s (load_duration %.1fs): %s; give the job's own "
            "values with --ollama-option" % (name, seconds, differed))


def num_ctx_differs(loaded, sent):
    """Why Ollama reloads a runner loaded at context loaded for a request
    that sends num_ctx sent (server/sched.go needsReload), or None."""
    if loaded and sent is not None and sent != loaded:
        return "num_ctx %s differs from the loaded runner's %d" % (sanitise(
            repr(sent)[:20]), loaded)
    return None


def ollama_payload(opts, model, options, **fields):
    """A warm-up's body, with the runner options and keep_alive the job uses."""
    payload = dict(model=model.name, **fields)
    if options:
        payload["options"] = options
    if opts.keep_alive is not None:
        payload["keep_alive"] = opts.keep_alive
    return payload


def parse_generate(data):
    """(final object, error text or None) of an /api/generate answer, one
    JSON object or NDJSON lines; ValueError when it is not JSON objects."""
    text = data.decode("utf-8", "replace")
    try:
        objects = [parse_json(text)]
    except ValueError:
        objects = [parse_json(line) for line in text.splitlines() if line.strip()]
    if not objects or not all(isinstance(o, dict) for o in objects):
        raise ValueError("not a JSON object")
    for obj in objects:
        if "error" in obj:
            return obj, error_text(obj["error"])
    return objects[-1], None


def ollama_embed(run, client, model):
    """Warm an embedding model with POST /api/embed, or /api/embeddings before
    Ollama 0.2.6: ready only with a vector (an empty input proves nothing)."""
    options = runner_options(run.opts, model)
    payload = ollama_payload(run.opts, model, options, input=WARMUP_PROMPT)
    with run.step("warmup", what="POST /api/embed", model=model) as budget:
        try:
            doc = client.json("POST", "/api/embed", budget, payload, model.name)
        except Fail as exc:
            if exc.status != 404:   # no such route: Ollama before 0.2.6
                raise
            doc = None
        if doc is not None:
            vectors = doc.get("embeddings")
            need_vector(doc, vectors[0] if isinstance(vectors, list) and vectors else None,
                        "POST /api/embed for " + model.name, "embeddings[0]")
            load_ns = whole_number(doc, "load_duration", "POST /api/embed for " + model.name)
            model.load_ms = load_ms(load_ns)
            return judge_load(run, model, load_ns, options)
    payload["prompt"] = payload.pop("input")
    with run.step("warmup", what="POST /api/embeddings", model=model) as budget:
        doc = client.json("POST", "/api/embeddings", budget, payload, model.name)
        need_vector(doc, doc.get("embedding"), "POST /api/embeddings for " + model.name,
                    "embedding")


def need_vector(doc, vector, what, field):
    """Fail unless vector is a non-empty list of numbers (or of such lists, per token)."""
    error = answer_error(doc)
    if error is not None:
        raise model_error(what, error)
    rows = vector if isinstance(vector, list) and vector and all(
        isinstance(v, list) for v in vector) else [vector]
    if not all(isinstance(r, list) and r and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in r)
               for r in rows):
        raise Fail(EX_UNAVAILABLE, "%s: not a valid answer: %s is not a non-empty list "
                   "of numbers (the model did not embed)" % (what, field))


def answer_error(doc):
    """The error text in a 200 answer ({"error": ...}, vLLM's {"object": "error"}), or None."""
    if doc.get("error") is not None:
        return error_text(doc["error"])
    if doc.get("object") == "error":
        return error_text(doc)
    return None


def error_text(value):
    """The message of {"error": "..."} or an OpenAI-style {"error": {...}}."""
    if isinstance(value, dict):
        value = value.get("message", value)
    return value if isinstance(value, str) else "(an error of type %s)" % type(value).__name__


def running_models(run, client, budget):
    try:
        return model_list(client.json("GET", "/api/ps", budget), "/api/ps")
    except Fail as exc:
        if exc.status != 404:
            raise
        note = "server has no /api/ps (Ollama before 0.1.38?)"
        if note not in run.ready_notes:
            run.ready_notes.append(note)
        return None


def model_list(doc, what):
    models = doc.get("models")
    if not isinstance(models, list):
        raise Fail(EX_CONFIG, not_server("ollama", "%s has no models list" % what))
    return [m for m in models if isinstance(m, dict) and _name(m)]


def _name(entry):
    """A model entry's name ("name", else "model"), or None; 512 characters at most."""
    return next((entry[key] for key in ("name", "model") if isinstance(
        entry.get(key), str) and entry[key].strip() and len(entry[key]) <= 512), None)


def whole_number(doc, key, what):
    """doc[key] if absent (None) or a count a server could mean (< 2**63), else Fail (69)."""
    value = doc.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)
                         and 0 <= value < 2 ** 63):
        return value
    raise Fail(EX_UNAVAILABLE, "%s: not a valid answer: %s is %s" % (
        what, key, sanitise(repr(value)[:40]) if isinstance(value, (int, float, str))
        else "a " + type(value).__name__))


def check_placement(run, running):
    """After the warm-ups: every model still resident (not unloaded when a
    later one loaded) and in VRAM (size_vram 0: on the CPU; under
    --min-vram-pct: at least that share of it); a cloud model is in neither."""
    models = local_models(run)
    for model in models:
        entries = entries_of(model, running)
        model.resident = bool(entries)
        read_context(run, model, entries[0] if entries else {}, "context_length",
                     "GET /api/ps")
        if entries:
            model.size, model.size_vram = (whole_number(entries[0], key, "GET /api/ps")
                                           for key in ("size", "size_vram"))
    gone = [m for m in models if not m.resident]
    if gone and len(gone) == len(models):
        subject = "model" if len(run.models) == 1 else ", ".join(m.name for m in gone)
        run.ready_notes.append("%s not resident after the warm-up (server keep-alive 0?), "
                               "GPU placement not verified" % subject)
        return
    unloaded(run, gone, "OLLAMA_MAX_LOADED_MODELS too low, or not enough VRAM for "
             "all; raise OLLAMA_MAX_LOADED_MODELS on the server, use smaller models")
    least = run.opts.min_vram_pct
    for model in models:
        size, vram = model.size, model.size_vram
        if not size or vram is None:
            run.ready_notes.append("GPU placement of %s not reported by the server"
                                   % model.name)
            continue
        pct = min(100, int(round(100.0 * vram / size)))
        run.vram_pct = pct if run.vram_pct is None else run.vram_pct
        if vram == 0 and not run.opts.allow_cpu:
            model.reason = "runs on the CPU"
            code, reason = on_the_cpu(run, model.name, size >> 20)
            raise Fail(code, reason, busy=code == EX_TEMPFAIL)     # VRAM held by others
        if least and 100 * vram < least * size and vram:    # --allow-cpu takes 0
            model.reason = "partial offload"
            raise Fail(EX_TEMPFAIL, "model %s: partial offload %d %% < %d %% "
                       "(--min-vram-pct): the rest runs on the CPU, as the GPU had no "
                       "more free memory; free it, or use a smaller model or num_ctx" % (
                           model.name, min(pct, 100 * vram // size), least), busy=True)
        if 0 < vram < size:
            run.ready_notes.append("partial offload: %d%% of %s in VRAM" % (pct, model.name))


def on_the_cpu(run, name, need):
    """(exit status, reason) of a model Ollama put on the CPU (size_vram 0).
    Ollama fits layers to the free VRAM (llm/llama_server.go), so another
    process holding it is the usual cause (75); a GPU with room that Ollama
    cannot use (suspend/resume) needs Ollama's troubleshooting remedies (69)."""
    free = local_gpus(run, "free_mib")
    said = "model %s runs on the CPU (size_vram 0): " % name
    remedy = ("Ollama cannot use the GPU (driver not ready, or after suspend/resume): "
              "reload nvidia_uvm (rmmod nvidia_uvm; modprobe nvidia_uvm) or reboot, "
              "as restarting ollama alone may not help")
    if free is not None and free < need:
        return EX_TEMPFAIL, said + ("VRAM held by other processes (%d MiB free, the model "
                                    "needs %d MiB): try later, or free the GPU" % (free, need))
    if free is not None:
        return EX_UNAVAILABLE, said + "the GPU has room (%d MiB free, the model needs %d " \
            "MiB), so %s" % (free, need, remedy)
    return EX_UNAVAILABLE, said + ("other processes hold the VRAM (Ollama fits the model to "
                                   "free VRAM; --gpu on the server's host tells), or %s; "
                                   "--allow-cpu accepts it" % remedy)


def local_gpus(run, key, gpus=None):
    """The sum of key over the GPU stage's GPUs (not MIG devices: their parent
    counts them), when --gpu measured them on the server's host; else None."""
    if not run.gpu or not is_loopback(url_host(run.opts.host)):
        return None
    values = [getattr(g, key) for g in (run.gpu["gpus"] if gpus is None else gpus)
              if not g.parent]
    return None if not values or None in values else sum(values)


def check_vram_held(run):
    """--gpu on the server's host: the GPUs hold at least half of what /api/ps
    says is in VRAM. Ollama reports all of a model in VRAM when it cannot read
    the runner's buffer sizes (ollama/ollama#7323, #9704, #10369), so only the
    driver can tell a CPU run: NVML, read again when the warm-up loaded a
    model (or reloaded it: load_duration over 1 s)."""
    local = local_models(run)
    claimed = sum(m.size_vram or 0 for m in local if m.resident) >> 20
    if run.opts.allow_cpu or not claimed or not run.gpu or not is_loopback(
            url_host(run.opts.host)):
        return
    if run.gpu["backend"] != "nvml":
        run.ready_notes.append("VRAM use not cross-checked (%s reports no memory per process)"
                               % run.gpu["backend"])
        return
    after = None
    if not all(m.was_loaded and (m.load_ms or 0) <= 1000 for m in local):
        after = gpus_again(run)
        if after is None:
            return
    held = vram_held(run, after, all(m.was_loaded is False for m in local))
    if held is None:
        run.ready_notes.append("VRAM use not cross-checked (NVML's per-process figures are "
                               "unusable here, and the warm-up did not load every model)")
    elif held * 2 < claimed:
        raise Fail(EX_UNAVAILABLE, "Ollama reports %d MiB in VRAM but the GPU holds %s: it "
                   "is running on the CPU (its GPU backend did not load: see the server "
                   "log)" % (claimed, "only %d MiB" % held if held else "none"), "placement")


def gpus_again(run):
    """The GPUs as NVML tells them now (a second placement stage), or None
    and a note: it failed, or the deadline leaves it no room (1 s is kept for
    the verdict, so the re-read never cuts a ready run)."""
    room = run.deadline_at - time.monotonic() - 1.0
    if room <= 0:
        run.ready_notes.append("VRAM use not cross-checked (no time left to read the GPU "
                               "again before the deadline)")
        return None
    try:
        with run.step("placement", min(run.opts.gpu_timeout, room), optional=True,
                      what="the GPU probe") as budget:
            doc = probe_nvml(run, time.monotonic() + budget)
    except Fail as exc:
        run.ready_notes.append("VRAM use not cross-checked (%s)" % exc.reason)
        return None
    return doc["gpus"] if isinstance(doc, dict) else []


def vram_held(run, after=None, grew=False):
    """MiB the GPUs give Ollama: its runners' memory (runner_mib) where NVML
    names the processes, else, when the warm-up loaded every model (grew) and
    the GPUs were read again (after), the memory taken since the GPU stage;
    never the memory in use as such (other tenants, the driver's reserve).
    None: neither is known."""
    runners = local_gpus(run, "runner_mib", after)
    if runners is not None or not grew or after is None:
        return runners
    free = local_gpus(run, "free_mib", after)
    base = local_gpus(run, "free_mib")
    return None if free is None or base is None else base - free


def unloaded(run, gone, causes):
    """Fail (75) for models a later load pushed out: they do not fit together."""
    for model in gone:
        model.reason = "unloaded when a later model loaded"
    if gone:
        raise Fail(EX_TEMPFAIL, "%s %s unloaded when a later model loaded: the models "
                   "do not fit together (%s, or run these jobs apart)" % (
                       ", ".join(m.name for m in gone),
                       "was" if len(gone) == 1 else "were", causes))


#: The largest context window believed (2**24 tokens; Llama 4 Scout's is 10M):
#: a larger one is a server's fault, never sent back as the warm-up's num_ctx.
MAX_CONTEXT = 2 ** 24


def read_context(run, model, doc, key, what):
    """model.context_length: doc[key] (Ollama /api/ps context_length from
    0.10.0, vLLM max_model_len, llama-server n_ctx), None when absent or 0;
    a value that is no count of 1 to MAX_CONTEXT is None too, and a problem
    (check_context fails on it only under --min-context)."""
    value = doc.get(key)
    model.context_length, model.context_bad = None, None
    if value is None or value == 0 and type(value) is int:
        return
    if type(value) is int and 0 < value <= MAX_CONTEXT:
        model.context_length = value
        return
    model.context_bad = "%s: %s of %s is %s, not a context window" % (
        what, key, model.name, sanitise(repr(value)[:40]) if isinstance(
            value, (int, float, str)) else "a " + type(value).__name__)
    if model.context_bad not in run.problems:
        run.problems.append(model.context_bad)


def check_context(run):
    """--min-context N: Fail (78) for a generative model whose context window,
    as the server reports it, is under N (an embedding model's is the input
    it embeds, not a chat's); a problem noted for one it does not report."""
    least = run.opts.min_context
    if not least:
        return
    models = [m for m in run.models if m.kind != "embed"]
    bad = [m.context_bad for m in models if m.context_bad]
    if bad:
        raise Fail(EX_UNAVAILABLE, "%s: --min-context cannot be checked" % "; ".join(bad),
                   "context")
    unknown = [m for m in models if m.context_length is None]
    cold = [m.name for m in unknown if m.was_loaded is False and not m.resident]
    if cold:                        # Ollama tells a runner's context, none before a load
        run.problems.append("context not checked: %s not loaded, so no context is "
                            "known yet" % ", ".join(cold))
    unknown = [m.name for m in unknown if m.name not in cold]
    if unknown:
        run.problems.append("context not checked: the server does not report the "
                            "context window of %s" % ", ".join(unknown))
    short = [m for m in models if m.context_length is not None and
             m.context_length < least]
    for model in short:
        model.reason = "context %d < %d" % (model.context_length, least)
    if short:
        raise Fail(EX_CONFIG, context_reason(short, least, run.api), "context")


def context_reason(short, least, api):
    """The 78 of --min-context: both numbers, and how the server sets a context."""
    said = "; ".join("%s runs with a %d-token context" % (m.name, m.context_length)
                     for m in short)
    return "%s, the job needs %d (--min-context): %s" % (
        said, least, api_rules(api).context_fix % {"least": least})


#: Runner error text meaning "retry later": GPU (or host) memory is taken,
#: the server is busy, or the model could not load within Ollama's limit.
BUSY_MARKERS = ("out of memory", "out of device memory", "unable to allocate",
                "cudamalloc failed", "requires more system memory", "server busy",
                "timed out waiting for llama runner to start",
                "timed out waiting for llama-server to start")

#: Ollama refusing a request (no such model, cannot generate, an option's type):
#: anchored, so that a runner death quoting "not found" stays a runner death.
_REFUSAL = (r"""^(model ('[^']*'|"[^"]*") not found(, try pulling it first)?"""
            r"""|("[^"]+"|\S+) does not support \w+"""
            r"""|option "[^"]+" must be of type \w+)$""")


def classify_runner_error(message):
    """Exit status for an error from the model runner (Ollama section 8)."""
    if any(marker in message.lower() for marker in BUSY_MARKERS):
        return EX_TEMPFAIL
    if re.match(_REFUSAL, message.strip()):
        return EX_CONFIG
    return EX_UNAVAILABLE


def model_error(what, error):
    return Fail(classify_runner_error(error), "%s: error from the model: %s"
                % (what, sanitise(error)))


def normalise_model(name):
    """Ollama's short display name: 'llama3.2' -> 'llama3.2:latest'."""
    name = name.strip()
    for prefix in ("registry.ollama.ai/", "library/"):
        if name.lower().startswith(prefix):
            name = name[len(prefix):]
    if ":" not in name.rsplit("/", 1)[-1]:
        name += ":latest"
    return name


def same_model(a, b):
    """Whether two model names mean the same model, as Ollama compares them."""
    return normalise_model(a).lower() == normalise_model(b).lower()


# ---- OpenAI-compatible servers: health -> models -> completion or embedding

def check_api(run, client):
    """Stage api (--api auto): "ollama" when GET /api/version says a version, else "openai"."""
    with run.step("api") as budget:
        try:
            doc = client.json("GET", "/api/version", budget)
        except Fail as exc:
            if exc.status is None:
                raise
            return "openai"
        return "ollama" if isinstance(doc.get("version"), str) else "openai"


def check_openai(run, client):
    """The stages of an OpenAI-compatible server (vLLM, llama-server, Ollama's /v1)."""
    if run.opts.health_path != "none":
        check_health(run, client, run.opts.health_path)
    with run.step("models") as budget:
        served = served_models(client.json("GET", "/v1/models", budget))
        if not served:
            raise Fail(EX_CONFIG, "the server serves no models (GET /v1/models)")
        choose_models(run, served, run.opts.model or [_name(served[0])], "served here",
                      "it serves")
    check_requirements(run)         # these servers declare no capabilities
    if run.opts.warmup == "off":
        openai_context(run, client)
        check_context(run)
        return "service up, %s served (warm-up off)" % model_names(run)
    check_asleep(run, client)
    for model in run.models:
        # one token: a completion, or a chat completion where the server has no
        # /v1/completions (gateways, chat-only servers); else one vector, as the
        # generation was refused or is absent (vLLM's task-gated routes)
        with run.timing(model):
            outcome = ask_openai(run, client, model, "completion")
            if outcome == "no route":
                outcome = ask_openai(run, client, model, "chat")
            if outcome != "done":
                ask_openai(run, client, model, "embedding")
    check_requirements(run, observed=True)
    openai_context(run, client)
    if len(run.models) > 1 and any(router_state(m.entry) for m in run.models):
        with run.step("placement", what="GET /v1/models") as budget:
            now = served_models(client.json("GET", "/v1/models", budget))
            states = [set(router_state(e) for e in now if e["name"] == m.name)
                      for m in run.models]      # empty: no longer listed
            unknown = [m.name for m, s in zip(run.models, states) if s == {None}]
            if unknown:
                run.ready_notes.append("load state of %s not reported" % ", ".join(unknown))
            unloaded(run, [m for m, s in zip(run.models, states) if not s & {"loaded", None}],
                     "llama-server's --models-max too low: raise it")
    check_context(run)
    return answered(run)


def check_health(run, client, path):
    """Stage health: GET path (--health-path). A 503 is 75, not ready (SGLang
    answers an empty one while it starts, drains or lags, its http_server.py
    health_generate), except where vLLM still answers it on a second look."""
    with run.step("health", what="GET " + path) as budget:
        ends = time.monotonic() + budget
        try:
            body = client.call("GET", path, budget)
        except Fail as exc:
            if exc.status == 404 and path == "/health":  # Ollama's /v1, some proxies
                run.ready_notes.append("server has no /health")
            elif exc.status == 404:
                raise Fail(EX_CONFIG, "GET %s: 404: no such path here: check "
                           "--health-path" % sanitise(path))
            elif exc.status == 503:
                raise Fail(*health_503(client, path, exc,
                                       lambda: max(0.01, ends - time.monotonic())))
            else:
                raise
            return
    try:
        doc = parse_json(body.decode("utf-8", "replace"))
    except ValueError:
        doc = None
    # LiteLLM's /health calls every model (docs.litellm.ai/docs/proxy/health).
    if isinstance(doc, dict) and "healthy_endpoints" in doc:
        run.ready_notes.append("LiteLLM's /health calls the models: use --health-path "
                               "/health/readiness")


def health_503(client, path, exc, left):
    """(code, reason) of a 503 at the health path: 69 only for a vLLM (GET
    /version answers {"version": ...}) whose path answers an empty 503 again,
    its EngineDeadError (vllm/entrypoints/openai/api_server.py health)."""
    said = "GET %s: 503 %s" % (path, sanitise(exc.detail) or "empty body")
    vllm = False
    try:
        if not (exc.detail or "").strip():
            vllm = isinstance(client.json("GET", "/version", left()).get("version"), str)
        if vllm:
            client.call("GET", path, left())
    except Fail as again:
        if vllm and again.status == 503 and not (again.detail or "").strip():
            return EX_UNAVAILABLE, (said + ": the engine is dead (vLLM's "
                                    "EngineDeadError); restart the server")
    except TimedOut:
        pass
    return EX_TEMPFAIL, said + ": not ready (starting, draining or overloaded)"


def check_asleep(run, client):
    """vLLM's sleep mode: a completion to a sleeping engine crashes it
    (vllm-project/vllm#15483), so GET /is_sleeping first (dev mode only,
    #14311); only {"is_sleeping": true} stops the run, any other answer or
    none (a timeout: the warm-up would time out too) lets it go on."""
    with run.step("sleep") as budget:
        try:
            doc = client.json("GET", "/is_sleeping", budget)
        except (Fail, TimedOut):
            return
        if doc.get("is_sleeping") is True:
            raise Fail(EX_TEMPFAIL, "GET /is_sleeping: engine asleep (POST /wake_up)")


def openai_context(run, client):
    """Each model's context window: vLLM's max_model_len in /v1/models; else,
    with --min-context and one model, llama-server's GET /props
    default_generation_settings.n_ctx, what one slot (one request) gets
    (llama.cpp tools/server README and get_props); a server without it says none."""
    for model in run.models:
        read_context(run, model, model.entry, "max_model_len", "GET /v1/models")
    if not run.opts.min_context or len(run.models) != 1 or run.models[0].context_length:
        return
    try:
        with run.step("props", optional=True) as budget:
            settings = client.json("GET", "/props", budget).get("default_generation_settings")
            read_context(run, run.models[0], settings if isinstance(settings, dict) else {},
                         "n_ctx", "GET /props")
    except Fail:
        pass                        # vLLM, gateways: no /props, the context is not told


def router_state(entry):
    """A /v1/models entry's load state as llama-server's router reports it,
    status {"value": "loaded", ...} (llama.cpp tools/server/server-models.cpp),
    or None: any other status (a string, a number, a list, true) says nothing."""
    status = entry.get("status")
    value = status.get("value") if isinstance(status, dict) else None
    return value if isinstance(value, str) else None


def served_models(doc):
    """A /v1/models answer's entries (vLLM's, llama-server's), each named by its id."""
    data = doc.get("data", doc.get("models"))
    if data is not None and not isinstance(data, list):
        raise Fail(EX_CONFIG, not_server("openai", "GET /v1/models has no data list"))
    entries = [dict(m, name=_name({"name": m.get("id")}) or _name(m))
               for m in data or () if isinstance(m, dict)]
    return [e for e in entries if e["name"]]


#: The body that proves a model on an OpenAI-compatible server, by stage.
OPENAI_ASKS = {
    "completion": {"prompt": WARMUP_PROMPT, "max_tokens": 1, "stream": False},
    "chat": {"messages": [{"role": "user", "content": WARMUP_PROMPT}], "max_tokens": 1},
    "embedding": {"input": WARMUP_PROMPT},
}

#: A server refusing generation with an embedding model: the text tells, not
#: the status, which differs by server and version.
_WRONG_KIND = r"(?i)does not support (completions|chat|generate)|(Chat )?Completions API"


def ask_openai(run, client, model, stage):
    """One request proving a model: "done", "no route" (404 or 405: not
    offered here) or "wrong kind" (generation asked of an embedding model)."""
    path = STAGE_WHAT[stage].split()[1]
    what = "POST %s for %s" % (path, model.name)
    with run.step(stage, model=model) as budget:
        try:
            doc = client.json("POST", path, budget, dict(OPENAI_ASKS[stage],
                                                         model=model.name), model.name)
        except Fail as exc:
            if stage != "embedding" and re.search(_WRONG_KIND, exc.detail or ""):
                return "wrong kind"
            if stage != "embedding" and exc.status in (404, 405):
                return "no route"
            if stage == "embedding" and (exc.status in (404, 405, 501) or re.search(
                    r"(?i)support embeddings|embedding=True", exc.detail or "")):
                raise Fail(EX_CONFIG, "%s: the server neither completes nor embeds with "
                           "this model (%s)" % (what, sanitise(exc.detail or exc.status)))
            raise
        error = answer_error(doc)       # vLLM answered some errors with a 200
        if stage == "embedding":
            data = doc.get("data")
            first = data[0] if isinstance(data, list) and data else None
            need_vector(doc, first.get("embedding") if isinstance(first, dict) else None,
                        what, "data[0].embedding")
        elif error is not None and re.search(_WRONG_KIND, error):
            return "wrong kind"
        elif error is not None:
            raise model_error(what, error)
        elif not isinstance(doc.get("choices"), list) or not doc["choices"]:
            raise Fail(EX_UNAVAILABLE, "%s: answered without a completion (no choices)"
                       % what)
    model.kind = "embed" if stage == "embedding" else "generate"
    return "done"


# ---- The APIs: what differs between Ollama and OpenAI-compatible servers ---

#: One API's ways: its name in a reason, its stages, whether a refused
#: connection is a server still starting (vLLM refuses while it loads a model)
#: and a 401 or 403 a refused token (a gateway's; Ollama's 403 is its host
#: guard), whether it has cloud models and `ollama pull`, and how its server is
#: given a larger context (%(least)d: the tokens --min-context asks).
Api = collections.namedtuple(
    "Api", "label check refused_while_loading refuses_tokens ollama context_fix")

APIS = {
    "ollama": Api(
        "Ollama", check_service, refused_while_loading=False, refuses_tokens=False,
        ollama=True, context_fix="set OLLAMA_CONTEXT_LENGTH=%(least)d on the server, "
        "PARAMETER num_ctx %(least)d in a Modelfile, or --ollama-option "
        "num_ctx=%(least)d so the warm-up loads it that way (requests to Ollama's "
        "OpenAI-compatible /v1 API cannot set num_ctx)"),
    "openai": Api(
        "OpenAI-compatible", check_openai, refused_while_loading=True,
        refuses_tokens=True, ollama=False, context_fix="restart the server with a "
        "larger context (vLLM --max-model-len %(least)d, llama-server --ctx-size "
        "%(least)d times --parallel)"),
}


def api_rules(api):
    """The Api of --api (auto, until GET /api/version has told: Ollama's)."""
    return APIS.get(api, APIS["ollama"])


# ---- The HTTP client: urllib, no proxy on loopback, failures classified ----

#: The most of an error answer read (bytes): its start says enough.
MAX_ERROR_BODY = 64 * 1024


class Client(object):
    """Talks to one base URL; every call returns bytes or raises Fail/TimedOut."""

    def __init__(self, base, api="ollama", token=None, context=None):
        host = url_host(base)
        if host == "":
            base = base.replace("://:", "://127.0.0.1:", 1)
        self.base, self.api = base, api
        self.headers = {"User-Agent": "%s/%s" % (PROG, __version__),
                        "Accept": "application/json", "Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = "Bearer " + token
        self.opener = http_opener(context, is_loopback(host))

    def call(self, method, path, budget, payload=None, about=None, as_json=False):
        """The body of a 2xx answer to METHOD path (about: the model it concerns),
        or as_json the JSON object in it."""
        what = "%s %s%s" % (method, path, " for " + about if about else "")
        from urllib.error import HTTPError
        from urllib.request import Request
        data = None if payload is None else json.dumps(payload).encode("ascii")
        request = Request(self.base + path, data=data, method=method, headers=self.headers)
        try:
            answer = self.opener.open(request, timeout=budget)
        except HTTPError as exc:
            body = self._read(exc, MAX_ERROR_BODY, what, allow_short=True)
            if 300 <= exc.code < 400:
                raise Fail(EX_CONFIG, "%s: redirected (%d) to %s; give --host the "
                           "final address" % (what, exc.code,
                                               sanitise(exc.headers.get("Location"))))
            code, reason = classify_answer(what, exc.code, body, self.api)
            raise Fail(code, reason, status=exc.code, detail=answer_message(body)[0])
        except Exception as exc:    # URLError, OSError, http.client errors
            raise Fail(*classify_exception(exc, what, self.base, self.api))
        body = self._read(answer, MAX_BODY, what)
        try:
            doc = parse_json(body.decode("utf-8")) if as_json else body
        except ValueError as exc:
            raise not_json(what, body, exc)
        if as_json and not isinstance(doc, dict):
            raise Fail(EX_CONFIG, not_server(self.api, "%s %s did not answer a JSON "
                                             "object" % (method, path)))
        return doc

    def _read(self, answer, limit, what, allow_short=False):
        """Read at most limit bytes; a longer answer ends the stage."""
        try:
            body = read_up_to(answer.read, limit)
            missing = getattr(answer, "length", None)   # Content-Length left
        except Exception as exc:    # OSError, http.client.IncompleteRead...
            if allow_short:
                return b""
            raise Fail(*classify_exception(exc, what, self.base, self.api))
        finally:
            answer.close()
        if allow_short:             # an error answer: its start is enough
            return body[:limit]
        if missing and len(body) <= limit:
            raise Fail(EX_UNAVAILABLE, "%s: connection closed in mid-answer, %d "
                       "bytes short" % (what, missing))
        if len(body) > limit:
            raise Fail(EX_UNAVAILABLE, "%s: answer larger than %d MiB, not what "
                       "Ollama sends" % (what, limit // (1024 * 1024)))
        return body[:limit]

    def json(self, method, path, budget, payload=None, about=None):
        return self.call(method, path, budget, payload, about, as_json=True)


def http_opener(context, loopback):
    """urllib's opener (imported only by a run that sends): redirects reported,
    never followed (the token would go along); an ASCII host resolved as bytes
    (a str loads the idna codec, 3 ms); no proxy for a loopback host."""
    import http.client
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):
            return None

    class AsciiHostConnection(http.client.HTTPConnection):
        def connect(self):
            host = self.host
            if isinstance(host, str) and all(ord(c) < 128 for c in host):
                self.host = host.encode("ascii")
            try:
                http.client.HTTPConnection.connect(self)
            finally:
                self.host = host

    class HTTPHandler(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(AsciiHostConnection, req)

    handlers = [NoRedirect(), HTTPHandler()]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    if loopback:
        handlers.append(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener(*handlers)


def classify_answer(what, status, body, api="ollama"):
    """(exit status, reason) of an HTTP answer that is not a success: the first rule."""
    message, is_json = answer_message(body)
    quoted = sanitise(message) or "empty body"
    said = "%s: %d %s" % (what, status, quoted)
    rules = api_rules(api)      # a gateway's 401 refuses the token, even with a signin_url
    cloud = None if status == 401 and rules.refuses_tokens else cloud_refusal(
        status, message, body)
    return next((code, reason) for applies, code, reason in (
        (cloud is not None, EX_CONFIG, "%s: %d %s: %s" % (what, status, quoted, cloud)),
        (status in (401, 403) and rules.refuses_tokens, EX_CONFIG, said + ": the server refuses "
         "the credentials: check the token (--token-file or GPU_PREFLIGHT_TOKEN)"),
        (status == 403, EX_CONFIG, "%s: 403 forbidden: Ollama's host guard refuses this "
         "host name (use the address it listens on) or a proxy said no" % what),
        (status in (401, 407), EX_CONFIG, "%s: %d authentication required: %s"
         % (what, status, quoted)),
        (status in (404, 405) and not is_json, EX_CONFIG,
         not_server(api, "%s answered %d %s" % (what, status, quoted))),
        (status == 503 and message.strip() == "Loading model", EX_TEMPFAIL,
         "%s: 503 Loading model: the server is still loading" % what),
        (status == 503, EX_TEMPFAIL, "%s: 503 server busy: %s" % (what, quoted)),
        (status in (400, 404), EX_CONFIG, said),
        (what.startswith("POST"), classify_runner_error(message), said),
        (True, EX_UNAVAILABLE, "%s: HTTP %d %s" % (what, status, quoted))) if applies)


def cloud_refusal(status, message, body):
    """Why Ollama refuses a cloud model, or None: cloud turned off on the
    server (403, internal/cloud/policy.go), or the server not signed in to
    ollama.com (401 with the sign-in link, server/routes.go)."""
    if status == 403 and message.startswith("ollama cloud is disabled"):
        return ("the server has Ollama cloud turned off (OLLAMA_NO_CLOUD=1, or "
                "disable_ollama_cloud in its server.json): turn it on, or use a local model")
    try:
        link = status == 401 and parse_json(body.decode("utf-8", "replace"))["signin_url"]
    except (ValueError, TypeError, KeyError):
        return None
    if isinstance(link, str):                       # its query: host name and key
        base = link.split("?")[0].split("#")[0]
        return ("the Ollama server is not signed in to ollama.com: run ollama signin "
                "on the server's host (it prints the link, %s%s)"
                % (sanitise(base, 80), "?..." if base != link else ""))
    return None


def answer_message(body):
    text = body.decode("utf-8", "replace").strip()
    try:
        doc = parse_json(text)
    except ValueError:
        return text, False
    if isinstance(doc, dict) and "error" in doc:
        return error_text(doc["error"]), True
    return text, False


def classify_exception(exc, what, url, api="ollama"):
    """(exit status, reason) for a network failure, or raise TimedOut."""
    import http.client          # loaded already: a request was made
    import ssl
    import urllib.error
    if isinstance(exc, urllib.error.URLError) and not isinstance(
            exc, urllib.error.HTTPError):
        exc = exc.reason if isinstance(exc.reason, BaseException) else exc
    if isinstance(exc, socket.timeout):
        raise TimedOut()
    where, said = url.split("://", 1)[-1].split("/", 1)[0], sanitise(exc)
    return next((code, reason) for kinds, code, reason in (
        (ConnectionRefusedError if api_rules(api).refused_while_loading else (), EX_TEMPFAIL,
         "connection refused by %s (vLLM refuses connections while it loads the model; "
         "or the service is down)" % where),
        (ConnectionRefusedError, EX_UNAVAILABLE, "connection refused by %s (is the "
         "service running and listening there?)" % where),
        (socket.gaierror, EX_UNAVAILABLE, "cannot resolve %s: %s" % (where, said)),
        ((ConnectionError, EOFError, http.client.IncompleteRead), EX_UNAVAILABLE,
         "%s: connection closed by %s in mid-answer" % (what, where)),
        ((ssl.SSLError, ssl.CertificateError), EX_CONFIG,   # 3.6: not an SSLError
         "%s: TLS error with %s: %s" % (what, where, said)),
        ((http.client.BadStatusLine, http.client.LineTooLong, http.client.UnknownProtocol),
         EX_CONFIG, "not an HTTP server at %s: %s" % (where, said)),
        (OSError, EX_UNAVAILABLE, "%s: network error: %s" % (what, said)),
        (BaseException, EX_UNAVAILABLE, "%s: %s: %s" % (what, type(exc).__name__, said)),
    ) if isinstance(exc, kinds))


def not_server(api, why):
    return "not an %s server: %s" % (api_rules(api).label, why)


def not_json(what, body, exc=None):
    """The failure for an answer that does not parse, quoting its start."""
    if exc is not None and not isinstance(exc, (json.JSONDecodeError, UnicodeError)):
        return Fail(EX_UNAVAILABLE, "%s: not a valid answer (not JSON this reads: %s)"
                    % (what, exc))
    return Fail(EX_UNAVAILABLE, "%s: answer is not JSON: %s"
                % (what, sanitise(body[:80].decode("latin-1"))))


#: The most digits of an integer in a server's answer (parse_json()).
MAX_INT_DIGITS = 4300


def parse_json(text):
    """A server's JSON text as values; ValueError when it is not JSON, nests
    too deeply, or holds an integer of more than MAX_INT_DIGITS (3.11's own
    limit: before it, parsing one is quadratic and outlasts any deadline)."""
    try:
        return json.loads(text, parse_int=_bounded_int, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply")


def _no_constant(name):         # NaN, Infinity: Python writes them, JSON has none
    raise ValueError("%s is not JSON" % name)


def _bounded_int(digits):
    if len(digits) > MAX_INT_DIGITS:
        raise ValueError("an integer of %d digits" % len(digits))
    return int(digits)


def is_loopback(host):
    """True for names and literals that never need a proxy."""
    host = host.lower().strip("[]")
    return (host in ("", "localhost", "::1", "::", "0.0.0.0")
            or host.endswith(".localhost") or host.startswith("127."))


def url_host(url):
    hostport = url.split("://", 1)[1].split("/", 1)[0]
    host, _ = _split_host_port(hostport)
    return host if host is not None else hostport


# ---- The GPU stage: NVML, nvidia-smi, AMD sysfs, each in a child process ----

def check_gpu(run):
    """Stage gpu (main thread, first): the first backend that answers, the GPUs judged."""
    opts = run.opts
    with run.step("gpu", opts.gpu_timeout) as budget:
        name, doc = first_backend(run, time.monotonic() + budget)
        cuda = doc.pop("cuda", None)
        run.gpu = dict(doc, backend=name, need=opts.gpu_need)
        gpus = doc["gpus"]
        if not gpus:
            raise Fail(EX_UNAVAILABLE, "%s found no GPU" % name)
        short = too_few_gpus(gpus, opts.expect_gpus)
        if short:
            raise Fail(EX_UNAVAILABLE, short + unseen_gpus(gpus, nvidia_pci_devices(), name))
        selected, unmatched, notes = select_gpus(gpus, opts.gpu_id, os.environ)
        for gpu in gpus:
            gpu.selected = gpu in selected
        run.ready_notes.extend(notes)
        if unmatched:               # a lost GPU without a UUID may be the one
            lost = [g for g in gpus if g.error and not g.uuid and (
                g.index is None or not all(is_digits(w) for w in unmatched))]
            source = "--gpu-id"
            if not opts.gpu_id:
                source = "CUDA_VISIBLE_DEVICES/NVIDIA_VISIBLE_DEVICES"
            reason = "no GPU matches %s in %s (found %s)" % (
                ",".join(unmatched), source, ", ".join(gpu_label(g) for g in gpus))
            if lost:
                raise Fail(EX_UNAVAILABLE, "%s; %s: %s" % (reason, gpu_label(lost[0]),
                                                          lost[0].error))
            raise Fail(EX_CONFIG, reason)
        if not selected:
            raise Fail(EX_CONFIG, "no GPU this user may open: %s" % "; ".join(notes))
        judge_gpu_stage(run, gpus, selected, cuda)


def judge_gpu_stage(run, gpus, selected, cuda):
    """The GPU stage's verdict: a GPU the driver gave up on (69) first, then
    CUDA (cuda: its state, or None where not checked), then the thresholds
    and a fabric not registered yet (75)."""
    cuda_failed = judge_cuda(cuda, gpus)
    if cuda and not cuda_failed:    # CUDA starts on every GPU: see fabric_doubts()
        run.problems.extend(fabric_doubts(gpus))
    code, reason, notes = judge_gpus(selected, run.opts)
    run.ready_notes.extend(notes)
    if code == EX_UNAVAILABLE or (code and not cuda_failed):
        # A fabric that never finishes is a fault, not a busy GPU: it escalates.
        raise Fail(code, reason, busy=code == EX_TEMPFAIL and not any(
            g.pending for g in selected))
    if cuda_failed:
        raise Fail(*cuda_failed)


def first_backend(run, ends_at):
    """(name, snapshot) of the first GPU backend that answers; under auto never
    past a dead NVIDIA driver to AMD (an integrated GPU) on an NVIDIA host."""
    auto = run.opts.gpu_backend == "auto"
    absent, failure = [], None
    for name, probe in GPU_PROBES:
        if not auto and run.opts.gpu_backend != name:
            continue
        if auto and name == "amd-sysfs" and nvidia_present():
            raise failure or Fail(EX_UNAVAILABLE, "an NVIDIA GPU is present but "
                                  "neither NVML nor nvidia-smi answered: %s"
                                  % "; ".join(absent))
        try:
            doc = probe(run, ends_at)
        except Fail as exc:
            if not auto or exc.code != EX_UNAVAILABLE:
                raise
            failure = failure or exc
            continue
        if isinstance(doc, dict):
            return name, doc
        absent.append(doc)
    raise failure or Fail(EX_UNAVAILABLE, "no GPU driver found: %s" % "; ".join(absent))


def nvidia_present():
    """Whether there is an NVIDIA GPU: a 0x10de PCI display controller, or /dev/nvidiaN."""
    if nvidia_pci_devices():
        return True
    root = os.environ.get(ENV_PREFIX + "ROOT", "/") or "/"
    dev = os.path.join(root, "dev")
    return any(re.match(r"^nvidia\d+$", n) for n in
               (os.listdir(dev) if os.path.isdir(dev) else ()))


def nvidia_pci_devices():
    """The addresses ("0000:3b:00.0") of the NVIDIA display controllers (vendor
    0x10de, class 0x03xxxx: no audio function, no NVSwitch) under
    /sys/bus/pci/devices, bound to a driver or not; [] when unreadable."""
    devices = os.path.join(os.environ.get(ENV_PREFIX + "ROOT", "/") or "/",
                           "sys/bus/pci/devices")
    try:
        names = sorted(os.listdir(devices))
    except OSError:
        return []
    found = []
    for device in names:
        if os.path.lexists(os.path.join(devices, device, "physfn")):
            continue        # an SR-IOV virtual function (a vGPU host's): NVML never lists it
        try:
            ids = [read_small_file(os.path.join(devices, device, name), 64).strip()
                   for name in ("vendor", "class")]
        except (OSError, ValueError):
            continue
        if ids[0] == b"0x10de" and ids[1].startswith(b"0x03"):
            found.append(device)
    return found


def too_few_gpus(gpus, expected):
    """The reason when the driver sees fewer whole GPUs than --expect-gpus,
    counted before --gpu-id or CUDA_VISIBLE_DEVICES select any; else None."""
    seen = len([g for g in gpus if not g.parent])
    if expected is None or seen >= expected:
        return None
    return "%d of %d GPUs visible (--expect-gpus)" % (seen, expected)


#: The most PCI addresses a reason names.
MAX_UNSEEN = 8


def unseen_gpus(gpus, present, backend):
    """'; not seen by NVML: 0000:3b:00.0' naming the PCI addresses in present
    (sysfs's NVIDIA GPUs) that none of the backend's whole GPUs has; "" when
    there are none, or when one of them has no bus id (a GPU whose handle
    failed may be any of them; AMD's records have none)."""
    known = [pci_address(g.pci) for g in gpus if not g.parent]
    if None in known:
        return ""
    unseen = ["%04x:%02x:%02x.%x" % a for a in sorted(set(map(pci_address, present))
                                                       - set(known) - {None})]
    if not unseen:
        return ""
    named = ", ".join(unseen[:MAX_UNSEEN])
    if len(unseen) > MAX_UNSEEN:
        named += " and %d more" % (len(unseen) - MAX_UNSEEN)
    return "; not seen by %s: %s" % ("NVML" if backend == "nvml" else backend, named)


def pci_address(text):
    """(domain, bus, device, function) of a PCI address however written:
    "00000000:3B:00.0" (NVML, nvidia-smi), "0000:3b:00.0" (sysfs); else None."""
    found = re.match(r"([0-9A-Fa-f]{1,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])\Z",
                     text or "")
    return tuple(int(n, 16) for n in found.groups()) if found else None


def gpu_label(gpu):
    """'GPU 1 (GPU-bbbbbbbb)', 'MIG device MIG-aaaaaaaa of GPU 0', for reasons."""
    uuid = (gpu.uuid or "")[:12]
    if gpu.parent:
        return "MIG device %s of GPU %s" % (uuid, gpu.index)
    if gpu.index is None:
        return gpu.name or "a GPU"
    return "GPU %s%s" % (gpu.index, " (%s)" % uuid if uuid else "")


def select_gpus(gpus, ids, environ):
    """The GPUs the job will use: (selected, unmatched ids, notes). --gpu-id
    takes indexes and UUID prefixes, else the UUIDs in CUDA_VISIBLE_DEVICES or
    NVIDIA_VISIBLE_DEVICES (not their indexes: CUDA's order need not be NVML's).
    A MIG UUID selects that MIG device, MIG-GPU-<uuid>/gi/ci its parent. By
    default: every GPU this user may open (a MIG device's parent covers it)."""
    notes = []
    for var in () if ids else ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        items = [i.strip() for i in environ.get(var, "").split(",") if i.strip()]
        ids = [i for i in items if i.upper().startswith(("GPU-", "MIG-"))]
        if ids:
            notes = []
            break
        if items and items[0] not in ("all", "none", "void"):
            notes = ["%s lists indexes, which need not be NVML's order: every GPU "
                     "checked" % var]
    if not ids:
        shut = [g for g in gpus if not g.access]
        notes += ["%s: %s, not checked" % (gpu_label(g), g.error) for g in shut]
        return [g for g in gpus if g.access and not g.parent], [], notes

    def matches(gpu, wanted):
        if is_digits(wanted):
            return gpu.index == int(wanted) and not gpu.parent
        if wanted.upper().startswith("MIG-GPU-"):       # MIG-GPU-<uuid>/gi/ci
            wanted = wanted[4:].split("/")[0]
        return (gpu.uuid or "").lower().startswith(wanted.lower())

    selected = [g for g in gpus if any(matches(g, w) for w in ids)]
    unmatched = [w for w in ids if not any(matches(g, w) for g in gpus)]
    return selected, unmatched, notes


def gpu_problems(gpu, opts):
    """(hard, soft, unknown) problems of one GPU against the thresholds."""
    hard = [text for text in (gpu.error, gpu.health, gpu.fabric) if text]
    soft, unknown = [], []
    if gpu.pending and not hard:     # a fabric not registered yet
        soft.append(gpu.pending)
    for option, key, unit, at_least in GPU_LIMITS:
        limit = getattr(opts, option)
        if limit is None or hard:
            continue
        value = getattr(gpu, key)
        if value is None:
            unknown.append("%s unknown%s" % (key, " (MIG)" if gpu.mig else ""))
        elif (value < limit) if at_least else (value > limit):
            soft.append("%d%s, limit %d (--%s)" % (value, unit, limit,
                                                   option.replace("_", "-")))
    return hard, soft, unknown


def judge_gpus(gpus, opts):
    """(exit status, reason, notes) for the selected GPUs; status 0 is fit."""
    verdicts = []
    for gpu in gpus:
        hard, soft, unknown = gpu_problems(gpu, opts)
        if opts.strict_gpu:
            soft, unknown = soft + [u + " (--strict-gpu)" for u in unknown], []
        gpu.fit = not hard and not soft
        verdicts.append((gpu, hard, soft, unknown))
    fit = [v for v in verdicts if v[0].fit]
    unfit = [v for v in verdicts if not v[0].fit]
    notes = ["%s: %s" % (gpu_label(g), ", ".join(u)) for g, _, _, u in verdicts if u]
    if fit and (opts.gpu_need == "any" or not unfit):
        notes += ["%s not fit: %s" % (gpu_label(g), "; ".join(h + s))
                  for g, h, s, _ in unfit]
        return EX_OK, "%d of %d GPUs fit" % (len(fit), len(gpus)), notes
    hard = [v for v in unfit if v[1]]
    if hard and (opts.gpu_need == "all" or len(hard) == len(unfit)):
        code, shown = EX_UNAVAILABLE, hard     # lost or broken: retrying won't help
    else:
        code, shown = EX_TEMPFAIL, unfit       # busy now, may be free later
    return code, "; ".join("%s: %s" % (gpu_label(g), ", ".join(h + s))
                           for g, h, s, _ in shown), notes


class Gpu(object):
    """One GPU or MIG device as every backend reports it: its figures and the
    driver's word on it (None: cannot be read), then what the GPU stage
    decides of it (selected, fit), which are not set until the stage does.
    The --json "gpu" object's "gpus" list shows the fields set."""

    __slots__ = ("index", "uuid", "name", "pci", "total_mib", "free_mib", "util_pct",
                 "procs", "proc_mib", "runner_mib", "temp_c", "mig", "parent", "access",
                 "error", "health", "fabric", "pending", "selected", "fit")

    def __init__(self, index, uuid, name, total=None, free=None, util=None, procs=None,
                 temp=None, error=None, pci=None):
        self.index, self.uuid, self.name, self.pci = index, uuid, name, pci
        self.total_mib, self.free_mib, self.util_pct, self.procs = total, free, util, procs
        self.proc_mib = self.runner_mib = self.mig = self.parent = None
        self.temp_c, self.access, self.error = temp, True, error
        self.health = self.fabric = self.pending = None

    def as_dict(self):
        """The fields set, by name (a probe's output, the --json "gpus" list)."""
        return dict((key, getattr(self, key)) for key in self.__slots__ if hasattr(self, key))

    @classmethod
    def from_dict(cls, doc):
        """The record as_dict() gave (a probe child's output); other keys are dropped."""
        gpu = cls(doc.get("index"), doc.get("uuid"), doc.get("name"))
        for key in cls.__slots__:
            if key in doc:
                setattr(gpu, key, doc[key])
        return gpu

    def __eq__(self, other):    # as the dicts were: `gpu in selected` compares fields
        return self.as_dict() == other.as_dict() if isinstance(other, Gpu) else NotImplemented


#: The most a GPU probe may print (bytes), and the most its exit is awaited
#: after its output ended (seconds; a child stuck in the driver is abandoned).
MAX_PROBE_OUTPUT, PROBE_REAP_WAIT = 1024 * 1024, 0.2


def spawn(run, child=None, argv=None, env=None):
    """Fork child() (its JSON result the output) or exec argv: (pid, the output's read end)."""
    import warnings
    rfd, wfd = os.pipe()
    with warnings.catch_warnings():     # a --wait retry may have threads
        warnings.simplefilter("ignore", DeprecationWarning)  # blocked in sockets
        pid = os.fork()
    if pid == 0:                    # the child: never returns
        status = 127 if argv else EX_SOFTWARE
        try:
            os.setpgid(0, 0)
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
                signal.signal(signum, signal.SIG_DFL)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(wfd if argv else null, 1)   # a stub NVML prints a banner
            os.dup2(null, 2)
            os.closerange(3, wfd)   # a stuck probe must hold no lock or pipe
            os.closerange(wfd + 1, min(os.sysconf("SC_OPEN_MAX"), 1 << 20))
            if argv:
                os.execve(argv[0], argv, env)
            data = json.dumps(child(), default=Gpu.as_dict).encode("utf-8")
            while data:
                data = data[os.write(wfd, data):]
            status = 0
        finally:
            os._exit(status)
    os.close(wfd)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)        # also here: a kill may come before the child's
    run.children.append(pid)
    return pid, rfd


def collect(run, pid, rfd, ends_at, what, reaped_by=None):
    """The child's output and exit status (None: not ended by reaped_by, or
    PROBE_REAP_WAIT after its output ended); Fail (75) when the output does
    not end in time."""
    poller = select.poll()      # select() cannot watch a descriptor past 1023
    poller.register(rfd, select.POLLIN)

    def read(size):
        left = ends_at - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            kill_probes(run)
            stage = run.current
            raise Fail(EX_TEMPFAIL, "GPU probe hung: %s did not answer within "
                       "%.3gs (driver wedged, or GPUs initialising without "
                       "persistence mode)" % (what, stage.ends_at - stage.started))
        return os.read(rfd, size)
    try:
        output = read_up_to(read, MAX_PROBE_OUTPUT)
    finally:
        os.close(rfd)
    end = reaped_by or time.monotonic() + PROBE_REAP_WAIT
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:   # reaped already: SIGCHLD was ignored
            run.children.remove(pid)
            return output, None
        if done:
            run.children.remove(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            return output, code
        if time.monotonic() > end:
            return output, None
        time.sleep(0.002)


def kill_probes(run):
    """SIGKILL every probe's process group still running; wait for none."""
    for pid in run.children:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def forked(run, child, ends_at, what):
    """The JSON object a forked probe child() returned, its "gpus" Gpu records
    again; Fail (69) when it died."""
    pid, rfd = spawn(run, child)
    out, status = collect(run, pid, rfd, ends_at, what)
    try:
        doc = json.loads(out.decode("utf-8"))
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise Fail(EX_UNAVAILABLE, "%s probe died (%s)" % (
            what, "signal %d" % -status if status and status < 0 else "exit %s" % status))
    if "gpus" in doc:
        doc["gpus"] = [Gpu.from_dict(gpu) for gpu in doc["gpus"]]
    return doc


#: NVML return codes the GPU stage names (nvml.h nvmlReturn_t).
NVML_NO_PERMISSION, NVML_INSUFFICIENT_SIZE, NVML_DRIVER_NOT_LOADED = 4, 7, 9
NVML_LIBRARY_NOT_FOUND, NVML_FUNCTION_NOT_FOUND, NVML_GPU_IS_LOST = 12, 13, 15
NVML_OPERATING_SYSTEM, NVML_LIB_RM_VERSION_MISMATCH = 17, 18
NVML_ARGUMENT_VERSION_MISMATCH, NVML_NOT_SUPPORTED = 25, 3

#: usedGpuMemory of a process NVML cannot measure (Windows WDDM, some vGPUs):
#: (-1) in an unsigned long long.
NVML_VALUE_NOT_AVAILABLE = -1

#: nvmlMemory_v2_t's version: NVML_STRUCT_VERSION(Memory, 2) = sizeof | 2 << 24.
NVML_MEMORY_V2 = 0x02000028
#: The values passed to NVML: the GPU's own temperature sensor, uncorrected
#: ECC errors counted since the driver loaded (volatile), MIG mode on.
NVML_TEMPERATURE_GPU, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 0, 1, 0
NVML_DEVICE_MIG_ENABLE = 1
#: The buffer of every string NVML writes: the largest it asks for (name and
#: UUID 96 bytes, the driver version 80).
NVML_DEVICE_NAME_V2_BUFFER_SIZE = 96
#: The versions of nvmlGpuFabricInfo_v3_t and _v2_t: v3 adds a last field, so
#: one ctypes class serves both, and drivers that know only v2 refuse v3's.
NVML_GPU_FABRIC_INFO_V3, NVML_GPU_FABRIC_INFO_V2 = 0x03000028, 0x02000024

#: The reason for NVML error 18 / nvidia-smi exit 18 ("%s": who said it).
VERSION_MISMATCH = ("NVIDIA driver and library versions differ (%s): the driver "
                    "was upgraded without reloading the kernel module; reboot")


def probe_nvml(run, ends_at):
    """NVML in a forked child: a snapshot dict, or a string when absent."""
    doc = forked(run, lambda: nvml_snapshot(run.opts.nvml_lib, run.opts.cuda_check == "on"),
                 ends_at, "NVML")
    code, text = doc.pop("nvml_error", None), sanitise(doc.pop("text", ""))
    if "untrusted" in doc:
        raise Fail(EX_CONFIG, sanitise(doc["untrusted"]))
    if code in (None, 0):
        return doc          # CUDA's word is judged by check_gpu: no fall-through past it
    if code in (NVML_LIBRARY_NOT_FOUND, NVML_FUNCTION_NOT_FOUND):
        return "NVML: %s" % text
    if code == NVML_DRIVER_NOT_LOADED:
        raise Fail(EX_UNAVAILABLE, "NVIDIA driver not loaded (NVML: %s)" % text)
    if code == NVML_LIB_RM_VERSION_MISMATCH:
        raise Fail(EX_UNAVAILABLE, VERSION_MISMATCH % ("NVML: " + text))
    raise Fail(EX_UNAVAILABLE, "NVML failed: %s" % text)


#: The nvml.h structs the probe passes, as ctypes classes: nvmlMemory_t,
#: _v2_t, nvmlProcessInfo_v1_t, _v2_t (also _v3), nvmlGpuFabricInfo_v3_t,
#: nvmlFieldValue_t and nvmlPciInfo_t.
NvmlStructs = collections.namedtuple(
    "NvmlStructs", "Memory MemoryV2 Process ProcessV2 FabricInfo FieldValue PciInfo")


def nvml_structs(c):
    """The NvmlStructs, built on ctypes module c (in the probe's child)."""
    def struct(name, *fields):
        return type(name, (c.Structure,), {"_fields_": list(fields)})
    uint, ull = c.c_uint, c.c_ulonglong
    process = (("pid", uint), ("usedGpuMemory", ull))
    return NvmlStructs(
            struct("Memory", ("total", ull), ("free", ull), ("used", ull)),
            struct("MemoryV2", ("version", uint), ("total", ull), ("reserved", ull),
                   ("free", ull), ("used", ull)),
            struct("Process", *process),
            struct("ProcessV2", *process + (("gpuInstanceId", uint),
                                            ("computeInstanceId", uint))),
            struct("FabricInfo", ("version", uint), ("clusterUuid", c.c_ubyte * 16),
                   ("status", c.c_int), ("cliqueId", uint), ("state", c.c_ubyte),
                   ("healthMask", uint), ("healthSummary", c.c_ubyte)),
            # value is a union of 8 bytes; ctypes zeroes it, so a 4-byte value
            # reads the same as its 8 bytes on the little-endian hosts NVIDIA
            # has drivers for.
            struct("FieldValue", ("fieldId", uint), ("scopeId", uint),
                   ("timestamp", c.c_longlong), ("latencyUsec", c.c_longlong),
                   ("valueType", c.c_int), ("nvmlReturn", c.c_int), ("value", ull)),
            struct("PciInfo", ("busIdLegacy", c.c_char * 16), ("domain", uint),
                   ("bus", uint), ("device", uint), ("pciDeviceId", uint),
                   ("pciSubSystemId", uint), ("busId", c.c_char * 32)))


#: Where NVML lives when dlopen's own search fails (never a CUDA toolkit
#: /stubs/ directory: that library is a link-time stub).
NVML_DIRS = ("/usr/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
             "/lib64", "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu",
             "/usr/lib/wsl/lib")


def nvml_candidates(path):
    """Where NVML may be: --nvml-lib alone, else in LD_LIBRARY_PATH, the
    linker's cache, NVML_DIRS; absolute, so what is loaded is what was checked."""
    if path:
        return [path]
    found = [os.path.join(d, NVML_NAME) for d in
             os.environ.get("LD_LIBRARY_PATH", "").split(":") if d.startswith("/")]
    with contextlib.suppress(OSError):
        with open("/etc/ld.so.cache", "rb") as handle:
            found += [p.decode("utf-8", "replace") for p in re.findall(
                br"\x00(/[^\x00]*/libnvidia-ml\.so\.1)(?=\x00)", handle.read(1 << 24))]
    found += [d + "/" + NVML_NAME for d in NVML_DIRS]
    return [p for i, p in enumerate(found) if p not in found[:i]]


def nvml_snapshot(path, cuda):
    """In the child: NVML's view of every GPU (and CUDA's, when cuda), or
    {"nvml_error"/"untrusted": ...}."""
    import ctypes
    found = nvml_library(ctypes, path)
    if isinstance(found, dict):
        return found
    nvml = Nvml(ctypes, *found)
    code = nvml.call("nvmlInit_v2")
    if code:
        return {"nvml_error": code, "text": nvml.error(code)}
    try:
        count = ctypes.c_uint(0)
        code = nvml.call("nvmlDeviceGetCount_v2", ctypes.byref(count))
        if code:
            return {"nvml_error": code, "text": nvml.error(code)}
        size = NVML_DEVICE_NAME_V2_BUFFER_SIZE
        driver = ctypes.create_string_buffer(size)
        nvml.call("nvmlSystemGetDriverVersion", driver, ctypes.c_uint(size))
        doc = {"driver": driver.value.decode("ascii", "replace") or None,
               "library": nvml.path,
               "gpus": [gpu for index in range(count.value) for gpu in nvml.device(index)]}
    finally:
        nvml.call("nvmlShutdown")
    state = cuda_state(ctypes, os.path.join(os.path.dirname(nvml.path), CUDA_NAME)) \
        if cuda else None
    return state if state and "untrusted" in state else dict(doc, cuda=state)


#: The CUDA driver library, from the driver's package as NVML is.
CUDA_NAME = "libcuda.so.1"


def cuda_state(c, name):
    """In the child: {"code", "text", "count"} from cuInit(0) and
    cuDeviceGetCount (no context, no memory), {"untrusted"}, or None when
    libcuda is not there. CUDA_VISIBLE_DEVICES is dropped first, so CUDA
    counts every GPU as NVML does (this child's environment only)."""
    if not os.path.isfile(name):        # AMD hosts, containers without CUDA
        return None
    distrust = library_distrust("CUDA", name)
    if distrust:
        return distrust
    try:
        lib = c.CDLL(name)
    except OSError:
        return None
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)    # unsetenv before cuInit reads it
    count, text = c.c_int(-1), c.c_char_p()
    code = lib.cuInit(c.c_uint(0)) or lib.cuDeviceGetCount(c.byref(count))
    if code and getattr(lib, "cuGetErrorString", None):
        lib.cuGetErrorString(c.c_int(code), c.byref(text))
    return {"code": code, "count": None if code else count.value,
            "text": (text.value or b"").decode("ascii", "replace")}


#: cuda.h's CUresult the CUDA check names apart.
CUDA_SYSTEM_NOT_READY = 802


def judge_cuda(state, gpus):
    """(exit code, reason) when CUDA cannot start or counts other GPUs than
    NVML's gpus; None when fine, or not checked (state None)."""
    if not state:
        return None
    code = state.get("code")
    if code == CUDA_SYSTEM_NOT_READY:
        return (EX_TEMPFAIL, "CUDA: system not yet initialized (802): the fabric manager "
                "has not finished (systemctl status nvidia-fabricmanager)")
    if code:        # 3, 46, 100, 999: Ollama's docs/troubleshooting.md
        return (EX_UNAVAILABLE, "CUDA cannot start: error %d (%s): reload the driver's "
                "unified memory module (rmmod nvidia_uvm && modprobe nvidia_uvm) or "
                "reboot" % (code, sanitise(state.get("text")) or "unknown"))
    whole = [g for g in gpus if not g.parent]
    if state.get("count") in (None, len(whole)) or any(   # lost or closed: NVML says why
            g.mig or g.error or g.access is False for g in whole):
        return None         # MIG: CUDA enumerates instances, not GPUs
    return (EX_UNAVAILABLE, "CUDA sees %s GPUs, NVML %d: a GPU failed to initialise "
            "for CUDA" % (state["count"], len(whole)))


def library_distrust(what, name):
    """{"untrusted": why} when another user could have written the library
    root is about to load (the directories too, as StrictModes checks), else None."""
    try:
        problem = untrusted(name)
    except OSError as exc:
        problem = exc.strerror
    if problem:
        return {"untrusted": "%s library %s: others could have written it: %s"
                % (what, name, problem)}
    return None


def nvml_library(c, path):
    """(the library, its path), each candidate judged before dlopen; or the failure dict."""
    why = "%s not found" % (path or NVML_NAME)
    for name in nvml_candidates(path):
        if not os.path.isfile(name):        # missing, or a FIFO that would block
            why = "%s is not a regular file" % name if os.path.exists(name) else why
            continue
        if "/stubs/" in os.path.realpath(name):
            why = "only the CUDA toolkit's stub library (%s)" % name
            continue
        distrust = library_distrust("NVML", name)
        if distrust:
            return distrust
        try:
            return c.CDLL(name), name
        except OSError as exc:
            why = str(exc)
    return {"nvml_error": NVML_LIBRARY_NOT_FOUND, "text": why}


class Nvml(object):
    """NVML in the probe's child; every argument a ctypes object (an int cuts a handle)."""

    def __init__(self, c, lib, path):
        self.c, self.lib, self.path = c, lib, path
        self.structs = nvml_structs(c)

    def call(self, function, *args):
        try:
            return getattr(self.lib, function)(*args)
        except AttributeError:
            return NVML_FUNCTION_NOT_FOUND

    def error(self, code):
        self.lib.nvmlErrorString.restype = self.c.c_char_p
        return "%s (NVML error %d)" % ((self.lib.nvmlErrorString(self.c.c_int(code)) or b"")
                                       .decode("ascii", "replace"), code)

    def text(self, function, handle):
        buf = self.c.create_string_buffer(NVML_DEVICE_NAME_V2_BUFFER_SIZE)
        ok = self.call(function, handle, buf,
                       self.c.c_uint(NVML_DEVICE_NAME_V2_BUFFER_SIZE)) == 0
        return buf.value.decode("utf-8", "replace") if ok else None

    def uint(self, function, handle, *args):
        value = self.c.c_uint(0)
        code = self.call(function, handle, *args + (self.c.byref(value),))
        return value.value if code == 0 else None

    def device(self, index):
        """The GPU at index, as records: the GPU, then its MIG devices."""
        c, handle = self.c, self.c.c_void_p()
        code = self.call("nvmlDeviceGetHandleByIndex_v2", c.c_uint(index), c.byref(handle))
        if code:
            gpu = Gpu(index, None, None, error=self.error(code))
            gpu.access = code not in (NVML_NO_PERMISSION, NVML_OPERATING_SYSTEM)
            return [gpu]
        gpu = Gpu(index, self.text("nvmlDeviceGetUUID", handle),
                  self.text("nvmlDeviceGetName", handle), pci=self.pci(handle))
        self.measure(handle, gpu)
        if gpu.error:
            return [gpu]
        util = (c.c_uint * 2)()
        if self.call("nvmlDeviceGetUtilizationRates", handle, c.byref(util)) == 0:
            gpu.util_pct = util[0]
        gpu.temp_c = self.uint("nvmlDeviceGetTemperature", handle,
                               c.c_int(NVML_TEMPERATURE_GPU))
        self.health(handle, gpu)
        return [gpu] + self.mig_devices(handle, gpu)

    def pci(self, handle):
        """The GPU's PCI bus id ("00000000:3B:00.0"), or None (a driver without
        nvmlDeviceGetPciInfo_v3 is not asked its older calls)."""
        info = self.structs.PciInfo()
        code = self.call("nvmlDeviceGetPciInfo_v3", handle, self.c.byref(info))
        return None if code else info.busId.decode("ascii", "replace")

    def mig_devices(self, handle, gpu):
        """The MIG devices of a GPU in MIG mode, each judged by its own figures."""
        c, mode, pending = self.c, self.c.c_uint(0), self.c.c_uint(0)
        if self.call("nvmlDeviceGetMigMode", handle, c.byref(mode), c.byref(pending)) == 0:
            gpu.mig = mode.value == NVML_DEVICE_MIG_ENABLE
        found = []
        for slot in range(self.uint("nvmlDeviceGetMaxMigDeviceCount", handle) or 0
                          if gpu.mig else 0):
            child = c.c_void_p()
            if self.call("nvmlDeviceGetMigDeviceHandleByIndex", handle, c.c_uint(slot),
                         c.byref(child)) == 0:
                mig = Gpu(gpu.index, self.text("nvmlDeviceGetUUID", child),
                          self.text("nvmlDeviceGetName", child))
                mig.parent = gpu.uuid
                self.measure(child, mig)
                found.append(mig)
        return found

    def measure(self, handle, gpu):
        """Memory and compute processes, of a GPU or a MIG device."""
        c, structs = self.c, self.structs
        mem = structs.MemoryV2(version=NVML_MEMORY_V2)  # v1 "used" counts reserved memory
        code = self.call("nvmlDeviceGetMemoryInfo_v2", handle, c.byref(mem))
        if code:
            mem = structs.Memory()
            code = self.call("nvmlDeviceGetMemoryInfo", handle, c.byref(mem))
        if code == NVML_GPU_IS_LOST:
            gpu.error = self.error(code)
        elif code == 0:
            gpu.total_mib, gpu.free_mib = mem.total >> 20, mem.free >> 20
        for function, kind in (("nvmlDeviceGetComputeRunningProcesses_v3", structs.ProcessV2),
                               ("nvmlDeviceGetComputeRunningProcesses_v2", structs.ProcessV2),
                               ("nvmlDeviceGetComputeRunningProcesses", structs.Process)):
            number, rows = c.c_uint(0), ()
            code = self.call(function, handle, c.byref(number), None)
            if code == NVML_INSUFFICIENT_SIZE:   # two calls: size, then data
                number = c.c_uint(number.value * 2 + 5)
                rows = (kind * number.value)()
                code = self.call(function, handle, c.byref(number), rows)
            if code != NVML_FUNCTION_NOT_FOUND:
                used = [rows[i].usedGpuMemory for i in range(number.value)] if code == 0 \
                    else [None]
                gpu.procs = number.value if code == 0 else None
                gpu.proc_mib = None if None in used or NVML_VALUE_NOT_AVAILABLE % 2 ** 64 \
                    in used else sum(used) >> 20
                gpu.runner_mib = None if gpu.proc_mib is None else runner_mib(
                    [rows[i].pid for i in range(number.value)], used)
                return

    def health(self, handle, gpu):
        """nvml_health() of the figures this GPU reports (None: unsupported),
        then the driver's own word: its recovery action and fabric state."""
        c, rows = self.c, [self.c.c_uint(0) for _ in range(4)]
        ecc = c.c_ulonglong(0)
        remapped = self.call("nvmlDeviceGetRemappedRows", handle, *map(c.byref, rows)) == 0
        gpu.health = nvml_health(
            rows[2].value if remapped else None,        # pending
            rows[3].value if remapped else None,        # failed
            self.uint("nvmlDeviceGetRetiredPagesPendingStatus", handle),
            ecc.value if self.call(
                "nvmlDeviceGetTotalEccErrors", handle, c.c_int(NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
                c.c_int(NVML_VOLATILE_ECC), c.byref(ecc)) == 0 else None)
        field = self.structs.FieldValue(fieldId=NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)
        code = self.call("nvmlDeviceGetFieldValues", handle, c.c_int(1), c.byref(field))
        fabric = self.structs.FabricInfo(version=NVML_GPU_FABRIC_INFO_V3)
        status = self.call("nvmlDeviceGetGpuFabricInfoV", handle, c.byref(fabric))
        if status == NVML_ARGUMENT_VERSION_MISMATCH:
            fabric.version = NVML_GPU_FABRIC_INFO_V2
            status = self.call("nvmlDeviceGetGpuFabricInfoV", handle, c.byref(fabric))
        known = code == 0 and field.nvmlReturn == 0 and field.valueType in NVML_VALUE_TYPES
        failed = status == 0 and fabric.status not in (0, NVML_NOT_SUPPORTED)
        asked, gpu.fabric, gpu.pending = driver_health(
            field.value if known else None, fabric.state if status == 0 else None,
            self.error(fabric.status) if failed else None, gpu.index)
        gpu.health = gpu.health or asked


#: /proc/PID/comm of Ollama's model runners: llama-server (GGUF models, 0.30.0
#: on), `ollama runner` (the server's own binary), ollama_llama_server (older
#: releases; comm keeps 15 characters).
RUNNER_COMMS = ("llama-server", "ollama", "ollama_llama_se")


def runner_mib(pids, used):
    """MiB that Ollama's runners among NVML's processes (pids, used bytes)
    hold; None when this process is not in the host's PID namespace (NVML
    gives the host's PIDs, and /proc here would name other processes)."""
    try:            # PROC_PID_INIT_INO (include/linux/proc_ns.h): the host's
        if os.readlink("/proc/self/ns/pid") != "pid:[4026531836]":
            return None
    except OSError:
        return None
    total = 0
    for pid, size in zip(pids, used):
        with contextlib.suppress(OSError):
            with open("/proc/%d/comm" % pid, "rb") as handle:
                if handle.read().rstrip(b"\n").decode("ascii", "replace") in RUNNER_COMMS:
                    total += size
    return total >> 20


def nvml_health(rows_pending, rows_failed, pages_pending, uncorrected):
    """Why a GPU needs a reset or service, or None (each figure None where the
    GPU cannot tell; uncorrected: ECC errors since the driver loaded)."""
    if rows_failed:
        return "row remapping failed: the GPU needs service"
    if rows_pending:
        return "row remapping pending: the GPU needs a reset"
    if pages_pending:
        return "retired pages pending: the GPU needs a reset"
    if uncorrected:
        return ("%d uncorrectable ECC errors since the driver loaded: the GPU needs a "
                "reset" % uncorrected)
    return None


#: nvml.h's field of the action the driver asks for (nvmlDeviceGpuRecoveryAction_t),
#: and the unsigned types its value may come in (read as the zeroed 8 bytes).
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
NVML_VALUE_TYPE_UNSIGNED_INT, NVML_VALUE_TYPE_UNSIGNED_LONG = 1, 2
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_VALUE_TYPES = (NVML_VALUE_TYPE_UNSIGNED_INT, NVML_VALUE_TYPE_UNSIGNED_LONG,
                    NVML_VALUE_TYPE_UNSIGNED_LONG_LONG)
#: What each action (1 to 7) asks of an admin, as nvml.h describes it.
RECOVERY_ACTIONS = (None, "GPU reset required (nvidia-smi -r -i %s)", "node reboot required",
                    "drain peer-to-peer (NVLink) work", "drain the GPU's work and reset it "
                    "(nvidia-smi -r -i %s)", "recover the IMEX domain",
                    "reset the GPU's PCIe bus", "system reboot required")
#: nvml.h's NVML_GPU_FABRIC_STATE_*: the GPU's registration with the fabric manager.
NVML_GPU_FABRIC_STATE_NOT_STARTED, NVML_GPU_FABRIC_STATE_IN_PROGRESS = 1, 2
NVML_GPU_FABRIC_STATE_COMPLETED = 3


def driver_health(action, fabric_state, fabric_error, index):
    """What the driver says of a GPU: (the recovery action it asks for, its
    NVLink fabric registration failed, not finished yet), each a reason or
    None; every argument None where the driver cannot tell (older drivers,
    GPUs without an NVSwitch fabric)."""
    asked = failed = pending = None
    if action:
        asked = "the driver's recovery action: %d (see nvml.h)" % action
        if action < len(RECOVERY_ACTIONS):
            asked = "the driver's recovery action: " + RECOVERY_ACTIONS[action].replace(
                "%s", str(index))
    if fabric_state == NVML_GPU_FABRIC_STATE_IN_PROGRESS:
        pending = "in progress"
    elif fabric_state == NVML_GPU_FABRIC_STATE_NOT_STARTED:
        pending = "not started"
    elif fabric_state == NVML_GPU_FABRIC_STATE_COMPLETED and fabric_error:
        failed = ("NVLink fabric registration failed: %s (journalctl -u "
                  "nvidia-fabricmanager)" % fabric_error)
    if pending:
        pending = ("NVLink fabric registration %s: the fabric manager has not finished "
                   "(systemctl status nvidia-fabricmanager)" % pending)
    return asked, failed, pending


def fabric_doubts(gpus):
    """Problem notes for the fabric failures of gpus where CUDA started on
    every GPU: H100 hosts without multi-node NVLink report a completed
    registration with an error status while every job runs (meta-pytorch/
    torchcomms#936), so only NVLink between GPUs is in doubt, not the GPU."""
    said = []
    for gpu in gpus:
        if gpu.fabric:
            said.append("%s: %s, but CUDA starts on every GPU: only NVLink between GPUs "
                        "may be down" % (gpu_label(gpu), gpu.fabric))
            gpu.fabric = None
    return said


SMI_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/opt/bin", "/usr/lib/wsl/lib")
SMI_FIELDS = ("index", "uuid", "name", "pci.bus_id", "memory.total", "memory.used",
              "memory.free", "utilization.gpu", "temperature.gpu")


def probe_smi(run, ends_at):
    """nvidia-smi's CSV: a snapshot dict, or a string when it is absent."""
    path = next((os.path.join(d, "nvidia-smi") for d in
                 os.environ.get("PATH", "").split(os.pathsep) + list(SMI_DIRS)
                 if d and os.access(os.path.join(d, "nvidia-smi"), os.X_OK)), None)
    if path is None:
        return "nvidia-smi not found in PATH or %s" % ", ".join(SMI_DIRS)
    try:
        problem = untrusted(path)
    except OSError as exc:
        problem = exc.strerror
    if problem:                 # it would run as root
        raise Fail(EX_CONFIG, "%s: others could have written it: %s" % (path, problem))

    def smi(query):
        pid, rfd = spawn(run, argv=[path, query, "--format=csv,noheader,nounits"],
                         env=dict(os.environ, LC_ALL="C"))
        out, status = collect(run, pid, rfd, ends_at, "nvidia-smi", ends_at)
        if status is None:      # its exit status says which GPUs failed
            kill_probes(run)
            raise Fail(EX_TEMPFAIL, "GPU probe hung: nvidia-smi did not exit within "
                       "%.3gs of its output ending" % (ends_at - run.current.started))
        return out.decode("utf-8", "replace"), status

    text, status = smi("--query-gpu=" + ",".join(SMI_FIELDS))
    said = sanitise(text.strip().splitlines()[0] if text.strip() else "no output")
    if status == NVML_DRIVER_NOT_LOADED or "couldn't communicate with the NVIDIA driver" in text:
        raise Fail(EX_UNAVAILABLE, "NVIDIA driver not loaded (nvidia-smi: %s)" % said)
    if status == NVML_LIB_RM_VERSION_MISMATCH or "version mismatch" in text:
        raise Fail(EX_UNAVAILABLE, VERSION_MISMATCH % ("nvidia-smi: " + said))
    if status in (NVML_LIBRARY_NOT_FOUND, 127):
        return "nvidia-smi: %s (exit %d)" % (said, status)
    gpus, lost = parse_smi_csv(text)
    gpus += [Gpu(index, None, "PCI " + bus, error=sanitise(why), pci=bus)
             for index, bus, why in lost]
    if status not in (0, None) and not lost:    # a GPU failed, and which is unknown
        raise Fail(EX_UNAVAILABLE, "nvidia-smi failed (exit %d): %s" % (status, sanitise(
            next((l for l in text.splitlines() if l.count(", ") != len(SMI_FIELDS) - 1
                  and l.strip()), "no message"))))
    apps, status = smi("--query-compute-apps=gpu_uuid,pid")
    if status in (0, NVML_GPU_IS_LOST):    # 15: one GPU lost, the others listed
        counts = parse_smi_apps(apps)
        for gpu in gpus:
            if gpu.uuid:
                gpu.procs = counts.get(gpu.uuid, 0)
    return {"driver": None, "library": path, "gpus": gpus}


def parse_smi_csv(text):
    """nvidia-smi --query-gpu=SMI_FIELDS CSV -> (Gpu records, lost GPUs as (index
    or None, bus id, why)). [N/A], [Not Supported] are None, never 0; lines of
    another field count are the tool's messages, skipped, except "Unable to
    determine the device handle for GPU <bus>: ..."."""
    gpus, lost = [], []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(", ")]
        if len(fields) != len(SMI_FIELDS):     # "...for GPU1: 0000:62:00.0: why"
            found = re.search(r"device handle for GPU(?:(\d+):)? ?([0-9A-Fa-f]+:"
                              r"[0-9A-Fa-f]+:[0-9A-Fa-f]+\.[0-9A-Fa-f]): (.*)", line)
            if found:           # or, from older drivers, "for GPU 00000000:62:00.0"
                lost.append((int(found.group(1)) if found.group(1) else None,
                             found.group(2), found.group(3).strip()))
            continue
        value = dict(zip(SMI_FIELDS, fields))
        number = lambda key: figure(value[key])
        gpus.append(Gpu(
            number("index"), value["uuid"], value["name"], pci=value["pci.bus_id"],
            total=number("memory.total"), free=number("memory.free"),
            util=number("utilization.gpu"), temp=number("temperature.gpu")))
    return gpus, lost


def figure(text):
    """A whole number nvidia-smi printed, or None ("[N/A]", or absurd)."""
    value = float(text) if re.match(_NUMBER, text) else None    # 400 digits: inf
    return int(value) if value is not None and -float("inf") < value < 2 ** 53 else None


def parse_smi_apps(text):
    """nvidia-smi --query-compute-apps=gpu_uuid,pid -> {uuid: processes}."""
    counts = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and is_digits(fields[1]):
            counts[fields[0]] = counts.get(fields[0], 0) + 1
    return counts


def probe_amd(run, ends_at):
    """AMD's sysfs files in a forked child: a snapshot, or a string if none."""
    root = os.environ.get(ENV_PREFIX + "ROOT", "/") or "/"
    doc = forked(run, lambda: amd_snapshot(root), ends_at, "AMD sysfs")
    return doc if doc.get("gpus") else "no AMD GPU under %s" % os.path.join(
        root, "sys/class/drm")


def amd_snapshot(root):
    """In the child: amdgpu's sysfs figures of every card[0-9]+ device."""
    base = os.path.join(root, "sys/class/drm")

    def read(*parts):       # never blocks: sysfs files are regular
        try:
            return read_small_file(os.path.join(*parts), 4096).decode("utf-8").strip()
        except (OSError, ValueError):
            return ""

    def number(text, shift=0):
        return int(text) >> shift if is_digits(text) else None

    gpus = []
    names = os.listdir(base) if os.path.isdir(base) else []
    for card in sorted((n for n in names if re.match(r"^card\d+$", n)),
                       key=lambda n: int(n[4:])):
        dev = os.path.join(base, card, "device")
        if read(dev, "vendor").lower() != "0x1002":
            continue
        total = number(read(dev, "mem_info_vram_total"), 20)
        used = number(read(dev, "mem_info_vram_used"), 20)
        hwmon = os.path.join(dev, "hwmon")
        temps = [number(read(hwmon, h, "temp1_input")) for h in
                 (sorted(os.listdir(hwmon)) if os.path.isdir(hwmon) else ())]
        temps = [t // 1000 for t in temps if t is not None]
        gpus.append(Gpu(
            int(card[4:]), read(dev, "unique_id") or None,
            read(dev, "product_name") or "AMD GPU %s" % card, total=total,
            free=max(total - used, 0) if total is not None and used is not None else None,
            util=number(read(dev, "gpu_busy_percent")),
            temp=temps[0] if temps else None))
    return {"driver": read(root, "sys/module/amdgpu/version") or None,
            "library": base, "gpus": gpus}


#: The GPU backends, in the order --gpu-backend auto tries them.
GPU_PROBES = (("nvml", probe_nvml), ("nvidia-smi", probe_smi), ("amd-sysfs", probe_amd))


# ---- Living under cron: the job, the lock, the shared verdict, metrics ------

def find_command(name, environ):
    """COMMAND's executable path, before any check; Fail 127 or 126 as a shell says."""
    dirs = environ.get("PATH", os.defpath).split(os.pathsep)
    paths = [name] if "/" in name else [os.path.join(d or ".", name) for d in dirs]
    found = [p for p in paths if os.path.exists(p)]
    for path in found:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    if found:
        raise Fail(EX_NOEXEC, "%s: permission denied (not an executable file)"
                   % sanitise(found[0]), "command")
    raise Fail(EX_NOTFOUND, "%s: command not found" % sanitise(name), "command")


def exec_job(job, inherited):
    """Become the job (lock inherited, signals as found, SIGPIPE, SIGXFSZ at
    default; no #!: /bin/sh, as execvp does); (status, why) when it fails."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGXFSZ,
                   signal.SIGCHLD):
        signal.signal(signum, signal.SIG_IGN if inherited.get(signum) is signal.SIG_IGN
                      else signal.SIG_DFL)
    if job.lock_fd is not None:
        os.set_inheritable(job.lock_fd, True)
    with contextlib.suppress(OSError, ValueError):
        if sys.stdout is not None:
            sys.stdout.flush()
    try:
        env = job_environment()
        try:
            os.execve(job.path, job.command, env)
        except OSError as exc:
            if exc.errno != errno.ENOEXEC:
                raise
            os.execve("/bin/sh", ["/bin/sh", job.path] + job.command[1:], env)
    except OSError as exc:
        return (EX_NOTFOUND if exc.errno == errno.ENOENT else EX_NOEXEC,
                "cannot run %s: %s" % (sanitise(job.path), exc.strerror))


def job_environment():
    """The environment this process was given (Python 3.7+ adds LC_CTYPE to
    its own), less the token: a secret goes no further than it must."""
    try:
        with open("/proc/self/environ", "rb") as handle:
            env = dict(item.split(b"=", 1) for item in handle.read().split(b"\0")
                       if b"=" in item)
    except OSError:
        env = dict(os.environb)
    env.pop((ENV_PREFIX + "TOKEN").encode("ascii"), None)
    return env


def take_lock(path):
    """An exclusive flock on path (never deleted: that races with its takers);
    Fail 75 when another holds it, 78 when path cannot be a lock."""
    try:
        fd = open_no_follow(path, 0o600)    # flock needs only a read: others
    except OSError as exc:                  # must not open it at all
        why = "a symlink, not followed" if exc.errno == errno.ELOOP else exc.strerror
        if exc.errno in (errno.EACCES, errno.EPERM) and os.geteuid() != 0:
            why += (": as a non-root user put the lock in $XDG_RUNTIME_DIR or a "
                    "directory of your own")
        raise Fail(EX_CONFIG, "lock file %s: %s" % (sanitise(path), why), "lock")
    info = os.fstat(fd)
    if info.st_uid not in (0, os.geteuid()):    # its owner could hold it forever
        os.close(fd)
        raise Fail(EX_CONFIG, "lock file %s is owned by %s, who could hold it and "
                   "skip every run: put the lock in a directory only root can write, "
                   "such as /run" % (sanitise(path), user_name(info.st_uid)), "lock")
    if info.st_uid == os.geteuid() and info.st_mode & 0o077:
        os.fchmod(fd, 0o600)                # an older version's 0644 lock, one name
    if not try_flock(fd):
        os.close(fd)
        raise Fail(EX_TEMPFAIL, "locked by another job (%s)" % sanitise(path), "lock")
    return fd


def try_flock(fd):
    """Take an exclusive flock on fd without waiting; whether it was free."""
    import fcntl
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # novermin
    except OSError:
        return False
    return True


def keep_state(run, shared):
    """After the verdict: --log-changes-only's judgement, the state, the metrics file."""
    opts, skips = run.opts, None
    if shared is not None:
        before = shared.previous
        if run.code == EX_OK and before.get("skips") and not run.reused:
            run.ready_notes.append("recovered after %d skips" % before["skips"])
        shared.escalate(run)
        run.unchanged = bool(opts.log_changes_only) and shared.unchanged(run)
        try:
            skips = shared.save(run)
        except OSError as exc:
            run.problems.append("state not saved: %s" % (exc.strerror or exc))
    if opts.metrics_file and run.stage != "lock":   # a lock held: the job runs
        text = metrics_text(run, skips if skips is not None else int(run.code != EX_OK),
                            time.time())
        try:
            write_atomic(opts.metrics_file, text.encode("utf-8"), 0o644)
        except OSError as exc:
            run.problems.append("metrics file %s: %s" % (opts.metrics_file,
                                                         exc.strerror or exc))


#: Verdicts that say nothing about the service: never shared, never skips.
NOT_A_CHECK = ("config", "command", "lock", "shared")

#: How often a caller waiting for another's check (--share-result) looks.
FLIGHT_POLL = 0.02


class Shared(object):
    """--share-result, --log-changes-only and the skip count: one state file
    per check, and a flight lock beside it. The state holds the last check's
    verdict (time, code, stage, reason, model, pid), the checks in a row that
    were not ready (skips), and the code last written to syslog (logged)."""

    def __init__(self, opts, environ):
        self.opts = opts
        directory = state_dir(opts, environ)
        self.base = os.path.join(directory, state_key(opts, environ))
        self.errors = os.path.join(directory, "errors.json")    # of any check
        self.previous = read_state(self.base + ".json")
        self.flight = None          # descriptor holding the flight lock
        self.streak = self.previous.get("streak")

    @classmethod
    def open(cls, run):
        """The state of run's check when an option needs it, else None (a problem noted)."""
        opts = run.opts
        if not (opts.share_result or opts.metrics_file or opts.log_changes_only
                or opts.escalate_after):
            return None
        try:
            return cls(opts, os.environ)
        except OSError as exc:
            run.problems.append("state not kept: %s" % (exc.strerror or exc))
            return None

    def reusable(self, since):
        """A verdict to reuse: ready and young enough, or (since) any written after since."""
        state = self.previous
        if "code" not in state or "time" not in state:     # types: read_state
            return None
        age = time.time() - state["time"]
        if state["code"] == EX_OK and 0 <= age < self.opts.share_result:
            return state
        if since is not None and state["time"] >= since and not state.get("cut"):
            return state            # (a check its own --deadline cut proves nothing)
        return None

    def wait_for_other_check(self, run):
        """Take the flight lock, waiting (to the deadline) while another caller
        checks; then a verdict to reuse, or None when this caller is to check.
        A default deadline waits as long as that check may load every model."""
        try:
            fd = open_no_follow(self.base + ".lock", 0o600)
        except OSError as exc:      # checked alone, as without --share-result
            run.problems.append("verdict not shared: %s.lock: %s" % (
                self.base, exc.strerror or exc))
            return None
        since, waited = time.time(), False
        while not try_flock(fd):
            if not waited:          # (the same key: the same models)
                run.make_room_for_loads(len(self.opts.model or [None]))
            if time.monotonic() + FLIGHT_POLL >= run.deadline_at:
                os.close(fd)
                raise Fail(EX_TEMPFAIL, run.cut_by_deadline("waiting for another caller's "
                                                          "check"), "shared")
            waited = True
            time.sleep(FLIGHT_POLL)
        self.flight = fd
        self.previous = read_state(self.base + ".json")
        return self.reusable(since if waited else None)

    def unchanged(self, run):
        """Whether this verdict repeats the last one logged. Verdicts that say
        nothing of the service (a lock held, a bad configuration) are compared
        only with each other; the first one after a configuration error is news."""
        before = self.previous
        if run.stage in NOT_A_CHECK:
            return before.get("aside") == [run.code, run.stage]
        error = read_state(self.errors)     # kept apart: a bad file changes the key
        return (before.get("logged") == run.code
                and error.get("time", 0) <= before.get("logged_at", 0))

    def escalate(self, run):
        """Count this run's 75 into the streak; --escalate-after N: 69 at N."""
        if not checked(run):
            return                  # a lock held, a verdict reused: no news
        self.streak = next_streak(self.streak, run.code, run.stage, time.time(), run.busy)
        if self.streak and self.streak[2] >= (self.opts.escalate_after or 1e9):
            run.escalate(escalated_reason(self.streak, run.reason))

    def save(self, run):
        """Record this run, release the flight lock; returns the skip count."""
        state = dict(self.previous)
        if checked(run):
            state.update(streak=self.streak, time=time.time(), code=run.code,
                         stage=run.stage, cut=run.cut, reason=redact(run.reason),
                         model=redact(run.model or ""), pid=os.getpid(),
                         skips=0 if run.code == EX_OK else state.get("skips", 0) + 1)
        aside = run.stage in NOT_A_CHECK
        if aside and not run.unchanged:
            state["aside"] = [run.code, run.stage]
            if run.stage in ("config", "command"):
                write_atomic(self.errors, json.dumps({"time": time.time()}).encode(), 0o600)
        elif not aside:
            state.pop("aside", None)
            if not run.unchanged:
                state.update(logged=run.code, logged_at=time.time())
        try:
            if state != self.previous:
                write_atomic(self.base + ".json", json.dumps(state).encode("utf-8"), 0o600)
        finally:
            if self.flight is not None:
                os.close(self.flight)
                self.flight = None
        return state.get("skips", 0)


def checked(run):
    """Whether run's verdict is its own check's: recorded, and counted as a skip."""
    return run.reused is None and run.stage not in NOT_A_CHECK \
        and run.code in (EX_OK, EX_UNAVAILABLE, EX_TEMPFAIL, EX_CONFIG)


def next_streak(streak, code, stage, now, busy=False):
    """The 75s in a row from one stage after a verdict: [stage, since, runs], or
    None. Any other verdict of a check (0, 69, 78) ends it, and so does a 75
    that says the GPU is in use by others (a threshold, VRAM held): the GPU
    answered, so it is busy, not broken. A 75 from another stage starts anew."""
    if code != EX_TEMPFAIL or busy:
        return None
    if streak and streak[0] == stage:
        return [stage, streak[1], streak[2] + 1]
    return [stage, now, 1]


def escalated_reason(streak, reason):
    """The cause first: a drain reason cut to its first characters keeps it."""
    return "%s (75 for %d runs in a row since %s: treated as unavailable)" % (
        reason, streak[2], time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(streak[1])))


def state_dir(opts, environ):
    """The state directory, made if missing and only this user's to write (else OSError)."""
    if opts.state_dir:
        path = opts.state_dir
    elif environ.get("XDG_RUNTIME_DIR", "").startswith("/") and os.path.isdir(
            environ["XDG_RUNTIME_DIR"]) and os.lstat(  # not su's leftover
            environ["XDG_RUNTIME_DIR"]).st_uid == os.geteuid():
        path = os.path.join(environ["XDG_RUNTIME_DIR"], STATE_SUBDIR)
    elif os.geteuid() == 0:
        path = ROOT_STATE_DIR
    else:
        path = "/tmp/%s-%d" % (STATE_SUBDIR, os.geteuid())
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() \
            or info.st_mode & 0o022:
        raise OSError(0, "%s is not a directory of this user's that only it can "
                      "write" % path)
    problem = untrusted(path)       # nor may anyone swap a directory above it
    if problem:
        raise OSError(0, problem)
    return path


#: The environment that changes what a check proves, besides urllib's proxies
#: (any *_proxy): the GPUs selected, the sysfs root, the CA store when there
#: is no --cafile, and where nvidia-smi and NVML are found.
KEY_ENVIRON = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", ENV_PREFIX + "ROOT",
               "SSL_CERT_FILE", "SSL_CERT_DIR", "PATH", "LD_LIBRARY_PATH")


def state_key(opts, environ):
    """A check's state file name: readable, plus a checksum of all that defines
    the check (CHECK options, the environment that changes it, the token)."""
    import zlib
    token = None
    if opts.token:              # hashlib only then: importing it costs 2 ms
        import hashlib
        token = hashlib.sha256(opts.token.encode("ascii")).hexdigest()
    check = json.dumps([[o.name, getattr(opts, o.name.replace("-", "_"))]
                        for o in each_option() if o.role == CHECK] + sorted(
        [k, v] for k, v in environ.items()
        if k in KEY_ENVIRON or k.lower().endswith("_proxy")) + [token], sort_keys=True)
    name = re.sub(r"[^A-Za-z0-9.-]+", "_", "%s_%s" % (opts.host, ",".join(opts.model)))
    return "%s-%08x" % (name.strip("_")[:80], zlib.crc32(check.encode("utf-8")))


def read_state(path):
    """The state saved at path, or {} when there is none or it is not what this writes."""
    try:
        doc = parse_json(read_small_file(path, MAX_CONFIG).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    streak = doc.get("streak")
    if streak is not None and not (
            isinstance(streak, list) and len(streak) == 3 and isinstance(streak[0], str)
            and all(isinstance(n, (int, float)) and not isinstance(n, bool)
                    and 0 <= n < 1e12 for n in streak[1:])):
        return {}
    for key, kinds in (("time", (int, float)), ("code", int), ("skips", int),
                       ("logged", int), ("logged_at", (int, float))):
        value = doc.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)
                                  or not -1e12 < value < 1e12):
            return {}
    return doc


def metrics_text(run, skips, now):
    """Prometheus text: each family once, HELP and TYPE, no timestamps (node_exporter)."""
    def label(value):       # the token hidden first (a server names models), then
        # control characters (C0, C1: a cat of the file runs no escape sequence);
        # UTF-8 only: a name from a non-UTF-8 argv shows escaped
        text = re.sub("[\x00-\x1f\x7f-\x9f]+", " ", redact(str(value or "")))
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
        return text.replace("\\", "\\\\").replace('"', '\\"')

    host = 'host="%s"' % label(run.opts.host)
    labels = '%s,model="%s"' % (host, label(",".join(run.opts.model)))
    families = [
        ("ready", "1 when the last check found the service ready, else 0",
         [(labels, int(run.code == EX_OK))]),
        ("last_run_timestamp_seconds", "Unix time of the last check", [(labels, now)]),
        ("exit_code", "exit status of the last check", [(labels, run.code)]),
        ("stage_duration_seconds", "time each stage of the last check took",
         [('%s,stage="%s"' % (labels, name), ms / 1000.0) for name, ms in stage_totals(run)]),
        ("consecutive_skips", "checks in a row that did not find the service ready",
         [(labels, skips)]),
        ("model_warmup_seconds", "time each model's warm-up took in the last check",
         [('%s,model="%s",kind="%s"' % (host, label(m.name), m.kind or ""),
           m.warmup_ms / 1000.0) for m in run.models if m.warmup_ms is not None]),
    ]
    lines = []
    for name, text, samples in (family for family in families if family[2]):
        lines += ["# HELP %s_%s %s" % (PROG, name, text), "# TYPE %s_%s gauge" % (PROG, name)]
        lines += ["%s_%s{%s} %s" % (PROG, name, names, repr(float(value))
                                    if isinstance(value, float) else value)
                  for names, value in samples]
    return "\n".join(lines) + "\n"


# ---- The report: syslog line, --json, terminal, from one set of facts -------

#: What -v says when the syslog line could not be sent.
NO_SYSLOG = ("syslog did not take the line (no daemon, or its queue stayed full): "
             "run one (rsyslog, syslog-ng, systemd-journald) or name a listening "
             "socket or UDP collector with --syslog-address; until then skips are "
             "printed on stderr")


def report(run):
    """Write the verdict: syslog always, stdout for --json, stderr as asked."""
    opts = run.opts
    facts = verdict_facts(run, (time.monotonic() - run.started) * 1000.0)

    hide = lambda text: redact(text, server_text=False)  # the whole output, once more
    line = hide(" ".join("%s=%s" % (f.log_key, quote(f.shown) if f.log_key == "reason"
                                    else log_value(f.shown)) for f in facts if f.log_key))
    problem = None
    if not opts.no_syslog and not run.unchanged:
        start_lookup(run)
        wait = lambda: min(SYSLOG_WAIT, run.deadline_at - time.monotonic())
        problem = send_syslog(line, severity_of(run.code), opts.syslog_facility,
                              opts.syslog_address, run.lookup and run.lookup.result(wait()),
                              wait())
    if opts.json:
        doc = dict((f.json_key, f.value) for f in facts if f.json_key)
        emit("stdout", hide(json.dumps(doc, sort_keys=True, default=Gpu.as_dict)) + "\n")
    if opts.quiet:
        return
    if opts.verbose:
        emit("stderr", "".join("%s: %s\n" % (PROG, text) for text in [line] + opts.said))
        if problem:
            emit("stderr", "%s: warning: %s; %s\n" % (PROG, sanitise(problem), NO_SYSLOG))
    elif problem and run.code != EX_OK:     # no syslog: cron mails it, systemd keeps it
        emit("stderr", "%s: %s\n" % (PROG, line))
    else:
        tty = getattr(sys.stderr, "isatty", bool)()
        if run.code != EX_OK and (run.code in (EX_SOFTWARE, EX_NOEXEC, EX_NOTFOUND) or tty):
            emit("stderr", hide("%s: skip (%d%s): %s\n" % (
                PROG, run.code, ", " + run.stage if run.stage else "",
                sanitise(verdict_reason(run), REASON_MAX))))
        if run.problems and tty:    # a person reads it: what was not done
            emit("stderr", hide("%s: warning: %s\n" % (
                PROG, sanitise("; ".join(run.problems), REASON_MAX))))
    if run.trace and opts.debug:
        emit("stderr", hide(run.trace))


def emit(name, text):
    """Write text to sys.stdout or sys.stderr (name) now; a closed or full one
    loses it, never the exit status (dropped: no failed flush at exit)."""
    stream = getattr(sys, name)
    try:
        stream.write(text)
        stream.flush()
    except (AttributeError, OSError, ValueError):
        setattr(sys, name, None)


def verdict_reason(run):
    return "; ".join([run.reason] + (run.ready_notes if run.code == EX_OK else []))


#: One fact of the verdict: its key in the log line and in --json (None: not
#: in that output), its value, and its form in the log line.
Fact = collections.namedtuple("Fact", "log_key json_key value shown")


def fact(log_key, json_key, value, *shown):
    """A Fact, shown in the log line as its value unless a form is given."""
    return Fact(log_key, json_key, value, shown[0] if shown else value)


def verdict_facts(run, elapsed_ms):
    """Every fact of the verdict once, as Facts in the log line's order."""
    ready, models, opts = run.code == EX_OK, run.models, run.opts
    loaded = models[0].was_loaded if models else None
    first_load = models[0].load_ms if models else None
    cloud = any(m.cloud for m in models)
    ctx = models[0].context_length if models else None
    return [
        fact("result", "result", "ready" if ready else "skip"), fact(None, "ready", ready),
        fact("code", "exit_code", run.code), fact("stage", "stage", run.stage),
        fact("reason", "reason", verdict_reason(run)), fact("host", "host", opts.host),
        fact("model", "model", run.model),
        fact("elapsed_ms", "elapsed_ms", round(elapsed_ms, 1), int(round(elapsed_ms))),
        fact("models" if len(models) > 1 else None, "models",
             [m.as_dict() for m in models],
             ", ".join("%s %s %s" % (m.name, m.kind or "-", "-" if m.warmup_ms is None
                                     else "%dms" % m.warmup_ms) for m in models)),
    ] + [fact("%s_ms" % name, None, int(round(ms))) for name, ms in stage_totals(run)] + [
        fact("was_loaded" if loaded is not None else None, "model_was_loaded", loaded,
             "yes" if loaded else "no"),
        fact("load_ms" if loaded is False and first_load is not None else None,
             "model_load_ms", first_load, first_load is not None and int(round(first_load))),
        fact("vram_pct" if run.vram_pct is not None else None, "vram_pct", run.vram_pct),
        fact("cloud" if cloud else None, "cloud", cloud, "yes"),
        fact("ctx" if ctx is not None else None, "context_length", ctx),
        fact("api" if run.api != "ollama" else None, "api", run.api),
        fact("attempts" if run.attempt > 1 else None, "attempts", run.attempt),
        fact("shared" if run.reused else None, "reused", run.reused is not None, "reused"),
        fact("problem" if run.problems else None, "problems", run.problems,
             "; ".join(run.problems)),
        fact("gpu_backend" if run.gpu else None, "gpu", run.gpu,
             run.gpu and run.gpu["backend"]),
    ] + [fact("gpu%d" % n, None, gpu_summary(gpu))
         for n, gpu in enumerate(run.gpu["gpus"] if run.gpu else ())] + [
        fact(None, "version", __version__), fact(None, "timeout_s", opts.timeout),
        fact(None, "deadline_s", run.deadline_s()), fact(None, "warmup", opts.warmup),
        fact(None, "stages", run.stages)]


def gpu_summary(gpu):
    """One GPU's figures for the log line; '-' where it cannot say."""
    keys = ("index", "uuid", "free_mib", "total_mib", "util_pct", "procs", "temp_c")
    figures = ((k, getattr(gpu, k)) for k in keys)
    text = " ".join("%s=%s" % (k, "-" if v is None else v) for k, v in figures)
    problem = gpu.error or gpu.health or gpu.fabric or gpu.pending
    if problem:
        text += " problem=" + problem
    return "%s name=%s" % (text, gpu.name or "-")


def stage_totals(run):
    """(stage, ms) in the order run; a stage run once per model is one sum."""
    totals = {}                 # in insertion order (CPython 3.6, and the language since)
    for stage in run.stages:
        totals[stage["name"]] = totals.get(stage["name"], 0) + stage["duration_ms"]
    return list(totals.items())


_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]+")
_BARE_VALUE_RE = re.compile(r"^[A-Za-z0-9._:/@+%,\[\]-]+$")


def quote(text):
    """A sanitised value in double quotes that it cannot close early."""
    text = sanitise(text, REASON_MAX)
    return '"%s"' % text.replace("\\", "\\\\").replace('"', '\\"')


def log_value(value):
    text = sanitise("-" if value is None or value == "" else value, REASON_MAX)
    return text if _BARE_VALUE_RE.match(text) else quote(text)


def sanitise(text, limit=SERVER_TEXT_MAX):
    """Text safe for one log line: no secret, no control characters, ASCII,
    capped (in that order: a cut or an escape must not hide a secret)."""
    text = redact(str(text)[:limit * 16])
    text = _CONTROL_RE.sub(" ", text).strip()
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    return text


#: Every SECRET_PIECE characters of the secrets in use (as sent and escaped),
#: and shorter secrets, which no output shows (redact()).
SECRET_PIECE = 8
_SECRETS = {"pieces": set(), "short": set()}


def forget_secrets():
    for secrets in _SECRETS.values():
        secrets.clear()


def add_secret(secret):
    """Hide secret and its pieces from every output, as sent and as a server echoes it."""
    html = secret.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    raw = secret.encode("utf-8", "surrogateescape")

    def url_quote(safe):        # as urllib.parse.quote does, without importing it
        return "".join(chr(b) if chr(b).isalnum() and b < 128 or chr(b) in "_.-~" + safe
                       else "%%%02X" % b for b in raw)
    for form in (secret, json.dumps(secret)[1:-1], url_quote(""), url_quote("/"),
                 html.replace('"', "&quot;").replace("'", "&#x27;"),
                 html.replace('"', "&#34;").replace("'", "&#39;")):
        if len(form) < SECRET_PIECE:
            _SECRETS["short"].add(form)
        _SECRETS["pieces"].update(form[i:i + SECRET_PIECE]
                                  for i in range(len(form) - SECRET_PIECE + 1))


def redact(text, server_text=True):
    """text with every run of characters holding a piece of a secret replaced
    by [token], with a backslash escaping its first or following its last (a
    JSON string or quoted log value stays whole). A secret shorter than a
    piece is hidden only in server_text: in a whole line it could be a letter."""
    pieces, n = _SECRETS["pieces"], SECRET_PIECE
    for short in _SECRETS["short"] if server_text else ():
        text = text.replace(short, "[token]")
    hits = [i for i in range(len(text) - n + 1) if text[i:i + n] in pieces] \
        if pieces else ()
    if not hits:
        return text

    def escapes(pos):           # text[pos] is a backslash escaping text[pos + 1]
        start = pos
        while start >= 0 and text[start] == "\\":
            start -= 1
        return (pos - start) % 2 == 1

    out, done = [], 0
    for i in hits:
        if i < done:            # inside the run already replaced
            continue
        end = i + n
        while end < len(text) and text[end - n + 1:end + 1] in pieces:
            end += 1
        start = i - 1 if i > 0 and escapes(i - 1) and i - 1 >= done else i
        if end < len(text) and escapes(end - 1):
            end += 1
        out += [text[done:start], "[token]"]
        done = end
    out.append(text[done:])
    return "".join(out)


#: syslog severities used: ready, skipped, configuration or internal error.
SEV_INFO, SEV_WARNING, SEV_ERR = 6, 4, 3

#: The most a UDP collector's name lookup, or a local log socket (a stream,
#: or a full queue), may hold the exit after the verdict (never past the deadline).
SYSLOG_WAIT = 0.2


def severity_of(code):
    return {EX_OK: SEV_INFO, EX_CONFIG: SEV_ERR, EX_SOFTWARE: SEV_ERR}.get(code, SEV_WARNING)


def syslog_message(line, severity, facility, udp, now=None):
    """An RFC 3164 datagram; the hostname only for UDP (local sockets add it)."""
    stamp = time.localtime(now)
    month = "Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split()[stamp.tm_mon - 1]
    head = "<%d>%s %2d %02d:%02d:%02d " % (facility * 8 + severity, month, stamp.tm_mday,
                                            stamp.tm_hour, stamp.tm_min, stamp.tm_sec)
    if udp:
        head += (socket.gethostname().split(".")[0] or "localhost") + " "
    return ("%s%s[%d]: %s" % (head, PROG, os.getpid(), line)).encode("ascii", "replace")


def send_syslog(line, severity, facility, address, udp_target=None, wait=SYSLOG_WAIT):
    """Send one line (UDP: to udp_target, resolved); an error or None, within
    wait. A local datagram socket is connected first, as glibc's syslog(3)
    does: only then does poll() wait for a full queue (a busy daemon, or one
    flooded) to take the line, where an unconnected send fails at once. A
    stream socket (syslog-ng's unix-stream, some containers) gets what
    syslog(3) sends it: the message and a NUL byte."""
    udp, sock = isinstance(address, tuple), None
    if udp and udp_target is None:
        return "cannot resolve syslog host %s in time" % address[0]
    message = syslog_message(line, severity, facility, udp)
    try:
        sock = socket.socket(udp_target[0] if udp else socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.settimeout(max(wait, 0.001))   # Python polls and resends until then
        try:
            if udp:
                sock.sendto(message, udp_target[1])
            else:
                sock.connect(address)
                sock.send(message)
            return None
        except OSError as exc:
            if udp or exc.errno != errno.EPROTOTYPE:
                raise
        sock.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(wait, 0.001))
        sock.connect(address)
        sock.sendall(message + b"\0")
    except (OSError, ValueError) as exc:    # ValueError: a path with a NUL byte
        return "syslog %s: %s" % (address, getattr(exc, "strerror", None) or exc)
    finally:
        if sock is not None:
            sock.close()
    return None


class Lookup(threading.Thread):
    """getaddrinfo of a UDP syslog host in the background: DNS can stall, the run cannot."""

    def __init__(self, host, port):
        threading.Thread.__init__(self, daemon=True)
        self.host, self.port, self.target = host, port, None
        self.start()

    def run(self):
        with contextlib.suppress(OSError, UnicodeError, ValueError, IndexError):
            info = socket.getaddrinfo(self.host, self.port, 0, socket.SOCK_DGRAM)[0]
            self.target = (info[0], info[4])

    def result(self, wait):
        self.join(max(0.0, wait))
        return self.target


def start_lookup(run):
    if (run.lookup is None and isinstance(run.opts.syslog_address, tuple)
            and not run.opts.no_syslog):
        run.lookup = Lookup(*run.opts.syslog_address)


# ---- Configuration: flags > GPU_PREFLIGHT_* > config file > defaults --------

def parse_seconds(text):
    try:
        value = float(text)
    except ValueError:
        raise ValueError("%r is not a number of seconds" % text)
    if not 0 < value < 1e6:
        raise ValueError("%r: must be more than 0 seconds" % text)
    return value


def parse_count(text, most=10 ** 9, least=0):
    if not is_digits(text.strip()) or not least <= int(text) <= most:
        raise ValueError("%r: expected a whole number from %d to %d" % (text, least, most))
    return int(text)


def parse_choice(*choices):
    def parse(text):
        if text not in choices:
            raise ValueError("%r: choose %s or %s" % (text, ", ".join(choices[:-1]),
                                                       choices[-1]))
        return text
    return parse


def parse_bool(text):
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("%r is not a boolean (1/0, true/false, yes/no)" % text)


def parse_health_path(text):
    """--health-path: none, or a URL path: a "/" first, printable ASCII, no space."""
    if text == "none" or re.match(r"/[!-~]{0,199}\Z", text):
        return text
    raise ValueError("%r: give a path starting with / (no spaces, at most 200 "
                     "characters) or none" % text)


def parse_path(text):
    """A path: not empty, no NUL; in the file system's encoding (3.6, C locale: escaped)."""
    if not text.strip() or "\0" in text:
        raise ValueError("%r is not a path" % text)
    return os.fsdecode(text.encode("utf-8", "surrogateescape"))


#: A Go duration as Ollama's keep_alive accepts it ("10m", "-1h30m", "0s").
_DURATION = r"^[-+]?(([0-9]+(\.[0-9]*)?|\.[0-9]+)(ns|us|\u00b5s|ms|s|m|h))+$"


def parse_keep_alive(text):
    """A keep_alive in a form Ollama accepts: number of seconds or duration."""
    text = text.strip()
    if re.match(_NUMBER, text):
        number = float(text)
        if abs(number) > 1e9:       # Go's time.Duration ends at 292 years
            raise ValueError("%r: more seconds than Ollama accepts" % text)
        return int(number) if number == int(number) else number
    if re.match(_DURATION, text):
        return text
    raise ValueError("%r is neither seconds (600, -1) nor a duration "
                     "with a unit (10m, 1h, 30s)" % text)


def parse_ollama_option(text):
    """KEY=VALUE for the warm-up's options; VALUE is JSON where it parses."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not re.match(r"^[a-z_][a-z0-9_]*$", key):
        raise ValueError("%r: expected KEY=VALUE, e.g. num_ctx=8192" % text)
    if key == "num_predict":
        raise ValueError("num_predict is fixed at 1 for the warm-up")
    try:
        if max_depth(raw) > 100:     # Python 3.13 parses 5000 levels; no option has 3
            raise ValueError("nested too deeply")
        value = parse_json(raw)
    except ValueError as exc:
        if not isinstance(exc, json.JSONDecodeError):   # too deep, too long a number
            raise ValueError("%s: %s" % (key, exc))
        value = raw
    return key, value


def max_depth(text):
    """How deep brackets nest in text, strings not counted."""
    depth = most = 0
    for token in re.findall(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', text):
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(token, 0)
        most = max(most, depth)
    return most


#: What Ollama's models may declare (types/model/capability.go), for --require.
CAPABILITIES = ("completion", "tools", "insert", "vision", "embedding", "thinking",
                "image", "audio")


def parse_models(text):
    """--model: one name or NAME,NAME; every name non-empty and distinct."""
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise ValueError("%r: a model name is empty" % text)
    unique_models(names)
    return names


def unique_models(names):
    """Raise ValueError when two names mean one model (qwen3, qwen3:latest)."""
    seen = {}
    for name in names:
        key = normalise_model(name).lower()
        if key in seen:
            raise ValueError("model %s is named twice (as %s)" % (name, seen[key]))
        seen[key] = name


def parse_require(text):
    """--require: CAP[,CAP] or MODEL=CAP[,CAP] -> [(MODEL or None, [CAP])]."""
    model, _, caps = text.rpartition("=")
    caps = [c.strip() for c in caps.split(",")]
    bad = [c for c in caps if c not in CAPABILITIES]
    if bad or (model is not None and "=" in text and not model.strip()):
        raise ValueError("%r: capabilities are %s" % (text, ", ".join(CAPABILITIES)))
    return [(model.strip() or None, caps)]


def shlex_split(text):
    import shlex
    return shlex.split(text)


def utf8(text):
    """text decoded as UTF-8 where it arrived escaped (Python 3.6 decodes argv
    and the environment as ASCII under the C locale); other bytes stay so."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8")
    except UnicodeError:
        return text


#: syslog facility codes (RFC 5424), by the names logger(1) accepts.
FACILITIES = dict(zip("kern user mail daemon auth syslog lpr news uucp cron authpriv ftp "
                      "local0 local1 local2 local3 local4 local5 local6 local7".split(),
                      list(range(12)) + list(range(16, 24))))


def parse_facility(text):
    if text.lower() not in FACILITIES:
        raise ValueError("%r: not a syslog facility (user, daemon, local0..local7...)"
                         % text)
    return FACILITIES[text.lower()]


def parse_syslog_address(text):
    """A UNIX datagram socket path, or HOST:PORT for UDP."""
    if "/" in text:
        return text
    host, port = _split_host_port(text)
    if not host or not port or not is_digits(port) or not 0 < int(port) < 65536:
        raise ValueError("%r: expected a socket path or HOST:PORT" % text)
    return (host, int(port))


def parse_gpu_ids(text):
    """--gpu-id: comma-separated NVML indexes or UUIDs (or UUID prefixes)."""
    ids = [item.strip() for item in text.split(",") if item.strip()]
    bad = [item for item in ids if not (is_digits(item) or re.match(
        r"^(GPU|MIG)-[0-9A-Za-z/-]+$", item))]
    if not ids or bad:
        raise ValueError("%r: expected indexes or UUIDs (0,1 or GPU-8f3a...)" % text)
    return ids


def parse_nvml_lib(text):
    """--nvml-lib: the absolute path of the driver's libnvidia-ml.so.1, not a
    stub. dlopen searches LD_LIBRARY_PATH and its cache for a bare name, so
    the file checked before it is loaded could be another."""
    text = parse_path(text)
    if not text.startswith("/"):
        raise ValueError("%r: give the library's absolute path (dlopen would search "
                         "for it, not load the file checked)" % text)
    if "/stubs/" in text:
        raise ValueError("%s is the CUDA toolkit's link-time stub, not the "
                         "driver's library" % text)
    return text


def host_url(value):
    """A --host value: parsed like OLLAMA_HOST, but a bad port is an error."""
    text = value.strip().strip("\"'")
    if re.search(r"[?#@]|[^\x21-\x7e]", text) or text.count("[") != text.count("]"):
        raise ValueError("%r is not a URL or HOST:PORT" % value)
    if text.endswith("://"):
        raise ValueError("%r names no host" % value)
    url, bad_port = parse_ollama_host(value)
    port = url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1]
    if bad_port is not None or port == "0":
        raise ValueError("%s: invalid port %r (1 to 65535)" % (value.strip(),
                                                              bad_port or port))
    problem = url_problem(url)
    if problem:
        raise ValueError("%s: %s" % (value.strip(), problem))
    return url


def url_problem(url):
    """Why urllib cannot use a base URL (not http(s), no usable host), or None."""
    host = url_host(url)
    if not url.startswith(("http://", "https://")):
        return "only http:// and https:// URLs are supported"
    if ":" not in host and re.match(r"^[A-Za-z0-9._~-]*$", host):
        return None
    with contextlib.suppress(OSError, ValueError):
        if ":" in host and socket.inet_pton(socket.AF_INET6, host.split("%", 1)[0]):
            return None
    return "%r is not a host name or IP address" % host


def parse_ollama_host(value):
    """(base URL, the bad port replaced with the default, or None) of an
    OLLAMA_HOST, as Ollama reads it: http://host means port 80, https://host
    443, no scheme 11434; quotes and spaces stripped; a path kept as a prefix."""
    text = value.strip().strip("\"'").strip()
    port = "11434"
    if "://" in text:
        scheme, rest = text.split("://", 1)
        port = {"http": "80", "https": "443"}.get(scheme, port)
    elif text == "ollama.com":
        scheme, rest, port = "https", text, "443"
    else:
        scheme, rest = "http", text
    rest = rest.rstrip("/")
    hostport, slash, path = rest.partition("/")
    path = ("/" + path.rstrip("/")) if slash and path.strip("/") else ""
    host, got_port = _split_host_port(hostport)
    if got_port is None:
        host = hostport.strip("[]") if hostport else "127.0.0.1"
        got_port = port
    bad_port = None
    if not is_digits(got_port) or int(got_port) > 65535:
        bad_port, got_port = got_port, port
    if ":" in host:
        host = "[%s]" % host
    return "%s://%s:%s%s" % (scheme, host, got_port, path), bad_port


def _split_host_port(text):
    """Go's net.SplitHostPort: (host, port), or (None, None) when it fails."""
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or not text[end + 1:].startswith(":"):
            return None, None
        return text[1:end], text[end + 2:]
    return tuple(text.split(":")) if text.count(":") == 1 else (None, None)


#: Where syslog lines go unless --syslog-address says otherwise.
DEFAULT_SYSLOG_ADDRESS = "/dev/log"

#: One option: its long name, short flag, role (CHECK or HOW_IT_RUNS), how its value
#: is read ("flag", a parser of one value, or a ListValue), default, metavar
#: and help text.
Option = collections.namedtuple("Option", "name short role kind default metavar help")

#: A repeatable option: parse turns one value into a list of items, split cuts
#: the environment's or a file's text into values.
ListValue = collections.namedtuple("ListValue", "parse split")

#: Every option, by --help group, as the fields of an Option.
OPTIONS = (
    ("the service", (
        ("host", None, CHECK, host_url, None, "URL",
         "Ollama base URL (default: OLLAMA_HOST as Ollama reads it, "
         "else %s)" % DEFAULT_HOST),
        ("api", None, CHECK, parse_choice("ollama", "openai", "auto"), "ollama", "NAME",
         "ollama (native API), openai (vLLM, llama-server: /health, /v1/models, "
         "/v1/completions) or auto (ask GET /api/version once)"),
        ("health-path", None, CHECK, parse_health_path, "/health", "PATH|none",
         "under --api openai, the readiness path asked first (default /health; "
         "LiteLLM: /health/readiness; none: start at GET /v1/models)"),
        ("token-file", None, CHECK, parse_path, None, "PATH",
         "send 'Authorization: Bearer' with the token in PATH (or in "
         "GPU_PREFLIGHT_TOKEN); never on the command line"),
        ("cafile", None, CHECK, parse_path, None, "PATH",
         "verify https:// hosts against this CA bundle instead of the system's"),
        ("insecure", None, CHECK, "flag", False, None,
         "do not verify TLS certificates (logged as a problem on every run)"),
        ("timeout", None, CHECK, parse_seconds, DEFAULT_TIMEOUT, "SECONDS",
         "time limit of each stage (default %g)" % DEFAULT_TIMEOUT),
        ("load-timeout", None, CHECK, parse_seconds, DEFAULT_LOAD_TIMEOUT, "SECONDS",
         "time limit of the warm-up of a model that is not loaded: its load "
         "(default %g; Ollama aborts a load when the client gives up)"
         % DEFAULT_LOAD_TIMEOUT),
        ("deadline", None, HOW_IT_RUNS, parse_seconds, None, "SECONDS",
         "hard limit on the whole run, from process start (default %g, plus "
         "--load-timeout for each model to load, --wait and --jitter)"
         % DEFAULT_DEADLINE),
    )),
    ("the model and its warm-up", (
        ("model", None, CHECK, ListValue(parse_models, lambda text: [text]), None, "NAME",
         "a model the job uses; repeatable, or NAME,NAME (default: one already "
         "loaded, else the first listed). Each must be present and answer, and "
         "all must sit in VRAM together; an embedding model is proven by a vector"),
        # from the environment or a file, "tools, vision qwen3=thinking" is two
        ("require", None, CHECK, ListValue(parse_require, lambda text: re.sub(
            r"\s*,\s*", ",", text).split()), None,
         "[MODEL=]CAP[,CAP]", "capabilities the job's generative models (or MODEL) "
         "must declare: %s; repeatable" % ", ".join(CAPABILITIES)),
        ("warmup", None, CHECK, parse_choice("token", "load", "off"), "token", "token|load|off",
         "token: generate one token; load: only load the model; off: skip "
         "(default token)"),
        ("keep-alive", None, CHECK, parse_keep_alive, None, "DURATION",
         "keep_alive sent with the warm-up (600, -1, 10m); not sent unless given"),
        ("ollama-option", None, CHECK, ListValue(lambda text: [parse_ollama_option(text)],
                                                 shlex_split), None, "KEY=VALUE",
         "runner option for the warm-up, as the job uses it (num_ctx=8192); "
         "repeatable"),
        ("allow-cpu", None, CHECK, "flag", False, None,
         "accept a model that Ollama runs on the CPU (size_vram 0)"),
        ("allow-cloud", None, CHECK, "flag", False, None,
         "accept an Ollama cloud model (remote_host in /api/tags, NAME:cloud, "
         "a -cloud tag): it runs on ollama.com, so it is warmed but left out of "
         "the placement check"),
        ("min-context", None, CHECK, parse_count, None, "N",
         "fail (78) unless every model runs with a context window of at least N "
         "tokens (Ollama's /api/ps context_length, vLLM's max_model_len, "
         "llama-server's /props n_ctx)"),
        ("min-vram-pct", None, CHECK, lambda text: parse_count(text, 100), None, "PCT",
         "skip (75) when less than PCT percent of a model sits in VRAM "
         "(default: a partial offload is only a note)"),
    )),
    ("the GPU", (
        ("gpu", None, CHECK, "flag", False, None,
         "check the GPU itself first (stage gpu): driver up, no GPU lost, "
         "thresholds met; implied by --gpu-backend, --nvml-lib, --gpu-id, a "
         "threshold and --strict-gpu"),
        ("gpu-timeout", None, CHECK, parse_seconds, DEFAULT_GPU_TIMEOUT, "SECONDS",
         "time limit of the GPU stage (default %g; NVML initialises each GPU in "
         "1-3 s without persistence mode)" % DEFAULT_GPU_TIMEOUT),
        ("gpu-backend", None, CHECK, parse_choice("auto", "nvml", "nvidia-smi", "amd-sysfs"),
         None, "NAME", "nvml, nvidia-smi or amd-sysfs (default auto: the first "
         "of them that is installed)"),
        ("cuda-check", None, CHECK, parse_choice("on", "off"), "on", "on|off",
         "with NVML, also start CUDA (cuInit, no context) from the %s beside "
         "NVML's: 802 (fabric manager not ready) 75, other failures 69 "
         "(default on)" % CUDA_NAME),
        ("nvml-lib", None, CHECK, parse_nvml_lib, None, "PATH",
         "the absolute path of the driver's %s (default: dlopen's search, "
         "then the usual directories)" % NVML_NAME),
        ("gpu-id", None, CHECK, parse_gpu_ids, None, "IDS",
         "GPUs to check: NVML indexes or UUIDs, comma-separated (default: the "
         "UUIDs in CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES, else all)"),
        ("gpu-need", None, CHECK, parse_choice("all", "any"), "all", "all|any",
         "every checked GPU must be fit, or any one (default all)"),
        ("expect-gpus", None, CHECK, lambda text: parse_count(text, least=1), None, "N",
         "fail (69) when the driver sees fewer than N GPUs, whatever is selected"),
        ("min-free-mib", None, CHECK, parse_count, None, "MIB",
         "skip unless this much GPU memory is free"),
        ("max-util", None, CHECK, lambda text: parse_count(text, 100), None, "PCT",
         "skip when GPU utilisation is above PCT"),
        ("max-procs", None, CHECK, parse_count, None, "N",
         "skip when more than N compute processes use the GPU"),
        ("max-temp", None, CHECK, parse_count, None, "C",
         "skip when the GPU is hotter than C degrees"),
        ("strict-gpu", None, CHECK, "flag", False, None,
         "a threshold the GPU cannot report (N/A, MIG) fails instead of "
         "being noted"),
    )),
    ("living under cron, and the job", (
        ("lock", None, HOW_IT_RUNS, parse_path, None, "PATH",
         "hold an exclusive flock on PATH from before the checks (until the "
         "job ends, with -- COMMAND); held elsewhere: exit 75"),
        ("wait", None, HOW_IT_RUNS, parse_seconds, None, "SECONDS",
         "retry a failed check (69, 75) with backoff 1, 2, 4 .. 15 s until "
         "ready or SECONDS have passed"),
        ("jitter", None, HOW_IT_RUNS, parse_seconds, None, "SECONDS",
         "sleep a random time up to SECONDS before the first attempt"),
        ("share-result", None, HOW_IT_RUNS, parse_seconds, None, "SECONDS",
         "reuse a ready verdict younger than SECONDS for the same check, and "
         "wait for a check in flight instead of sending another"),
        ("state-dir", None, HOW_IT_RUNS, parse_path, None, "PATH",
         "where shared verdicts and skip counts live (default "
         "$XDG_RUNTIME_DIR/%s, %s for root, else /tmp/%s-UID)"
         % (STATE_SUBDIR, ROOT_STATE_DIR, STATE_SUBDIR)),
        ("metrics-file", None, HOW_IT_RUNS, parse_path, None, "PATH",
         "write Prometheus metrics there for node_exporter's textfile collector"),
        ("log-changes-only", None, HOW_IT_RUNS, "flag", False, None,
         "log only when the verdict changes (for every-minute schedules)"),
        ("escalate-after", None, CHECK, lambda text: parse_count(text, 10 ** 6, 1), None, "N",
         "exit 69 instead of 75 once the same stage has answered 75 for N "
         "runs in a row (a fault that never heals)"),
    )),
    ("output and logging", (
        ("json", None, HOW_IT_RUNS, "flag", False, None,
         "print one JSON object with the verdict on stdout"),
        ("verbose", "-v", HOW_IT_RUNS, "flag", False, None,
         "print the log line on stderr, even under cron"),
        ("quiet", "-q", HOW_IT_RUNS, "flag", False, None, "print nothing on stderr"),
        ("syslog-facility", None, HOW_IT_RUNS, parse_facility, FACILITIES["user"], "NAME",
         "syslog facility (default user)"),
        ("syslog-address", None, HOW_IT_RUNS, parse_syslog_address, DEFAULT_SYSLOG_ADDRESS,
         "PATH|HOST:PORT", "syslog socket path or UDP collector (default %s)"
         % DEFAULT_SYSLOG_ADDRESS),
        ("no-syslog", None, HOW_IT_RUNS, "flag", False, None, "do not write to syslog"),
        ("debug", None, HOW_IT_RUNS, "flag", False, None, "show a traceback on internal errors"),
    )),
)

EPILOG = """\
examples:
  %(run)s --model llama3.2 --timeout 5 --deadline 15 && job
  %(run)s --gpu --max-util 30 --min-free-mib 20000 -- /opt/jobs/batch.sh
  %(run)s --api openai --host https://llm.example.org --token-file /etc/t
in /etc/cron.d/gpu-batch (in `crontab -e`, leave out the user field root):
  */10 * * * *  root  /usr/local/bin/gpu_preflight --lock /run/gpu0.lock -- /opt/jobs/batch.sh

A cold model (not loaded when the run starts) gets --load-timeout (60 s) to
load, and the default deadline grows by as much; Ollama aborts a load when the
client gives up. A longer load: --load-timeout 300, or keep the model loaded
on the server (OLLAMA_KEEP_ALIVE=-1, or --keep-alive 1h).

Each long option is also GPU_PREFLIGHT_<NAME> (GPU_PREFLIGHT_KEEP_ALIVE=10m)
and a key in the [gpu_preflight] section of the config file (keep-alive = 10m).
The bearer token is read from --token-file or GPU_PREFLIGHT_TOKEN only.
"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """argparse's help layout without shutil (2 ms: argparse makes one on every run)."""

    def __init__(self, prog):
        try:
            width = int(os.environ.get("COLUMNS", "")) or os.get_terminal_size(1).columns
        except (OSError, ValueError):
            width = 80
        argparse.RawDescriptionHelpFormatter.__init__(self, prog, width=max(width, 40) - 2)


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so main() keeps control."""

    def error(self, message):
        raise UsageError(message)

    def _print_message(self, message, file=None):
        emit("stderr" if file is sys.stderr else "stdout", message or "")

    def exit(self, status=0, message=None):
        if message:
            emit("stderr", message)
        raise _ParserExit(status)


def _argtype(parse):
    """Wrap a parser so argparse shows its message for a bad value."""
    def convert(text):
        try:
            return parse(utf8(text))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc))
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def each_option():
    return [Option(*row) for _, rows in OPTIONS for row in rows]


def build_parser(run="python3 gpu_preflight.py"):
    """The command line: every option defaults to None (= not given). run: how
    the examples of --help call the script (invoked_as())."""
    description = "\n\n".join(__doc__.split("\n\n")[:7])
    parser = _Parser(prog=PROG, usage="%(prog)s [OPTION ...] [-- COMMAND [ARG ...]]",
                     description=description.replace("python3 gpu_preflight.py", run),
                     epilog=EPILOG % {"run": run}, allow_abbrev=False,
                     formatter_class=_Formatter)
    for title, rows in OPTIONS:
        group = parser.add_argument_group(title)
        for option in map(Option._make, rows):
            flags = ([option.short] if option.short else []) + ["--" + option.name]
            if option.kind == "flag":
                group.add_argument(*flags, action="store_true", default=None,
                                   help=option.help)
            elif isinstance(option.kind, ListValue):
                group.add_argument(*flags, action="append", default=None,
                                   metavar=option.metavar, help=option.help,
                                   type=_argtype(option.kind.parse))
            else:
                group.add_argument(*flags, metavar=option.metavar, help=option.help,
                                   type=_argtype(option.kind))
    parser.add_argument_group("configuration").add_argument(
        "--config", metavar="PATH", help="config file (default %s when it exists; or "
        "GPU_PREFLIGHT_CONFIG)" % DEFAULT_CONFIG)
    parser.add_argument("--version", action=_ShowVersion, nargs=0, help="show the "
                        "version (X.Y.Z+ID, ID naming this copy of the file) and exit")
    return parser


class _ShowVersion(argparse.Action):
    """--version: the release, this copy's blob_id() and the Python. The file
    is read and hashed only here: a run that checks does neither."""

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            with open(__file__, "rb") as handle:
                copy = blob_id(handle.read())
        except OSError:
            copy = "unknown"
        emit("stdout", "%s %s+%s (Python %s)\n" % (
            PROG, __version__, copy, sys.version.split()[0]))
        parser.exit()


def blob_id(source):
    """The first 12 hex digits of git's id for a file of these bytes (what git
    hash-object prints), its #! line read as the repository's, which packagers
    rewrite (git-filter-repo's --version hashes its own file the same way)."""
    import hashlib              # only here: importing it costs 2 ms
    source = re.sub(br"\A#![^\n]*", b"#!/usr/bin/env python3", source)
    return hashlib.sha1(b"blob %d\0" % len(source) + source).hexdigest()[:12]


def invoked_as(argv0):
    """The script as it was run: its name (gpu_preflight, installed), or
    python3 NAME.py for a .py file; PROG for a name that is not plain ASCII."""
    name = os.path.basename(argv0)
    name = name if re.match(r"^[A-Za-z0-9_.+-]{1,64}\Z", name) else PROG
    return "python3 " + name if name.endswith(".py") else name


def configure(ns, environ):
    """Options for this run, plus a configuration error message or None (the
    options then carry what flags and defaults say: the error is logged where
    the command line asked)."""
    path, must_exist = config_path(ns, environ)
    try:
        values = read_config_file(path, must_exist)
        opts = resolve_options(ns, environ, values, path)
        opts.said.insert(0, "config file %s" % path if values is not None else
                         "no config file (%s does not exist)" % path)
        return opts, None
    except ConfigError as exc:
        try:
            return resolve_options(ns, environ, {}), str(exc)
        except ConfigError:
            return resolve_options(ns, {}, {}), str(exc)


def config_path(ns, environ):
    """(path, must it exist): --config, GPU_PREFLIGHT_CONFIG, (not as root) an
    existing $XDG_CONFIG_HOME/gpu_preflight.conf (~/.config), DEFAULT_CONFIG."""
    given = ns.config or environ.get(ENV_PREFIX + "CONFIG", "").strip()
    if given:
        return given, True
    if os.geteuid() != 0:
        base = environ.get("XDG_CONFIG_HOME", "").strip()
        if not base.startswith("/"):        # the XDG rule: a relative one is ignored
            base = os.path.join(environ.get("HOME", ""), ".config")
        user = os.path.join(base, PROG + ".conf")
        if base.startswith("/") and os.path.exists(user):
            return user, True
    return DEFAULT_CONFIG, False


#: The keys whose values may be quoted: host (unquoted as Ollama does
#: OLLAMA_HOST) and ollama-option (shell words).
QUOTES_TAKEN = ("host", "ollama-option")


def read_config_file(path, must_exist):
    """The [gpu_preflight] keys of an INI file; None when there is none, as allowed."""
    if not must_exist and not os.path.lexists(path):   # a dangling link is an error
        return None
    try:
        text = read_trusted(path, MAX_CONFIG).decode("utf-8-sig")     # a BOM is no text
    except UnicodeDecodeError:
        raise ConfigError("bad config file %s: not UTF-8 text" % path)
    except ValueError as exc:
        raise ConfigError("cannot read config file %s: %s" % (path, exc))
    lines = [l.strip() for l in text.splitlines() if l.strip()[:1] not in ("", "#", ";")]
    if lines in ([], ["[%s]" % PROG]):
        return {}           # install.sh's example, all comments: no configparser
    import configparser
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text, path)
    except configparser.MissingSectionHeaderError:
        raise ConfigError("bad config file %s: its first setting comes before any "
                          "section: put [%s] on a line above it" % (path, PROG))
    except configparser.Error as exc:   # its first lines say what and where
        said = " ".join(str(exc).split("\n")[:2]).replace("\t", " ") or type(exc).__name__
        raise ConfigError("bad config file %s: %s" % (path, said))
    if not parser.has_section(PROG):
        raise ConfigError("config file %s has no [%s] section" % (path, PROG))
    known = set(option.name for option in each_option())
    values = {}
    for key, text in parser.items(PROG):
        name = key.replace("_", "-")
        if name not in known:
            raise ConfigError("config file %s: unknown key %r" % (path, key))
        if len(text) > 1 and text[0] == text[-1] and text[0] in "\"'" and \
                name not in QUOTES_TAKEN:
            raise ConfigError("config file %s: %s = %s: INI values take no quotes: "
                              "write %s = %s" % (path, key, text, key, text[1:-1]))
        values[name] = text
    return values


def resolve_options(ns, environ, file_values, file_name="config file"):
    """Flags, environment, file and defaults merged into one Namespace;
    ConfigError for a bad environment or file value."""
    file_values = file_values or {}
    opts = argparse.Namespace(said=[])     # said: what -v tells about the setup
    for name, _, _, kind, default, _, _ in each_option():
        attr = name.replace("-", "_")
        value = getattr(ns, attr, None)
        env_name = ENV_PREFIX + attr.upper()
        source = None
        try:
            if value is None and environ.get(env_name, "").strip():
                source = env_name
                value = _from_text(kind, utf8(environ[env_name]))
            elif value is None and name in file_values:
                source = "%s: %s" % (file_name, name)
                value = _from_text(kind, file_values[name])
        except ValueError as exc:
            raise ConfigError("%s: %s" % (source, exc))
        value = default if value is None else value
        if isinstance(kind, ListValue):     # repeated flags: one list
            value = [x for part in value or () for x in part]
        setattr(opts, attr, value)
    if opts.host is None:
        opts.host = DEFAULT_HOST
        if environ.get("OLLAMA_HOST", "").strip():
            opts.host, bad_port = parse_ollama_host(environ["OLLAMA_HOST"])
            if bad_port:        # as Ollama itself does
                opts.said.append("OLLAMA_HOST=%s: invalid port %r, using %s as Ollama "
                                 "does" % (sanitise(environ["OLLAMA_HOST"]), bad_port,
                                           opts.host.rsplit(":", 1)[1]))
            problem = url_problem(opts.host)
            if problem:
                raise ConfigError("OLLAMA_HOST=%r: %s" % (environ["OLLAMA_HOST"], problem))
    opts.gpu = bool(opts.gpu or opts.gpu_backend or opts.nvml_lib or opts.gpu_id
                    or opts.strict_gpu or opts.expect_gpus
                    or any(getattr(opts, l[0]) is not None for l in GPU_LIMITS))
    opts.gpu_backend = opts.gpu_backend or "auto"
    opts.token = opts.tls_context = None    # read_token() and tls_context()
    opts.deadline_default = opts.deadline is None   # grows when a model must load
    if opts.deadline is None:
        opts.deadline = DEFAULT_DEADLINE + (opts.wait or 0) + (opts.jitter or 0)
    opts.ollama_option = dict(opts.ollama_option)
    if opts.verbose and opts.quiet:     # a flag beats the environment and file
        if ns.verbose or ns.quiet:
            opts.verbose, opts.quiet = bool(ns.verbose), bool(ns.quiet)
        else:
            raise ConfigError("verbose and quiet exclude each other")
    return opts


def _from_text(kind, text):
    if kind == "flag":
        return parse_bool(text)
    if isinstance(kind, ListValue):
        return [[item for part in kind.split(text) for item in kind.parse(part)]]
    return kind(text)


def read_token(opts, environ):
    """The bearer token from --token-file or GPU_PREFLIGHT_TOKEN, or None; Fail
    (78) for a file others can read (as root), an empty one, or a token a
    header cannot carry."""
    path, where = opts.token_file, "GPU_PREFLIGHT_TOKEN"
    text = environ.get(ENV_PREFIX + "TOKEN", "")
    if text.strip():
        add_secret(text.strip())
    if path:
        where = "token file %s" % sanitise(path)
        try:
            text = read_trusted(path, MAX_CONFIG).decode("utf-8-sig")     # a BOM is no text
            mode = os.stat(path).st_mode
        except (OSError, ValueError) as exc:
            raise Fail(EX_CONFIG, "cannot read %s: %s" % (
                where, sanitise(getattr(exc, "strerror", None) or exc)), "config")
        if os.geteuid() == 0 and mode & 0o044:
            raise Fail(EX_CONFIG, "%s is readable by group or others (mode %04o): "
                       "chmod 600 it" % (where, stat.S_IMODE(mode)), "config")
        text = text.strip().split("\n")[0].strip()
        if not text:
            raise Fail(EX_CONFIG, "%s is empty" % where, "config")
        add_secret(text)
    text = text.strip()
    if text and not re.match(r"^[\x21-\x7e]+$", text):
        raise Fail(EX_CONFIG, "the token in %s has characters an HTTP header cannot "
                   "carry" % where, "config")
    return text or None


def tls_context(opts):
    """The TLS context of an https:// host: the system's CAs, --cafile, or --insecure."""
    if not opts.host.startswith("https://"):
        return None
    import ssl
    if opts.insecure:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    try:
        pem = opts.cafile and read_trusted(opts.cafile, MAX_BODY).decode("ascii")
        if pem is not None and not pem.strip():
            raise ValueError("empty file")  # cadata="" would mean the system store
        return ssl.create_default_context(cadata=pem)
    except (ValueError, ssl.SSLError) as exc:    # UnicodeDecodeError is a ValueError
        raise Fail(EX_CONFIG, "cannot use --cafile %s: %s" % (
            sanitise(opts.cafile), sanitise(exc)), "config")


# ---- Files root reads or writes (trusted, bounded); small utilities ---------

def untrusted(path):
    """Why someone other than this user or root could have written path, or
    None; OSError when it cannot be looked up. OpenSSH's StrictModes: the file
    and every directory above it owned by this user or root and writable by
    no one else (a sticky /tmp is fine above an entry that passes); a symlink
    judged by its owner, the directory holding it and what it points to."""
    owners = (0, os.geteuid())
    todo = [p for p in os.path.join(os.getcwd(), path).split("/") if p]  # no lexical ..
    here, hops = "/", 0
    info = os.lstat(here)
    while True:
        mode = info.st_mode
        if info.st_uid not in owners:
            if owners[1] == 0:
                allowed, chown_to = "root", "root"
            else:
                allowed, chown_to = "this user or root", user_name(owners[1], bare=True)
            return "%s is owned by %s, not by %s: chown %s %s" % (
                here, user_name(info.st_uid), allowed, chown_to, here)
        if stat.S_ISLNK(mode):
            hops += 1
            if hops > 40:
                raise OSError(errno.ELOOP, "too many levels of symbolic links")
            target = os.readlink(here)
            todo[:0] = [p for p in target.split("/") if p]
            here = "/" if target.startswith("/") else os.path.dirname(here)
            info = os.lstat(here)
            continue
        sticky_dir = stat.S_ISDIR(mode) and mode & stat.S_ISVTX and todo
        if mode & 0o022 and not sticky_dir:
            return "%s is writable by group or others (mode %04o): chmod go-w %s" % (
                here, stat.S_IMODE(mode), here)
        while todo and todo[0] in (".", ".."):
            here = os.path.dirname(here) if todo.pop(0) == ".." else here
        if not todo:
            return None
        here = os.path.join(here, todo.pop(0))
        info = os.lstat(here)


def user_name(uid, bare=False):
    """'uid 65534 (nobody)' for messages; bare: 'nobody', as chown takes it."""
    import pwd
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid) if bare else "uid %d" % uid
    return name if bare else "uid %d (%s)" % (uid, name)


def read_trusted(path, limit):
    """A small regular file only this user or root could write; else ValueError why."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ValueError("not a regular file")
        problem = untrusted(path)
        if problem is None:
            return read_small_file(path, limit)
    except OSError as exc:
        problem = exc.strerror or str(exc)
    else:
        problem = "others could have written it: " + problem
    raise ValueError(problem)


def read_up_to(read, limit):
    """What read(size) gives until b"", or limit + 1 bytes (the caller can say
    "too large"); 64 KiB at a time (read(limit) would allocate limit)."""
    chunks, size = [], 0
    while size <= limit:
        chunk = read(min(65536, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def read_small_file(path, limit):
    """The bytes of a regular file of at most limit bytes, never blocking on a
    FIFO or device; OSError, or ValueError when it is not small and regular."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # novermin: flags, not types
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        data = read_up_to(lambda size: os.read(fd, size), limit)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError("larger than %d KiB" % (limit // 1024))
    return data


def open_no_follow(path, mode=0o644):
    """A regular file's descriptor, created with mode if missing; never via a
    symlink, nor a hard link (planted in /tmp, another name of any root file)."""
    try:
        fd = create_no_follow(path, mode, os.O_RDONLY)
    except FileExistsError:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # novermin
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        raise OSError(0, "it has %d names (a hard link, perhaps to another file of "
                      "root's): give a path of its own" % info.st_nlink
                      if stat.S_ISREG(info.st_mode) else "not a regular file")
    return fd


def create_no_follow(path, mode, flags, dir_fd=None):
    """A new file's descriptor with mode whatever the umask; never via a symlink."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode,  # novermin
                 dir_fd=dir_fd)
    os.fchmod(fd, mode)
    return fd


def write_atomic(path, data, mode):
    """Replace path with data (a temporary file, then rename) through a
    descriptor of its directory: no symlink, this user's or root's, writable
    by no one else, sticky /tmp aside (another's could redirect root's file)."""
    directory, name = os.path.split(path)
    dfd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)  # novermin
    try:
        info = os.fstat(dfd)
        if info.st_uid not in (0, os.geteuid()) or (
                info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX):
            raise OSError(0, "%s is %s's or others can write it" % (
                directory or ".", user_name(info.st_uid)))
        tmp = ".%s.%d.tmp" % (name, os.getpid())
        fd = create_no_follow(tmp, mode, os.O_WRONLY, dfd)
        try:
            try:
                while data:
                    data = data[os.write(fd, data):]
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            os.unlink(tmp, dir_fd=dfd)
            raise
    finally:
        os.close(dfd)


def is_digits(text):
    """A count in 1 to 18 ASCII digits (str.isdigit() takes more than int() does)."""
    return bool(re.match(r"^[0-9]{1,18}$", text))


if __name__ == "__main__":
    sys.exit(main(started=process_started()))
