"""Property test: whatever the options and whatever the server answers, the
script ends in a documented verdict, on time, with one log line.

Each case is drawn from a seeded random.Random: option values (on the command
line, as GPU_PREFLIGHT_* variables, in a config file, shadowed by each other),
and the answers of every endpoint the script reads (/api/tags, /api/ps,
/api/generate, /api/version, /health, /v1/models, /v1/completions), built
from the faithful shapes of the Ollama/vLLM/llama-server reference and then
mutated: numbers of every size (400- and 5000-digit integers, 1e309, NaN and
Infinity tokens), wrong types at every field, missing and extra fields, deep
nesting, empty, huge, non-ASCII and control-character strings, NDJSON
variants, error answers, broken bodies and HTTP framing. The real script runs
as a subprocess in cron's environment against a loopback server per case, a
few at a time. For every case it asserts:

  - the exit status is documented (0, 64, 69, 75, 78): never 70;
  - no traceback on stdout or stderr, and silence under cron (stderr only for
    a usage error, stdout only with --json: one JSON object with the code);
  - exactly one syslog line carrying the exit code (none for a usage error,
    which speaks on stderr);
  - the run ended within its deadline (+ SLACK);
  - a bad option value is 64 on the command line, naming the option, and 78
    (stage config) from the environment or the config file, naming its
    source; values that are fine are never refused.

The cases are dealt from a plan of targets (each endpoint's answer, each
troublesome option, the config file, a mix), in shuffled rounds so that any
count covers them evenly; within a target the values lean to the edges (an
answer's numbers all of one class, name and model made to disagree, option
values that are long, not ASCII or nested). The first cases are EXAMPLES:
inputs that broke the script before, a faithful ready run with
one hazard each; case 0 is an integer of 1.2 million digits in /api/tags
(quadratic to parse where Python has no 4300-digit limit, 3.6 here: the
interpreter is pinned; bounded at HUNG_AFTER past the deadline).

All failures are collected, grouped (an exit 70 by its exception and the
function it came from), and reported together with the seed, one failing
case per group in full (command line, environment, config, answers with
their mutations, what came back) and how to rerun a case alone:

  GPU_PREFLIGHT_PROPERTY_SEED    the seed (default DEFAULT_SEED plus 1000
                                 times the interpreter's minor version)
  GPU_PREFLIGHT_PROPERTY_CASES   random cases after the examples (default 51)
  GPU_PREFLIGHT_PROPERTY_JOBS    cases run at once (default 3)
  GPU_PREFLIGHT_PROPERTY_ONLY    comma-separated case numbers to run alone
  GPU_PREFLIGHT_PROPERTY_VERBOSE 1: a summary on stderr (time, verdicts)

Each interpreter draws its own cases (its minor version is in the default
seed): the 8 of a suite run try 8 x 51 different inputs, three rounds of the
plan each, where 200 drawn alike under each were the same inputs 8 times over
at 4 times the CPU. A run of 210 cases takes about 8 s on 2 idle cores (about
11 s on 3.6, where case 0 alone takes 8 s).
"""

import concurrent.futures
import copy
import http.server
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import fakes
import support
from test_contract import SLACK

DEFAULT_SEED = 20250610
SEED = int(os.environ.get("GPU_PREFLIGHT_PROPERTY_SEED", "")
           or DEFAULT_SEED + 1000 * sys.version_info[1])
CASES = int(os.environ.get("GPU_PREFLIGHT_PROPERTY_CASES", "") or 51)
JOBS = int(os.environ.get("GPU_PREFLIGHT_PROPERTY_JOBS", "") or 3)
ONLY = [int(i) for i in os.environ.get("GPU_PREFLIGHT_PROPERTY_ONLY", "").split(",")
        if i.strip()]
VERBOSE = os.environ.get("GPU_PREFLIGHT_PROPERTY_VERBOSE", "") not in ("", "0")

#: The exit statuses the script documents for a check without -- COMMAND.
DOCUMENTED = (0, 64, 69, 75, 78)
#: The deadline when none is given (the script's DEFAULT_DEADLINE).
DEFAULT_DEADLINE = 10.0
#: How long past its bound a run may go before it is killed as hung.
HUNG_AFTER = 25.0
#: Digits of the integer of case 0 (7-10 s to parse on 3.6).
HUGE_DIGITS = 1200000
MAX_BODY = 4 * 1024 * 1024

ENDPOINTS = ("/api/tags", "/api/ps", "/api/generate", "/api/version",
             "/health", "/v1/models", "/v1/completions")
GOOD, UNKNOWN, BAD = "good", "unknown", "bad"


# ---- JSON text that json.dumps cannot write -----------------------------------

class Raw(object):
    """JSON text spliced in as is: integers too long for str() on 3.11+,
    NaN/Infinity tokens, nesting deeper than any recursion limit."""

    def __init__(self, text, label=None):
        self.text, self.label = text, label or text

    def __repr__(self):
        return self.label


