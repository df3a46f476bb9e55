"""Real consumers for the once_* tests: a private mount namespace, a one-node
Slurm (munged, slurmctld, slurmd), prometheus-node-exporter.

Nothing here changes the machine outside the test's temp directory:
  - MountNamespace holds a private mount namespace (`unshare --mount
    --propagation private`) open with a small holder process; mounts are made
    inside it (an overlay over /etc whose upper layer is a temp directory, a
    tmpfs over /run, a temp directory bound onto /usr/local), and programs are
    started in it with `nsenter --mount=/proc/HOLDER/ns/mnt`. Its mounts vanish
    with its last process; close() ends every process still in it, by PID
    (they are all this test's: the namespace is its own), then the holder.
  - SlurmCluster runs munged (its own key, /run/munge in the namespace),
    slurmctld and slurmd in the foreground (-D/-F) as children of the test,
    with a private slurm.conf (/etc/slurm/slurm.conf in the namespace), state,
    spool, pid and log files under the temp directory and free loopback ports.
  - NodeExporter runs prometheus-node-exporter with only the textfile
    collector on a free 127.0.0.1 port.
  - SystemdContainer boots the machine's own systemd as PID 1 of private
    PID, mount, network, UTS, IPC and cgroup namespaces, on a root that is an
    overlay of / with a tmpfs on top (see its docstring).
Standard library only; these run once per suite, under /usr/bin/python3.
"""

import errno
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import time
import unittest

import support
from emu_base import free_port

SLURM_TOOLS = ("slurmctld", "slurmd", "sinfo", "scontrol", "sbatch", "srun",
               "squeue", "munged")
NODE_EXPORTER = "prometheus-node-exporter"


def need(ok, message):
    """Skip when a precondition is missing; under CI=true fail instead (also
    from setUpClass, where there is no test case to fail)."""
    if ok:
        return
    if support.IN_CI:
        raise AssertionError(message + " (CI=true: .ci/run must provide it)")
    raise unittest.SkipTest(message)


def tools(names):
    """{name: path} of each tool on PATH or in /usr/sbin (need() each)."""
    found = {}
    for name in names:
        found[name] = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
        need(found[name], "%s is not installed" % name)
    return found


def require_namespaces():
    """need() root and a private mount namespace (unshare, nsenter)."""
    need(os.geteuid() == 0, "the real daemons run as root (private mount namespace)")
    need(can_unshare(), "cannot make a private mount namespace (unshare --mount, nsenter)")


def can_unshare():
    """Whether this process may make a private mount namespace (root)."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"):
        return False
    return subprocess.call(["unshare", "--mount", "--propagation", "private", "true"],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL) == 0


def wait_for(what, predicate, timeout, interval=0.2):
    """predicate()'s first true value within timeout s, else AssertionError."""
    ends_at = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > ends_at:
            raise AssertionError("timed out after %ss waiting for %s" % (timeout, what))
        time.sleep(interval)


def write_file(path, text, mode=0o644, owner=None):
    """Write text to path with mode (not narrowed by the umask), owned by owner
    (a user name) or root."""
    with open(path, "w") as handle:
        handle.write(text)
    os.chmod(path, mode)
    if owner:
        entry = pwd.getpwnam(owner)
        os.chown(path, entry.pw_uid, entry.pw_gid)


def root_dir(path, mode=0o755):
    """Make path (if missing) a root-owned directory with mode: files root reads
    configuration or code from must not sit in a directory others can write."""
    if not os.path.isdir(path):
        os.makedirs(path)
    os.chown(path, 0, 0)
    os.chmod(path, mode)
    return path


# Run by /bin/sh in the new namespace: $1 the work directory. Each line of
# $work/mounts is "overlay DIR LOWER UPPER WORK", "tmpfs DIR" or "bind DIR SRC".
NAMESPACE_SETUP = r"""
set -eu
work=$1
while read -r kind dir a b c; do
    case $kind in
        overlay) mount -t overlay overlay -o "lowerdir=$a,upperdir=$b,workdir=$c" "$dir" ;;
        tmpfs) mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs "$dir" ;;
        bind) mount --bind "$a" "$dir" ;;
        *) echo "unknown mount kind $kind" >&2; exit 1 ;;
    esac
done < "$work/mounts"
echo ready
exec cat >/dev/null
"""


