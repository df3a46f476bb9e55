"""The GPU layer against NVIDIA's own nvml.h (no GPU needed).

The header comes from NVIDIA's headers-only wheel nvidia-nvml-dev, which
.ci/run installs into its test venv and names in NVML_INCLUDE_DIR. Outside CI
the test also looks in that venv, /usr/local/cuda/include and /usr/include,
and skips when there is none; under CI=true a missing header or cc fails.

  * tests/fake_nvml.c compiled with nvml.h included (-Werror, and
    -Wmissing-prototypes so that no function of the fake goes unchecked): a
    fake function whose signature differs from NVIDIA's declaration is a
    compile error, so a test failure (a control proves it is). The fake's
    plain build declares nvml.h's types itself; those declarations are held
    against the header too.
  * gpu_preflight.nvml_structs(): each ctypes Structure's size and each
    field's name, order, offset and size against sizeof/offsetof printed by
    a C program built against nvml.h (field names and order read from the
    header's typedef); every int NVML_* constant of the script against the
    header's value; the plain numbers nvml_snapshot() passes (sensor, ECC,
    MIG values, buffer sizes) and the ctypes widths it passes enums with.
  * every nvml* function the script looks up by name is declared by nvml.h
    under that very name (not a #define to a _v2/_v3).
"""

import ast
import ctypes
import glob
import os
import re
import shutil
import subprocess
import tempfile
import unittest

import fakes
import support

#: The ctypes classes nvml_structs() returns, in order, and nvml.h's names.
STRUCTS = ("nvmlMemory_t", "nvmlMemory_v2_t", "nvmlProcessInfo_v1_t",
           "nvmlProcessInfo_v2_t", "nvmlGpuFabricInfo_v3_t", "nvmlFieldValue_t",
           "nvmlPciInfo_t")
#: Script constants whose nvml.h name is not NVML_ERROR_<rest> or the same.
CONSTANT_NAMES = {"NVML_MEMORY_V2": "nvmlMemory_v2",
                  "NVML_GPU_FABRIC_INFO_V3": "nvmlGpuFabricInfo_v3",
                  "NVML_GPU_FABRIC_INFO_V2": "nvmlGpuFabricInfo_v2"}
#: The struct versions the fake's plain build defines itself.
VERSIONS = ("nvmlMemory_v2", "nvmlGpuFabricInfo_v3", "nvmlGpuFabricInfo_v2")
#: Functions the script surely calls: the extraction below must find them.
SURELY_CALLED = ("nvmlInit_v2", "nvmlShutdown", "nvmlErrorString",
                 "nvmlDeviceGetMemoryInfo_v2",
                 "nvmlDeviceGetComputeRunningProcesses")
#: Compiler flags: every warning an error; no definition without nvml.h's
#: prototype. The unversioned names stay themselves (see fake_nvml.c).
WERROR = ["-Wall", "-Werror", "-Wmissing-prototypes"]
NVML_FUNCTION = re.compile(r"nvml[A-Z][A-Za-z0-9_]*\Z")


def header_candidates():
    """Where nvml.h may be, outside CI (the CI venv first)."""
    venv = os.path.join(os.environ.get("TMPDIR") or "/tmp", "gpu_preflight-ci-venv")
    return (sorted(glob.glob(os.path.join(
        venv, "lib", "python3*", "site-packages", "nvidia", "*", "include")))
            + ["/usr/local/cuda/include", "/usr/include"])


def require_header(testcase, header="nvml.h", variable="NVML_INCLUDE_DIR",
                   wheel="nvidia-nvml-dev"):
    """The directory holding NVIDIA's header (named by variable, from the
    wheel); skip outside CI, fail under CI=true."""
    given = os.environ.get(variable)
    if given:
        if not os.path.isfile(os.path.join(given, header)):
            testcase.fail("%s=%s holds no %s" % (variable, given, header))
        return given
    if support.IN_CI:
        testcase.fail("%s is not set (CI=true: .ci/run must install the %s wheel "
                      "and export it)" % (variable, wheel))
    for directory in header_candidates():
        if os.path.isfile(os.path.join(directory, header)):
            return directory
    raise unittest.SkipTest("NVIDIA's %s not found: pip install %s (into any venv) and "
                            "set %s to the directory holding it" % (header, wheel, variable))


