"""The README's recipes, checked as far as this machine allows.

Every gpu_preflight command line in the README's code blocks is parsed by
the script's own option parser (a typo in a recipe fails here); the systemd
units pass `systemd-analyze verify` with their programs replaced by real
executables; the Slurm health-check script passes `sh -n` and shellcheck.
Crontab lines run under a real cron in tests/test_cron.py; the quick
start's cron line also runs here, its command as printed, against a model
that Ollama must load first.

The reference is held against the script: the "--json prints one object
with these fields" list names exactly the keys that --json prints (nested
lists too), and the options table lists every long option of --help with its
GPU_PREFLIGHT_ variable and a "check" column that matches the option's role.
The README's order is held too: what an on-call admin needs (install, a cron
line, a sample skip line, the exit table) within its first 100 lines, and a
table of contents that links every section.
"""

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import unittest

import fakes
import support
from ollama_emu import Emulator

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
            match = re.search(r"(?:^|[\s/])(?<!-t )gpu_preflight(?:\.py)? (-[^&|;\])]*)",
                              line)
            if not match or line.lstrip().startswith("command:"):
                continue
            options, dashes, _ = match.group(1).partition(" -- ")
            found.append((line, shlex.split(options, comments=True), bool(dashes)))
    return found


def readme_text():
    with open(os.path.join(support.REPO, "README.md")) as handle:
        return handle.read()


def readme_json_fields():
    """{top-level key: [its nested keys]} of the README's sentence "`--json`
    prints one object with these fields: ...": names in backticks, a
    parenthesis after a key listing the keys of its objects."""
    match = re.search(r"(?ms)^`--json` prints one object with these fields: (.*?)\n\n",
                      readme_text())
    if not match:
        raise AssertionError("README.md lost its sentence \"`--json` prints one "
                             "object with these fields: ...\"")
    fields, depth, last = {}, 0, None
    for token in re.findall(r"`[a-z_]+`|[()]", match.group(1)):
        if token == "(":
            depth += 1
        elif token == ")":
            depth -= 1
        elif depth == 0:
            last = token.strip("`")
            if last in fields:
                raise AssertionError("README names --json field %s twice" % last)
            fields[last] = []
        elif depth == 1 and last is not None:
            fields[last].append(token.strip("`"))
        else:
            raise AssertionError("README's --json list nests deeper than expected")
    return fields


def readme_options_table():
    """[(long option or None, environment variable, check cell, row)] of the
    table under "### Options and environment"."""
    section = re.search(r"(?ms)^### Options and environment\n(.*?)(?=^#)", readme_text())
    if not section:
        raise AssertionError("README.md lost its section ### Options and environment")
    rows = []
    for line in section.group(1).splitlines():
        if not line.startswith("| ") or line.startswith("| option ") or \
                line.startswith("|---"):
            continue
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) != 5:
            raise AssertionError("not a row of five cells: %r" % line)
        longs = re.findall(r"`(?:-\w, )?--([a-z][a-z-]*)", cells[0])
        if cells[0] != "(environment only)" and len(longs) != 1:
            raise AssertionError("a row without one long option: %r" % line)
        env = re.match(r"`(GPU_PREFLIGHT_[A-Z_]+)`", cells[1])
        if not env:
            raise AssertionError("a row without its GPU_PREFLIGHT_ variable: %r" % line)
        rows.append((longs[0] if longs else None, env.group(1), cells[2], line))
    return rows


def readme_anchors():
    """[(level, anchor)] of the README's headings outside code blocks, each
    with the anchor GitHub gives it: the text lower-cased, punctuation but
    dashes dropped, spaces made dashes ("(`--gpu`)" gives "---gpu")."""
    found, fenced = [], False
    for line in readme_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            hashes, title = line.split(" ", 1)
            title = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower())
            found.append((len(hashes), title.replace(" ", "-")))
    return found