def open_namespace(pid):
    """The mount namespace of pid, held open: its name ("mnt:[INODE]") and the
    descriptor. Held, its inode number cannot pass to a namespace another test
    makes meanwhile, so killing the processes by that name reaches none of its."""
    fd = os.open("/proc/%d/ns/mnt" % pid, os.O_RDONLY)
    return "mnt:[%d]" % os.fstat(fd).st_ino, fd


class MountNamespace(object):
    """A private mount namespace with the given mounts, held open until close().

    mounts: tuples ("overlay", DIR, LOWER, UPPER, WORKDIR), ("tmpfs", DIR) or
    ("bind", DIR, SOURCE), made in order. The holder reads its stdin (a pipe of
    this process), so it also ends when this process dies.
    """

    def __init__(self, work, mounts):
        self.work = work
        with open(os.path.join(work, "mounts"), "w") as handle:
            for mount in mounts:
                handle.write(" ".join(mount) + "\n")
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
             NAMESPACE_SETUP, "sh", work],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd="/")
        line = self.holder.stdout.readline()
        if line != b"ready\n":
            self.holder.stdin.close()
            err = self.holder.communicate()[1]
            raise RuntimeError("the mount namespace was not set up: %r %r" % (line, err))
        self.ns, self.ns_fd = open_namespace(self.holder.pid)
        self.started = []

    def argv(self, argv, user=None):
        """argv run inside the namespace (as user, else root)."""
        prefix = ["nsenter", "--mount=/proc/%d/ns/mnt" % self.holder.pid]
        if user:
            entry = pwd.getpwnam(user)
            prefix += ["-S", str(entry.pw_uid), "-G", str(entry.pw_gid)]
        return prefix + ["--"] + list(argv)

    def popen(self, argv, user=None, **kwargs):
        """Start argv in the namespace; nsenter execs it, so the pid is its own."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        kwargs.setdefault("cwd", "/")
        proc = subprocess.Popen(self.argv(argv, user), **kwargs)
        self.started.append(proc)
        return proc

    def run(self, argv, timeout=30, check=True, stdin=None):
        """Run argv in the namespace; its stdout and stderr together, as text."""
        proc = subprocess.Popen(self.argv(argv), cwd="/",
                                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            out = proc.communicate(stdin, timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise AssertionError("%s did not end within %ss" % (argv, timeout))
        out = out.decode("utf-8", "replace")
        if check and proc.returncode != 0:
            raise AssertionError("%s: exit %d: %s" % (" ".join(argv), proc.returncode, out))
        return out

    def pids(self):
        """Processes in this namespace other than the holder."""
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == self.holder.pid:
                continue
            try:
                if os.readlink("/proc/%s/ns/mnt" % name) == self.ns:
                    found.append(int(name))
            except OSError:
                pass
        return found

    def stop(self, proc, timeout=10):
        """SIGTERM one process started here, SIGKILL after timeout; reap it."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self):
        """End what runs in the namespace (by PID), then the holder; once.
        Called again, it does nothing: the name self.ns is no longer held,
        and another test's namespace may have it now."""
        if self.ns_fd is None:
            return
        for proc in reversed(self.started):
            self.stop(proc)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = self.pids()      # strays: job steps, a health check
            for pid in left:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            ends_at = time.monotonic() + 5
            while left and time.monotonic() < ends_at:
                time.sleep(0.1)
                left = self.pids()
            if not left:
                break
        if self.holder.poll() is None:
            self.holder.stdin.close()
            try:
                self.holder.wait(5)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait()
        for stream in (self.holder.stdout, self.holder.stderr):
            stream.close()
        os.close(self.ns_fd)
        self.ns_fd = None


def short_hostname():
    return socket.gethostname().split(".")[0]