class DupKey(object):
    """A key written again (JSON allows it; the last one wins)."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return "%s (again)" % self.name


def encode(value, ascii_only=True):
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{%s}" % ",".join(
            "%s:%s" % (encode(k.name if isinstance(k, DupKey) else k, ascii_only),
                       encode(v, ascii_only)) for k, v in value.items())
    if isinstance(value, list):
        return "[%s]" % ",".join(encode(v, ascii_only) for v in value)
    if value is True or value is False or value is None or isinstance(value, float):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    return json.dumps(value, ensure_ascii=ascii_only)


def to_bytes(text):
    return text.encode("utf-8", "surrogatepass")    # a lone surrogate as CESU


def show(value, most=60):
    """A short description of a value for the failure report."""
    if isinstance(value, Raw):
        return value.label
    if isinstance(value, bytes):
        text = repr(value)
    elif isinstance(value, str):
        text = repr(value)
    else:
        text = encode(value)
    if len(text) > most:
        text = "%s... (%d chars)" % (text[:most], len(text))
    return text


# ---- Value pools ---------------------------------------------------------------

SMALL_NUMBERS = ("0", "1", "-1", "7", "4096", "2147483648")
EDGE_NUMBERS = ("9007199254740993", "9223372036854775807", "9223372036854775808",
                "-9223372036854775809", "18446744073709551616")
HUGE_NUMBERS = (("1" + "0" * 309, "310-digit integer"), ("9" * 400, "400-digit integer"),
                ("-" + "9" * 400, "negative 400-digit integer"),
                ("5" * 1000, "1000-digit integer"),
                ("1" + "0" * 4299, "4300-digit integer"), ("7" * 4301, "4301-digit integer"),
                ("8" * 5000, "5000-digit integer"))
FLOATS = ("1.5", "-0.0", "0.1", "1e308", "1e309", "-1e309", "1e-400", "4.9e-324",
          "1E2", "123456789012345678901234567890.5", "2.0")
TOKENS = ("NaN", "Infinity", "-Infinity")


def number(rng):
    """A JSON number of any size (or a NaN/Infinity token)."""
    r = rng.random()
    if r < 0.25:
        return Raw(rng.choice(SMALL_NUMBERS))
    if r < 0.4:
        return Raw(rng.choice(EDGE_NUMBERS))
    if r < 0.75:
        return Raw(*rng.choice(HUGE_NUMBERS))
    if r < 0.9:
        return Raw(rng.choice(FLOATS))
    return Raw(rng.choice(TOKENS))


def string(rng):
    r = rng.random()
    if r < 0.03:
        return "\u00e9" * 1500000          # 3 MB of UTF-8
    if r < 0.08:
        return "x" * 70000
    return rng.choice((
        "", "", " ", "x", "llama3.2:latest", "llama3.2", "LLAMA3.2:Latest", "absent:latest",
        "\u043c\u043e\u0434\u0435\u043b\u044c:latest", "\u6a21\u578b", "\U0001f999:7b",
        "\x00", "\x1b[31mred\x1b[0m", "a\nb\r\n", "\u2028", "\ud800", "\\", "\"",
        "error", "null", "0", "true", "load", "length", "stop", "unload"))


def deep(rng):
    """Nesting from harmless to past every recursion limit."""
    depth = rng.choice((2, 50, 990, 1000, 1001, 5000, 50000))
    if rng.random() < 0.5:
        return Raw("[" * depth + "]" * depth, "[[...]] nested %d deep" % depth)
    return Raw('{"a":' * depth + "1" + "}" * depth, '{"a":{"a":...}} nested %d deep' % depth)


def any_value(rng, depth=0):
    """A JSON value of any type."""
    r = rng.random()
    if r < 0.25:
        return number(rng)
    if r < 0.5:
        return string(rng)
    if r < 0.56:
        return rng.choice((True, False))
    if r < 0.62:
        return None
    if r < 0.68:
        return rng.choice(([], {}))
    if r < 0.8 and depth < 2:
        return [any_value(rng, depth + 1) for _ in range(rng.randint(1, 3))]
    if r < 0.92 and depth < 2:
        return dict((rng.choice(("a", "name", "model", "error", "", "\u00e9")),
                     any_value(rng, depth + 1)) for _ in range(rng.randint(1, 3)))
    return deep(rng)


def like(rng, old):
    """A value of the same JSON type as old, at its edges."""
    if isinstance(old, bool):
        return rng.choice((not old, None, 0, 1, "true", "false"))
    if isinstance(old, (int, float, Raw)):
        return number(rng)
    if isinstance(old, str):
        return string(rng)
    return any_value(rng)


# ---- Faithful answers (shared/reference/ollama-api.md) ---------------------------

MODEL_NAMES = ("llama3.2:latest", "qwen3:8b", "mistral:latest", "user/m:7b",
               "nomic-embed-text:latest")
DIGEST = "a80c4f17acd55265feec403c7aef86be0c25983ab279d83f3bcd3abbcb5b8b72"
DETAILS = {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
           "parameter_size": "3.2B", "quantization_level": "Q4_K_M"}


def tags_entry(name):
    return {"name": name, "model": name,
            "modified_at": "2025-05-04T17:37:44.706015396-07:00",
            "size": 2019393189, "digest": DIGEST, "details": copy.deepcopy(DETAILS)}


def ps_entry(name, rng):
    size = 5137025024
    vram = rng.choice((size, size, size, 0, size * 45 // 100))
    entry = tags_entry(name)
    del entry["modified_at"]
    entry.update(size=size, size_vram=vram, context_length=4096,
                 expires_at="2024-06-04T14:38:31.83753-07:00")
    return entry


def generate_final(model, load):
    doc = {"model": model, "created_at": "2025-05-04T17:37:44.706015396Z",
           "response": "" if load else "!", "done": True,
           "done_reason": "load" if load else "length"}
    if not load:
        doc.update(context=[128006, 882, 128007], total_duration=4935886791,
                   load_duration=2134895834, prompt_eval_count=26,
                   prompt_eval_duration=342546000, eval_count=1,
                   eval_duration=1264000)
    return doc


def v1_models(names, flavour):
    if flavour == "ollama":
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": 1717000000, "owned_by": "library"}
            for n in names] or None}
    if flavour == "llama-server":
        return {"models": [{"name": n, "model": n, "modified_at": "", "size": "",
                            "digest": "", "type": "model", "description": "",
                            "tags": [""], "capabilities": ["completion"],
                            "parameters": "", "details": copy.deepcopy(DETAILS)}
                           for n in names],
                "object": "list",
                "data": [{"id": n, "object": "model", "created": 1717000000,
                          "owned_by": "llamacpp", "meta": {"n_vocab": 32000}}
                         for n in names]}
    return {"object": "list", "data": [
        {"id": n, "object": "model", "created": 1717000000, "owned_by": "vllm",
         "root": "/models/" + n, "parent": None, "max_model_len": 4096,
         "permission": [{"id": "modelperm-1", "object": "model_permission",
                         "allow_sampling": True, "is_blocking": False}]}
        for n in names]}


def completion(model):
    return {"id": "cmpl-7", "object": "text_completion", "created": 1717000000,
            "model": model, "system_fingerprint": "fp_ollama",
            "choices": [{"text": "!", "index": 0, "finish_reason": "length",
                         "logprobs": None}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


#: Error answers real servers send (status, body).
ERRORS = (
    (404, b"404 page not found"), (405, b"405 method not allowed"),
    (500, {"error": "llama runner process has terminated: CUDA error: out of memory"}),
    (500, {"error": "model runner has unexpectedly stopped, this may be due to "
                    "resource limitations or an internal error"}),
    (503, {"error": "server busy, please try again.  maximum pending requests exceeded"}),
    (404, {"error": "model 'x' not found"}),
    (404, {"error": "model \"x\" not found, try pulling it first"}),
    (400, {"error": "invalid character 'x' looking for beginning of value"}),
    (500, {"error": "timed out waiting for llama runner to start - progress 0.00 - "}),
    (503, {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}),
    (401, {"error": {"message": "Invalid API Key", "type": "authentication_error",
                     "code": 401}}),
    (404, {"object": "error", "message": "The model `x` does not exist.",
           "type": "NotFoundError", "param": "model", "code": 404}),
    (403, b""), (503, b""), (500, b"Internal Server Error"), (502, b"<html>bad gateway</html>"),
    (301, b""), (299, b"{}"), (418, b"teapot"), (599, b"?"),
)


# ---- Mutations -------------------------------------------------------------------

def locations(doc):
    """(container, key, path) of every node below the root."""
    found, todo = [], [(doc, "$")]
    while todo:
        node, path = todo.pop()
        items = (node.items() if isinstance(node, dict) else
                 enumerate(node) if isinstance(node, list) else ())
        for key, child in items:
            sub = "%s.%s" % (path, key) if isinstance(node, dict) else "%s[%d]" % (path, key)
            found.append((node, key, sub))
            todo.append((child, sub))
    return found


#: Fields the script reads: mutated more often.
READ = ("models", "name", "model", "size", "size_vram", "load_duration", "done",
        "done_reason", "error", "version", "data", "id", "choices", "response")


def mutate(rng, doc, log, count):
    """Apply count random mutations to doc (in place); returns the new root."""
    for _ in range(count):
        places = locations(doc)
        r = rng.random()
        if not places or r < 0.06:
            doc = any_value(rng) if rng.random() < 0.5 else deep(rng)
            log.append("$ = %s" % show(doc))
            continue
        weights = [3 if str(key) in READ else 1 for _, key, _ in places]
        node, key, path = rng.choices(places, weights)[0]
        if r < 0.45:
            value = like(rng, node[key]) if rng.random() < 0.55 else any_value(rng)
            node[key] = value
            log.append("%s = %s" % (path, show(value)))
        elif r < 0.6:
            del node[key]
            log.append("%s removed" % path)
        elif r < 0.72:
            dicts = [(n[k], p) for n, k, p in places if isinstance(n[k], dict)]
            if isinstance(doc, dict):
                dicts.append((doc, "$"))
            if not dicts:
                continue
            target, where = rng.choice(dicts)
            name = rng.choice(("extra", "", "\u043a\u043b\u044e\u0447", "error", "done",
                               "models", "\x00", "name"))
            value = any_value(rng)
            target[DupKey(name) if name in target else name] = value
            log.append("%s: extra %r = %s" % (where, name, show(value)))
        elif r < 0.84:
            lists = [(n[k], p) for n, k, p in places if isinstance(n[k], list)]
            if not lists:
                continue
            target, where = rng.choice(lists)
            op = rng.random()
            if op < 0.3 or not target:
                target.append(any_value(rng))
                log.append("%s: appended %s" % (where, show(target[-1])))
            elif op < 0.55:
                del target[:]
                log.append("%s emptied" % where)
            else:
                copies = rng.choice((2, 1000))
                if len(encode(target[0])) > 1000:
                    copies = 2          # no answers of gigabytes
                target.extend(copy.deepcopy(target[0]) for _ in range(copies - 1))
                log.append("%s: first entry %d times" % (where, copies))
        else:
            alias(rng, doc, log)
    return doc


#: Number classes a sweep gives every number of an answer (with weights).
NUMBER_CLASSES = (("overflow", 0.45), ("edge", 0.15), ("small", 0.1), ("float", 0.1),
                  ("token", 0.1), ("any", 0.1))
OVERFLOW_NUMBERS = tuple(h for h in HUGE_NUMBERS if not h[0].startswith("-"))


def class_number(rng, kind):
    if kind == "overflow":
        return Raw(*rng.choice(OVERFLOW_NUMBERS))
    if kind == "edge":
        return Raw(rng.choice(EDGE_NUMBERS))
    if kind == "small":
        return Raw(rng.choice(SMALL_NUMBERS + ("-5",)))
    if kind == "float":
        return Raw(rng.choice(FLOATS))
    if kind == "token":
        return Raw(rng.choice(TOKENS))
    return number(rng)


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def sweep_class(rng, doc, log, chance):
    """One number of one class (too big for a float, int64 edges, floats,
    NaN...) in place of each number of doc, with this chance (one number, so
    that one the parser refuses does not hide the others)."""
    kind = rng.choices([k for k, _ in NUMBER_CLASSES], [w for _, w in NUMBER_CLASSES])[0]
    value = class_number(rng, kind)
    hit = []
    for node, key, path in locations(doc):
        if is_number(node[key]) and rng.random() < chance:
            node[key] = class_number(rng, kind) if kind == "any" else value
            hit.append(path if kind != "any" else "%s = %s" % (path, show(node[key])))
    if hit:
        log.append(", ".join(hit) + ("" if kind == "any" else " = %s" % show(value)))


def alias(rng, doc, log):
    """Ollama repeats a model's name as name and model: make them disagree
    (empty, absent, null, another type, another name)."""
    entries = [n[k] for n, k, _ in locations(doc) if isinstance(n[k], dict)
               and ("name" in n[k] or "model" in n[k] or "id" in n[k])]
    if not entries:
        return
    entry = rng.choice(entries)
    for field, choices in (("name", ("", "", None, "absent", 5, "other:latest", "keep")),
                           ("model", (5, {"a": 1}, [1], True, 1.5, "", "absent", "keep")),
                           ("id", (5, {"a": 1}, "", None, "absent", "keep"))):
        if field not in entry:
            continue
        value = rng.choice(choices)
        if value == "absent":
            del entry[field]
        elif value != "keep":
            entry[field] = value
        log.append("entry %s: %s" % (field, value if value in ("absent", "keep")
                                     else show(value)))


def sweep_numbers(rng, doc, log, chance):
    """Give each number in doc an edge value with this chance."""
    for node, key, path in locations(doc):
        old = node[key]
        if isinstance(old, (int, float)) and not isinstance(old, bool) and \
                rng.random() < chance:
            node[key] = number(rng)
            log.append("%s = %s" % (path, show(node[key])))


# ---- An answer: status, body, framing ------------------------------------------

class Answer(object):
    def __init__(self, status, body, framing="length", ctype="application/json; charset=utf-8",
                 log=None):
        self.status, self.body, self.framing, self.ctype = status, body, framing, ctype
        self.log = log or []

    def describe(self):
        body = self.body
        head = repr(body[:160]) + ("... (%d bytes)" % len(body) if len(body) > 160 else "")
        text = "%d %s, %s" % (self.status, self.framing, head)
        if self.log:
            text += "\n        mutations: " + "; ".join(self.log)
        return text


def corrupt_body(rng, body, log):
    """Whole-body breakage: empty, truncated, not an object, framing of JSON."""
    kind = rng.choice(("empty", "scalar", "truncated", "trailing", "twice", "lines",
                       "bom", "utf16", "badutf8", "spaces", "oversize", "html", "sse"))
    log.append("body: " + kind)
    if kind == "empty":
        return b""
    if kind == "scalar":
        return rng.choice((b"null", b"[]", b'"x"', b"1", b"true", b"[{}]"))
    if kind == "truncated":
        return body[:rng.randint(0, max(0, len(body) - 1))]
    if kind == "trailing":
        return body + b"x"
    if kind == "twice":
        return body + body
    if kind == "lines":
        return body + b"\n" + body + b"\n"
    if kind == "bom":
        return b"\xef\xbb\xbf" + body
    if kind == "utf16":
        return body.decode("utf-8", "replace").encode("utf-16")
    if kind == "badutf8":
        cut = body.find(b'"') + 1
        return body[:cut] + b"\xff\xc3(" + body[cut:]
    if kind == "spaces":
        return b" \n\t" * rng.choice((1, 100000)) + body
    if kind == "oversize":
        return body + b" " * (MAX_BODY + 1 - len(body))
    if kind == "html":
        return b"<html><body>404</body></html>"
    return b"data: " + body + b"\n\ndata: [DONE]\n\n"


def error_answer(rng, log):
    status, body = rng.choice(ERRORS)
    if isinstance(body, dict):
        body = copy.deepcopy(body)
        if rng.random() < 0.4:
            body = mutate(rng, body, log, 1)
        body = to_bytes(encode(body))
    if rng.random() < 0.1:
        body = b'{"error":"' + b"x" * 70000 + b'"}'
        log.append("70000-byte error message")
    log.insert(0, "error answer %d" % status)
    return status, body


def finish(rng, doc, log, hit, broken=False):
    """Encode doc; on a hit endpoint vary the framing, and when broken send an
    error answer or a broken body instead."""
    if isinstance(doc, bytes):
        body = doc
    else:
        body = to_bytes(encode(doc, rng.random() < 0.7))
    status, ctype = 200, "application/json; charset=utf-8"
    if broken:
        if rng.random() < 0.5:
            status, body = error_answer(rng, log)
        else:
            body = corrupt_body(rng, body, log)
    if len(body) > 2 * MAX_BODY:    # the script stops reading past MAX_BODY
        body = body[:MAX_BODY + 1]
        log.append("body cut at %d bytes" % len(body))
    framing = "length"
    if hit:
        framing = rng.choice(("length",) * 8 + ("close", "close", "chunked", "chunked",
                                                "short"))
        if rng.random() < 0.1:
            ctype = rng.choice(("text/plain", "", "application/x-ndjson"))
    return Answer(status, body, framing, ctype, log)


def ndjson(rng, final, log):
    """/api/generate streamed although stream was false: chunks, then final."""
    chunks = [{"model": final.get("model"), "created_at": "2025-05-04T17:37:44Z",
               "response": rng.choice(("H", "", "\u00e9", "\x00")), "done": False}
              for _ in range(rng.randint(0, 3))]
    lines = [encode(c) for c in chunks] + [encode(final)]
    kind = rng.choice(("plain", "blank", "crlf", "error", "notobject", "cut", "nofinal",
                       "garbage"))
    log.append("NDJSON %d lines, %s" % (len(lines), kind))
    if kind == "blank":
        lines.insert(rng.randint(0, len(lines)), "")
    elif kind == "error":
        lines.insert(rng.randint(0, len(lines)), encode({"error": like(rng, "x")}))
    elif kind == "notobject":
        lines.insert(rng.randint(0, len(lines)), rng.choice(("[1]", "1", "null", '"x"')))
    elif kind == "cut":
        lines[-1] = lines[-1][:len(lines[-1]) // 2]
    elif kind == "nofinal":
        lines.pop()
    elif kind == "garbage":
        lines.append("not json")
    sep = "\r\n" if kind == "crlf" else "\n"
    return to_bytes(sep.join(lines) + sep)


# ---- Option values ---------------------------------------------------------------

def labelled(good=(), unknown=(), bad=()):
    return ([(v, GOOD) for v in good] + [(v, UNKNOWN) for v in unknown]
            + [(v, BAD) for v in bad])


SECONDS_BAD = ("0", "-1", "soon", "", "nan", "NaN", "inf", "-inf", "infinity", "1e6",
               "1e400", "9" * 400, "0x10", "\u00b2", "1,5", "-0", "1e-400")
POOLS = {
    "timeout": labelled(("1", "0.5", "1.5", " 1 ", "1e0", "0.25", "1e-300"),
                        ("\u0661", "\U0001d7d0"), SECONDS_BAD),
    "deadline": labelled(("2", "1.5", "2.5", "2.0", " 2 ", "2e0", "1e-300"),
                         ("\u0662",), SECONDS_BAD),
    "gpu-timeout": labelled(("1", "0.5", "2"), (), ("0", "x", "nan", "9" * 400)),
    "wait": labelled(("0.5", "1", "2"), (), ("0", "-1", "x")),
    "jitter": labelled(("0.2", "0.5"), (), ("0", "-1", "x")),
    "share-result": labelled(("1", "60"), (), ("0", "x")),
    "keep-alive": labelled(
        ("-1", "0", "600", "10m", "1h30m", "0s", "1.5", "-1h", "5\u00b5s", "300ms", "+5m",
         ".5h"),
        ("\u0661\u0662", "9" * 309, "1" + "0" * 20, "9" * 308, "9" * 400 + "m"),
        ("10x", "", "abc", "1e3", "9" * 400, "9" * 400 + ".5", "\u00b2", "m", "--1",
         "1 m", "10M")),
    "ollama-option": labelled(
        ("num_ctx=8192", "num_gpu=99", "temperature=0.5", 'stop=["a","b"]', "seed=-1",
         "x=", "mirostat=0", "num_thread=null", "use_mmap=false", 'k={"a":[1,2]}',
         "k=text with spaces"),
        ("k=NaN", "k=" + "9" * 400, "k=" + "1" * 5000, "k=\u00e9")
        + tuple("k=" + "[" * d + "]" * d for d in (990, 1000, 5000, 30000))
        + tuple("k=" + '{"a":' * d + "1" + "}" * d for d in (1000, 15000)),
        ("num_predict=2", "NUM_CTX=1", "=1", "novalue", "\u043a\u043b\u044e\u0447=1",
         "k-1=2", "", "1k=2")),
    "gpu-id": labelled(("0", "1", "0,1", " 0 ", "5", "GPU-abc", "MIG-1234", "0,GPU-x"),
                       ("\u0661", "\U0001d7d8", "\u0660,\u0661"),
                       ("", ",", "x", "-1", "GPU_", "\u00b2", "0,\u00b2", "\u2460", "1.0")),
    "model": labelled(("llama3.2", "absent:latest", "LLAMA3.2:Latest", " llama3.2 ", "x",
                       "registry.ollama.ai/library/llama3.2:latest"),
                      ("", "\u043c\u043e\u0434\u0435\u043b\u044c", "\u6a21\u578b:7b",
                       "\U0001f999", "caf\u00e9", "a\tb", "a\x1bb", "x" * 100000,
                       b"\xff\xfe", b"caf\xe9", b"llama\x80:latest")),
    "api": labelled(("ollama", "openai", "auto"), (), ("OpenAI", "", "vllm")),
    "warmup": labelled(("token", "load", "off"), (), ("full", "", "Token", "on")),
    "gpu-backend": labelled(("auto", "nvml", "nvidia-smi", "amd-sysfs"), (),
                            ("cuda", "", "AMD")),
    "gpu-need": labelled(("all", "any"), (), ("some", "")),
    "min-free-mib": labelled(("0", "100", "1000000000", " 7 "), ("\u0661\u0660",),
                             ("-1", "1.5", "1000000001", "x", "\u00b2", "9" * 400, "")),
    "max-util": labelled(("0", "50", "100"), (), ("101", "-5", "\u00b2", "")),
    "max-procs": labelled(("0", "3"), (), ("-1", "x", "\u00b2", "9" * 400)),
    "max-temp": labelled(("0", "90"), (), ("-1", "hot", "\u00b2")),
    "syslog-facility": labelled(("user", "local0", "DAEMON", "cron"), (),
                                ("local8", "", "\u00fc", "kernel")),
    "metrics-file": labelled(("{tmp}/metrics.prom", "{tmp}/missing/m.prom", "{tmp}"),
                             ("{tmp}/m\u00e9trics.prom",), ("",)),
    "host": labelled(
        ("127.0.0.1:{port}", "http://127.0.0.1:{port}", "http://127.0.0.1:{port}/",
         " http://127.0.0.1:{port} ", "'127.0.0.1:{port}'", '"http://127.0.0.1:{port}"',
         "localhost:{port}", "http://localhost:{port}", "http://127.0.0.1:{port}/prefix",
         "127.0.0.2:{port}", "[::1]:{port}"),
        ("127.0.0.1:{arabic_port}", "http://\u00fcn\u00ef.localhost:{port}",
         "http://127.0.0.1:{port}/\u00fc", "http://127.0.0.1:{port}:{port}",
         "HTTP://127.0.0.1:{port}", ""),
        ("http://127.0.0.1:99999", "ftp://127.0.0.1:{port}", "127.0.0.1:{port}?x=1",
         "127.0.0.1:{port}#f", "user@127.0.0.1:{port}", "http://[::1:{port}",
         "127.0.0.1:\u00b2", "127.0.0.1:-1", "http://127.0.0.1: {port}")),
}
FLAGS = ("allow-cpu", "json", "gpu", "strict-gpu", "insecure", "log-changes-only")
FLAG_TEXT = labelled(("1", "0", "true", "false", "yes", "no", "on", "off", "TRUE", " yes "),
                     (), ("maybe", "2", "tru", "y"))
TOKENS_ENV = labelled(("sk-abc123", "t0k3n"), (), ("t\u00f6k", "a b", "\x01x"))
#: The options the targets "options" and "config" draw from.
DRAWN = tuple(POOLS) + FLAGS + ("model", "keep-alive", "ollama-option", "gpu-id",
                                "host", "deadline", "timeout")


def env_name(option):
    return "GPU_PREFLIGHT_" + option.upper().replace("-", "_")


def worst(labels):
    return BAD if BAD in labels else UNKNOWN if UNKNOWN in labels else GOOD


class Case(object):
    """One run: options in their places, answers per endpoint, expectations."""

    def __init__(self, index, seed):
        self.index, self.seed = index, seed
        self.placed = {}        # option -> {place: (text, label)}, place cli/env/config
        self.cli_extra = []     # flags without a value source (--debug, -v)
        self.env = {}           # other variables (OLLAMA_HOST)
        self.config_via = "cli"     # --config, or "env": GPU_PREFLIGHT_CONFIG
        self.config_bad = None  # why the file itself is refused
        self.token = None       # (text, label)
        self.answers = {}
        self.notes = []         # how the case was drawn

    def place(self, option, where, text, label):
        self.placed.setdefault(option, {})[where] = (text, label)

    def winner(self, option):
        """(place, text, label) of the source the script uses, or None."""
        places = self.placed.get(option, {})
        if "cli" in places:
            return ("cli",) + places["cli"]
        if "env" in places:
            text = places["env"][0]
            if isinstance(text, bytes) or text.strip():
                return ("env",) + places["env"]
        if "config" in places and self.config_bad is None:
            return ("config",) + places["config"]
        return None

    def expectation(self):
        """(kind, names): usage (64), config (78), "usage or config", good
        (neither), unknown; names: the bad values (one: it must be named)."""
        winners = dict((o, self.winner(o)) for o in self.placed)
        cli_bad = [o for o, w in winners.items() if w and w[0] == "cli" and w[2] == BAD]
        cli_unknown = any(w and w[0] == "cli" and w[2] == UNKNOWN for w in winners.values())
        if cli_bad:     # names: the one to name, unless another may be refused first
            return "usage", cli_bad if not cli_unknown else []
        late_bad = ["%s (%s)" % (o, w[0]) for o, w in winners.items()
                    if w and w[0] != "cli" and w[2] == BAD]
        if self.config_bad:
            late_bad.append("config file: " + self.config_bad)
        if self.token and self.token[1] == BAD:
            late_bad.append("token")
        if late_bad:        # a value on the command line may still be refused first
            if any(w and w[0] != "cli" and w[2] == UNKNOWN for w in winners.values()):
                late_bad.append("and a value that may be refused")     # none to name
            return "usage or config" if cli_unknown else "config", late_bad
        if any(w and w[2] == UNKNOWN for w in winners.values()):
            return "unknown", []
        return "good", []

    def seconds(self, option, default):
        won = self.winner(option)
        if won is None or won[2] == BAD:
            return default
        try:
            value = float(won[1])
        except ValueError:
            return default
        return value if 0 < value < 1e6 else default

    def bound(self):
        """The deadline the run must keep (its --deadline, else the default)."""
        extra = self.seconds("wait", 0) + self.seconds("jitter", 0)
        return self.seconds("deadline", DEFAULT_DEADLINE + extra)


# ---- Drawing a case ----------------------------------------------------------------

#: What a case varies, dealt in shuffled rounds so that every count covers
#: each about evenly; the endpoints whose numbers the script computes with
#: (/api/ps, /api/generate) come twice.
TARGETS = ("/api/tags", "/api/ps", "/api/ps", "/api/generate", "/api/generate", "openai",
           "auto", "keep-alive", "ollama-option", "gpu-id", "model", "host", "seconds",
           "other", "options", "config", "mixed")
#: Option targets: the options each varies.
OPTION_TARGETS = {
    "keep-alive": ("keep-alive",), "ollama-option": ("ollama-option",),
    "gpu-id": ("gpu-id",), "model": ("model",), "host": ("host",),
    "seconds": ("timeout", "deadline", "gpu-timeout", "wait", "jitter", "share-result"),
    "other": ("api", "warmup", "gpu-backend", "gpu-need", "min-free-mib", "max-util",
              "max-procs", "max-temp", "syslog-facility", "metrics-file") + FLAGS,
}


def target_of(index, seed):
    rounds, at = divmod(index, len(TARGETS))
    order = list(TARGETS)
    random.Random(seed * 7919 + rounds).shuffle(order)
    return order[at]


def edges(pool):
    """The values of a pool most likely to break a parser: unknown ones, and
    bad ones that are long or not ASCII."""
    return [(v, l) for v, l in pool if l == UNKNOWN or l == BAD and (
        not isinstance(v, str) or len(v) > 40 or re.search(r"[^\x00-\x7f]", v))]


def draw_value(rng, option, edge_bias, where):
    """(text, label) for option at where; --ollama-option on the command line
    is a list, elsewhere its items quoted in one string (shlex)."""
    if option in FLAGS:
        return rng.choice(FLAG_TEXT)
    pool = POOLS[option]
    if option == "ollama-option":
        items = [rng.choice(edges(pool) if rng.random() < edge_bias else pool)
                 for _ in range(rng.randint(1, 3))]
        if where != "cli":      # one string: within the kernel's 128 KiB per string
            while len(items) > 1 and sum(len(i[0]) for i in items) > 100000:
                items.pop()
        texts = [i[0] for i in items]
        return (texts if where == "cli" else " ".join(shlex.quote(t) for t in texts),
                worst([i[1] for i in items]))
    return rng.choice(edges(pool) if rng.random() < edge_bias and edges(pool) else pool)


def place_option(rng, case, option, where, edge_bias):
    """Give option a drawn value at where (and now and then a shadowed one
    below it, which precedence must hide)."""
    if option in FLAGS and where == "cli":
        case.place(option, "cli", None, GOOD)
    else:
        case.place(option, where, *draw_value(rng, option, edge_bias, where))
    lower = {"cli": "env", "env": "config", "config": None}[where]
    if lower and rng.random() < 0.2:
        case.place(option, lower, *draw_value(rng, option, edge_bias, lower))
        case.notes.append("%s also in %s (shadowed)" % (option, lower))


def draw_case(index, seed):
    rng = random.Random(seed * 1000003 + index)
    case = Case(index, seed)
    target = target_of(index, seed)
    api = {"openai": "openai", "auto": "auto", "/api/tags": "ollama", "/api/ps": "ollama",
           "/api/generate": "ollama"}.get(target) or rng.choice(
               ("ollama",) * 3 + ("openai", "auto"))
    flavour = rng.choice(("vllm", "ollama", "llama-server"))
    deep_target = target in ("/api/ps", "/api/generate")   # runs that must get there
    names = rng.sample(MODEL_NAMES, rng.choice((1, 2, 3) if deep_target else
                                               (0, 1, 1, 1, 2, 2, 3, 3)))
    loaded = [n for n in names if rng.random() < 0.5]

    # The base: options every run has, mostly on the command line.
    def base(option, text):
        case.place(option, rng.choice(("cli",) * 8 + ("env", "config")), text, GOOD)

    base("host", rng.choice(("http://127.0.0.1:{port}", "127.0.0.1:{port}")))
    base("deadline", rng.choice(("2", "2.5", "3")))
    base("timeout", rng.choice(("1", "1.5", "2")))
    if api != "ollama" or rng.random() < 0.2:
        base("api", api)
    if names and rng.random() < 0.5:
        base("model", rng.choice(names + ([] if deep_target else
                                          ["llama3.2", "absent:latest"])))
    if rng.random() < 0.35:
        base("metrics-file", "{tmp}/metrics.prom")
    if rng.random() < 0.1 and not deep_target:
        base("warmup", rng.choice(("load", "off")))
    case.cli_extra.append("--debug")    # a traceback names the site of a 70
    if rng.random() < 0.1:
        case.cli_extra.append("-v")

    # The target: what this case varies.
    focus = target
    if target in ("openai", "auto"):
        focus = rng.choice({"openai": ("/health", "/v1/models", "/v1/completions"),
                            "auto": ("/api/version", "/api/tags", "/api/generate",
                                     "/v1/models")}[target])
    case.notes.append("target %s, api %s (%s answers), models %s, loaded %s"
                      % (focus, api, flavour, names, loaded))
    if target in OPTION_TARGETS:
        options = OPTION_TARGETS[target]
        for option in rng.sample(options, min(len(options), rng.randint(1, 3))):
            where = rng.choice(("cli",) * 5 + ("env",) * 3 + ("config",) * 2)
            place_option(rng, case, option, where, 0.6)
        if target == "model":       # where the model name is written
            case.place("metrics-file", rng.choice(("cli", "env")), "{tmp}/metrics.prom",
                       GOOD)
            for option in ("share-result", "log-changes-only"):
                if rng.random() < 0.3:
                    place_option(rng, case, option, "cli", 0)
        if target == "host" and rng.random() < 0.3:
            text, label = rng.choice(POOLS["host"])
            del case.placed["host"]
            case.env["OLLAMA_HOST"] = text
            case.place("ollama-host", "env", text, GOOD if label == GOOD else UNKNOWN)
        if target == "other" and rng.random() < 0.3:
            case.token = rng.choice(TOKENS_ENV)
    elif target in ("options", "config"):
        for option in rng.sample(DRAWN, rng.randint(2, 4)):
            where = rng.choice(("cli", "cli", "env", "config") if target == "options"
                               else ("config", "config", "env"))
            place_option(rng, case, option, where, 0.3)
        if rng.random() < (0.4 if target == "config" else 0.1):
            corrupt_config(rng, case)
    if rng.random() < 0.5 and any("config" in p for p in case.placed.values()):
        case.config_via = "env"
    if case.winner("deadline") is None or case.winner("deadline")[2] != GOOD:
        for option in ("wait", "jitter"):     # no long retries without a short deadline
            case.placed.pop(option, None)
    won = case.winner("warmup")
    load = bool(won and won[1] == "load")

    # The answers: faithful, then broken where the target is.
    def answer(endpoint, doc, chance=0.0):
        hit = focus == endpoint or (target == "mixed" and rng.random() < 0.4) \
            or rng.random() < chance
        log = []
        if not hit:
            return finish(rng, doc, log, False)
        if isinstance(doc, bytes):
            return finish(rng, doc, log, True, rng.random() < 0.5)
        entries = endpoint in ("/api/tags", "/api/ps", "/v1/models")
        mode = rng.choice(("numbers", "numbers", "structure", "structure", "body")
                          + (("alias", "alias") if entries else ()))
        log.append(mode)
        if mode == "numbers":
            sweep_class(rng, doc, log, 0.85)
        elif mode == "alias":
            alias(rng, doc, log)
        elif mode == "structure":
            sweep_numbers(rng, doc, log, 0.15)
            doc = mutate(rng, doc, log, rng.randint(1, 3))
        return finish(rng, doc, log, True, mode == "body")

    case.answers["/api/tags"] = [answer("/api/tags", {"models": [tags_entry(n) for n in names]},
                                        0.03)]
    ps_first = {"models": [ps_entry(n, rng) for n in loaded]}
    ps_after = {"models": [ps_entry(n, rng) for n in names]}
    case.answers["/api/ps"] = [answer("/api/ps", ps_first, 0.03),
                               answer("/api/ps", ps_after, 0.03)]
    final = generate_final(rng.choice(names or ["x"]), load)
    if focus == "/api/generate" and rng.random() < 0.3:
        log = ["NDJSON"]
        if rng.random() < 0.5:
            sweep_class(rng, final, log, 0.85)
        gen = Answer(200, ndjson(rng, final, log), rng.choice(("length", "chunked", "close")),
                     "application/x-ndjson", log)
    else:
        gen = answer("/api/generate", final, 0.03)
    case.answers["/api/generate"] = [gen]
    if api == "auto" and flavour != "ollama" and rng.random() < 0.7:
        case.answers["/api/version"] = [Answer(404, b"404 page not found",
                                               ctype="text/plain")]
    else:
        case.answers["/api/version"] = [answer("/api/version", {"version": "0.32.15"})]
    health = rng.choice((b"", b'{"status":"ok"}', b"404"))
    case.answers["/health"] = [answer("/health", health) if health != b"404" else
                               Answer(404, b"404 page not found", ctype="text/plain")]
    case.answers["/v1/models"] = [answer("/v1/models", v1_models(names, flavour), 0.03)]
    case.answers["/v1/completions"] = [answer("/v1/completions",
                                              completion(rng.choice(names or ["x"])), 0.03)]
    check_config(case)
    return case


def check_config(case):
    """A config file that cannot be read at all is refused whatever it holds."""
    text = config_bytes(case, {"port": 65535, "tmp": "/tmp/gpfl-prop-xxxxxxxx"})
    if text is not None and case.config_bad is None:
        try:
            text.decode("utf-8")
        except UnicodeDecodeError:
            case.config_bad = "a value that is not UTF-8"
        if len(text) > 64 * 1024:
            case.config_bad = "larger than 64 KiB"


def corrupt_config(rng, case):
    """Break the config file itself (78 whatever its values say)."""
    kind = rng.choice(("nosection", "unknownkey", "noequals", "duplicate", "large",
                       "badutf8", "directory", "missing", "tokenkey"))
    case.config_bad = kind
    case.notes.append("config file broken: " + kind)


def config_bytes(case, ctx):
    """The config file's bytes (None: no file)."""
    values = [(o, p["config"]) for o, p in sorted(case.placed.items()) if "config" in p]
    if not values and not case.config_bad:
        return None
    lines = [b"[gpu_preflight]"]
    for option, (text, _) in values:
        if text is None:
            continue
        key = option if case.index % 2 else option.replace("-", "_")
        lines.append(key.encode() + b" = " + value_bytes(text, ctx))
    kind = case.config_bad
    if kind == "nosection":
        lines[0] = b"[other]"
    elif kind == "unknownkey":
        lines.append(b"tiemout = 1")
    elif kind == "noequals":
        lines.append(b"garbage line")
    elif kind == "duplicate":
        lines += [b"timeout = 1", b"timeout = 2"]
    elif kind == "large":
        lines.append(b"# " + b"x" * 70000)
    elif kind == "badutf8":
        lines.append(b"# caf\xe9")
    elif kind == "tokenkey":
        lines.append(b"token = secret")
    return b"\n".join(lines) + b"\n"


