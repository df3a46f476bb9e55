#!/usr/bin/env python3
"""Loopback emulator of the Ollama HTTP server, for gpu_preflight's tests and benchmark.

It answers like Ollama 0.32.x on the endpoints a preflight touches (see the
project's Ollama API reference): GET/HEAD /, GET/HEAD /api/version, GET/HEAD
/api/tags, GET /api/ps and POST /api/generate (validation order, exact error
bodies, load-only and unload replies, NDJSON streaming by default, cold loads
that send no byte until loaded and abort when the client hangs up).  Other
paths get gin's "404 page not found", wrong methods "405 method not allowed".

Modes (fault_on / --fault-on restricts a fault to one path, default "all"):
  healthy       faithful Ollama (the default)
  cold          healthy, but nothing loaded at start (like --cold / loaded=())
  cpu, partial  /api/ps reports size_vram 0 / 45 % of size
  hang          read the request, never answer
  trickle       a valid reply, one byte every trickle_interval (2 s) seconds
  close_mid_body  full Content-Length, ~10 body bytes, then close
  garbage, truncated, huge  200 application/json: not JSON / cut JSON / 100 MB
  busy, oom, cuda_error, runner_died, load_timeout, pull_first
                the matching /api/generate error (after request validation)
  error_in_200  /api/generate errors inside a 200 reply (pre-0.12.6 Ollama)
  no_done       /api/generate answers one chunk with done:false, nothing more
  hostguard     403 with an empty body;  not_ollama: 404 page not found
  old_server    <= 0.3.14: missing model -> 400 "model is required", no /api/ps
  slow_start    answer nothing for load_seconds after start (startup window)

Run it:   python3 tests/ollama_emu.py --port 11434 --mode cold --load-seconds 3
Import:   from ollama_emu import Emulator;  emu = Emulator(mode="busy").start()
Standard library only, CPython 3.6+.
"""

import datetime
import email.utils
import hashlib
import json
import re
import sys
import time
from http.client import responses as _REASONS

from emu_base import HTTPEmulator, cli_parser, serve_until_signalled
from emu_base import free_port  # noqa: F401  (the tests import it from here)

MODES = (
    ("healthy", "faithful Ollama (default)"),
    ("cold", "healthy, nothing loaded at start; first generate waits --load-seconds"),
    ("cpu", "/api/ps reports size_vram 0 (silent CPU fallback)"),
    ("partial", "/api/ps reports size_vram = 45% of size (partial offload)"),
    ("hang", "accept and read the request, never answer"),
    ("trickle", "a valid reply sent one byte every 2 seconds"),
    ("close_mid_body", "headers with the full Content-Length, ~10 body bytes, close"),
    ("garbage", "200 application/json with a non-JSON body"),
    ("truncated", "200 application/json with a complete but cut JSON text"),
    ("huge", "200 application/json with a 100 MB body"),
    ("busy", "generate -> 503 server busy"),
    ("oom", "generate -> 500 unable to allocate CUDA0 buffer"),
    ("cuda_error", "generate -> 500 CUDA error: an illegal memory access"),
    ("runner_died", "generate -> 500 model runner has unexpectedly stopped"),
    ("load_timeout", "generate -> 500 timed out waiting for llama runner to start"),
    ("pull_first", "generate -> 404 model \"NAME\" not found, try pulling it first"),
    ("error_in_200", "generate -> 200 carrying {\"error\":...} (pre-0.12.6)"),
    ("no_done", "generate -> 200 one chunk with done:false and nothing more"),
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
           "/api/tags": ("GET", "HEAD"), "/api/ps": ("GET",), "/api/generate": ("POST",)}

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
_FOREVER = -1.0                      # keep_alive < 0: Go uses MaxInt64 ns (~292 years)
_MAX_NS_SECONDS = (2 ** 63 - 1) // 10 ** 9

# GenerateRequest fields whose JSON type the Go decoder enforces (Go type names).
_FIELD_TYPES = {"model": "string", "prompt": "string", "suffix": "string",
                "system": "string", "template": "string", "stream": "bool",
                "raw": "bool", "options": "map[string]interface {}"}
_GO_KIND = {"string": str, "bool": bool, "map[string]interface {}": dict}
# api.Options fields by type, as checked by Options.FromMap.
_OPT_INT = ("num_keep", "seed", "num_predict", "top_k", "repeat_last_n", "num_ctx",
            "num_batch", "num_gpu", "main_gpu", "num_thread")
_OPT_FLOAT = ("temperature", "top_p", "min_p", "typical_p", "repeat_penalty",
              "presence_penalty", "frequency_penalty")
_OPT_BOOL = ("numa", "use_mmap")
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


def _details(name):
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