class SlurmCluster(object):
    """One slurmctld and one slurmd (node NODE) with munge, in a namespace.

    work: a root-owned 0755 temp directory; etc_files: {path under /etc: (text,
    mode)} added to the overlay (slurm.conf is written here); usr_local: a
    directory bound onto /usr/local; conf: extra slurm.conf lines.
    """

    NODE = "gpfl-node"
    PARTITION = "gpfl"

    def __init__(self, work, etc_files, usr_local, conf=()):
        self.work = work
        self.ports = [free_port(), free_port()]
        while self.ports[0] == self.ports[1]:
            self.ports[1] = free_port()
        upper = root_dir(os.path.join(work, "etc-upper"))
        root_dir(os.path.join(work, "etc-work"))
        for folder in ("state", "spool", "log", "run"):
            root_dir(os.path.join(work, folder))
        root_dir(os.path.join(upper, "slurm"))
        munge_etc = os.path.join(upper, "munge")
        root_dir(munge_etc, 0o700)
        munge_var = os.path.join(work, "munge")
        root_dir(munge_var, 0o700)
        entry = pwd.getpwnam("munge")
        for folder in (munge_etc, munge_var):
            os.chown(folder, entry.pw_uid, entry.pw_gid)
        with open(os.path.join(munge_etc, "munge.key"), "wb") as handle:
            handle.write(os.urandom(1024))
        os.chmod(os.path.join(munge_etc, "munge.key"), 0o400)
        os.chown(os.path.join(munge_etc, "munge.key"), entry.pw_uid, entry.pw_gid)
        files = dict(etc_files)
        files["slurm/slurm.conf"] = (self.slurm_conf(conf), 0o644)
        for path, (text, mode) in sorted(files.items()):
            root_dir(os.path.dirname(os.path.join(upper, path)))
            write_file(os.path.join(upper, path), text, mode)
        self.namespace = MountNamespace(work, [
            ("overlay", "/etc", "/etc", upper, os.path.join(work, "etc-work")),
            ("tmpfs", "/run"),
            ("bind", "/usr/local", usr_local),
        ])
        self.daemons = []

    def slurm_conf(self, extra):
        work = self.work
        lines = [
            "ClusterName=gpfltest",
            "SlurmctldHost=%s(127.0.0.1)" % short_hostname(),
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            "SlurmctldPort=%d" % self.ports[0], "SlurmdPort=%d" % self.ports[1],
            "StateSaveLocation=%s/state" % work, "SlurmdSpoolDir=%s/spool" % work,
            "SlurmctldPidFile=%s/run/slurmctld.pid" % work,
            "SlurmdPidFile=%s/run/slurmd.pid" % work,
            "SlurmctldLogFile=%s/log/slurmctld.log" % work,
            "SlurmdLogFile=%s/log/slurmd.log" % work,
            "SlurmdDebug=debug2", "LogTimeFormat=iso8601_ms",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "NodeName=%s NodeHostname=%s NodeAddr=127.0.0.1 CPUs=%d RealMemory=1000 "
            "State=UNKNOWN" % (self.NODE, short_hostname(), os.cpu_count() or 1),
            "PartitionName=%s Nodes=%s Default=YES MaxTime=INFINITE State=UP"
            % (self.PARTITION, self.NODE),
        ]
        return "\n".join(lines + list(extra)) + "\n"

    def start(self):
        """munged, slurmctld, slurmd; returns when the node is up."""
        ns, log = self.namespace, os.path.join(self.work, "log")
        ns.run(["/bin/sh", "-c", "mkdir -m 0755 /run/munge && chown munge:munge /run/munge"])
        munge_var = os.path.join(self.work, "munge")
        self.munged = self.daemon(["munged", "-F", "--key-file=/etc/munge/munge.key",
                                   "--seed-file=%s/seed" % munge_var,
                                   "--pid-file=/run/munge/munged.pid"], "munged", "munge")
        wait_for("munged's socket", lambda: os.path.exists(
            "/proc/%d/root/run/munge/munge.socket.2" % self.munged.pid), 10)
        self.slurmctld = self.daemon(["slurmctld", "-D"], "slurmctld")
        wait_for("slurmctld", lambda: self.run(["scontrol", "ping"], check=False)
                 .find("is UP") >= 0, 20, 0.3)
        self.slurmd = self.daemon(["slurmd", "-D", "-N", self.NODE], "slurmd")
        wait_for("node %s up" % self.NODE, lambda: self.state()[0] in
                 ("idle", "drained", "draining", "mixed", "allocated"), 30, 0.3)
        return self

    def daemon(self, argv, name, user=None):
        out = open(os.path.join(self.work, "log", name + ".out"), "wb")
        try:
            proc = self.namespace.popen(argv, user=user, stdout=out,
                                        stderr=subprocess.STDOUT)
        finally:
            out.close()
        time.sleep(0.05)
        if proc.poll() is not None:
            raise AssertionError("%s exited %s at once: %s" % (
                name, proc.returncode, self.log(name + ".out")))
        return proc

    def log(self, name):
        try:
            with open(os.path.join(self.work, "log", name), "rb") as handle:
                return handle.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def run(self, argv, check=True, timeout=30):
        return self.namespace.run(argv, timeout=timeout, check=check)

    def state(self):
        """(state, reason) of the node, as sinfo -N -o "%N %T %E" prints them."""
        out = self.run(["sinfo", "-h", "-N", "-n", self.NODE, "-o", "%N|%T|%E"],
                       check=False).strip()
        parts = out.split("|")
        if len(parts) != 3 or parts[0] != self.NODE:
            return (out, None)
        return (parts[1], parts[2])

    def resume(self):
        self.run(["scontrol", "update", "NodeName=%s" % self.NODE, "State=RESUME"])
        wait_for("node back in service", lambda: self.state()[0] in
                 ("idle", "mixed", "allocated"), 10)

    def sbatch(self, command):
        """Submit a batch job; its id."""
        out = self.run(["sbatch", "--parsable", "-N1", "-o", "/dev/null",
                        "--wrap", command]).strip()
        return out.split(";")[0]

    def job(self, job_id):
        """{key: value} of scontrol show job, {} once it is gone."""
        out = self.run(["scontrol", "-o", "show", "job", job_id], check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out)) if "JobId=" in out else {}

    def close(self):
        for job_id in self.run(["squeue", "-h", "-o", "%i"], check=False).split():
            self.run(["scancel", job_id], check=False)
        self.namespace.close()

    def health_check_runs(self):
        """[(seconds, rc)] of each health check slurmd ran: from its RPC to
        the script's end, by slurmd's own log (debug2, ms timestamps)."""
        runs, begun = [], None
        pattern = re.compile(r"^\[(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})\] (?:debug\d?: )?"
                             r"(?:error: )?(.*)$")
        for line in self.log("slurmd.log").splitlines():
            match = pattern.match(line)
            if not match:
                continue
            stamp = time.mktime(time.strptime(match.group(1)[:19], "%Y-%m-%dT%H:%M:%S")) \
                + int(match.group(1)[20:]) / 1000.0
            text = match.group(2)
            if text.startswith("Processing RPC: REQUEST_HEALTH_CHECK"):
                begun = stamp
            elif text.startswith("health_check ") and begun is not None:
                rc = re.search(r"rc:(\d+)", text)
                runs.append((stamp - begun, int(rc.group(1)) if rc else None))
                begun = None
        return runs