def value_bytes(text, ctx):
    if isinstance(text, bytes):
        return text.replace(b"{tmp}", ctx["tmp"].encode())
    return fill(text, ctx).encode("utf-8", "surrogateescape")


def fill(text, ctx):
    if isinstance(text, bytes):
        return text
    return (text.replace("{port}", str(ctx["port"])).replace("{tmp}", ctx["tmp"])
            .replace("{arabic_port}", "".join(chr(0x660 + int(d)) for d in str(ctx["port"]))))


def command_line(case, ctx, sink_path):
    """argv and environment of the run."""
    argv = list(case.cli_extra)
    env = support.cron_env(XDG_RUNTIME_DIR=ctx["xdg"], GPU_PREFLIGHT_ROOT=ctx["amd_root"],
                           GPU_PREFLIGHT_STATE_DIR=None)
    env.update((k, fill(v, ctx)) for k, v in case.env.items())
    for option, places in sorted(case.placed.items()):
        for where, (text, _) in places.items():
            if option == "ollama-host":
                continue
            if where == "cli":
                if text is None:
                    argv.append("--" + option)
                    continue
                for item in (text if isinstance(text, list) else [text]):
                    item = fill(item, ctx)
                    if isinstance(item, bytes):
                        argv += [b"--" + option.encode(), item]
                    elif item.startswith("-") or joined(case, option):
                        argv.append("--%s=%s" % (option, item))
                    else:
                        argv += ["--" + option, item]
            elif where == "env":
                env[env_name(option)] = fill(text, ctx)
    if case.token:
        env["GPU_PREFLIGHT_TOKEN"] = case.token[0]
    config = config_bytes(case, ctx)
    path = os.path.join(ctx["tmp"], "gp.conf")
    if case.config_bad == "directory":
        path = ctx["tmp"]
    elif case.config_bad == "missing":
        path = os.path.join(ctx["tmp"], "absent.conf")
    elif config is not None:
        with open(path, "wb") as handle:
            handle.write(config)
    if config is not None or case.config_bad:
        if case.config_via == "env":
            env["GPU_PREFLIGHT_CONFIG"] = path
        else:
            argv += ["--config", path]
    argv += ["--syslog-address", sink_path]
    return argv, env, config


