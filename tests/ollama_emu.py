#!/usr/bin/env python3
"""Loopback emulator of the Ollama HTTP server, for gpu_preflight's tests and benchmark.

It answers like Ollama on the endpoints a preflight touches (see the project's
references ollama-api.md and multi-model.md): GET/HEAD /, GET/HEAD
/api/version, GET/HEAD /api/tags, GET /api/ps, POST /api/show, POST
/api/generate, POST /api/chat, POST /api/embed and the legacy POST
/api/embeddings (validation order, exact error bodies, load-only and unload
replies, NDJSON streaming by default, cold loads that send no byte until
loaded and abort when the client that started them hangs up).  Other paths
get gin's "404 page not found", wrong methods "405 method not allowed".

Several models, each generative, embedding or cloud, with capabilities, a
size, a load time and optionally a forced GPU share (Model, or a spec string
"NAME[=KIND[:CAPS[:SIZE_MIB[:LOAD_S[:GPU_PCT]]]]]", e.g.
"nomic-embed-text:latest=embed" or "qwen3:latest=generate:completion,tools").
What the server says depends on `version` (default 0.32.15), as the real one:
  capabilities   /api/tags from 0.30.0 (with details.context_length and
                 embedding_length), /api/show from 0.6.4, none before
  /api/embed     from 0.2.6 (404 before); metrics from 0.3.1; empty input:
                 200 {"embeddings":[]} without a load before 0.3.6, loads the
                 model first from 0.3.6; on a generative model: vectors (old
                 llama runner), 500 "this model does not support embeddings"
                 (Go engine archs, 0.6.1 to 0.29), 501 "This server does not
                 support embeddings. Start it with `--embeddings`" after the
                 load (0.30.0 on)
  generate/chat on an embedding model: 400, text by version ("embedding models
                 do not support generate" < 0.2.0, `M does not support
                 generate` 0.2.0-0.2.1, `"M" does not support generate` after)
  missing model  400 "model is required" up to 0.3.14, 404 after
  scheduler      OLLAMA_MAX_LOADED_MODELS (max_loaded; default 1 before 0.2.0,
                 3 after) and a VRAM budget (vram_mib): loading a model that
                 does not fit beside the loaded ones evicts one first (the
                 idle one with the shortest keep-alive, then by name), as
                 server/sched.go does: from 0.30.0 it must fit in 80 % of the
                 free VRAM, before in all of it; alone, it loads partially
                 offloaded.  /api/ps then lists only what is resident, with
                 size and size_vram.  One load at a time; from 0.32.4 GET
                 /api/ps blocks while a load is under way.  Aliases (Model
                 blob=, as ollama cp makes them) share one digest and one
                 runner, listed once in /api/ps under the name that loaded it
  /api/ps        404 before 0.1.38; context_length from 0.10.0
  cloud models   (0.12.0 on; kind "cloud") listed in /api/tags with remote_model
                 and remote_host, never loaded, never in /api/ps; generate for
                 one, or for any NAME:cloud / NAME:TAG-cloud reference (listed or
                 not), is relayed to ollama.com; `cloud` says what the server's
                 account and policy let through: "signed_in" (answers),
                 "disabled" (OLLAMA_NO_CLOUD: 403) or "signed_out" (401 with a
                 signin_url)
  context        each runner has the num_ctx it was loaded with (the request's
                 options.num_ctx, else the server's default: context_length /
                 OLLAMA_CONTEXT_LENGTH, else 2048 before 0.6.7, 4096 after,
                 from 0.15.5 by VRAM: 32768 from 23 GiB, 262144 from 47),
                 capped at the model's training context.  A request whose
                 runner options (num_ctx, num_batch, num_gpu, main_gpu,
                 use_mmap, num_thread) differ from the loaded runner's reloads
                 it, taking the load time (counted in .reloads); load_duration
                 is the time from arrival to the runner being ready, as Ollama
                 measures it (small but non-zero when warm)
  wrong method   405 from 0.6.9, 404 before

Modes (fault_on / --fault-on restricts a fault to one path, default "all"):
  healthy       faithful Ollama (the default)
  cold          healthy, but nothing loaded at start (like --cold / loaded=())
  cpu, partial  /api/ps reports size_vram 0 / 45 % of size for every model
  cpu_claims_gpu  /api/ps reports size_vram = size while the runners run on
                the CPU (gpu_file lists none)
  hang          read the request, never answer
  trickle       a valid reply, one byte every trickle_interval (2 s) seconds
  close_mid_body  full Content-Length, ~10 body bytes, then close
  garbage, truncated, huge  200 application/json: not JSON / cut JSON / 100 MB
  busy, oom, cuda_error, runner_died, load_timeout, pull_first
                the matching error of a warm-up request (generate, chat, embed,
                embeddings), after request validation
  error_in_200  /api/generate errors inside a 200 reply (pre-0.12.6 Ollama)
  no_done       /api/generate answers one chunk with done:false, nothing more
  empty_embedding  /api/embed answers {"embeddings":[]}, /api/embeddings
                {"embedding":[]} after the load (what an empty input gets)
  empty_vector  /api/embed answers {"embeddings":[[]]}
  hostguard     403 with an empty body;  not_ollama: 404 page not found
  old_server    <= 0.3.14: missing model -> 400 "model is required", no /api/ps
  slow_start    answer nothing for load_seconds after start (startup window)

Every request is recorded in .requests as a Request: a tuple (method, path,
parsed JSON body or None, headers) with .started, .ended (when its reply
began) and .status.  A GET /api/ps that arrives while a warm-up request is in
flight is also appended to .ps_during_warmup; evictions to .evictions as
(victim, model loaded, "max_loaded" or "vram").

gpu_file (--gpu-file): a file the emulator keeps as "PID BYTES" lines, one per
runner it has on the GPU, for the fake NVML (tests/fake_nvml.c,
FAKE_NVML_RUNNERS) to list as compute processes: what nvidia-smi shows of a
real Ollama's runners. Each PID is a real process named llama-server (a sleep).

Run it:   python3 tests/ollama_emu.py --port 11434 --mode cold --load-seconds 3
          python3 tests/ollama_emu.py --version 0.12.3 --vram-mib 8192 \\
              --model qwen3:latest=generate:completion,tools:5000 \\
              --model nomic-embed-text:latest=embed
Import:   from ollama_emu import Emulator, Model
          emu = Emulator(models=("qwen3:latest", Model("bge-m3:latest", "embed")),
                         version="0.5.7", max_loaded=1).start()
Standard library only, CPython 3.6+.
"""

import datetime
import email.utils
import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from http.client import responses as _REASONS

from emu_base import HTTPEmulator, cli_parser, serve_for_command, serve_until_signalled
from emu_base import free_port  # noqa: F401  (the tests import it from here)

MODES = (
    ("healthy", "faithful Ollama (default)"),
    ("cold", "healthy, nothing loaded at start; first generate waits --load-seconds"),
    ("cpu", "/api/ps reports size_vram 0 (silent CPU fallback)"),
    ("partial", "/api/ps reports size_vram = 45% of size (partial offload)"),
    ("cpu_claims_gpu", "/api/ps reports size_vram = size, the runner on the CPU"),
    ("hang", "accept and read the request, never answer"),
    ("trickle", "a valid reply sent one byte every 2 seconds"),
    ("close_mid_body", "headers with the full Content-Length, ~10 body bytes, close"),
    ("garbage", "200 application/json with a non-JSON body"),
    ("truncated", "200 application/json with a complete but cut JSON text"),
    ("huge", "200 application/json with a 100 MB body"),
    ("busy", "warm-up -> 503 server busy"),
    ("oom", "warm-up -> 500 unable to allocate CUDA0 buffer"),
    ("cuda_error", "warm-up -> 500 CUDA error: an illegal memory access"),
    ("runner_died", "warm-up -> 500 model runner has unexpectedly stopped"),
    ("load_timeout", "warm-up -> 500 timed out waiting for llama runner to start"),
    ("pull_first", "warm-up -> 404 model \"NAME\" not found, try pulling it first"),
    ("error_in_200", "generate -> 200 carrying {\"error\":...} (pre-0.12.6)"),
    ("no_done", "generate -> 200 one chunk with done:false and nothing more"),
    ("empty_embedding", "embed -> 200 {\"embeddings\":[]}; embeddings -> {\"embedding\":[]}"),
    ("empty_vector", "embed -> 200 {\"embeddings\":[[]]}"),
    ("hostguard", "every request -> 403 with an empty body"),
    ("not_ollama", "every path -> 404 page not found"),
    ("old_server", "missing model -> 400 model is required; /api/ps -> 404"),
    ("slow_start", "answer nothing for the first --load-seconds after start"),
)
MODE_NAMES = tuple(name for name, _ in MODES)

JSON_CT = "application/json; charset=utf-8"
NDJSON_CT = "application/x-ndjson"
TEXT_UTF8 = "text/plain; charset=utf-8"
TEXT = "text/plain"