def strip_comments(text):
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def header_fields(header, struct):
    """The field names of `typedef struct ... { } struct;` in nvml.h, in order."""
    for body, names in re.findall(r"typedef\s+struct\s*\w*\s*\{([^{}]*)\}\s*([\w\s,]+);",
                                  header):
        if struct in re.split(r"[\s,]+", names.strip()):
            return [re.findall(r"(\w+)\s*(?:\[[^\]]*\])?\s*\Z", decl.strip())[0]
                    for decl in body.split(";") if decl.strip()]
    raise AssertionError("nvml.h has no typedef struct %s" % struct)


def called_functions(source):
    """The nvml* names gpu_preflight.py looks up: string literals that are a
    whole function name (call("nvmlInit_v2")) and attributes (lib.nvmlX)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        kind = type(node).__name__             # no ast.Str: deprecated in 3.12
        if kind == "Constant" and isinstance(node.value, str):
            value = node.value
        elif kind == "Str":
            value = node.s
        elif kind == "Attribute":
            value = node.attr
        else:
            continue
        if NVML_FUNCTION.match(value):
            names.add(value)
    return names


class NvmlHeaderCase(unittest.TestCase):
    maxDiff = None

    @classmethod
    def setUpClass(cls):
        case = unittest.TestCase()
        cls.cc = support.require_tool(case, "cc")
        cls.include = require_header(case)
        with open(os.path.join(cls.include, "nvml.h"), encoding="utf-8",
                  errors="replace") as header:
            cls.header = strip_comments(header.read())
        cls.dir = tempfile.mkdtemp(prefix="gpfl-nvmlh-")
        with open(fakes.FAKE_NVML_C, encoding="utf-8") as source:
            cls.fake_source = source.read()
        with open(support.SCRIPT, encoding="utf-8") as source:
            cls.script_source = source.read()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def compile(self, name, source, flags, shared=False):
        """Compile source (text) against nvml.h; return (exit status, output, path)."""
        path = os.path.join(self.dir, name)
        with open(path + ".c", "w", encoding="utf-8") as out:
            out.write(source)
        cmd = ([self.cc] + (["-shared", "-fPIC"] if shared else []) + flags
               + ["-I", self.include, "-o", path, path + ".c"])
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, cwd=self.dir)
        output = proc.communicate(timeout=60)[0].decode("utf-8", "replace")
        return proc.returncode, "%s\n%s" % (" ".join(cmd), output[-6000:]), path

    def build_fake(self, name, source, variant=()):
        return self.compile(name, source, WERROR + ["-O1", "-DFAKE_NVML_WITH_HEADER"]
                            + list(variant), shared=True)

    def run_c(self, name, source):
        """Compile and run a C program against nvml.h; return its stdout lines."""
        code, output, path = self.compile(name, source, WERROR)
        self.assertEqual(code, 0, "C program against nvml.h did not compile:\n" + output)
        return subprocess.check_output([path], timeout=30).decode("ascii").splitlines()

    # ---- (a) the fake's functions are NVIDIA's declarations -------------

    def test_fake_nvml_compiles_against_header(self):
        """Every function of the fake checked by nvml.h, and exported under
        its own name (no macro of nvml.h renamed it)."""
        code, output, path = self.build_fake("fake", self.fake_source)
        self.assertEqual(code, 0, "tests/fake_nvml.c disagrees with NVIDIA's nvml.h:\n"
                         + output)
        defined = re.findall(r"^(?:nvmlReturn_t|const char \*)\s*(nvml\w+)\(",
                             self.fake_source, re.M)
        self.assertGreaterEqual(len(defined), 20, defined)
        lib = ctypes.CDLL(path)
        self.assertEqual([name for name in defined if not hasattr(lib, name)], [],
                         "not exported under the name the fake defines")

    def test_old_driver_fake_compiles_against_header(self):
        code, output, _ = self.build_fake("fake-old", self.fake_source,
                                          ["-DFAKE_OLD_DRIVER"])
        self.assertEqual(code, 0, "tests/fake_nvml.c -DFAKE_OLD_DRIVER disagrees with "
                         "NVIDIA's nvml.h:\n" + output)

    def test_plain_fake_declarations_match_header(self):
        """The plain build (what tests/test_gpu.py runs) declares nvml.h's
        types itself: each struct's fields, sizes and offsets, each enum's
        width and each constant's value as nvml.h has them."""
        start, end = "#include <nvml.h>\n#else\n", "#endif /* FAKE_NVML_WITH_HEADER */"
        block = strip_comments(self.fake_source[
            self.fake_source.index(start) + len(start):self.fake_source.index(end)])
        types = [name for names in re.findall(r"\}\s*([\w\s,]+);", block)
                 for name in re.split(r"[\s,]+", names) if name] + ["nvmlDevice_t"]
        constants = sorted(set(re.findall(r"\b(NVML_[A-Z0-9_]+)\s*[=,}]", block)
                               + re.findall(r"#define\s+(NVML_[A-Z0-9_]+)\s", block)))
        self.assertGreaterEqual(len(constants), 12, constants)
        self.assertIn("nvmlMemory_v2_t", types)
        lines = ["#include <stddef.h>", "#include <stdio.h>", "DECLARATIONS",
                 "int main(void)", "{"]
        for name in types:
            lines.append('    printf("sizeof %s %%zu\\n", sizeof(%s));' % (name, name))
            if not re.search(r"typedef\s+struct\s*\w*\s*\{[^{}]*\}[\w\s,]*\b%s\b"
                             % name, block):
                continue                        # an enum or the handle
            fields = header_fields(block, name)
            self.assertEqual(fields, header_fields(self.header, name), name)
            for field in fields:
                lines.append('    printf("%s.%s %%zu %%zu\\n", offsetof(%s, %s), '
                             'sizeof(((%s *)0)->%s));'
                             % (name, field, name, field, name, field))
        for name in constants + list(VERSIONS):
            lines.append('    printf("%s %%lld\\n", (long long)(%s));' % (name, name))
        program = "\n".join(lines + ["    return 0;", "}", ""])
        theirs = self.run_c("plain-header", program.replace(
            "DECLARATIONS", "#include <nvml.h>"))
        ours = self.run_c("plain-fake", program.replace("DECLARATIONS", block))
        self.assertEqual(ours, theirs, "fake_nvml.c's own declarations vs nvml.h")

    def test_signature_mismatch_fails_the_build(self):
        """The check can fail: a wrong parameter type, or a function nvml.h
        does not declare, each stops the fake's build."""
        wrong = self.fake_source.replace("nvmlTemperatureSensors_t sensorType",
                                         "int sensorType")
        self.assertNotEqual(wrong, self.fake_source)
        undeclared = self.fake_source + \
            "\nnvmlReturn_t nvmlNotInTheHeader(void) { return NVML_SUCCESS; }\n"
        for name, source, expect in (("wrong", wrong, "conflicting types"),
                                     ("undeclared", undeclared, "missing-prototypes")):
            with self.subTest(name=name):
                code, output, _ = self.build_fake(name, source)
                self.assertNotEqual(code, 0, output)
                self.assertIn(expect, output)

    # ---- (b) ctypes layouts and constants -------------------------------

    def test_structs_and_constants_match_header(self):
        gp = support.load_script()
        classes = gp.nvml_structs(ctypes)
        self.assertEqual(len(classes), len(STRUCTS))
        lines = ["#include <stddef.h>", "#include <stdio.h>", "#include <nvml.h>",
                 "#define FIELD(t, f) printf(\"field %s.%s %zu %zu\\n\", #t, #f, "
                 "offsetof(t, f), sizeof(((t *)0)->f))",
                 "int main(void)", "{"]
        for cls, struct in zip(classes, STRUCTS):
            lines.append('    printf("size %%s %%zu\\n", "%s", sizeof(%s));' % (struct, struct))
            for field in header_fields(self.header, struct):
                lines.append("    FIELD(%s, %s);" % (struct, field))
        constants = {}
        for name, value in sorted(vars(gp).items()):
            if re.match(r"NVML_[A-Z0-9_]+\Z", name) and type(value) is int:
                constants[name] = value
                theirs = CONSTANT_NAMES.get(name) or next(
                    (c for c in ("NVML_ERROR_" + name[5:], name)
                     if re.search(r"\b%s\b" % c, self.header)), None)
                self.assertIsNotNone(theirs, "%s = %d has no counterpart in nvml.h"
                                     % (name, value))
                lines.append('    printf("const %s %%lld\\n", (long long)(%s));'
                             % (name, theirs))
        self.assertIn("NVML_MEMORY_V2", constants)
        self.assertGreaterEqual(len(constants), 9, constants)
        lines += ["    return 0;", "}", ""]
        sizes, fields, values = {}, {}, {}
        for line in self.run_c("layout", "\n".join(lines)):
            kind, name, rest = line.split(" ", 2)
            if kind == "size":
                sizes[name] = int(rest)
            elif kind == "field":
                struct, field = name.split(".")
                fields.setdefault(struct, []).append(
                    (field,) + tuple(int(n) for n in rest.split()))
            else:
                values[name] = int(rest)
        for cls, struct in zip(classes, STRUCTS):
            with self.subTest(struct=struct, ctypes=cls.__name__):
                ours = [(name, getattr(cls, name).offset, getattr(cls, name).size)
                        for name, _ in cls._fields_]
                self.assertEqual(ours, fields[struct], "fields (name, offset, size)")
                self.assertEqual(ctypes.sizeof(cls), sizes[struct], "sizeof")
        for name, value in constants.items():
            with self.subTest(constant=name):
                self.assertEqual(value, values[name])

    def test_recovery_actions_are_named_by_their_nvml_values(self):
        """The script's text for each nvmlDeviceGpuRecoveryAction_t sits at
        nvml.h's value of that action (and NONE, 0, has none)."""
        gp = support.load_script()
        words = (("NONE", None), ("GPU_RESET", "GPU reset required"),
                 ("NODE_REBOOT", "node reboot"), ("DRAIN_P2P", "peer-to-peer"),
                 ("DRAIN_AND_RESET", "drain the GPU's work and reset"),
                 ("RECOVER_IMEX_DOMAIN", "IMEX domain"), ("BUS_RESET", "PCIe bus"),
                 ("SYSTEM_REBOOT", "system reboot"))
        lines = ["#include <stdio.h>", "#include <nvml.h>", "int main(void)", "{"]
        lines += ['    printf("%%d\\n", (int)NVML_GPU_RECOVERY_ACTION_%s);' % name
                  for name, _ in words]
        values = [int(n) for n in self.run_c("actions", "\n".join(
            lines + ["    return 0;", "}", ""]))]
        self.assertEqual(len(gp.RECOVERY_ACTIONS), len(words))
        for (name, word), value in zip(words, values):
            with self.subTest(action=name):
                text = gp.RECOVERY_ACTIONS[value]
                if word is None:
                    self.assertIsNone(text, name)
                else:
                    self.assertIn(word, text, "%s (%d)" % (name, value))

    def test_literals_the_script_passes(self):
        """What nvml_snapshot() passes as ctypes types, held against nvml.h
        (the sensor, ECC and MIG values are NVML_* constants, checked above):
        buffer sizes, the utilisation array, enum widths (ctypes passes enums
        as c_int/c_uint)."""
        expected = [
            ("NVML_SUCCESS", 0),
            ("offsetof(nvmlUtilization_t, gpu)", 0),
            ("sizeof(nvmlUtilization_t)", ctypes.sizeof(ctypes.c_uint * 2)),
            ("sizeof(nvmlDevice_t)", ctypes.sizeof(ctypes.c_void_p))]
        for enum in ("nvmlReturn_t", "nvmlTemperatureSensors_t", "nvmlEnableState_t",
                     "nvmlMemoryErrorType_t", "nvmlEccCounterType_t"):
            expected.append(("sizeof(%s)" % enum, ctypes.sizeof(ctypes.c_int)))
        at_most = [("NVML_DEVICE_NAME_V2_BUFFER_SIZE", 96),
                   ("NVML_DEVICE_UUID_V2_BUFFER_SIZE", 96),
                   ("NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE", 96)]
        lines = ["#include <stddef.h>", "#include <stdio.h>", "#include <nvml.h>",
                 "int main(void)", "{"]
        for expr, _ in expected + at_most:
            lines.append('    printf("%%lld\\n", (long long)(%s));' % expr)
        lines += ["    return 0;", "}", ""]
        got = [int(n) for n in self.run_c("literals", "\n".join(lines))]
        for (expr, want), value in zip(expected, got):
            self.assertEqual(value, want, expr)
        for (expr, buffer), value in zip(at_most, got[len(expected):]):
            self.assertLessEqual(value, buffer, "%s: the script's buffer is %d"
                                 % (expr, buffer))

    # ---- (c) the names the script calls ---------------------------------

    def test_called_functions_declared(self):
        fields = set(name for cls in support.load_script().nvml_structs(ctypes)
                     for name, _ in cls._fields_)      # field.nvmlReturn is no call
        names = sorted(called_functions(self.script_source) - fields)
        for name in SURELY_CALLED:
            self.assertIn(name, names)
        lines = ["#define NVML_NO_UNVERSIONED_FUNC_DEFS", "#include <nvml.h>"]
        for name in names:
            lines += ["#ifdef %s" % name, '#error "%s is a macro in nvml.h"' % name,
                      "#endif", "__typeof__(%s) %s;" % (name, name)]
        code, output, _ = self.compile("names", "\n".join(lines) + "\n",
                                       WERROR + ["-c", "-Wno-deprecated-declarations"])
        self.assertEqual(code, 0, "gpu_preflight.py calls a function nvml.h does not "
                         "declare under that name (%s):\n%s" % (", ".join(names), output))

