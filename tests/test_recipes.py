"""The README's recipes, checked as far as this machine allows.

Every gpu_preflight command line in the README's code blocks is parsed by
the script's own option parser (a typo in a recipe fails here); the systemd
units pass `systemd-analyze verify` with their programs replaced by real
executables; the Slurm health-check script passes `sh -n` and shellcheck.
Crontab lines run under a real cron in tests/test_cron.py.
"""

import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
import unittest

import support

gp = support.load_script()


def readme_blocks():
    """(info string, text) of every fenced code block in README.md."""
    with open(os.path.join(support.REPO, "README.md")) as handle:
        text = handle.read()
    return re.findall(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)  # novermin


def command_lines():
    """(line, options, whether a -- COMMAND follows) of every gpu_preflight
    invocation in a block."""
    found = []
    for info, body in readme_blocks():
        for line in body.replace("\\\n", " ").split("\n"):
            match = re.search(r"(?:^|[\s/])(?<!-t )gpu_preflight(?:\.py)? (-[^&|;\]]*)",
                              line)
            if not match or line.lstrip().startswith("command:"):
                continue
            options, dashes, _ = match.group(1).partition(" -- ")
            found.append((line, shlex.split(options, comments=True), bool(dashes)))
    return found


class RecipeTest(unittest.TestCase):
    def test_every_command_line_parses(self):
        """Each recipe line as the script itself reads a command line: every
        option taken as written, the COMMAND after -- found, the options
        merged without a configuration error."""
        lines = command_lines()
        self.assertGreaterEqual(len(lines), 9, "README lost its recipes?")
        for line, words, has_command in lines:
            with self.subTest(line=line):
                args = words + (["--", "/bin/true"] if has_command else [])
                try:
                    ns, command = gp.parse_command_line(args)
                    opts = gp.resolve_options(ns, {}, {})
                except (gp._ParserExit, gp.ConfigError) as exc:
                    self.fail("%s: %r" % (line, exc))
                self.assertEqual(command, ["/bin/true"] if has_command else None)
                given = [w.split("=")[0] for w in words
                         if w.startswith("--") or w in ("-v", "-q")]
                self.assertTrue(given, "no option read from the line")
                for word in given:
                    name = {"-v": "verbose", "-q": "quiet"}.get(word, word[2:])
                    self.assertIsNotNone(getattr(ns, name.replace("-", "_"), None),
                                         "%s not taken as given" % word)
                    self.assertIsNotNone(getattr(opts, name.replace("-", "_"), None), word)

    def test_systemd_units_verify(self):
        tool = support.require_tool(self, "systemd-analyze")
        units = [(body.split("\n", 1)[0][len("# /etc/systemd/system/"):], body)
                 for info, body in readme_blocks()
                 if body.startswith("# /etc/systemd/system/")]
        self.assertEqual(sorted(name for name, _ in units),
                         ["gpu-nightly.service", "gpu-nightly.timer"])
        work = tempfile.mkdtemp(prefix="gpfl-units-")
        self.addCleanup(shutil.rmtree, work, True)
        script = os.path.join(work, "gpu_preflight")
        shutil.copy(support.SCRIPT, script)
        os.chmod(script, 0o755)
        paths = []
        for name, body in units:
            paths.append(os.path.join(work, name))
            with open(paths[-1], "w") as handle:
                handle.write(body.replace("/usr/local/bin/gpu_preflight", script)
                             .replace("/opt/jobs/nightly.sh", "/bin/true"))
        proc = subprocess.run([tool, "verify", "--man=no"] + paths,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.assertEqual((proc.returncode, proc.stdout.decode()), (0, ""))

    def test_slurm_health_check_script(self):
        scripts = [body for info, body in readme_blocks()
                   if info == "sh" and "HealthCheckProgram" in body]
        self.assertEqual(len(scripts), 1)
        work = tempfile.mkdtemp(prefix="gpfl-slurm-")
        self.addCleanup(shutil.rmtree, work, True)
        path = os.path.join(work, "healthcheck.sh")
        with open(path, "w") as handle:
            handle.write(scripts[0])
        subprocess.run(["sh", "-n", path], check=True)
        shellcheck = support.require_tool(self, "shellcheck")
        subprocess.run([shellcheck, "-s", "sh", path], check=True)


if __name__ == "__main__":
    unittest.main()