def joined(case, option):
    """--option=value or --option value: fixed per case and option."""
    return (case.index + len(option)) % 3 == 0


# ---- The loopback server -------------------------------------------------------------

class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass        # the script hung up: what it does then is under test


def serve(answers):
    """A loopback HTTP server answering each endpoint as scripted."""
    calls = {}
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def reply(self):
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            path = self.path.split("?", 1)[0]
            endpoint = next((e for e in ENDPOINTS if path.endswith(e)), None)
            if endpoint is None:
                answer = Answer(404, b"404 page not found", ctype="text/plain")
            else:
                with lock:
                    calls[endpoint] = calls.get(endpoint, 0) + 1
                    n = calls[endpoint]
                given = answers[endpoint]
                answer = given[min(n, len(given)) - 1]
            self.send_response(answer.status)
            if answer.ctype:
                self.send_header("Content-Type", answer.ctype)
            if answer.status in (301, 302):
                self.send_header("Location", "http://127.0.0.1:1/elsewhere")
            body = answer.body
            if answer.framing == "chunked":
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                step = max(1, len(body) // 3)
                for at in range(0, len(body), step):
                    piece = body[at:at + step]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.write(b"0\r\n\r\n")
                return
            if answer.framing == "length":
                self.send_header("Content-Length", str(len(body)))
            elif answer.framing == "short":
                self.send_header("Content-Length", str(len(body) + 100))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_HEAD = reply

        def log_message(self, *args):
            pass

    server = _Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,))
    thread.daemon = True
    thread.start()
    return server