def help_long_options():
    """The long options that `gpu_preflight.py --help` prints, in order."""
    proc = subprocess.run([sys.executable, support.SCRIPT, "--help"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=support.cron_env())
    if proc.returncode != 0:
        raise AssertionError("--help: exit %d: %r" % (proc.returncode, proc.stderr))
    found = []
    for line in proc.stdout.decode("utf-8").splitlines():
        match = re.match(r"^  (?:-\w, )?--([a-z][a-z-]*)", line)
        if match and match.group(1) not in found:
            found.append(match.group(1))
    return found


class ReferenceTest(unittest.TestCase):
    """The README's reference sections against what the script does."""

    maxDiff = None

    def test_json_field_list_names_exactly_the_keys_json_prints(self):
        fields = readme_json_fields()
        work = tempfile.mkdtemp(prefix="gpfl-json-")
        self.addCleanup(shutil.rmtree, work, True)
        root = fakes.make_amd_sysfs(work, [dict(busy=1, used_mib=512, total_mib=65536,
                                                temp_c=40, name="AMD Instinct")])
        with Emulator(mode="healthy") as emu:
            res = support.run_script(["--host", emu.url, "--json", "--no-syslog",
                                      "--gpu", "--gpu-backend", "amd-sysfs"],
                                     env=support.cron_env(GPU_PREFLIGHT_ROOT=root))
        self.assertEqual(res.code, 0, res)
        doc = json.loads(res.stdout)
        self.assertEqual(sorted(fields), sorted(doc), "README's --json list vs --json")
        nested = {"models": doc["models"], "stages": doc["stages"], "gpu": [doc["gpu"]]}
        for key, objects in sorted(nested.items()):
            with self.subTest(field=key):
                self.assertTrue(objects and all(isinstance(o, dict) for o in objects), doc)
                printed = set()
                for obj in objects:
                    printed.update(obj)
                self.assertEqual(sorted(fields[key]), sorted(printed),
                                 "README's keys of %s vs --json" % key)
        # only a model's stage names its model, as the README says
        for stage in doc["stages"]:
            self.assertEqual("model" in stage, stage["name"] == "warmup", stage)
        others = sorted(k for k, v in fields.items() if v and k not in nested)
        self.assertEqual(others, [], "README lists keys of a field this test does not read")

    def test_options_table_lists_every_long_option_with_its_variable_and_role(self):
        rows = readme_options_table()
        listed = [name for name, env, check, line in rows if name]
        self.assertEqual(len(listed), len(set(listed)), "an option listed twice")
        printed = [name for name in help_long_options() if name not in ("help", "version")]
        self.assertEqual(sorted(listed), sorted(printed),
                         "the options table vs gpu_preflight.py --help")
        role = dict((entry.name, entry.role) for entry in gp.each_option())
        self.assertEqual(sorted(set(printed) - set(role)), ["config"],
                         "an option of --help that each_option() does not know")
        for name, env, check, line in rows:
            with self.subTest(row=line):
                if name is None:            # environment only: the script reads it
                    self.assertIn(env[len(gp.ENV_PREFIX):], ("TOKEN", "ROOT"), line)
                    self.assertEqual(check, {"TOKEN": "yes (digest)",
                                             "ROOT": "yes"}[env[len(gp.ENV_PREFIX):]], line)
                    continue
                self.assertEqual(env, gp.ENV_PREFIX + name.upper().replace("-", "_"), line)
                if name == "config":        # not an option of the check (NOT_A_CHECK)
                    self.assertEqual(check, "", line)
                    continue
                self.assertIn(role[name], (gp.CHECK, gp.HOW_IT_RUNS), name)
                self.assertEqual(check, "yes" if role[name] == gp.CHECK else "", line)


class ReadmeOrderTest(unittest.TestCase):
    """The README in the order an on-call admin reads it: the first 100 lines
    install, schedule and explain a skipped job; the contents lead to every
    section, and every link to a section finds it."""

    def test_the_first_100_lines_install_schedule_and_explain_a_skip(self):
        head = "\n".join(readme_text().splitlines()[:100])
        wanted = [("the install line", r"(?m)^sudo sh install\.sh "),
                  ("a cron line", r"(?m)^```cron\n# /etc/cron\.d/\S+: .*\n.* root  /"),
                  ("where to look", r"journalctl -t gpu_preflight"),
                  ("a sample skip line", r" gpu_preflight\[\d+\]: result=skip code=\d+ ")]
        wanted += [("exit table row %s" % code, r"(?m)^\| %s \| " % code)
                   for code in ("0", "64", "69", "70", "75", "78", "126, 127", "130, 143")]
        missing = [what for what, pattern in wanted if not re.search(pattern, head)]
        self.assertEqual(missing, [], "not in the README's first 100 lines")

    def test_the_contents_link_every_section_in_order(self):
        contents = re.search(r"(?ms)^## Contents\n(.*?)(?=^## )", readme_text())
        self.assertTrue(contents, "README.md lost its ## Contents")
        sections = [anchor for level, anchor in readme_anchors()
                    if level == 2 and anchor != "contents"]
        linked = re.findall(r"\]\(#([^)]+)\)", contents.group(1))
        self.assertEqual([anchor for anchor in linked if anchor in sections], sections)

    def test_every_link_to_a_section_finds_it(self):
        anchors = set(anchor for level, anchor in readme_anchors())
        links = re.findall(r"\]\(#([^)]+)\)", readme_text())
        self.assertGreater(len(links), 20, "the README lost its links?")
        self.assertEqual([link for link in links if link not in anchors], [])


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

    def test_the_unittest_lines_of_running_the_tests_run_from_the_repository_root(self):
        """`python3 -m unittest tests.MODULE` as "Running the tests" shows it:
        the test modules import their helpers (`import support`) by name."""
        section = re.search(r"(?ms)^## Running the tests\n(.*?)(?=^## )", readme_text())
        lines = re.findall(r"^python3 -m unittest ([\w.]+)", section.group(1), re.M)
        self.assertGreaterEqual(len(lines), 2, "the section lost its unittest lines")
        for name in lines:
            with self.subTest(name=name):
                proc = subprocess.run([sys.executable, "-m", "unittest", name],
                                      cwd=support.REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, env=support.cron_env())
                said = proc.stdout.decode("ascii", "replace")
                self.assertEqual(proc.returncode, 0, said)
                self.assertRegex(said, r"\nRan [1-9]\d* tests? in ", said)

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

    def test_the_no_mta_advice_appends_the_skip_line_and_not_the_jobs_stderr(self):
        """Output's advice for a host without syslog daemon or mail transfer
        agent, as written: the cron command appends the preflight's skip line
        to the file; the job's stderr, when it runs, goes elsewhere."""
        text = " ".join(readme_text().split())
        found = re.findall(r"`(/usr/local/bin/gpu_preflight [^`]*2>>[^`]*)`", text)
        self.assertEqual(len(found), 1, "the README's no-MTA redirect example")
        work = tempfile.mkdtemp(prefix="gpfl-nomta-")
        self.addCleanup(shutil.rmtree, work, True)
        log, job = os.path.join(work, "gp.log"), os.path.join(work, "job.sh")
        with open(job, "w") as handle:
            handle.write("#!/bin/sh\necho job-said >&2\n")
        os.chmod(job, 0o755)
        conf = os.path.join(work, "gp.conf")
        with open(conf, "w") as handle:
            handle.write("[gpu_preflight]\n")
        line = (found[0].replace("/usr/local/bin/gpu_preflight", "%s %s" % (
            sys.executable, support.SCRIPT)).replace("/var/log/gpu_preflight.log", log)
            .replace("/opt/jobs/batch.sh", job))
        model = re.search(r"--model (\S+)", line).group(1)
        for served, result, in_log in (("other", "result=skip code=78", 1),
                                       (model, "job-said", 0)):
            with self.subTest(served=served), Emulator(models=(served,)) as emu:
                with open(log, "w"):
                    pass                # each run's lines only
                proc = subprocess.run(["/bin/sh", "-c", line], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      env=support.cron_env(
                                          GPU_PREFLIGHT_HOST=emu.url,
                                          GPU_PREFLIGHT_CONFIG=conf,
                                          GPU_PREFLIGHT_SYSLOG_ADDRESS=os.path.join(
                                              work, "no-daemon.sock")))
                with open(log) as handle:
                    logged = handle.read().splitlines()
                said = proc.stdout + proc.stderr
                self.assertEqual(len(logged), in_log, logged)
                self.assertIn(result, (logged or [said.decode()])[0])
                self.assertEqual(said, b"" if in_log else b"job-said\n", line)

    def test_the_quick_start_cron_line_runs_its_job_when_the_model_must_load(self):
        """The quick start's cron line, its command as printed, on a schedule
        where Ollama unloaded the model between runs (a 12 s load, past the
        deadline of 10 s a run without a load to wait for would get): the job
        runs. /usr/local/bin/gpu_preflight and /opt/jobs are this test's, in a
        mount namespace of its own; the host comes from GPU_PREFLIGHT_HOST."""
        unshare = support.require_tool(self, "unshare", "/usr/bin/unshare")
        section = re.search(r"(?ms)^## Quick start\n(.*?)(?=^## )", readme_text())
        block = re.search(r"(?ms)^```cron\n(.*?)^```$", section.group(1))
        lines = [l for l in block.group(1).splitlines() if l.strip() and l[0] != "#"]
        self.assertEqual(len(lines), 1, "the quick start's cron block: one line")
        command = lines[0].split(None, 6)[6]        # after the schedule and user
        program, job = shlex.split(command)[0], re.search(r"&&\s*(\S+)", command).group(1)
        work = tempfile.mkdtemp(prefix="gpfl-quick-")
        self.addCleanup(shutil.rmtree, work, True)
        marker, files = os.path.join(work, "ran"), []
        launcher = '#!/bin/sh\nexec %s %s "$@"\n' % (sys.executable, support.SCRIPT)
        record = "#!/bin/sh\necho ran >>%s\n" % marker
        for path, text in ((program, launcher), (job, record)):
            self.assertRegex(path, r"^/(usr/local/bin|opt)/")
            files.append(os.path.join(work, path.lstrip("/")))
            os.makedirs(os.path.dirname(files[-1]), exist_ok=True)
            with open(files[-1], "w") as handle:
                handle.write(text)
            os.chmod(files[-1], 0o755)
        os.makedirs(os.path.join(work, "opt"), exist_ok=True)
        os.makedirs(os.path.join(work, "usr/local/bin"), exist_ok=True)
        setup = ('set -e; mount --bind "$1/usr/local/bin" /usr/local/bin; '
                 'mount --bind "$1/opt" /opt; exec /bin/sh -c "$2"')
        sink, load = support.SyslogSink(), 12
        self.addCleanup(sink.close)
        with Emulator(loaded=(), load_seconds=load) as emu:
            proc = subprocess.run(
                [unshare, "--mount", "--propagation", "private", "/bin/sh", "-c", setup,
                 "sh", work, command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, timeout=120, env=support.cron_env(
                    GPU_PREFLIGHT_HOST=emu.url, GPU_PREFLIGHT_SYSLOG_ADDRESS=sink.path))
        self.assertEqual((proc.returncode, proc.stdout), (0, b""), command)
        with open(marker) as handle:
            self.assertEqual(handle.read(), "ran\n")
        fields = support.parse_fields(sink.messages()[0].partition("]: ")[2])
        self.assertEqual((fields["result"], fields["was_loaded"]), ("ready", "no"))
        self.assertGreaterEqual(int(fields["load_ms"]), load * 1000)

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