class NodeExporter(object):
    """prometheus-node-exporter serving only a textfile directory."""

    def __init__(self, binary, directory, log_path):
        self.port = free_port()
        self.url = "http://127.0.0.1:%d/metrics" % self.port
        self.log_path = log_path
        log = open(log_path, "wb")
        try:
            self.proc = subprocess.Popen(
                [binary, "--collector.disable-defaults", "--collector.textfile",
                 "--collector.textfile.directory=%s" % directory,
                 "--web.listen-address=127.0.0.1:%d" % self.port],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd="/")
        finally:
            log.close()

    def wait_ready(self, timeout=15):
        def up():
            if self.proc.poll() is not None:
                raise AssertionError("node exporter exited %s: %s" % (
                    self.proc.returncode, self.log()))
            try:
                return self.scrape()
            except OSError:
                return None
        return wait_for("node exporter on port %d" % self.port, up, timeout, 0.1)

    def scrape(self):
        """The text of one GET /metrics."""
        import urllib.request
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(self.url, timeout=5) as answer:
            return answer.read().decode("utf-8")

    def log(self):
        with open(self.log_path, "rb") as handle:
            return handle.read().decode("utf-8", "replace")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_exposition(text):
    """{family: [(labels dict, value float)]} of Prometheus text output;
    AssertionError on a line that is neither a comment nor a sample."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            raise AssertionError("not a sample line: %r" % line)
        labels = dict((k, re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), v))
                      for k, v in _LABEL.findall(match.group(2) or ""))
        samples.setdefault(match.group(1), []).append((labels, float(match.group(3))))
    return samples


# Run by /bin/sh as PID 1 of new PID, mount, network, UTS, IPC and cgroup
# namespaces: $1 the work directory (a tmpfs goes on $1/c), $2 the checkout,
# $3 the unit the container boots. Everything systemd may write is made
# private first: the root is an overlay of / whose upper layer is that tmpfs,
# /run, /tmp and /dev are fresh tmpfs, /proc and /sys are this namespace's own
# with /proc/sys, /proc/sysrq-trigger and all of /sys read-only, cgroup2 is
# the namespace's own subtree. Then pivot_root, the host's tree detached, and
# systemd starts without the capabilities that reach the host's kernel from
# any namespace (modules, clock, raw I/O, the kernel log, audit).
SYSTEMD_SETUP = r"""
set -eu
work=$1 repo=$2 unit=$3
c=$work/c
mount -t tmpfs -o mode=0755 tmpfs "$c"
mkdir "$c/upper" "$c/work" "$c/root"
mount -t overlay overlay -o "lowerdir=/,upperdir=$c/upper,workdir=$c/work" "$c/root"
r=$c/root
mount -t proc -o nosuid,nodev,noexec proc "$r/proc"
for p in sys sysrq-trigger; do
    [ -e "$r/proc/$p" ] || continue
    mount --bind "$r/proc/$p" "$r/proc/$p"
    mount -o remount,bind,ro "$r/proc/$p"