# ---- Running and judging a case ------------------------------------------------------

class Outcome(object):
    def __init__(self, case, argv, env, config, code, out, err, elapsed, lines, hung):
        self.case, self.argv, self.env, self.config = case, argv, env, config
        self.code, self.out, self.err, self.elapsed = code, out, err, elapsed
        self.lines, self.hung = lines, hung
        self.fields = {}
        if len(lines) == 1:
            self.fields = support.parse_fields(lines[0].partition("]: ")[2])

    def describe(self):
        case = self.case
        text = ["case %d (seed %d): %s" % (case.index, case.seed, "; ".join(case.notes)),
                "    argv: %s" % " ".join(shell_word(a) for a in self.argv),
                "    env: %s" % " ".join("%s=%s" % (k, shell_word(v))
                                         for k, v in sorted(self.env.items())
                                         if k != "PATH")]
        if self.config is not None:
            text.append("    config: %s" % show(self.config, 300))
        for endpoint in ENDPOINTS:
            for n, answer in enumerate(case.answers[endpoint]):
                if answer.log or endpoint in ("/api/tags", "/v1/models"):
                    text.append("    %s%s: %s" % (endpoint, " (call %d)" % (n + 1)
                                                  if len(case.answers[endpoint]) > 1 else "",
                                                  answer.describe()))
        text.append("    -> exit %s in %.2fs (bound %.1fs + %.1fs)%s" % (
            self.code, self.elapsed, case.bound(), SLACK, ", killed: hung" if self.hung
            else ""))
        text.append("    syslog: %s" % (self.lines or "(none)"))
        if self.out:
            text.append("    stdout: %s" % show(self.out, 300))
        if self.err:
            text.append("    stderr: %s" % show(self.err, 3000))
        return "\n".join(text)


