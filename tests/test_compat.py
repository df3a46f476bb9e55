"""The product's fixed shape: one ASCII, stdlib-only file that 3.6 parses.

Three layers hold the Python floor: this interpreter compiling the file (the
suite runs under every version from 3.6 to 3.13), ast.parse with
feature_version=(3, 6) where the interpreter has it, and vermin.
"""

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import unittest

import support


def source():
    with open(support.SCRIPT, "rb") as handle:
        return handle.read()


class ShapeTest(unittest.TestCase):
    def test_ascii_only(self):
        source().decode("ascii")

    def test_parses_as_python_3_6(self):
        tree = compile(source(), support.SCRIPT, "exec", ast.PyCF_ONLY_AST)
        self.assertIsInstance(tree, ast.Module)
        if sys.version_info >= (3, 8):
            ast.parse(source(), feature_version=(3, 6))  # novermin: guarded

    def test_imports_only_the_standard_library(self):
        stdlib = sysconfig.get_paths()["stdlib"]
        tree = ast.parse(source())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                names.add(node.module.split(".")[0])
        self.assertIn("urllib", names)
        for name in sorted(names):
            if name in sys.builtin_module_names:
                continue
            module = __import__(name)
            where = os.path.realpath(getattr(module, "__file__", "") or "")
            self.assertTrue(where.startswith(os.path.realpath(stdlib)),
                            "%s comes from %s, not the standard library" % (name, where))
            self.assertNotIn("site-packages", where)

    def test_only_the_main_guard_exits(self):
        tree = ast.parse(source())
        guard = [n for n in tree.body if isinstance(n, ast.If)
                 and "__main__" in ast.dump(n.test)]
        self.assertEqual(len(guard), 1)
        allowed = set(id(n) for n in ast.walk(guard[0]))
        # A forked GPU probe must end with os._exit: it may not unwind into main().
        spawn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "spawn"]
        allowed.update(id(n) for n in ast.walk(spawn[0]) if isinstance(n, ast.Call)
                       and getattr(n.func, "attr", "") == "_exit")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("exit", "_exit") \
                    and isinstance(node.func.value, ast.Name) \
                    and node.func.value.id in ("sys", "os"):
                self.assertIn(id(node), allowed, "exit call at line %d" % node.lineno)

    def test_top_level_layout(self):
        allowed = {"gpu_preflight.py", "README.md", "tests", "install.sh", "LICENSE",
                   ".ci", ".gitignore", ".gitattributes"}
        git = shutil.which("git")
        # .git is a directory in a clone, a file in a worktree. git refuses a
        # checkout owned by another user ("dubious ownership") unless told it
        # is safe; -c on the command line is enough for this one read.
        if git and os.path.exists(os.path.join(support.REPO, ".git")):
            proc = subprocess.Popen(
                [git, "-c", "safe.directory=*", "ls-files", "-z"],
                cwd=support.REPO, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = proc.communicate()
            self.assertEqual(proc.returncode, 0, err.decode("utf-8", "replace"))
            entries = set(p.split("/")[0] for p in out.decode().split("\0") if p)
        else:
            entries = set(os.listdir(support.REPO)) - {".git"}
        self.assertLessEqual(entries, allowed)
        self.assertIn("gpu_preflight.py", entries)


class VerminTest(unittest.TestCase):
    ONCE = True     # vermin reads the files, whatever runs the suite: once a run

    def test_vermin_finds_nothing_newer_than_3_6(self):
        vermin = support.require_tool(self, "vermin", os.environ.get("VERMIN"))
        files = [support.SCRIPT] + sorted(
            os.path.join(support.TESTS, f) for f in os.listdir(support.TESTS)
            if f.endswith(".py"))
        proc = subprocess.Popen(
            [vermin, "-t=3.6-", "--violations", "--eval-annotations",
             "--feature", "union-types", "--no-tips"] + files,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out = proc.communicate()[0].decode("utf-8", "replace")
        self.assertEqual(proc.returncode, 0, out)


if __name__ == "__main__":
    unittest.main()