# ---- The CUDA check against NVIDIA's cuda.h (nvidia-cuda-runtime-cu12's
# nvidia/cuda_runtime/include/cuda.h; .ci/run names it in CUDA_INCLUDE_DIR) --

class CudaHeaderCase(unittest.TestCase):
    """The fake libcuda.so.1 and the script's CUDA calls as cuda.h declares them."""

    @classmethod
    def setUpClass(cls):
        case = unittest.TestCase()
        support.require_tool(case, "cc")
        cls.include = require_header(case, "cuda.h", "CUDA_INCLUDE_DIR",
                                     "nvidia-cuda-runtime-cu12")
        cls.dir = tempfile.mkdtemp(prefix="gpfl-cudah-")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def test_fake_cuda_compiles_against_header(self):
        path = fakes.build_fake_cuda(self.dir, self.include)
        lib = ctypes.CDLL(path)
        for name in ("cuInit", "cuDeviceGetCount", "cuGetErrorString"):
            self.assertTrue(hasattr(lib, name), name)

    def test_constants_and_signatures_the_script_uses(self):
        """802 as the script names it; the three calls take what ctypes passes
        (c_uint, c_int *, c_int and const char **) and return CUresult (an
        enum: int), checked by the compiler (GCC's builtin: no link needed)."""
        with open(support.SCRIPT, encoding="utf-8") as script:
            named = re.search(r"^CUDA_SYSTEM_NOT_READY = (\d+)$", script.read(), re.M)
        self.assertIsNotNone(named, "the script names 802 CUDA_SYSTEM_NOT_READY")
        source = "\n".join([
            "#include <cuda.h>",
            "#include <stdio.h>",
            "#define SAME(f, t) _Static_assert(__builtin_types_compatible_p("
            "__typeof__(&f), t), #f)",
            "SAME(cuInit, CUresult (*)(unsigned int));",
            "SAME(cuDeviceGetCount, CUresult (*)(int *));",
            "SAME(cuGetErrorString, CUresult (*)(CUresult, const char **));",
            "_Static_assert(sizeof(CUresult) == sizeof(int), \"CUresult is an int\");",
            "int main(void) { printf(\"%d\\n\", (int)CUDA_ERROR_SYSTEM_NOT_READY); "
            "return 0; }", ""])
        path = os.path.join(self.dir, "consts")
        with open(path + ".c", "w", encoding="utf-8") as out:
            out.write(source)
        output = subprocess.check_output(
            [support.require_tool(self, "cc")] + WERROR + ["-I", self.include, "-o", path,
                                                          path + ".c"],
            stderr=subprocess.STDOUT, timeout=60)
        self.assertEqual(output, b"")
        self.assertEqual(int(subprocess.check_output([path], timeout=30)),
                         int(named.group(1)))


if __name__ == "__main__":
    unittest.main()