def shell_word(word):
    """word as bash reads it back: quoted, or $'...' with escapes."""
    if isinstance(word, str) and not re.match(r"^[ -~]*$", word):
        word = word.encode("utf-8", "surrogateescape")
    if isinstance(word, bytes):
        word = "$'%s'" % "".join("\\x%02x" % b if b > 126 or b < 32 or b in b"'\\"
                                 else chr(b) for b in word)
    else:
        word = shlex.quote(word)
    return word if len(word) < 160 else "%s...(%d chars)" % (word[:160], len(word))


def run_case(case, python, amd_root):
    tmp = tempfile.mkdtemp(prefix="gpfl-prop-")
    server = serve(case.answers)
    sink = support.SyslogSink()
    try:
        xdg = os.path.join(tmp, "xdg")
        os.mkdir(xdg, 0o700)
        ctx = {"port": server.server_port, "tmp": tmp, "xdg": xdg, "amd_root": amd_root}
        argv, env, config = command_line(case, ctx, sink.path)
        bound = case.bound() + SLACK
        started = time.monotonic()
        proc = subprocess.Popen([python, support.SCRIPT] + argv, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                cwd="/", start_new_session=True)
        hung = False
        try:
            out, err = proc.communicate(timeout=bound + HUNG_AFTER)
        except subprocess.TimeoutExpired:
            hung = True
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        elapsed = time.monotonic() - started
        lines = []
        sink.sock.setblocking(False)
        while True:
            try:
                lines.append(sink.sock.recv(65536).decode("ascii", "backslashreplace"))
            except (BlockingIOError, socket.error):
                break
        return Outcome(case, argv, env, config, proc.returncode,
                       out.decode("utf-8", "backslashreplace"),
                       err.decode("utf-8", "backslashreplace"), elapsed, lines, hung)
    finally:
        sink.close()
        server.shutdown()
        server.server_close()
        shutil.rmtree(tmp, ignore_errors=True)