_ROUTES = {"/": ("GET", "HEAD"), "/api/version": ("GET", "HEAD"),
           "/api/tags": ("GET", "HEAD"), "/api/ps": ("GET",), "/api/generate": ("POST",),
           "/api/chat": ("POST",), "/api/show": ("POST",), "/api/embed": ("POST",),
           "/api/embeddings": ("POST",)}
#: Requests that schedule (load) a model: /api/ps must not be read during one.
WARMUP_PATHS = ("/api/generate", "/api/chat", "/api/embed", "/api/embeddings")

_GENERATE_ERRORS = {
    "busy": (503, "server busy, please try again.  maximum pending requests exceeded"),
    "oom": (500, "llama runner process has terminated: error loading model: "
                 "unable to allocate CUDA0 buffer"),
    "cuda_error": (500, "llama runner process has terminated: CUDA error: "
                        "an illegal memory access was encountered"),
    "runner_died": (500, "model runner has unexpectedly stopped, this may be due to resource "
                         "limitations or an internal error, check ollama server logs for details"),
    "load_timeout": (500, "timed out waiting for llama runner to start - progress 0.00 - "),
}
_ERROR_IN_200 = "an error was encountered while running the model: CUDA error: out of memory"
#: /api/embed on a generative model: llama-server's 501 (0.30.0 on), the Go engine's 500.
NO_EMBEDDINGS_501 = "This server does not support embeddings. Start it with `--embeddings`"
NO_EMBEDDINGS_GO = "this model does not support embeddings"
_FOREVER = -1.0                      # keep_alive < 0: Go uses MaxInt64 ns (~292 years)
_MAX_NS_SECONDS = (2 ** 63 - 1) // 10 ** 9
_DEFAULT_KEEP = 300.0                # OLLAMA_KEEP_ALIVE default 5m

#: Capability names (types/model/capability.go) and the release that added the later ones.
CAPABILITIES = ("completion", "tools", "insert", "vision", "embedding", "thinking",
                "image", "audio")
_CAP_SINCE = {"thinking": (0, 9, 0), "image": (0, 14, 0), "audio": (0, 20, 0)}
#: Architectures that run on the Go engine (ollamarunner) from 0.6.1 to 0.29.x.
_GO_ENGINE_ARCHS = ("gemma3", "gemma3n", "qwen3", "qwen3moe", "qwen25vl", "llama4",
                    "mistral3", "gptoss", "mllama")
EMBED_SIZE = 274302450               # nomic-embed-text:latest, bytes
CLOUD_MANIFEST_SIZE = 384            # a cloud model's manifest: config, no weights
KINDS = ("generate", "embed", "cloud")
#: What the server's ollama.com account and OLLAMA_NO_CLOUD let a cloud request do.
CLOUD_STATES = ("signed_in", "disabled", "signed_out")
#: server/cloud_proxy.go defaultCloudProxyBaseURL: where cloud models run.
CLOUD_HOST = "https://ollama.com:443"

# Request fields whose JSON type the Go decoder enforces (Go type names), per struct.
_FIELD_TYPES = {"model": "string", "prompt": "string", "suffix": "string",
                "system": "string", "template": "string", "stream": "bool",
                "raw": "bool", "options": "map[string]interface {}"}
_CHAT_FIELDS = {"model": "string", "stream": "bool", "options": "map[string]interface {}",
                "messages": "[]api.Message"}
_EMBED_FIELDS = {"model": "string", "truncate": "bool", "options": "map[string]interface {}",
                 "dimensions": "int"}
_LEGACY_FIELDS = {"model": "string", "prompt": "string", "options": "map[string]interface {}"}
_SHOW_FIELDS = {"model": "string", "name": "string", "verbose": "bool"}
_GO_KIND = {"string": str, "bool": bool, "map[string]interface {}": dict, "int": int,
            "[]api.Message": list}
# api.Options fields by type, as checked by Options.FromMap.
_OPT_INT = ("num_keep", "seed", "num_predict", "top_k", "repeat_last_n", "num_ctx",
            "num_batch", "num_gpu", "main_gpu", "num_thread")
_OPT_FLOAT = ("temperature", "top_p", "min_p", "typical_p", "repeat_penalty",
              "presence_penalty", "frequency_penalty")
_OPT_BOOL = ("numa", "use_mmap")
#: api.Runner: the options server/sched.go needsReload compares with the loaded runner's.
_RUNNER_OPTIONS = ("num_ctx", "num_batch", "num_gpu", "main_gpu", "use_mmap", "num_thread")
_UNITS = {"ns": 1e-9, "us": 1e-6, u"\u00b5s": 1e-6, u"\u03bcs": 1e-6, "ms": 1e-3,
          "s": 1.0, "m": 60.0, "h": 3600.0}


# ---------------------------------------------------------------- helpers