def _request_error(req):
    """Go decoder error for a GenerateRequest object, or None."""
    if req.get("keep_alive") is not None:
        try:
            _keep_alive(req["keep_alive"])
        except ValueError as exc:
            return str(exc)
    for key, value in req.items():
        want = _FIELD_TYPES.get(key)
        if want is None or value is None:
            continue
        if type(value) is not _GO_KIND[want]:
            return ("json: cannot unmarshal %s into Go struct field GenerateRequest.%s of type %s"
                    % (_json_kind(value), key, want))
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


# ---------------------------------------------------------------- the emulator

class Emulator(HTTPEmulator):
    """An Ollama look-alike on a loopback port. See the module docstring for the modes."""

    def __init__(self, mode="healthy", models=("llama3.2:latest",), loaded=None,
                 load_seconds=5.0, fault_on="all", host="127.0.0.1", port=0,
                 size=2019393189, version="0.32.15"):
        if mode not in MODE_NAMES:
            raise ValueError("unknown mode %r (one of %s)" % (mode, ", ".join(MODE_NAMES)))
        HTTPEmulator.__init__(self, mode, fault_on, host, port, load_seconds)
        self.models, self.size, self.version = tuple(models), size, version
        if mode == "cold":
            loaded = ()
        self.loaded = set(self._resolve(n) or n for n in
                          (self.models[:1] if loaded is None else loaded))
        self._modified = _rfc3339(_local_now())
        self._keep = {}                # model -> keep_alive seconds
        self._loading = {}             # model -> {"deadline": t, "waiters": n}

    def count(self, method, path):
        with self._lock:
            return sum(1 for r in self.requests if r[0] == method and r[1] == path)

    # -- per-request entry point (HTTPEmulator._serve calls these)

    def _record(self, h, method, path, target, body):
        """Log (method, path, parsed JSON body or None, headers); the time it came is t0."""
        t0 = time.time()
        try:
            parsed = json.loads(body.decode("utf-8", "replace")) if body else None
        except ValueError:
            parsed = None
        with self._lock:
            self.requests.append((method, path, parsed, _Headers(h.headers.items())))
        return t0

    def _pieces(self, reply, head_only, http10):
        return _pieces(reply, head_only, http10)

    def _huge_parts(self):
        return b'{"models":[', b'{"name":"x"},', b'{"name":"x"}]}'

    def _huge_head(self, length):
        return _head(200, JSON_CT, length)

    def _serve_mode(self, h, method, path, body, mode, t0):
        if mode == "slow_start":
            wait = self._started_at + self.load_seconds - time.time()
            if wait > 0 and self._stop.wait(wait):
                return
            mode = "healthy"
        if mode == "hang":
            return self._hang(h)
        if mode in _FIXED_REPLIES:
            return h.send(_FIXED_REPLIES[mode])
        if mode == "huge":
            return self._send_huge(h)
        reply = self._route(h, method, path, body, mode, t0)
        if reply is None:
            return                        # cold load aborted: the client left
        if mode == "trickle":
            self._trickle(h, reply)
        elif mode == "close_mid_body":
            body = reply.body if reply.lines is None else b"".join(reply.lines)
            h.wfile.write(_head(reply.status, reply.ctype, len(body)) + body[:10])
        else:
            h.send(reply)

    # -- endpoints

    def _route(self, h, method, path, body, mode, t0):
        methods = _ROUTES.get(path)
        if methods is None or (mode == "old_server" and path == "/api/ps"):
            return _text(404, "404 page not found")
        if method not in methods:        # gin: 405 since v0.6.9, 404 before
            if mode == "old_server":
                return _text(404, "404 page not found")
            return _text(405, "405 method not allowed")
        if path == "/":
            return _text(200, "Ollama is running", TEXT_UTF8)
        if path == "/api/version":
            return _json_reply(200, {"version": self.version})
        if path == "/api/tags":
            return _json_reply(200, {"models": [self._tag_entry(m) for m in self.models]})
        if path == "/api/ps":
            return _json_reply(200, {"models": self._ps_entries(mode)})
        return self._generate(h, body, mode, t0)

    def _resolve(self, name):
        """The listed model a requested name means, or None."""
        want = _canonical_model(name)
        for model in self.models:
            if _canonical_model(model) == want:
                return model
        return None

    def _tag_entry(self, name):
        return {"name": name, "model": name, "modified_at": self._modified, "size": self.size,
                "digest": hashlib.sha256(name.encode("utf-8")).hexdigest(),
                "details": _details(name)}

    def _ps_entries(self, mode):
        with self._lock:
            names = sorted(self.loaded)
            keep = dict(self._keep)
        vram = {"cpu": 0, "partial": int(self.size * 0.45)}.get(mode, self.size)
        entries = []
        for name in names:
            seconds = keep.get(name, 300.0)
            seconds = _MAX_NS_SECONDS if seconds < 0 else seconds
            expires = _local_now() + datetime.timedelta(seconds=seconds)
            entry = self._tag_entry(name)
            del entry["modified_at"]
            entry.update([("expires_at", _rfc3339(expires)), ("size_vram", vram),
                          ("context_length", 4096)])
            entries.append(entry)
        return entries

    def _generate(self, h, body, mode, t0):
        """POST /api/generate, checks in the order of reference section 6.2."""
        text = body.decode("utf-8", "replace")
        if not text.strip(" \t\r\n"):
            return _error(400, "missing request body")
        req, err = _decode_json(text)
        if err is None and req is not None and not isinstance(req, dict):
            err = ("json: cannot unmarshal %s into Go value of type api.GenerateRequest"
                   % _json_kind(req))
        req = req if isinstance(req, dict) else {}
        err = err or _request_error(req)
        if err:
            return _error(400, err)
        keep = None if req.get("keep_alive") is None else _keep_alive(req["keep_alive"])
        raw_name = req.get("model") or ""
        if not raw_name.strip():
            if mode == "old_server":
                return _error(400, "model is required")
            return _error(404, "model '%s' not found" % raw_name)
        name = self._resolve(raw_name)
        if name is None:
            return _error(404, "model '%s' not found" % raw_name)
        prompt = req.get("prompt") or ""
        if not prompt and keep == 0:
            with self._lock:
                self.loaded.discard(name)
            return self._done_object(raw_name, "unload")
        err = _options_error(req.get("options"))
        if err:
            return _error(500, err)
        if mode in _GENERATE_ERRORS:
            if mode != "busy":
                with self._lock:
                    self.loaded.discard(name)
            return _error(*_GENERATE_ERRORS[mode])
        if mode == "pull_first":
            return _error(404, "model %s not found, try pulling it first" % _go_quote(raw_name))
        load_ns = self._ensure_loaded(h, name, t0)
        if load_ns is None:
            return None
        with self._lock:
            if keep is not None or name not in self._keep:
                self._keep[name] = 300.0 if keep is None else keep
            if keep == 0:
                self.loaded.discard(name)
        return self._generate_reply(req, raw_name, prompt, load_ns, mode)

    def _ensure_loaded(self, h, name, t0):
        """Load name if cold (no bytes sent meanwhile); None when the client left first."""
        with self._lock:
            if name in self.loaded:
                return max(int((time.time() - t0) * 1e9), 100000)
            rec = self._loading.get(name)
            if rec is None:
                rec = self._loading[name] = {"deadline": time.time() + self.load_seconds,
                                             "waiters": 0}
            rec["waiters"] += 1
        while time.time() < rec["deadline"]:
            left = rec["deadline"] - time.time()
            if self._stop.is_set() or h.client_gone(max(0.0, min(0.05, left))):
                with self._lock:          # abort the load when its last client is gone
                    rec["waiters"] -= 1
                    if rec["waiters"] == 0 and self._loading.get(name) is rec:
                        del self._loading[name]
                return None
        with self._lock:
            if self._loading.get(name) is rec:
                del self._loading[name]
            self.loaded.add(name)
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
    parser = cli_parser(
        "ollama_emu.py", "Loopback emulator of the Ollama HTTP API (for gpu_preflight tests).",
        MODES)
    parser.add_argument("--port", type=int, default=11434, help="TCP port (0: any free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--mode", default="healthy", choices=MODE_NAMES, metavar="MODE",
                        help="behaviour, see below (default healthy)")
    parser.add_argument("--model", action="append", metavar="NAME",
                        help="a model /api/tags lists (repeatable; default llama3.2:latest)")
    parser.add_argument("--cold", action="store_true", help="start with no model loaded")
    parser.add_argument("--load-seconds", type=float, default=5.0, metavar="S",
                        help="cold-load time, also the slow_start window (default 5)")
    parser.add_argument("--fault-on", default="all", metavar="PATH",
                        help="apply the mode only to this path, e.g. /api/generate (default all)")
    args = parser.parse_args(argv)
    emu = Emulator(mode=args.mode, models=tuple(args.model or ("llama3.2:latest",)),
                   loaded=() if args.cold else None, load_seconds=args.load_seconds,
                   fault_on=args.fault_on, host=args.host, port=args.port)
    details = "mode=%s models=%s loaded=%s" % (
        emu.mode, ",".join(emu.models) or "none", ",".join(sorted(emu.loaded)) or "none")
    return serve_until_signalled(emu, "ollama emulator", "cannot listen on", details)


if __name__ == "__main__":
    sys.exit(main())