def normal(text, most=70):
    """Text with numbers and quoted values blurred, for grouping failures."""
    text = re.sub(r"\\[xuU][0-9a-fA-F]+", "N", text)
    text = re.sub(r"\d+", "N", text)
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'...'", text)
    return text[:most]


def crash_site(outcome, internal):
    """'OverflowError in check_service()': the exception and the function of
    the script it came from (the traceback --debug prints)."""
    kind = internal.group(1).split(":")[0] if internal else "?"
    frames = re.findall(r'File "[^"]*gpu_preflight\.py", line \d+, in (\w+)', outcome.err)
    if frames:
        return "%s in %s()" % (kind, frames[-1])
    return normal(internal.group(1) if internal else outcome.err)


def judge(outcome):
    """The violated properties of one run: [(kind, detail)]."""
    case, code, problems = outcome.case, outcome.code, []
    kind, names = case.expectation()
    internal = re.search(r"internal error: (\w+: [^\n\"]*)", outcome.err + " ".join(
        outcome.lines))
    if outcome.hung:
        problems.append(("hung: killed %gs past its deadline" % HUNG_AFTER, ""))
    if code == 70:
        problems.append(("exit 70 (internal error)", crash_site(outcome, internal)))
    elif code not in DOCUMENTED:
        problems.append(("undocumented exit status", str(code)))
    debug = code == 70 and "--debug" in case.cli_extra    # documented: --debug shows it
    for stream, text in (("stdout", outcome.out), ("stderr", "" if debug else outcome.err)):
        for marker in ("Traceback (most recent call last)", "Exception in thread",
                       "Exception ignored"):
            if marker in text:
                last = text.strip().splitlines()[-1]
                problems.append(("traceback on " + stream, normal(last)))
                break
    want_lines = 0 if code == 64 else 1
    if len(outcome.lines) != want_lines:
        problems.append(("%d syslog lines, not %d" % (len(outcome.lines), want_lines),
                         "exit %s" % code))
    elif outcome.fields and outcome.fields.get("code") != str(code):
        problems.append(("syslog code differs from the exit status",
                         "%s vs %s" % (outcome.fields.get("code"), code)))
    # The run's own clock where it logged one (a loaded machine slows the
    # test's, not the run's); the test's wall clock for a run that did not.
    took = outcome.elapsed
    if outcome.fields and outcome.fields.get("elapsed_ms", "").isdigit():
        took = int(outcome.fields["elapsed_ms"]) / 1000.0
    if took > case.bound() + SLACK and not outcome.hung:
        problems.append(("overran the deadline", "exit %s stage %s" % (
            code, outcome.fields.get("stage"))))
    verbose = "-v" in case.cli_extra
    as_json = any(text is None or isinstance(text, str) and text.strip().lower() in (
        "1", "true", "yes", "on") for text, _ in case.placed.get("json", {}).values())
    if code == 64:
        if outcome.out or len(outcome.err.splitlines()) != 1 or \
                not outcome.err.startswith("gpu_preflight: error:"):
            problems.append(("usage error not one line on stderr", normal(outcome.err)))
    elif code != 70:
        if outcome.err and not verbose:
            problems.append(("stderr not silent under cron", normal(outcome.err)))
        if outcome.out and not as_json:
            problems.append(("stdout not silent", normal(outcome.out)))
        if outcome.out and as_json:
            try:
                doc = json.loads(outcome.out)
                if outcome.out.count("\n") != 1 or doc.get("exit_code") != code:
                    raise ValueError("not one line with the exit code")
            except ValueError as exc:
                problems.append(("--json is not one JSON object", normal(str(exc))))
    stage = outcome.fields.get("stage")
    if kind == "usage":
        if code != 64:
            problems.append(("bad value on the command line not 64", "exit %s" % code))
        elif len(names) == 1 and "--" + names[0] not in outcome.err:
            problems.append(("usage error does not name the option", names[0]))
    elif kind == "usage or config":
        if code != 64 and (code != 78 or stage != "config"):
            problems.append(("bad value from environment/config file not 78 (config)",
                             "exit %s stage %s" % (code, stage)))
    elif kind == "config":
        if code != 78 or stage != "config":
            problems.append(("bad value from environment/config file not 78 (config)",
                             "exit %s stage %s" % (code, stage)))
        elif len(names) == 1 and "config file" not in names[0] and names[0] != "token":
            option, where = names[0].split(" (")
            source = env_name(option) if where == "env)" else option
            reason = outcome.fields.get("reason", "")
            if source not in reason and source.replace("-", "_") not in reason:
                problems.append(("configuration error does not name its source", source))
    elif kind == "good" and (code == 64 or stage == "config"):
        problems.append(("good values refused", "exit %s stage %s" % (code, stage)))
    return problems