def _dumps(obj):
    """Compact JSON bytes as Go's json.Marshal writes them (<, >, & escaped)."""
    text = json.dumps(obj, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode("ascii")


def _go_quote(text):
    """Go's %q / strconv.Quote for the ASCII names a test uses."""
    return json.dumps(text)


def _rfc3339(when, utc=False):
    """Go's RFC3339Nano: nanoseconds with trailing zeros trimmed, 'Z' for a zero offset."""
    if utc:
        when = when.replace(tzinfo=None)
        offset = "Z"
    else:
        minutes = int(when.utcoffset().total_seconds() // 60)
        sign = "-" if minutes < 0 else "+"
        offset = "Z" if minutes == 0 else "%s%02d:%02d" % (sign, abs(minutes) // 60, abs(minutes) % 60)
    nanos = when.microsecond * 1000 + 417
    return when.strftime("%Y-%m-%dT%H:%M:%S") + ("." + ("%09d" % nanos).rstrip("0")) + offset


def _local_now():
    return datetime.datetime.now().astimezone()


def _canonical_model(name):
    """Ollama name matching: 'llama3.2' is 'llama3.2:latest', default registry dropped, any case."""
    name = name.lower()
    if ":" not in name.rsplit("/", 1)[-1]:
        name += ":latest"
    for prefix in ("registry.ollama.ai/", "library/"):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


def _cloud_base(name):
    """The model a NAME:cloud or NAME:TAG-cloud reference asks ollama.com for,
    or None for a reference without that suffix (internal/modelref/modelref.go
    parseSourceSuffix: the text after the last colon, "cloud", or ending in
    "-cloud" without a slash; any case)."""
    head, colon, suffix = name.strip().rpartition(":")
    lowered = suffix.strip().lower()
    if not colon or (lowered != "cloud" and ("/" in suffix or not lowered.endswith("-cloud"))):
        return None
    return head if lowered == "cloud" else head + ":" + suffix.strip()[:-len("-cloud")]


def _details(name):
    name = _cloud_base(name) or name
    base = name.rsplit("/", 1)[-1].split(":")[0].lower()
    letters = re.match(r"[a-z]+", base)
    family = letters.group(0) if letters else "llama"
    size = re.match(r"(\d+(?:\.\d+)?)b$", name.rsplit(":", 1)[-1].lower())
    return {"parent_model": "", "format": "gguf", "family": family, "families": [family],
            "parameter_size": (size.group(1) + "B") if size else "3.2B",
            "quantization_level": "Q4_K_M"}


def _json_kind(value):
    """The JSON type name Go's decoder uses in its messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _quote_char(ch):
    """Go encoding/json quoteChar."""
    if ch == "'":
        return "'\\''"
    if ch == '"':
        return "'\"'"
    esc = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}.get(ch)
    if esc is None:
        esc = ch if 0x20 <= ord(ch) < 0x7f else "\\u%04x" % ord(ch)
    return "'" + esc + "'"


def _container_at(text, pos):
    """'{' or '[' : the innermost open container before pos (strings skipped)."""
    stack, in_str, esc = [], False, False
    for ch in text[:pos]:
        if esc:
            esc = False
        elif in_str:
            esc, in_str = ch == "\\", ch != '"'
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append(ch)
        elif ch in "}]" and stack:
            stack.pop()
    return stack[-1] if stack else ""


def _decode_json(text):
    """(value, None) or (None, Go decoder message). Like json.Decoder.Decode: trailing data ignored."""
    start = len(text) - len(text.lstrip(" \t\r\n"))
    try:
        return json.JSONDecoder().raw_decode(text, start)[0], None
    except ValueError as exc:
        pos, msg = getattr(exc, "pos", len(text)), getattr(exc, "msg", str(exc))
    if pos >= len(text) or msg.startswith("Unterminated"):
        return None, "unexpected EOF"
    where = "looking for beginning of value"
    if msg.startswith("Expecting property name"):
        where = "looking for beginning of object key string"
    elif msg.startswith("Expecting ':'"):
        where = "after object key"
    elif msg.startswith("Expecting ','"):
        where = ("after object key:value pair" if _container_at(text, pos) == "{"
                 else "after array element")
    elif msg.startswith("Invalid control"):
        where = "in string literal"
    elif msg.startswith("Invalid \\"):
        where = "in string escape code"
    return None, "invalid character %s %s" % (_quote_char(text[pos]), where)


def _parse_go_duration(text):
    """Seconds for Go's time.ParseDuration; ValueError carries Go's message."""
    quoted, rest, neg, total = _go_quote(text), text, False, 0.0
    if rest[:1] in ("-", "+"):
        neg, rest = rest[0] == "-", rest[1:]
    if rest == "0":
        return 0.0
    if not rest:
        raise ValueError("time: invalid duration " + quoted)
    while rest:
        number = re.match(r"\d*(?:\.\d*)?", rest).group(0)
        if not re.search(r"\d", number):
            raise ValueError("time: invalid duration " + quoted)
        rest = rest[len(number):]
        unit = re.match(r"[^0-9.]*", rest).group(0)
        if not unit:
            raise ValueError("time: missing unit in duration " + quoted)
        if unit not in _UNITS:
            raise ValueError("time: unknown unit %s in duration %s" % (_go_quote(unit), quoted))
        rest = rest[len(unit):]
        total += float(number) * _UNITS[unit]
    return -total if neg else total


def _keep_alive(value):
    """api.Duration.UnmarshalJSON: seconds, _FOREVER for negatives; ValueError on bad input."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        kind = {"bool": "bool", "array": "[]interface {}"}.get(_json_kind(value),
                                                                "map[string]interface {}")
        raise ValueError("Unsupported type: '%s'" % kind)
    seconds = _parse_go_duration(value) if isinstance(value, str) else float(value)
    return _FOREVER if seconds < 0 else seconds


def _request_error(req, fields=None, struct="GenerateRequest"):
    """Go decoder error for a request object of api.STRUCT, or None."""
    fields = _FIELD_TYPES if fields is None else fields
    if req.get("keep_alive") is not None:
        try:
            _keep_alive(req["keep_alive"])
        except ValueError as exc:
            return str(exc)
    for key, value in req.items():
        want = fields.get(key)
        if want is None or value is None:
            continue
        if type(value) is not _GO_KIND[want]:
            return ("json: cannot unmarshal %s into Go struct field %s.%s of type %s"
                    % (_json_kind(value), struct, key, want))
    return None


def _options_error(options):
    """Options.FromMap error for a wrong option type, or None."""
    for key, value in (options or {}).items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is None:
            continue
        if key in _OPT_INT and not number:
            return "option %s must be of type integer" % _go_quote(key)
        if key in _OPT_FLOAT and not number:
            return "option %s must be of type float32" % _go_quote(key)
        if key in _OPT_BOOL and not isinstance(value, bool):
            return "option %s must be of type boolean" % _go_quote(key)
        if key == "stop" and not isinstance(value, list):
            return "option %s must be of type array" % _go_quote(key)
    return None


def _canon(key):
    return "-".join(part.capitalize() for part in str(key).split("-"))


class _Headers(dict):
    """Request headers keyed like Go's CanonicalHeaderKey ('User-Agent'), looked up in any case."""

    def __init__(self, pairs=()):
        dict.__init__(self, ((_canon(k), v) for k, v in pairs))

    def __getitem__(self, key):
        return dict.__getitem__(self, _canon(key))

    def __contains__(self, key):
        return dict.__contains__(self, _canon(key))

    def get(self, key, default=None):
        return dict.get(self, _canon(key), default)


class _Reply(object):
    """A response: a plain body, or NDJSON lines sent chunked."""

    def __init__(self, status, body=b"", ctype=JSON_CT, lines=None):
        self.status, self.body, self.ctype, self.lines = status, body, ctype, lines


def _json_reply(status, obj):
    return _Reply(status, _dumps(obj))


def _error(status, message):
    return _json_reply(status, {"error": message})


def _text(status, message, ctype=TEXT):
    return _Reply(status, message.encode("ascii"), ctype)


def _head(status, ctype, length=None, chunked=False):
    lines = ["HTTP/1.1 %d %s" % (status, _REASONS.get(status, "Status"))]
    if ctype:
        lines.append("Content-Type: " + ctype)
    lines.append("Date: " + email.utils.formatdate(usegmt=True))
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    elif length is not None:
        lines.append("Content-Length: %d" % length)
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")


def _pieces(reply, head_only=False, http10=False):
    """The bytes of a reply, in the writes a server would make."""
    if reply.lines is None:
        yield _head(reply.status, reply.ctype, len(reply.body))
        if reply.body and not head_only:
            yield reply.body
        return
    chunked = not http10
    yield _head(reply.status, reply.ctype, chunked=chunked)
    for line in reply.lines:
        yield (b"%x\r\n%s\r\n" % (len(line), line)) if chunked else line
    if chunked:
        yield b"0\r\n\r\n"


_FIXED_REPLIES = {
    "hostguard": _Reply(403, b"", None),
    "not_ollama": _text(404, "404 page not found"),
    "garbage": _Reply(200, b"<html>oops</html>"),
    "truncated": _Reply(200, b'{"models":[{"name":"ll'),
}


# ---------------------------------------------------------------- models

def _version_tuple(text):
    """(major, minor, patch) of a version string; a source build ("0.0.0") is the newest."""
    nums = [int(n) for n in re.findall(r"\d+", str(text or ""))[:3]]
    found = tuple(nums) + (0,) * (3 - len(nums))
    return (999, 0, 0) if found == (0, 0, 0) else found


def _arch(name, kind):
    """general.architecture of a model, guessed from its name as the GGUFs have it."""
    base = name.rsplit("/", 1)[-1].split(":")[0].lower()
    if kind == "embed":
        return "nomic-bert" if base.startswith("nomic") else "bert"
    for prefix, arch in (("llama4", "llama4"), ("llama", "llama"), ("qwen3", "qwen3"),
                         ("qwen2.5vl", "qwen25vl"), ("qwen2", "qwen2"), ("gemma3n", "gemma3n"),
                         ("gemma3", "gemma3"), ("gemma2", "gemma2"), ("gemma", "gemma"),
                         ("mistral-small3", "mistral3"), ("mistral", "llama"),
                         ("gpt-oss", "gptoss"), ("phi3", "phi3"), ("deepseek-r1", "qwen2")):
        if base.startswith(prefix):
            return arch
    letters = re.match(r"[a-z]+", base)
    return letters.group(0) if letters else "llama"


class Model(object):
    """A model the emulated server has pulled.

    kind          "generate" or "embed" (a GGUF with <arch>.pooling_type), or
                  "cloud": a generative model that runs on ollama.com (its
                  manifest holds a config with remote_host, no weights)
    capabilities  what /api/show and /api/tags report (default ["completion"]
                  or ["embedding"]); the server checks requests against them
    size          bytes (default: the emulator's size, or 274302450 for embed)
    load_seconds  cold-load time (default: the emulator's load_seconds); a
                  cloud model's: how long ollama.com takes to answer (default 0)
    gpu_pct       force size_vram to this share of size once loaded (0: the CPU
                  fallback, 45: partial offload); default: as the scheduler
                  places it in the VRAM budget
    dims          embedding width (768 embed, 3072 generate)
    arch          general.architecture (default from the name)
    blob          the weights' blob: models with the same blob are aliases
                  (ollama cp): one digest in /api/tags, one runner (the
                  scheduler's key is the blob path), and /api/ps lists it once,
                  under the name that loaded it (default: a blob of its own)
    """

    def __init__(self, name, kind="generate", capabilities=None, size=None,
                 load_seconds=None, gpu_pct=None, dims=None, arch=None, blob=None):
        if kind not in KINDS:
            raise ValueError("unknown kind %r (one of %s)" % (kind, ", ".join(KINDS)))
        if capabilities is None:
            capabilities = ["embedding"] if kind == "embed" else ["completion"]
        unknown = [c for c in capabilities if c not in CAPABILITIES]
        if unknown:
            raise ValueError("unknown capabilities %s (known: %s)"
                             % (", ".join(unknown), ", ".join(CAPABILITIES)))
        self.name, self.kind, self.capabilities = name, kind, list(capabilities)
        self.size, self.load_seconds, self.gpu_pct = size, load_seconds, gpu_pct
        self.dims = dims or (768 if kind == "embed" else 3072)
        self.arch = arch or _arch(name, kind)
        self.blob = blob

    @classmethod
    def parse(cls, spec):
        """A Model from "NAME[=KIND[:CAPS[:SIZE_MIB[:LOAD_S[:GPU_PCT]]]]]" (empty fields: default)."""
        name, _, rest = str(spec).partition("=")
        if not name:
            raise ValueError("model spec %r has no name" % spec)
        fields = rest.split(":") if rest else []
        if len(fields) > 5:
            raise ValueError("model spec %r has too many fields" % spec)
        fields += [""] * (5 - len(fields))
        kind, caps, size_mib, load_s, gpu_pct = fields
        return cls(name, kind or "generate",
                   [c for c in caps.split(",") if c] if caps else None,
                   int(float(size_mib) * 1024 * 1024) if size_mib else None,
                   float(load_s) if load_s else None,
                   float(gpu_pct) if gpu_pct else None)

    def __repr__(self):
        return "Model(%r, %r, %r)" % (self.name, self.kind, self.capabilities)


class Request(tuple):
    """A request as the emulator saw it: (method, path, parsed JSON body or None,
    headers), plus .started (arrival), .ended (its reply began; None while in
    flight) and .status."""

    def __new__(cls, method, path, body, headers, started):
        self = tuple.__new__(cls, (method, path, body, headers))
        self.started, self.ended, self.status = started, None, None
        return self

    method = property(lambda self: self[0])
    path = property(lambda self: self[1])
    body = property(lambda self: self[2])
    headers = property(lambda self: self[3])

    @property
    def model(self):
        return self[2].get("model") if isinstance(self[2], dict) else None


def _vector(seed, dims, normalize=True):
    """A deterministic pseudo-random vector, L2-normalized as /api/embed returns them."""
    rnd = random.Random(hashlib.sha256(seed.encode("utf-8")).hexdigest())
    values = [rnd.uniform(-1.0, 1.0) for _ in range(dims)]
    if normalize:
        norm = math.sqrt(sum(v * v for v in values)) or 1.0
        values = [v / norm for v in values]
    else:
        values = [v * 3.0 for v in values]
    return [float("%.7g" % v) for v in values]


# ---------------------------------------------------------------- the emulator

def _named_process(folder, name):
    """A sleep of an hour whose /proc/PID/comm is name (folder/name links to
    sleep), once the kernel has named it: execve sets comm after it closes
    the descriptors Popen waits on, so Popen may return before."""
    proc = subprocess.Popen([os.path.join(folder, name), "3600"])
    for _ in range(500):
        with open("/proc/%d/comm" % proc.pid) as handle:
            if handle.read().strip() == name:
                break
        time.sleep(0.01)
    return proc


class Emulator(HTTPEmulator):
    """An Ollama look-alike on a loopback port. See the module docstring.

    models      names or Model objects or spec strings (see Model.parse)
    loaded      names loaded at start (default: the first model)
    version     the release it answers as (what differs: module docstring)
    vram_mib    the VRAM budget of the scheduler (None: unlimited)
    max_loaded  OLLAMA_MAX_LOADED_MODELS (None or 0: 1 before 0.2.0, else 3)
    cloud       what a cloud request gets: one of CLOUD_STATES (module docstring)
    context_length  OLLAMA_CONTEXT_LENGTH: the num_ctx of a request that sends
                none (None: the release's default, see the module docstring)
    runner_options  {name: options} a model loaded at start was loaded with
                (the job's own request, e.g. {"num_ctx": 32768})
    gpu_file    where to list the runners on the GPU (module docstring)
    """

    def __init__(self, mode="healthy", models=("llama3.2:latest",), loaded=None,
                 load_seconds=5.0, fault_on="all", host="127.0.0.1", port=0,
                 size=2019393189, version="0.32.15", vram_mib=None, max_loaded=None,
                 cloud="signed_in", context_length=None, runner_options=None,
                 gpu_file=None):
        if mode not in MODE_NAMES:
            raise ValueError("unknown mode %r (one of %s)" % (mode, ", ".join(MODE_NAMES)))
        if cloud not in CLOUD_STATES:
            raise ValueError("unknown cloud state %r (one of %s)"
                             % (cloud, ", ".join(CLOUD_STATES)))
        self.cloud = cloud
        HTTPEmulator.__init__(self, mode, fault_on, host, port, load_seconds)
        specs = [m if isinstance(m, Model) else Model.parse(m) for m in models]
        self.specs = dict((m.name, m) for m in specs)
        self.models, self.size, self.version = tuple(m.name for m in specs), size, version
        self.v = _version_tuple(version)
        if self.v < (0, 1, 26) and any(m.kind == "embed" for m in specs):
            raise ValueError("Ollama %s has no embedding models (0.1.26 on)" % version)
        if self.v < (0, 12, 0) and any(m.kind == "cloud" for m in specs):
            raise ValueError("Ollama %s has no cloud models (0.12.0 on)" % version)
        if self.v < (0, 16, 2) and cloud == "disabled":   # OLLAMA_NO_CLOUD, #14221
            raise ValueError("Ollama %s cannot disable cloud (0.16.2 on)" % version)
        self.vram = None if vram_mib is None else int(float(vram_mib) * 1024 * 1024)
        self.max_loaded = max_loaded or (1 if self.v < (0, 2, 0) else 3)
        self.context_length = context_length or self._default_context()
        self.loaded = set()
        self._opts = {}                # loaded model -> its runner's options (api.Runner)
        self.reloads = []              # (model, runner options before, options asked)
        self._vram = {}                # loaded model -> size_vram bytes
        self._refs = {}                # model -> requests using its runner now
        self._keep = {}                # model -> keep_alive seconds (session duration)
        self._loading = {}             # model -> {"deadline", "owner", "vram"}
        self._in_flight = {}           # id(Request) -> Request not answered yet
        self.ps_during_warmup = []     # (GET /api/ps Request, ((path, model), ...) in flight)
        self.evictions = []            # (victim, model being loaded, "max_loaded" | "vram")
        if mode == "cold":
            loaded = ()
        for name in (self.models[:1] if loaded is None else loaded):
            name = self._resolve(name) or name
            if self._spec(name).kind == "cloud":
                continue                  # nothing of it runs here
            self._vram[name] = self._placement(self._spec(name))
            self._opts[name] = self._runner_options(name, (runner_options or {}).get(name))
            self.loaded.add(name)
        self.gpu_file = gpu_file
        self._runners, self._runner_dir = [], None   # llama-server look-alikes
        self._publish()
        self._modified = _rfc3339(_local_now())

    def count(self, method, path):
        with self._lock:
            return sum(1 for r in self.requests if r[0] == method and r[1] == path)

    def posts(self, *paths):
        """The POST requests to these paths (all warm-up paths when none given), in order."""
        paths = paths or WARMUP_PATHS
        with self._lock:
            return [r for r in self.requests if r[0] == "POST" and r[1] in paths]

    # -- per-request entry point (HTTPEmulator._serve calls these)

    def _record(self, h, method, path, target, body):
        """Log the request as a Request; it is the context of _serve_mode."""
        t0 = time.time()
        try:
            parsed = json.loads(body.decode("utf-8", "replace")) if body else None
        except ValueError:
            parsed = None
        rec = Request(method, path, parsed, _Headers(h.headers.items()), t0)
        with self._lock:
            self.requests.append(rec)
            self._in_flight[id(rec)] = rec
            if path == "/api/ps":
                busy = tuple((r[1], r.model) for r in self._in_flight.values()
                             if r[1] in WARMUP_PATHS)
                if busy:
                    self.ps_during_warmup.append((rec, busy))
        return rec

    def _replied(self, rec, status):
        """The reply to rec begins (or it ends unanswered): no longer in flight."""
        with self._lock:
            if rec.ended is None:
                rec.ended, rec.status = time.time(), status
            self._in_flight.pop(id(rec), None)

    def _pieces(self, reply, head_only, http10):
        return _pieces(reply, head_only, http10)

    def _huge_parts(self):
        return b'{"models":[', b'{"name":"x"},', b'{"name":"x"}]}'

    def _huge_head(self, length):
        return _head(200, JSON_CT, length)

    def _serve_mode(self, h, method, path, body, mode, rec):
        try:
            self._answer(h, method, path, body, mode, rec)
        finally:
            self._replied(rec, None)

    def _answer(self, h, method, path, body, mode, rec):
        if mode == "slow_start":
            wait = self._started_at + self.load_seconds - time.time()
            if wait > 0 and self._stop.wait(wait):
                return
            mode = "healthy"
        if mode == "hang":
            return self._hang(h)
        if mode in _FIXED_REPLIES:
            self._replied(rec, _FIXED_REPLIES[mode].status)
            return h.send(_FIXED_REPLIES[mode])
        if mode == "huge":
            self._replied(rec, 200)
            return self._send_huge(h)
        reply = self._route(h, method, path, body, mode, rec.started)
        if reply is None:
            return                        # cold load aborted: the client left
        self._replied(rec, reply.status)
        if mode == "trickle":
            self._trickle(h, reply)
        elif mode == "close_mid_body":
            body = reply.body if reply.lines is None else b"".join(reply.lines)
            h.wfile.write(_head(reply.status, reply.ctype, len(body)) + body[:10])
        else:
            h.send(reply)

    # -- endpoints

    def _route(self, h, method, path, body, mode, t0):
        old = mode == "old_server"
        methods = _ROUTES.get(path)
        if (methods is None or (path == "/api/ps" and (old or self.v < (0, 1, 38)))
                or (path == "/api/embed" and self.v < (0, 2, 6))):
            return _text(404, "404 page not found")
        if method not in methods:        # gin: 405 since v0.6.9, 404 before
            if old or self.v < (0, 6, 9):
                return _text(404, "404 page not found")
            return _text(405, "405 method not allowed")
        if path == "/":
            return _text(200, "Ollama is running", TEXT_UTF8)
        if path == "/api/version":
            return _json_reply(200, {"version": self.version})
        if path == "/api/tags":
            return _json_reply(200, {"models": [self._tag_entry(m) for m in self.models]})
        if path == "/api/ps":
            if self.v >= (0, 32, 4) and not self._wait_for_loads(h):
                return None
            return _json_reply(200, {"models": self._ps_entries(mode)})
        if path == "/api/show":
            return self._show(body)
        handler = {"/api/generate": self._generate, "/api/chat": self._chat,
                   "/api/embed": self._embed, "/api/embeddings": self._embeddings}[path]
        return handler(h, body, mode, t0)

    def _wait_for_loads(self, h):
        """/api/ps from 0.32.4 takes each runner's lock, held for a whole load."""
        while True:
            with self._lock:
                if not self._loading:
                    return True
            if self._stop.is_set() or h.client_gone(0.02):
                return False

    def _resolve(self, name):
        """The listed model a requested name means, or None."""
        want = _canonical_model(name)
        for model in self.models:
            if _canonical_model(model) == want:
                return model
        return None

    def _spec(self, name):
        return self.specs.get(name) or Model(name)

    def _size(self, spec):
        if spec.size is not None:
            return spec.size
        if spec.kind == "cloud":
            return CLOUD_MANIFEST_SIZE
        return EMBED_SIZE if spec.kind == "embed" else self.size

    def _caps(self, spec):
        """The capabilities this server version knows of the model."""
        return [c for c in spec.capabilities if self.v >= _CAP_SINCE.get(c, (0, 0, 0))]

    def _details(self, spec):
        if spec.kind == "embed":
            return {"parent_model": "", "format": "gguf", "family": spec.arch,
                    "families": [spec.arch], "parameter_size": "137M",
                    "quantization_level": "F16"}
        details = _details(spec.name)
        details.update([("family", spec.arch), ("families", [spec.arch])])
        return details

    def _full_name(self, spec):
        """The canonical name scheduleRunner prints: registry.ollama.ai/library/m:tag."""
        name = _canonical_model(spec.name)
        return "registry.ollama.ai/" + (name if "/" in name else "library/" + name)

    def _tag_entry(self, name):
        spec = self._spec(name)
        entry = {"name": name, "model": name}
        if spec.kind == "cloud":          # api.ListModelResponse, from the model's config
            entry.update([("remote_model", _cloud_base(name) or name),
                          ("remote_host", CLOUD_HOST)])
        entry.update([("modified_at", self._modified), ("size", self._size(spec)),
                      ("digest", hashlib.sha256((spec.blob or name).encode("utf-8"))
                       .hexdigest()), ("details", self._details(spec))])
        if self.v >= (0, 30, 0):
            entry["details"].update([("context_length", 2048 if spec.kind == "embed"
                                      else 131072), ("embedding_length", spec.dims)])
            caps = self._caps(spec)
            if caps:
                entry["capabilities"] = caps
        return entry

    def _ps_entries(self, mode):
        with self._lock:
            names = list(self.loaded)
            keep, placed = dict(self._keep), dict(self._vram)
        entries = []
        for name in names:
            spec = self._spec(name)
            size = self._size(spec)
            vram = self._on_gpu(mode, name, size, placed)
            if mode == "cpu_claims_gpu":
                vram = size
            seconds = keep.get(name, _DEFAULT_KEEP)
            seconds = _MAX_NS_SECONDS if seconds < 0 else seconds
            expires = _local_now() + datetime.timedelta(seconds=seconds)
            entry = self._tag_entry(name)
            del entry["modified_at"]
            entry.pop("capabilities", None)
            entry.update([("expires_at", _rfc3339(expires)), ("size_vram", vram)])
            if self.v >= (0, 10, 0):          # the runner's per-sequence num_ctx
                entry["context_length"] = self._opts.get(name, {}).get(
                    "num_ctx", self.context_length)
            entries.append((-seconds, name, entry))
        return [entry for _, _, entry in sorted(entries, key=lambda e: e[:2])]

    def _show(self, body):
        """POST /api/show (ShowHandler): the model's card, capabilities from 0.6.4."""
        text = body.decode("utf-8", "replace")
        if not text.strip(" \t\r\n"):
            return _error(400, "missing request body")
        req, err = _decode_json(text)
        if err is None and req is not None and not isinstance(req, dict):
            err = ("json: cannot unmarshal %s into Go value of type api.ShowRequest"
                   % _json_kind(req))
        req = req if isinstance(req, dict) else {}
        err = err or _request_error(req, _SHOW_FIELDS, "ShowRequest")
        if err:
            return _error(400, err)
        raw_name = req.get("model") or req.get("name") or ""
        if not raw_name:
            return _error(400, "model is required")
        name = self._resolve(raw_name)
        refusal = self._cloud_refusal(raw_name, name, "remote model details are unavailable",
                                      relayed=self._cloud_ref(raw_name))
        if refusal:
            return refusal
        if name is None and not self._cloud_ref(raw_name):
            shown = raw_name if ":" in raw_name.rsplit("/", 1)[-1] else raw_name + ":latest"
            return _error(404, "model '%s' not found" % shown)
        name = name or raw_name           # unlisted NAME:cloud: ollama.com's card
        spec = self._spec(name)
        caps = self._caps(spec)
        if spec.kind == "embed":
            template = "{{ .Prompt }}"
        else:
            template = ("{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n"
                        "{{ end }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n"
                        "<|im_start|>assistant\n")
            if "tools" in caps:
                template = "{{- if .Tools }}# Tools\n{{ range .Tools }}{{ . }}\n{{ end }}" \
                           "{{ end }}" + template
            if "insert" in caps:
                template += "{{ .Suffix }}"
        digest = hashlib.sha256(name.encode("utf-8")).hexdigest()
        obj = {"license": "", "modelfile": (
            "# Modelfile generated by \"ollama show\"\n# To build a new Modelfile based on "
            "this, replace FROM with:\n# FROM %s\n\nFROM /usr/share/ollama/.ollama/models/"
            "blobs/sha256-%s\nTEMPLATE %s\n" % (name, digest, json.dumps(template))),
            "parameters": "" if spec.kind == "embed" else 'stop "<|im_end|>"',
            "template": template, "details": self._details(spec)}
        if self.v >= (0, 1, 45):
            arch = spec.arch
            info = {"general.architecture": arch, "general.file_type": 15,
                    "general.parameter_count": 136727040 if spec.kind == "embed"
                    else 3212749888,
                    arch + ".block_count": 12 if spec.kind == "embed" else 28,
                    arch + ".context_length": 2048 if spec.kind == "embed" else 131072,
                    arch + ".embedding_length": spec.dims}
            if spec.kind == "embed":
                info[arch + ".pooling_type"] = 1
            if "vision" in caps:
                info[arch + ".vision.block_count"] = 32
            obj["model_info"] = info
        if self.v >= (0, 6, 4):
            if caps:                                  # omitempty
                obj["capabilities"] = caps
            obj["modified_at"] = self._modified
        return _json_reply(200, obj)

    # -- warm-up requests: validation, then the scheduler

    def _decode(self, body, struct, fields):
        """(request dict, None) or (None, the 400 reply) for a POST body of api.STRUCT."""
        text = body.decode("utf-8", "replace")
        if not text.strip(" \t\r\n"):
            return None, _error(400, "missing request body")
        req, err = _decode_json(text)
        if err is None and req is not None and not isinstance(req, dict):
            err = "json: cannot unmarshal %s into Go value of type api.%s" % (
                _json_kind(req), struct)
        req = req if isinstance(req, dict) else {}
        err = err or _request_error(req, fields, struct)
        return (None, _error(400, err)) if err else (req, None)

    def _missing_model(self, raw_name, mode):
        """An empty model name: 400 up to 0.3.14, then 404 model '' not found."""
        if mode == "old_server" or self.v <= (0, 3, 14):
            return _error(400, "model is required")
        return _error(404, "model '%s' not found" % raw_name)

    def _kind_refusal(self, raw_name, what):
        """generate or chat on a model without the completion capability."""
        if self.v < (0, 2, 0):
            return _error(400, "embedding models do not support %s" % what)
        if self.v < (0, 2, 2):
            return _error(400, "%s does not support %s" % (raw_name, what))
        return _error(400, "%s does not support %s" % (_go_quote(raw_name), what))

    def _think_refusal(self, req, raw_name, spec):
        if req.get("think") is not True or "thinking" in self._caps(spec):
            return None
        if self.v >= (0, 12, 5):
            return _error(400, "%s does not support thinking" % _go_quote(raw_name))
        if self.v >= (0, 9, 0):
            return _error(400, "%s does not support thinking" % self._full_name(spec))
        return None

    def _fault(self, mode, raw_name, name):
        """The reply of an error mode for a warm-up request, or None."""
        if mode in _GENERATE_ERRORS:
            if mode != "busy":
                with self._lock:
                    self._unload(name)
            return _error(*_GENERATE_ERRORS[mode])
        if mode == "pull_first":
            return _error(404, "model %s not found, try pulling it first" % _go_quote(raw_name))
        return None

    def _generate(self, h, body, mode, t0):
        """POST /api/generate, checks in the order of reference section 6.2."""
        req, refusal = self._decode(body, "GenerateRequest", _FIELD_TYPES)
        if refusal:
            return refusal
        keep = None if req.get("keep_alive") is None else _keep_alive(req["keep_alive"])
        raw_name = req.get("model") or ""
        if not raw_name.strip():
            return self._missing_model(raw_name, mode)
        name = self._resolve(raw_name)
        if self._cloud_ref(raw_name) or self._spec(name or raw_name).kind == "cloud":
            return self._relay(req, raw_name, name)
        if name is None:
            return _error(404, "model '%s' not found" % raw_name)
        prompt = req.get("prompt") or ""
        if not prompt and keep == 0:
            with self._lock:
                self._unload(name)
            return self._done_object(raw_name, "unload")
        spec = self._spec(name)
        caps = self._caps(spec)
        refusal = self._think_refusal(req, raw_name, spec)
        if refusal:
            return refusal
        if "completion" not in caps:      # checked before scheduling: nothing loads
            return self._kind_refusal(raw_name, "generate")
        if req.get("suffix") and "insert" not in caps and self.v >= (0, 2, 6):
            return _error(400, "%s does not support insert" % self._full_name(spec))
        err = _options_error(req.get("options"))
        if err:
            return _error(500, err)
        refusal = self._fault(mode, raw_name, name)
        if refusal:
            return refusal
        load_ns = self._acquire(h, name, t0, keep, req.get("options"))
        if load_ns is None:
            return None
        self._release(name, keep)
        return self._generate_reply(req, raw_name, prompt, load_ns, mode)

    def _cloud_ref(self, raw_name):
        """NAME:cloud, NAME:TAG-cloud: proxied to ollama.com unpulled from 0.17.6
        ("don't require pulling stubs for cloud models", #14574); before, only a
        pulled (listed) one runs, as a listed remote model."""
        return self.v >= (0, 17, 6) and _cloud_base(raw_name) is not None

    def _cloud_refusal(self, raw_name, name, operation, relayed=True):
        """What a request for a cloud model gets before anything is relayed, or None:
        403 when cloud is off (internal/cloud/policy.go DisabledError, routes.go
        GenerateHandler and ShowHandler, cloud_proxy.go proxyCloudRequestWithPath),
        401 with the server key's sign-in link when it is not signed in and the
        request goes to ollama.com (relayed; routes.go {"error": "unauthorized",
        "signin_url": signinURL()}, signinURLStr
        "https://ollama.com/connect?name=%s&key=%s": host name, public key)."""
        if not self._cloud_ref(raw_name) and self._spec(name or raw_name).kind != "cloud":
            return None
        if self.cloud == "disabled":
            return _error(403, "ollama cloud is disabled: " + operation)
        if self.cloud == "signed_out" and relayed:
            return _json_reply(401, {"error": "unauthorized", "signin_url":
                                     "https://ollama.com/connect?name=gpu-host&key="
                                     "c3NoLWVkMjU1MTkgQUFBQUMzTnphQzFsWkRJMU5URTVBQUFBSQ"})
        return None

    def _relay(self, req, raw_name, name):
        """POST /api/generate for a cloud model: no scheduler, no load, nothing in
        /api/ps; ollama.com's answer passed on.  A NAME:cloud reference is proxied
        as it is (routes.go GenerateHandler, modelSourceCloud ->
        proxyCloudJSONRequest); a listed remote model is re-asked of remote_host,
        each answer written as one JSON line with model, remote_model and
        remote_host set (the `m.Config.RemoteHost != ""` branch)."""
        refusal = self._cloud_refusal(raw_name, name, "remote model is unavailable")
        if refusal:
            return refusal
        # The relay waits for ollama.com's answer however long it takes there
        # (a queue, a cold start): cloud_proxy.go passes the upstream reply on.
        if self._stop.wait(self._spec(name or raw_name).load_seconds or 0):
            return None
        options = req.get("options") or {}
        final = {"model": _cloud_base(raw_name) if self._cloud_ref(raw_name) else raw_name}
        if not self._cloud_ref(raw_name):
            final.update([("remote_model", _cloud_base(name) or name),
                          ("remote_host", CLOUD_HOST)])
        final.update([("created_at", _rfc3339(datetime.datetime.now(datetime.timezone.utc),
                                              utc=True)),
                      ("response", "Hello" if req.get("prompt") else ""), ("done", True),
                      ("done_reason", "length" if options.get("num_predict") == 1 else "stop"),
                      ("total_duration", 412000000), ("prompt_eval_count", 11),
                      ("eval_count", 1)])
        return _Reply(200, _dumps(final) + b"\n", JSON_CT if req.get("stream") is False
                      else NDJSON_CT)

    def _chat(self, h, body, mode, t0):
        """POST /api/chat (ChatHandler): like generate, with messages and tools."""
        req, refusal = self._decode(body, "ChatRequest", _CHAT_FIELDS)
        if refusal:
            return refusal
        keep = None if req.get("keep_alive") is None else _keep_alive(req["keep_alive"])
        raw_name = req.get("model") or ""
        if not raw_name.strip():
            return _error(400, "model is required")
        name = self._resolve(raw_name)
        if name is None:
            return _error(404, "model '%s' not found" % raw_name)
        messages = req.get("messages") or []
        if not messages and keep == 0:
            with self._lock:
                self._unload(name)
            return self._chat_object(raw_name, "", "unload")
        spec = self._spec(name)
        caps = self._caps(spec)
        refusal = self._think_refusal(req, raw_name, spec)
        if refusal:
            return refusal
        if "completion" not in caps:
            return self._kind_refusal(raw_name, "chat")
        if req.get("tools") and "tools" not in caps and self.v >= (0, 2, 6):
            shown = self._full_name(spec) if self.v >= (0, 5, 2) else raw_name
            return _error(400, "%s does not support tools" % shown)
        err = _options_error(req.get("options"))
        if err:
            return _error(500, err)
        refusal = self._fault(mode, raw_name, name)
        if refusal:
            return refusal
        load_ns = self._acquire(h, name, t0, keep, req.get("options"))
        if load_ns is None:
            return None
        self._release(name, keep)
        if not messages:
            return self._chat_object(raw_name, "", "load")
        options = req.get("options") or {}
        reason = "length" if options.get("num_predict") == 1 else "stop"
        created = _rfc3339(datetime.datetime.now(datetime.timezone.utc), utc=True)
        final = {"model": raw_name, "created_at": created,
                 "message": {"role": "assistant", "content": ""}, "done_reason": reason,
                 "done": True, "total_duration": load_ns + 29100000, "load_duration": load_ns,
                 "prompt_eval_count": 11, "prompt_eval_duration": 21500000,
                 "eval_count": 1, "eval_duration": 6400000}
        if req.get("stream") is False:
            final["message"]["content"] = "Hello"
            return _json_reply(200, final)
        token = {"model": raw_name, "created_at": created,
                 "message": {"role": "assistant", "content": "Hello"}, "done": False}
        return _Reply(200, lines=[_dumps(token) + b"\n", _dumps(final) + b"\n"],
                      ctype=NDJSON_CT)

    def _chat_object(self, raw_name, content, reason):
        return _json_reply(200, {"model": raw_name, "created_at": _rfc3339(
            datetime.datetime.now(datetime.timezone.utc), utc=True),
            "message": {"role": "assistant", "content": content}, "done_reason": reason,
            "done": True})

    def _no_embeddings(self, spec):
        """What embedding a generative model gets, by version and engine (None: vectors)."""
        if spec.kind == "embed":
            return None
        if self.v >= (0, 30, 0):
            return (501, NO_EMBEDDINGS_501)
        if self.v >= (0, 6, 1) and spec.arch in _GO_ENGINE_ARCHS:
            return (500, NO_EMBEDDINGS_GO)
        return None

    def _embed(self, h, body, mode, t0):
        """POST /api/embed (EmbedHandler, 0.2.6 on)."""
        req, refusal = self._decode(body, "EmbedRequest", _EMBED_FIELDS)
        if refusal:
            return refusal
        keep = None if req.get("keep_alive") is None else _keep_alive(req["keep_alive"])
        raw_name = req.get("model") or ""
        value = req.get("input")
        if self.v < (0, 3, 6):            # before "Load Embedding Model on Empty Input"
            if value is None:
                return _error(400, "invalid input type")
            if value in ("", []):
                return _json_reply(200, {"model": raw_name, "embeddings": []})
        if isinstance(value, str):
            inputs = [value] if value else []
        elif value is None:
            inputs = []
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            inputs = value
        else:
            return _error(400, "invalid input type")
        if not raw_name.strip():
            return self._missing_model(raw_name, mode)
        name = self._resolve(raw_name)
        if name is None:
            return _error(404, "model %s not found, try pulling it first" % _go_quote(raw_name))
        err = _options_error(req.get("options"))
        if err:
            return _error(500, err)
        refusal = self._fault(mode, raw_name, name)
        if refusal:
            return refusal
        # no capability check: anything loads
        load_ns = self._acquire(h, name, t0, keep, req.get("options"))
        if load_ns is None:
            return None
        self._release(name, keep)
        if not inputs:
            return _json_reply(200, {"model": raw_name, "embeddings": []})
        spec = self._spec(name)
        failure = self._no_embeddings(spec)
        if failure:
            return _error(*failure)
        if mode in ("empty_embedding", "empty_vector"):
            return _json_reply(200, {"model": raw_name, "embeddings":
                                     [] if mode == "empty_embedding" else [[]]})
        dims = spec.dims
        wanted = req.get("dimensions")
        if self.v >= (0, 11, 11) and isinstance(wanted, int) and 0 < wanted < dims:
            dims = wanted
        obj = {"model": raw_name, "embeddings": [
            _vector(name + "\0" + text, dims) for text in inputs]}
        if self.v >= (0, 3, 1):
            obj.update([("total_duration", load_ns + 14000000), ("load_duration", load_ns),
                        ("prompt_eval_count", sum(1 + len(t.split()) for t in inputs))])
        return _json_reply(200, obj)

    def _embeddings(self, h, body, mode, t0):
        """The legacy POST /api/embeddings (EmbeddingsHandler): {"embedding":[...]}."""
        req, refusal = self._decode(body, "EmbeddingRequest", _LEGACY_FIELDS)
        if refusal:
            return refusal
        keep = None if req.get("keep_alive") is None else _keep_alive(req["keep_alive"])
        raw_name = req.get("model") or ""
        if not raw_name.strip():
            return _error(400, "model is required")
        name = self._resolve(raw_name)
        if name is None:
            return _error(404, "model %s not found, try pulling it first" % _go_quote(raw_name))
        err = _options_error(req.get("options"))
        if err:
            return _error(500, err)
        refusal = self._fault(mode, raw_name, name)
        if refusal:
            return refusal
        load_ns = self._acquire(h, name, t0, keep, req.get("options"))
        if load_ns is None:
            return None
        self._release(name, keep)
        prompt = req.get("prompt") or ""
        if not prompt:                    # "an empty request loads the model"
            return _json_reply(200, {"embedding": []})
        spec = self._spec(name)
        failure = self._no_embeddings(spec)
        if failure:                       # no 501 passthrough on this route
            return _error(500, failure[1])
        if mode in ("empty_embedding", "empty_vector"):
            return _json_reply(200, {"embedding": []})
        return _json_reply(200, {"embedding": _vector(name + "\0" + prompt, spec.dims,
                                                      normalize=False)})

    # -- the scheduler (server/sched.go)

    def _on_gpu(self, mode, name, size, placed):
        """The bytes of a loaded model in VRAM. Current Ollama starts llama-server
        without -ngl, which fits layers to the free VRAM (llm/llama_server.go
        L399-409): none (cpu) or some (partial) when other processes hold it.
        Where it cannot read the runner's buffer sizes it reports the whole
        model in VRAM ("use model file size as a rough proxy", L2638ff;
        ollama/ollama#7323, #9704, #10369): cpu_claims_gpu, none really."""
        if mode in ("cpu", "cpu_claims_gpu"):
            return 0
        return int(size * 0.45) if mode == "partial" else placed.get(name, size)

    def _publish(self):
        """Rewrite gpu_file (under the lock): "PID BYTES" of each runner on the GPU."""
        if self.gpu_file is None:
            return
        lines = []
        for pid, name in zip(self._runner_pids(len(self._vram)), sorted(self._vram)):
            held = self._on_gpu(self.mode, name, self._size(self._spec(name)), self._vram)
            if held > 0:
                lines.append("%d %d\n" % (pid, held))
        with open(self.gpu_file + ".new", "w") as handle:
            handle.write("".join(lines))
        os.rename(self.gpu_file + ".new", self.gpu_file)

    def _runner_pids(self, count):
        """The PIDs of count real processes whose /proc/PID/comm is llama-server,
        as Ollama 0.30.0 on starts one per loaded model (llm/llama_server.go):
        what NVML lists, and gpu_preflight names by comm. Each lives an hour
        at most (one left behind ends); stop() ends them all."""
        if self._runner_dir is None:
            self._runner_dir = tempfile.mkdtemp(prefix="ollama-emu-")
            os.symlink(shutil.which("sleep"), os.path.join(self._runner_dir, "llama-server"))
        self._runners = [p for p in self._runners if p.poll() is None]
        while len(self._runners) < count:
            self._runners.append(_named_process(self._runner_dir, "llama-server"))
        return [p.pid for p in self._runners[:count]]

    def _close(self, taken, conns):
        HTTPEmulator._close(self, taken, conns)
        for proc in self._runners:
            proc.kill()
            proc.wait()
        if self._runner_dir is not None:
            shutil.rmtree(self._runner_dir, ignore_errors=True)

    def _placement(self, spec):
        """size_vram of spec loaded now: all of it, or what VRAM is free (alone)."""
        size = self._size(spec)
        if spec.gpu_pct is not None:
            return int(size * spec.gpu_pct / 100.0)
        if self.vram is None:
            return size
        return max(0, min(size, self.vram - sum(self._vram.values())))

    def _victim(self):
        """findRunnerToUnload: shortest session first (keep_alive < 0 last), then by
        name; the first idle one, else the first."""
        def order(name):
            seconds = self._keep.get(name, _DEFAULT_KEEP)
            return (2 ** 64 - 1 if seconds < 0 else int(seconds * 1e9), name)
        ranked = sorted(self.loaded, key=order)
        idle = [n for n in ranked if not self._refs.get(n)]
        return (idle or ranked)[0]

    def _make_room(self, spec):
        """Evict until spec may load (under the lock); a busy victim's name to wait for, or None."""
        size = self._size(spec)
        while self.loaded:
            cause = None
            if len(self.loaded) >= self.max_loaded:
                cause = "max_loaded"
            elif self.vram is not None:
                free = self.vram - sum(self._vram.values())
                room = free * 0.8 if self.v >= (0, 30, 0) else free
                if size > room:
                    cause = "vram"
            if cause is None:
                return None
            victim = self._victim()
            if self._refs.get(victim):
                return victim
            self._unload(victim)
            self.evictions.append((victim, spec.name, cause))
        return None

    def _unload(self, name):
        self.loaded.discard(name)
        self._vram.pop(name, None)
        self._opts.pop(name, None)
        self._publish()

    def _default_context(self):
        """num_ctx when neither the request nor OLLAMA_CONTEXT_LENGTH gives one:
        2048, 4096 from 0.6.7 (envconfig, commit 44b466eeb), from 0.15.5 by total
        VRAM (server/routes.go Serve, commit 0334ffa62: 4096 below 23 GiB,
        32768 from 23, 262144 from 47; unset vram_mib: below 23)."""
        if self.v < (0, 6, 7):
            return 2048
        gib = (self.vram or 0) / 2.0 ** 30
        if self.v < (0, 15, 5) or gib < 23:
            return 4096
        return 32768 if gib < 47 else 262144

    def _runner_options(self, name, options):
        """The api.Runner a request with these options asks of name's runner:
        num_ctx defaulted (server/routes.go modelOptions), at least 4
        (server/sched.go getRunner) and capped at the model's training
        context (llm/server.go NewLlamaServer); a num_gpu below 0 matches
        any (server/sched.go needsReload)."""
        options = options if isinstance(options, dict) else {}
        runner = dict((key, options.get(key)) for key in _RUNNER_OPTIONS)
        train = 2048 if self._spec(name).kind == "embed" else 131072
        asked = options.get("num_ctx")
        asked = self.context_length if asked is None else max(int(asked), 4)
        runner["num_ctx"] = min(asked, train)
        if isinstance(runner["num_gpu"], (int, float)) and runner["num_gpu"] < 0:
            runner["num_gpu"] = None
        return runner

    def _use(self, name, keep):
        self._refs[name] = self._refs.get(name, 0) + 1
        if keep is not None or name not in self._keep:
            self._keep[name] = _DEFAULT_KEEP if keep is None else keep

    def _runner(self, name):
        """schedulerModelKey is the blob: an alias of a loaded (or loading) model
        uses that model's runner, which keeps the name that loaded it."""
        blob = self._spec(name).blob
        if blob is None:
            return name
        with self._lock:
            for other in sorted(self.loaded) + sorted(self._loading):
                if other != name and self._spec(other).blob == blob:
                    return other
        return name

    def _release(self, name, keep):
        name = self._runner(name)
        with self._lock:
            self._refs[name] = max(0, self._refs.get(name, 0) - 1)
            if keep == 0:
                self._unload(name)

    def _acquire(self, h, name, t0, keep, options=None):
        """Schedule name: use it when loaded with these runner options, else (one
        load at a time, after evicting what must go, or unloading the runner whose
        options differ once it is idle: server/sched.go getRunner, needsReload)
        load it for its load time, sending no byte meanwhile.  The load ns, or
        None when the client left first.

        The load runs on the context of the request that started it, as Ollama's
        does (server/routes.go passes c.Request.Context() to scheduleRunner;
        server/sched.go load() calls llama.Load(req.ctx) and WaitUntilRunning(req.ctx);
        llm/llama_server.go WaitUntilRunning returns on ctx.Done(), logging "client
        connection closed before llama-server finished loading, aborting load", and
        the failed runner is expired): when that client hangs up the load is dropped,
        whoever else waits for it, and a request still waiting schedules a load of
        its own.  Nothing of an aborted load stays loaded."""
        name = self._runner(name)
        spec = self._spec(name)
        seconds = self.load_seconds if spec.load_seconds is None else spec.load_seconds
        want = self._runner_options(name, options)
        while True:
            rec = None
            while rec is None:
                with self._lock:
                    stale = name in self.loaded and self._opts.get(name) != want
                    if stale and not self._refs.get(name):
                        self.reloads.append((name, self._opts.get(name), want))
                        self._unload(name)
                        stale = False
                    if name in self.loaded and not stale:
                        self._use(name, keep)
                        return max(int((time.time() - t0) * 1e9), 100000)
                    rec = self._loading.get(name)
                    if rec is None and not stale and not self._loading and \
                            self._make_room(spec) is None:
                        rec = self._loading[name] = {"deadline": time.time() + seconds,
                                                     "owner": h, "options": want,
                                                     "vram": self._placement(spec)}
                if rec is None and (self._stop.is_set() or h.client_gone(0.02)):
                    return None
            while time.time() < rec["deadline"] and self._loading.get(name) is rec:
                left = rec["deadline"] - time.time()
                if self._stop.is_set() or h.client_gone(max(0.0, min(0.05, left))):
                    with self._lock:      # the client that started the load: abort it
                        if rec["owner"] is h and self._loading.get(name) is rec:
                            del self._loading[name]
                    return None
            if self._loading.get(name) is rec or name in self.loaded:
                break                     # else aborted: this request schedules again
        with self._lock:
            if self._loading.get(name) is rec:
                del self._loading[name]
                self.loaded.add(name)
                self._vram[name] = rec["vram"]
                self._opts[name] = rec["options"]
                self._publish()
            self._use(name, keep)
        return max(int((time.time() - t0) * 1e9), 100000)

    def _done_object(self, raw_name, reason):
        return _json_reply(200, {"model": raw_name, "created_at": _rfc3339(
            datetime.datetime.now(datetime.timezone.utc), utc=True), "response": "", "done": True,
            "done_reason": reason})

    def _generate_reply(self, req, raw_name, prompt, load_ns, mode):
        stream = req.get("stream") is not False
        created = _rfc3339(datetime.datetime.now(datetime.timezone.utc), utc=True)
        if mode == "no_done":
            obj = {"model": raw_name, "created_at": created, "response": "Hi", "done": False}
            return _Reply(200, lines=[_dumps(obj) + b"\n"], ctype=NDJSON_CT) if stream \
                else _json_reply(200, obj)
        if mode == "error_in_200" and (not stream or not prompt):
            err = _dumps({"error": _ERROR_IN_200})
            return _Reply(200, lines=[err + b"\n"], ctype=NDJSON_CT) if stream else _Reply(200, err)
        if not prompt:
            return self._done_object(raw_name, "load")
        options = req.get("options") or {}
        token = {"model": raw_name, "created_at": created, "response": "Hello", "done": False}
        final = {"model": raw_name, "created_at": created, "response": "", "done": True,
                 "done_reason": "length" if options.get("num_predict") == 1 else "stop"}
        if not req.get("raw"):
            final["context"] = [128006, 882, 128007, 271, 9906]
        prompt_ns, eval_ns = 21500000, 6400000
        final.update([("total_duration", load_ns + prompt_ns + eval_ns + 1200000),
                      ("load_duration", load_ns),
                      ("prompt_eval_count", 10 + len(prompt.split())),
                      ("prompt_eval_duration", prompt_ns), ("eval_count", 1),
                      ("eval_duration", eval_ns)])
        if not stream:
            final["response"] = "Hello"
            return _json_reply(200, final)
        last = {"error": _ERROR_IN_200} if mode == "error_in_200" else final
        return _Reply(200, lines=[_dumps(token) + b"\n", _dumps(last) + b"\n"], ctype=NDJSON_CT)


# ---------------------------------------------------------------- command line

def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else None
    argv = argv[:argv.index("--")] if command is not None else argv
    parser = cli_parser(
        "ollama_emu.py [OPTIONS] [-- COMMAND [ARG ...]]",
        "Loopback emulator of the Ollama HTTP API (for gpu_preflight tests). With "
        "-- COMMAND it listens on a free port, runs COMMAND with OLLAMA_HOST set to "
        "its URL, stops and exits with COMMAND's status.", MODES)
    parser.add_argument("--port", type=int, default=None,
                        help="TCP port (0: any free one; default 11434, or 0 with a COMMAND)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--mode", default="healthy", choices=MODE_NAMES, metavar="MODE",
                        help="behaviour, see below (default healthy)")
    parser.add_argument("--model", action="append", metavar="SPEC",
                        help="a model /api/tags lists (repeatable; default llama3.2:latest): "
                        "NAME[=KIND[:CAPS[:SIZE_MIB[:LOAD_S[:GPU_PCT]]]]], KIND generate, "
                        "embed or cloud, CAPS comma-separated (completion,tools,...), empty fields "
                        "default, e.g. nomic-embed-text:latest=embed")
    parser.add_argument("--loaded", action="append", metavar="NAME",
                        help="a model loaded at start (repeatable; default the first)")
    parser.add_argument("--cold", action="store_true", help="start with no model loaded")
    parser.add_argument("--version", default="0.32.15", metavar="X.Y.Z",
                        help="the Ollama release to answer as (default 0.32.15)")
    parser.add_argument("--vram-mib", type=float, default=None, metavar="MIB",
                        help="VRAM budget of the scheduler (default unlimited)")
    parser.add_argument("--context-length", type=int, default=None, metavar="N",
                        help="OLLAMA_CONTEXT_LENGTH: num_ctx of a request that sends none "
                        "(default 4096, 2048 before 0.6.7)")
    parser.add_argument("--gpu-file", default=None, metavar="PATH",
                        help="keep there the runners on the GPU, for the fake NVML's "
                        "FAKE_NVML_RUNNERS")
    parser.add_argument("--max-loaded", type=int, default=None, metavar="N",
                        help="OLLAMA_MAX_LOADED_MODELS (default 1 before 0.2.0, else 3)")
    parser.add_argument("--load-seconds", type=float, default=5.0, metavar="S",
                        help="cold-load time, also the slow_start window (default 5)")
    parser.add_argument("--cloud", default="signed_in", choices=CLOUD_STATES,
                        help="what a cloud model's request gets: signed_in (answers), "
                        "disabled (OLLAMA_NO_CLOUD: 403), signed_out (401 signin_url)")
    parser.add_argument("--fault-on", default="all", metavar="PATH",
                        help="apply the mode only to this path, e.g. /api/generate (default all)")
    args = parser.parse_args(argv)
    try:
        models = tuple(Model.parse(s) for s in (args.model or ("llama3.2:latest",)))
        emu = Emulator(mode=args.mode, models=models,
                       loaded=() if args.cold else args.loaded,
                       load_seconds=args.load_seconds, fault_on=args.fault_on,
                       host=args.host, version=args.version,
                       port=args.port if args.port is not None else 0 if command else 11434,
                       vram_mib=args.vram_mib, max_loaded=args.max_loaded,
                       cloud=args.cloud, context_length=args.context_length,
                       gpu_file=args.gpu_file)
    except ValueError as exc:
        parser.error(str(exc))
    details = "mode=%s version=%s models=%s loaded=%s" % (
        emu.mode, emu.version,
        ",".join("%s(%s)" % (m, emu.specs[m].kind) for m in emu.models) or "none",
        ",".join(sorted(emu.loaded)) or "none")
    if command:
        return serve_for_command(emu, "ollama emulator", details, command)
    return serve_until_signalled(emu, "ollama emulator", "cannot listen on", details)


if __name__ == "__main__":
    sys.exit(main())