done
mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$r/sys"
mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 "$r/sys/fs/cgroup"
mount -t tmpfs -o mode=0755,nosuid tmpfs "$r/dev"
for node in null zero full random urandom tty; do
    : > "$r/dev/$node"
    mount --bind "/dev/$node" "$r/dev/$node"
done
mkdir -m 1777 "$r/dev/shm"
mkdir "$r/dev/pts"
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts "$r/dev/pts"
ln -s pts/ptmx "$r/dev/ptmx"
ln -s /proc/self/fd "$r/dev/fd"
ln -s /proc/self/fd/0 "$r/dev/stdin"
ln -s /proc/self/fd/1 "$r/dev/stdout"
ln -s /proc/self/fd/2 "$r/dev/stderr"
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs "$r/run"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$r/tmp"
# A fresh host: what an install of gpu_preflight and the README's recipes leave
# on this machine is not in the container (removed in the overlay's upper
# layer; the machine's files stay). The tests install and write their own.
for p in etc/gpu_preflight.conf etc/gpu_preflight.token etc/cron.d/gpu-batch \
        etc/cron.d/rag-agent etc/cron.d/coder-agent etc/systemd/system/gpu-nightly.service \
        etc/systemd/system/gpu-nightly.timer usr/local/bin/gpu_preflight \
        usr/local/lib/gpu_preflight opt/jobs; do
    rm -rf "$r/$p"
done
mkdir -p "$r$repo"          # last: a checkout in /tmp or /run stays visible
mount --rbind "$repo" "$r$repo"
mount -o remount,bind,ro "$r$repo"
mkdir -p "$r/etc/systemd/system"
cp "$work/$unit" "$r/etc/systemd/system/$unit"
: > "$r/.gpfl-container"
cd "$r"
mkdir .gpfl-oldroot
pivot_root . .gpfl-oldroot
umount -l /.gpfl-oldroot
rmdir /.gpfl-oldroot
# refuse to boot anywhere but on the overlay, with the kernel's knobs read-only
[ -e /.gpfl-container ] || { echo "not the container's root" >&2; exit 1; }
for p in /proc/sys/kernel/pid_max /sys; do
    if [ -w "$p" ]; then echo "$p is writable" >&2; exit 1; fi
