"""A real rsyslog daemon receives gpu_preflight's line, on a private socket.

rsyslogd runs in the foreground of a child process with a private config
(never touching /dev/log), listening on a UNIX socket and on UDP, and writes
"facility.severity tag msg" lines to a file that the tests read back.
"""

import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

import support
from ollama_emu import Emulator, free_port

CONFIG = """\
global(workDirectory="{dir}" processInternalMessages="on")
module(load="imuxsock" SysSock.Use="off")
input(type="imuxsock" Socket="{dir}/log.sock" CreatePath="on")
module(load="imudp")
input(type="imudp" Address="127.0.0.1" Port="{port}")
template(name="line" type="string"
         string="%syslogfacility-text%.%syslogseverity-text% %syslogtag%%msg%\\n")
*.* action(type="omfile" file="{dir}/out.log" template="line")
"""


class RsyslogTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = None
        cls.dir = tempfile.mkdtemp(prefix="gpfl-rsyslog-")

    @classmethod
    def tearDownClass(cls):
        if cls.daemon is not None:
            cls.daemon.send_signal(signal.SIGTERM)
            try:
                cls.daemon.wait(10)
            except subprocess.TimeoutExpired:
                cls.daemon.kill()
                cls.daemon.wait()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def setUp(self):
        if type(self).daemon is None:
            type(self).start_daemon(self)
        self.out = os.path.join(self.dir, "out.log")

    @classmethod
    def start_daemon(cls, testcase):
        rsyslogd = support.require_tool(testcase, "rsyslogd", "/usr/sbin/rsyslogd")
        cls.udp_port = free_port()
        conf = os.path.join(cls.dir, "rsyslog.conf")
        with open(conf, "w") as handle:
            handle.write(CONFIG.format(dir=cls.dir, port=cls.udp_port))
        cls.daemon = subprocess.Popen(
            [rsyslogd, "-n", "-iNONE", "-f", conf],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        out = os.path.join(cls.dir, "out.log")
        until = time.monotonic() + 15
        while time.monotonic() < until:
            if os.path.exists(os.path.join(cls.dir, "log.sock")) and os.path.exists(out):
                with open(out) as handle:
                    if "start" in handle.read():
                        return
            if cls.daemon.poll() is not None:
                break
            time.sleep(0.05)
        testcase.fail("rsyslogd did not start (exit %r)" % cls.daemon.poll())

    def wait_for_line(self, needle, wait=10.0):
        until = time.monotonic() + wait
        while time.monotonic() < until:
            with open(self.out) as handle:
                for line in handle:
                    if needle in line:
                        return line.rstrip("\n")
            time.sleep(0.05)
        with open(self.out) as handle:
            self.fail("no line with %r in rsyslog's output:\n%s" % (needle, handle.read()))

    def test_ready_is_info_on_the_chosen_facility(self):
        sock = os.path.join(self.dir, "log.sock")
        with Emulator().start() as emu:
            res = support.run_script(["--host", emu.url, "--syslog-address", sock,
                                      "--syslog-facility", "local3"])
        self.assertEqual(res.code, 0, res)
        self.assertEqual((res.stdout, res.stderr), ("", ""))
        line = self.wait_for_line("host=%s" % emu.url)
        self.assertTrue(line.startswith("local3.info gpu_preflight["), line)
        fields = support.parse_fields(line.split("]: ", 1)[1])
        self.assertEqual(fields["result"], "ready")
        self.assertEqual(fields["model"], "llama3.2:latest")

    def test_skip_is_warning_and_config_error_is_err(self):
        sock = os.path.join(self.dir, "log.sock")
        port = free_port()
        res = support.run_script(["--host", "127.0.0.1:%d" % port,
                                  "--syslog-address", sock, "--syslog-facility", "daemon"])
        self.assertEqual(res.code, 69, res)
        line = self.wait_for_line("host=http://127.0.0.1:%d" % port)
        self.assertTrue(line.startswith("daemon.warning gpu_preflight["), line)
        self.assertIn("code=69", line)

        res = support.run_script(["--config", "/nonexistent/gp.conf", "--host",
                                  "127.0.0.1:%d" % (port + 1), "--syslog-address", sock])
        self.assertEqual(res.code, 78, res)
        line = self.wait_for_line("host=http://127.0.0.1:%d" % (port + 1))
        self.assertTrue(line.startswith("user.err gpu_preflight["), line)
        self.assertIn("cannot read config file", line)

    def test_udp_collector(self):
        port = free_port()
        res = support.run_script(["--host", "127.0.0.1:%d" % port, "--syslog-address",
                                  "127.0.0.1:%d" % self.udp_port,
                                  "--syslog-facility", "local7"])
        self.assertEqual(res.code, 69, res)
        line = self.wait_for_line("host=http://127.0.0.1:%d" % port)
        # the hostname in the datagram was parsed as such, not taken as the tag
        self.assertTrue(line.startswith("local7.warning gpu_preflight["), line)


if __name__ == "__main__":
    unittest.main()