# ---- Examples: inputs known to have broken the script ---------------------------------

def example_case(index, seed):
    """A faithful ready run (one model, loaded, in VRAM) with one known hazard."""
    what, change = EXAMPLES[index]
    case = Case(index, seed)
    case.cli_extra = ["--debug"]
    case.place("host", "cli", "http://127.0.0.1:{port}", GOOD)
    case.place("deadline", "cli", "2", GOOD)
    case.place("timeout", "cli", "1", GOOD)
    name = "llama3.2:latest"
    entry = ps_entry(name, random.Random(0))
    entry["size_vram"] = entry["size"]
    docs = {"/api/tags": {"models": [tags_entry(name)]},
            "/api/ps": [{"models": [entry]}, {"models": [copy.deepcopy(entry)]}],
            "/api/generate": generate_final(name, False),
            "/api/version": {"version": "0.32.15"}, "/health": b"",
            "/v1/models": v1_models([name], "vllm"), "/v1/completions": completion(name)}
    change(case, docs)
    for endpoint in ENDPOINTS:
        given = docs[endpoint]
        case.answers[endpoint] = [      # the changed answer shows on failure
            Answer(200, doc if isinstance(doc, bytes) else to_bytes(encode(doc)),
                   log=[what] if "%s#%d" % (endpoint, n) in case.notes else [])
            for n, doc in enumerate(given if isinstance(given, list) else [given])]
    case.notes = [n for n in case.notes if "#" not in n]
    case.notes.append("example: " + what)
    return case


def _set(path, value):
    """A change setting docs[endpoint]...[key] = value."""
    def change(case, docs):
        node = docs
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        case.notes.append("%s#%s" % (path[0], path[1] if len(path) > 1
                                     and isinstance(path[1], int) else 0))
    return change


def _option(option, where, text, label, *more):
    def change(case, docs):
        case.place(option, where, text, label)
        for extra in more:
            case.place(*extra)
    return change


def _tags_entry(case, docs):
    docs["/api/tags"]["models"].append({"name": "", "model": 5})
    case.notes.append("/api/tags#0")
    case.place("model", "cli", "x", GOOD)


NINES = "9" * 400
METRICS = ("metrics-file", "cli", "{tmp}/metrics.prom", GOOD)
#: (what, change): case N is EXAMPLES[N]; the random cases follow them.
EXAMPLES = (
    ("an integer of %d digits in /api/tags (no digit limit on 3.6)" % HUGE_DIGITS,
     _set(("/api/tags",), Raw('{"models":%s}' % ("1" * HUGE_DIGITS),
                              '{"models": <%d-digit integer>}' % HUGE_DIGITS))),
    ("400-digit size_vram in /api/ps",
     _set(("/api/ps", 1, "models", 0, "size_vram"), Raw(NINES, "400-digit integer"))),
    ("400-digit load_duration in /api/generate",
     _set(("/api/generate", "load_duration"), Raw(NINES, "400-digit integer"))),
    ("/api/tags entry {name: '', model: 5} with --model x", _tags_entry),
    ("--keep-alive of 400 nines", _option("keep-alive", "cli", NINES, BAD)),
    ("GPU_PREFLIGHT_KEEP_ALIVE of 400 nines", _option("keep-alive", "env", NINES, BAD)),
    ("--ollama-option k=[[[...]]] 50000 deep",
     _option("ollama-option", "cli", ["k=" + "[" * 50000 + "]" * 50000], UNKNOWN)),
    ("--gpu-id \u00b2 (isdigit() but not int())", _option("gpu-id", "cli", "\u00b2", BAD)),
    ("non-UTF-8 --model with --metrics-file",
     _option("model", "cli", b"caf\xe9", UNKNOWN, METRICS)),
    ("non-ASCII --model with --metrics-file (3.6, C locale)",
     _option("model", "cli", "caf\u00e9", UNKNOWN, METRICS)),
)


class PropertyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="gpfl-prop-amd-")
        cls.amd_root = fakes.make_amd_sysfs(cls.dir, [
            {"busy": 5, "used_mib": 1024, "temp_c": 45, "unique_id": "abc123",
             "name": "AMD Instinct MI300X"}, {"busy": 80, "used_mib": 60000}])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def one(self, index):
        """(index, verdict, problems, description of the case or None)."""
        try:
            case = (example_case(index, SEED) if index < len(EXAMPLES)
                    else draw_case(index, SEED))
            outcome = run_case(case, sys.executable, self.amd_root)
            problems = judge(outcome)
            description = outcome.describe() if problems else None
            first = [p for p in problems if p[0].startswith(("exit 70", "hung"))][:1]
            if first and len(problems) > 1:     # one root cause: report it once
                description += "\n    also: %s" % "; ".join(
                    "%s (%s)" % p for p in problems if p not in first)
                problems = first
            return (index, (outcome.code, outcome.fields.get("stage")), outcome.elapsed,
                    problems, description)
        except Exception:
            import traceback
            return (index, None, 0.0, [("the test itself failed", "case %d" % index)],
                    traceback.format_exc())

    def test_any_input_ends_in_a_documented_verdict_on_time_with_one_log_line(self):
        indexes = ONLY or list(range(len(EXAMPLES) + CASES))
        started = time.monotonic()
        pool = concurrent.futures.ThreadPoolExecutor(max(1, JOBS))
        try:
            results = list(pool.map(self.one, indexes))
        finally:
            pool.shutdown()
        took = time.monotonic() - started
        groups, verdicts, described = {}, {}, {}
        for index, verdict, elapsed, problems, description in results:
            verdicts[verdict] = verdicts.get(verdict, 0) + 1
            described[index] = description
            for problem in problems:
                groups.setdefault(problem, []).append(index)
        if VERBOSE:
            slowest = sorted(results, key=lambda r: -r[2])[:3]
            sys.stderr.write("\nproperty: seed %d, %d cases, %d at once, %.1fs (slowest: "
                             "%s); verdicts (exit, stage): %s\n" % (
                                 SEED, len(indexes), JOBS, took, ", ".join(
                                     "case %d %.1fs" % (r[0], r[2]) for r in slowest),
                                 ", ".join("%s %s: %d" % (k[0], k[1], v) if k else
                                           "none: %d" % v for k, v in sorted(
                                               verdicts.items(), key=str))))
        if groups:
            report = ["seed %d, %d cases: %d distinct failures (rerun one case alone: "
                      "GPU_PREFLIGHT_PROPERTY_SEED=%d GPU_PREFLIGHT_PROPERTY_ONLY=N)"
                      % (SEED, len(indexes), len(groups), SEED)]
            for n, ((what, detail), indexes_hit) in enumerate(sorted(
                    groups.items(), key=lambda item: str(item[0]))):
                report.append("\n[%d] %s: %s (cases %s)" % (
                    n + 1, what, detail, ", ".join(str(i) for i in indexes_hit)))
                report.append(min((described[i] for i in indexes_hit), key=len))
            self.fail("\n".join(report))
        if not ONLY:    # the answers must let the runs get deep, not stop at the door
            self.assertIn(0, [k[0] for k in verdicts if k], verdicts)
            deep_stages = ("placement", "completion", "warmup")
            self.assertTrue(any(k[1] in deep_stages for k in verdicts if k), verdicts)


if __name__ == "__main__":
    unittest.main()