done
exec /usr/bin/env -i container=gpfl-test \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /usr/bin/setpriv \
    --bounding-set -sys_module,-sys_time,-sys_rawio,-syslog,-audit_control,-audit_write,-audit_read,-wake_alarm,-block_suspend \
    /lib/systemd/systemd --unit="$unit"
"""

#: The unit the container boots: what a host has before multi-user.target
#: (sysinit.target: journald, tmpfiles ...; sockets.target: /dev/log), no
#: services of the machine's own.
CONTAINER_TARGET = """\
[Unit]
Description=gpu_preflight test container
Wants=sockets.target
After=sockets.target
"""

SYSTEMD = "/lib/systemd/systemd"


def cgroup2_dir():
    """The directory of this process's cgroup in the cgroup2 hierarchy, or None."""
    mount = None
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            left, _, right = line.partition(" - ")
            if right.split(" ", 1)[0] == "cgroup2":
                mount = left.split(" ")[4]
                break
    if mount is None:
        return None
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            if line.startswith("0::"):
                return os.path.join(mount, line[3:].strip().lstrip("/"))
    return None


class SystemdContainer(object):
    """The machine's systemd as PID 1 of a container made of namespaces.

    Nothing it does reaches the machine: unshare --mount --pid --net --uts
    --ipc --cgroup --fork; the root is an overlay of / whose upper layer is a
    tmpfs (so /etc, /usr/local, /opt, /var written in there vanish with it),
    without what the machine's own gpu_preflight install and the README's
    recipes put there (/etc/gpu_preflight.conf, /usr/local/bin/gpu_preflight,
    /etc/cron.d/gpu-batch ...), so it starts as a fresh host;
    /run, /tmp and /dev are fresh tmpfs (/dev with null, zero, full, random,
    urandom and tty bound in, a new devpts); /proc is the namespace's own
    with /proc/sys and /proc/sysrq-trigger read-only, so systemd-sysctl and
    binfmt leave the kernel alone; /sys is a fresh read-only sysfs (no udev)
    with the cgroup namespace's cgroup2 on /sys/fs/cgroup; systemd's bounding
    set lacks CAP_SYS_MODULE, CAP_SYS_TIME, CAP_SYS_RAWIO, CAP_SYSLOG and the
    audit ones. Its cgroup is a new child of this process's cgroup2
    directory, removed by close(). The checkout is bound in read-only at its
    own path; the network is the namespace's own loopback only.

    It boots CONTAINER_TARGET (sysinit.target and sockets.target: journald
    with /dev/log, tmpfiles, ...), as `container=gpfl-test`, which systemd
    recognises: units conditioned on bare metal are skipped as in any
    container. Commands run in it with run() (nsenter into every namespace
    and its root); its files are reachable from here through path().
    """

    def __init__(self, work, unit_name="gpfl-test.target"):
        self.work = work
        self.proc = None
        self.pid = None
        self.cgroup = None
        parent = cgroup2_dir()
        if parent is None or not os.access(parent, os.W_OK):
            raise RuntimeError("no writable cgroup2 directory for the container")
        self.cgroup = os.path.join(parent, "gpfl-systemd-%d-%s" % (
            os.getpid(), os.path.basename(work)))
        os.mkdir(self.cgroup)
        os.mkdir(os.path.join(work, "c"), 0o755)
        with open(os.path.join(work, unit_name), "w") as handle:
            handle.write(CONTAINER_TARGET)
        procs = os.path.join(self.cgroup, "cgroup.procs")
        self.log_path = os.path.join(work, "container.out")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(support.prepared(     # the cgroup before
                ["/bin/sh", "-c", 'echo "$$" > "$0" && exec "$@"', procs,  # unshare:
                 "unshare", "--mount", "--pid", "--net", "--uts", "--ipc",  # its root
                 "--cgroup", "--fork", "--propagation", "private", "/bin/sh", "-c",
                 SYSTEMD_SETUP, "sh", work, support.REPO, unit_name]),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd="/", start_new_session=True)

    def start(self, timeout=60):
        """Wait until systemd has booted the container's target; self."""
        def booted():
            if self.proc.poll() is not None:
                raise AssertionError("the container ended (exit %s): %s" % (
                    self.proc.returncode, self.log()))
            if self.pid is None:
                self.pid = self._systemd_pid()
                if self.pid is None:
                    return False
            out = self.run(["systemctl", "is-system-running", "--wait"], check=False,
                           timeout=timeout)
            return out.strip() in ("running", "degraded") and out
        try:
            state = wait_for("systemd in the container", booted, timeout, 0.2)
        except Exception:
            self.close()
            raise
        if state.strip() != "running":
            failed = self.run(["systemctl", "--failed", "--no-legend", "--plain"],
                              check=False)
            self.close()
            raise AssertionError("the container booted %s: %s" % (state.strip(), failed))
        return self

    def _systemd_pid(self):
        """The pid (here) of the unshare's child once it is systemd."""
        try:
            with open("/proc/%d/task/%d/children" % (self.proc.pid, self.proc.pid)) as handle:
                children = handle.read().split()
            if not children:
                return None
            with open("/proc/%s/comm" % children[0]) as handle:
                comm = handle.read().strip()
            if comm != "systemd":
                return None
            with open("/proc/%s/root/.gpfl-container" % children[0]):
                pass                    # the overlay root, pivoted into
            return int(children[0])
        except (IOError, OSError):
            return None

    def log(self):
        with open(self.log_path, "rb") as handle:
            return handle.read().decode("utf-8", "replace")

    def argv(self, argv, env=None, cwd="/"):
        """argv as run in the container: its namespaces and root, env -i
        with env (default: PATH as a root login shell has it, HOME), cwd."""
        if self.pid is None:
            raise RuntimeError("the container has not started")
        environ = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   "HOME": "/root", "LOGNAME": "root", "USER": "root", "SHELL": "/bin/sh",
                   "LANG": "C.UTF-8"}
        if env is not None:
            environ = dict(env)
        prefix = ["nsenter", "--target", str(self.pid), "--mount", "--uts", "--ipc",
                  "--net", "--pid", "--cgroup", "--root", "--wd"]
        # (nsenter resolves --wd=DIR before it enters the root: env does it after)
        return prefix + ["--", "/usr/bin/env", "-i", "--chdir=%s" % cwd] + [
            "%s=%s" % item for item in sorted(environ.items())] + list(argv)

    def popen(self, argv, env=None, cwd="/", **kwargs):
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(self.argv(argv, env=env, cwd=cwd), cwd="/",
                                start_new_session=True, **kwargs)

    def run(self, argv, check=True, timeout=60, env=None, cwd="/", status=False):
        """Run argv in the container; its stdout and stderr together, as
        text (with status=True: (exit status, text))."""
        proc = self.popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
        try:
            out = proc.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise AssertionError("%s did not end within %ss in the container"
                                 % (argv, timeout))
        out = out.decode("utf-8", "replace")
        if check and proc.returncode != 0:
            raise AssertionError("%s: exit %d in the container: %s" % (
                " ".join(argv), proc.returncode, out))
        return (proc.returncode, out) if status else out

    def sh(self, script, **kwargs):
        """Run a shell command line in the container (see run)."""
        return self.run(["/bin/sh", "-c", script], **kwargs)

    def path(self, inside):
        """Where a path of the container is reachable from here."""
        return "/proc/%d/root%s" % (self.pid, inside)

    def netns_argv(self, argv):
        """argv run here, but in the container's network namespace (its
        127.0.0.1), e.g. an emulator listening on Ollama's own port."""
        return ["nsenter", "--target", str(self.pid), "--net", "--"] + list(argv)

    def close(self):
        """SIGKILL systemd (the kernel ends every process of its PID
        namespace), wait for the unshare, remove the cgroup subtree."""
        if self.proc is not None and self.proc.poll() is None:
            pid = self.pid or self._systemd_pid()
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.cgroup and os.path.isdir(self.cgroup):
            ends_at = time.monotonic() + 10
            while True:
                try:
                    for folder, subdirs, files in os.walk(self.cgroup, topdown=False):
                        os.rmdir(folder)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY) or \
                            time.monotonic() > ends_at:
                        raise
                    time.sleep(0.1)
