#!/usr/bin/env python3
"""Loopback emulator of OpenAI-compatible inference servers, for gpu_preflight's tests.

Three flavours, each answering like the real server on the endpoints a preflight
touches (project reference, ollama-api.md section 12, read against the servers'
sources):

  vllm      vLLM's OpenAI server (FastAPI on uvicorn): GET /health (200, empty
            body), GET /version, GET /v1/models (ModelCard list), POST
            /v1/completions, /v1/chat/completions and /v1/embeddings.  Errors are
            {"error":{"message","type","param","code"}}; unknown paths
            {"detail":"Not Found"}, wrong methods (HEAD included, as FastAPI
            does) {"detail":"Method Not Allowed"}.  Header names are lower-case
            like uvicorn's.  With a token only /v1/* paths need
            "Authorization: Bearer TOKEN" (401 {"error":"Unauthorized"}).
            While loading the port is bound but not listening: refused.
  llamacpp  llama.cpp's llama-server (cpp-httplib): HTTP up at once; while
            loading every path but the web UI "/" answers 503 "Loading model";
            then GET /health and /v1/health {"status":"ok"}, GET /models and
            /v1/models (one body with both "models" and "data"), GET /props
            (single-model mode: default_generation_settings.n_ctx is the
            context of one slot, -c divided by --parallel: n_ctx), POST
            /completions, /v1/completions, /chat/completions,
            /v1/chat/completions, /embedding, /embeddings, /v1/embeddings;
            anything else 404 "File Not Found".  JSON is
            compact with sorted keys (nlohmann::json), Content-Type
            "application/json; charset=utf-8"; HEAD is GET without a body.
            With a token every path but /health, /v1/health and "/" needs
            "Authorization: Bearer TOKEN" (or X-Api-Key) -> 401 "Invalid API
            Key".  The request's model name is not checked (single-model mode).
  llama-cpp-python  `python -m llama_cpp.server` 0.3.x (FastAPI on uvicorn), as
            observed (reference multi-model.md B8): no /health (404
            {"detail":"Not Found"}), GET /v1/models {"object":"list","data":
            [{"id","object":"model","owned_by":"me","permissions":[]}]}, POST
            /v1/completions, /v1/chat/completions, /v1/embeddings; an unknown
            model name is served by the loaded model; the port opens only
            after the load (mode loading: refused); with a token every /v1/*
            path needs it (401 {"detail":"Invalid API key"}).

Models are names, or "NAME=KIND" with KIND generate (default) or embed (a
pooling model).  What a request of the wrong kind gets, and /v1/embeddings:
  vllm      the wrong API for the model (completions or chat on an embedding
            model, embeddings on a generative one): by era (wrong_kind /
            --wrong-kind): "200-nested" (default; 200 with {"error":{"message":
            "The model does not support Completions API",...}}, v0.10.1 on),
            "200-flat" (200 with {"object":"error","message":...}, before
            v0.10.1), "501" (NotImplementedError builds), "404" (task-gated
            routes: {"detail":"Not Found"}).  Embeddings: {"id":"embd-...",
            "object":"list","data":[{"index":0,"object":"embedding",
            "embedding":[...]}],"usage":{...}}
  llamacpp  embeddings=True is --embeddings: then completions and chat get 501
            "This server does not support completions. Start it without
            `--embeddings`" (2024-2025 builds); without it /v1/embeddings gets
            501 "This server does not support embeddings. Start it with
            `--embeddings`"; with it, a generative (pooling none) model gets
            400 "Pooling type 'none' is not OAI compatible..." on the OpenAI
            routes
  llama-cpp-python  embeddings=True is --embedding true: completions still
            work; /v1/embeddings answers per-token vectors (a list of lists)
            for a generative model (pooling none), a flat list for an
            embedding model; without it 500 "Llama model must be created with
            embedding=True to call this method"
embedding_shape="nested" makes any flavour answer embeddings as a list of
per-token vectors (what pooling-none models give), "flat" one vector.

llamacpp router mode (router_max=N / --router-max N: llama-server --models-dir
... --models-max N, multi-model.md B6): GET /models and /v1/models list every
model as {"object":"list","data":[{"id","aliases","tags","object":"model",
"owned_by":"llamacpp","created","status":{"value":"loaded"|"unloaded"}}]};
POST requests need "model" (missing: 400 "model name is missing from the
request"; unknown: 400 "model 'x' not found"), autoload it, and when N
models run already unload the least recently used one first (unload_lru: by
count, no VRAM check; 0 = unlimited). Every child runs with the same flags.

Modes (fault_on / --fault-on restricts a mode to one path, default "all"):
  healthy         faithful server (the default)
  loading         the first load_seconds after start: vllm refuses connections,
                  llamacpp answers 503 {"error":{"code":503,"message":"Loading
                  model","type":"unavailable_error"}}; healthy afterwards
  engine_dead     vllm: /health 503 empty, completions 500 "EngineCore
                  encountered an issue..."; llamacpp: /health and completions 500
                  "Model failed to load" (the error state of 2024 builds)
  hang            read the request, never answer
  trickle         a valid reply, one byte every trickle_interval (2 s)
  close_mid_body  headers with the full Content-Length, ~10 body bytes, close
  garbage         200 application/json with a body that is not JSON
  huge            200 application/json with a 100 MB body (huge_size)
  no_health       GET /health (llamacpp also /v1/health) -> 404, as a server
                  or proxy without one
  oom             completions -> 500 CUDA out of memory, in the flavour's shape
  empty_models    the models list is empty (llamacpp: "data" and "models")
  redirect        every request -> 302, Location http://evil.example:9/steal
  chat_only       no /v1/completions (and llamacpp /completions): 404 in the
                  flavour's shape, as a chat-only server or gateway has it
  completions_405 POST /v1/completions -> 405 Method Not Allowed
  error_in_200    completions and chat -> 200 whose body is an error object
                  (vLLM's flat {"object":"error",...}, CUDA out of memory)
  empty_embedding /v1/embeddings -> 200 with data[0].embedding []
  sglang_starting flavour vllm as SGLang answers while it starts: GET /health
                  an empty 503 for load_seconds (sgl-project/sglang
                  python/sglang/srt/entrypoints/http_server.py health_generate:
                  Response(status_code=503) while starting, shutting down or
                  when the health generation is late; gpustack/gpustack#6203),
                  then 200; no GET /version (404)
  litellm         flavour vllm as the LiteLLM proxy: GET /health makes real API
                  calls (docs.litellm.ai/docs/proxy/health), so it sleeps
                  litellm_delay (5 s) then answers {"healthy_endpoints": [...],
                  "unhealthy_endpoints": [], ...}; GET /health/readiness answers
                  at once {"status": "healthy", ...}
  sleeping        vLLM in sleep mode: GET /is_sleeping {"is_sleeping": true}
                  (vllm/entrypoints/openai/api_server.py, dev mode, #14311); a
                  completion or chat then crashes the engine
                  (vllm-project/vllm#15483): 500, recorded in .requests

Every request is recorded in .requests as a dict: method, path (no query),
target (as sent), headers (dict, lower-case names), body (bytes), time.

Run it:   python3 tests/openai_emu.py --port 8000 --flavour vllm --mode loading
          python3 tests/openai_emu.py --flavour vllm --model qwen2.5-0.5b \
              --model bge-m3=embed --wrong-kind 200-flat
Import:   from openai_emu import OpenAIEmulator
          with OpenAIEmulator(flavour="llamacpp", token="k") as emu: ... emu.url
          OpenAIEmulator(flavour="llamacpp", models=("bge-m3=embed",), embeddings=True)
Standard library only, CPython 3.6+.
"""

import email.utils
import hashlib
import json
import math
import random
import sys
import time
import uuid
from http.client import responses as _REASONS

from emu_base import Handler, HTTPEmulator, cli_parser, serve_until_signalled
from emu_base import free_port  # noqa: F401  (public here before emu_base existed)

FLAVOURS = ("vllm", "llamacpp", "llama-cpp-python")
DEFAULT_PORTS = {"vllm": 8000, "llamacpp": 8080, "llama-cpp-python": 8000}
UVICORN = ("vllm", "llama-cpp-python")        # FastAPI on uvicorn: its header style
KINDS = ("generate", "embed")
WRONG_KIND = ("200-nested", "200-flat", "501", "404")

MODES = (
    ("healthy", "faithful server (default)"),
    ("loading", "first --load-seconds: vllm refuses connections, llamacpp answers 503"),
    ("engine_dead", "vllm: /health 503, completions 500; llamacpp: 500 Model failed to load"),
    ("hang", "accept and read the request, never answer"),
    ("trickle", "a valid reply sent one byte every 2 seconds"),
    ("close_mid_body", "headers with the full Content-Length, ~10 body bytes, close"),
    ("garbage", "200 application/json with a non-JSON body"),
    ("huge", "200 application/json with a 100 MB body"),
    ("no_health", "GET /health (and llamacpp /v1/health) -> 404"),
    ("oom", "completions -> 500 CUDA out of memory"),
    ("empty_models", "the models list is empty"),
    ("redirect", "every request -> 302 to http://evil.example:9/steal"),
    ("chat_only", "no /v1/completions: 404 (a chat-only server or gateway)"),
    ("completions_405", "POST /v1/completions -> 405 Method Not Allowed"),
    ("error_in_200", "completions and chat -> 200 with an error object (CUDA out of memory)"),
    ("empty_embedding", "/v1/embeddings -> 200 with data[0].embedding []"),
    ("sglang_starting", "SGLang starting: /health empty 503 for --load-seconds, no /version"),
    ("litellm", "LiteLLM proxy: slow /health (healthy_endpoints), fast /health/readiness"),
    ("sleeping", "vLLM asleep: /is_sleeping true, a completion crashes it (500)"),
)
MODE_NAMES = tuple(name for name, _ in MODES)

VLLM_VERSION = "0.9.2"
LLAMACPP_BUILD = "b5890-2f3a8c1e"     # system_fingerprint: b<build number>-<commit>
REDIRECT_TO = "http://evil.example:9/steal"

VLLM_JSON = "application/json"
LLAMA_JSON = "application/json; charset=utf-8"
VLLM_SSE = "text/event-stream; charset=utf-8"
LLAMA_SSE = "text/event-stream"

ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
VLLM_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "139.72 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process "
            "has 138.65 GiB memory in use.")
LLAMA_OOM = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 2048.00 MiB on device 0: "
             "cudaMalloc failed: out of memory")
LLAMA_LOAD_FAILED = "Model failed to load"
#: Answers to a request of the wrong kind (reference multi-model.md B5, B6, B8).
VLLM_NO_API = "The model does not support %s API"        # Completions, Chat Completions, Embeddings
LLAMA_NO_EMBEDDINGS = "This server does not support embeddings. Start it with `--embeddings`"
LLAMA_NO_COMPLETIONS = ("This server does not support completions. Start it without "
                        "`--embeddings`")
LLAMA_POOLING_NONE = ("Pooling type 'none' is not OAI compatible. Please use a different "
                      "pooling type")
LCP_NO_EMBEDDINGS = "Llama model must be created with embedding=True to call this method"

# Paths per flavour: path -> allowed methods (vLLM routes are FastAPI's, no HEAD).
_VLLM_ROUTES = {"/health": ("GET",), "/version": ("GET",), "/v1/models": ("GET",),
                "/v1/completions": ("POST",), "/v1/chat/completions": ("POST",),
                "/v1/embeddings": ("POST",)}
_LCP_ROUTES = {"/v1/models": ("GET",), "/v1/completions": ("POST",),
               "/v1/chat/completions": ("POST",), "/v1/embeddings": ("POST",),
               "/extras/tokenize": ("POST",), "/extras/tokenize/count": ("POST",),
               "/extras/detokenize": ("POST",)}
_LLAMA_ROUTES = {"/": ("GET", "HEAD"), "/health": ("GET", "HEAD"),
                 "/v1/health": ("GET", "HEAD"), "/models": ("GET", "HEAD"),
                 "/v1/models": ("GET", "HEAD"), "/props": ("GET", "HEAD"),
                 "/completions": ("POST",),
                 "/v1/completions": ("POST",), "/chat/completions": ("POST",),
                 "/v1/chat/completions": ("POST",), "/embedding": ("POST",),
                 "/embeddings": ("POST",), "/v1/embeddings": ("POST",)}
_LLAMA_PUBLIC = ("/health", "/v1/health", "/")     # no API key (server-http.cpp)
_LLAMA_FRONTEND = ("/",)                              # served even while loading
_LLAMA_INDEX = (b"<!doctype html><html><head><meta charset=\"utf-8\"><title>llama.cpp - chat"
                b"</title></head><body><div id=\"app\"></div></body></html>")


# ---------------------------------------------------------------- helpers

def _vllm_dumps(obj):
    """Starlette JSONResponse.render: compact, UTF-8, key order kept."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _llama_dumps(obj):
    """nlohmann::json dump(-1): compact, UTF-8, keys sorted (std::map objects)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False,
                      sort_keys=True).encode("utf-8")


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_tokens(prompt):
    """A plausible prompt token count: BOS plus one per word ("test" -> 2)."""
    if isinstance(prompt, list):
        return 1 + sum(_prompt_tokens(p) - 1 if isinstance(p, str) else 1 for p in prompt)
    return 1 + len(str(prompt or "").split())


def _model_spec(spec):
    """(name, kind) of "NAME" or "NAME=KIND"."""
    name, _, kind = str(spec).partition("=")
    kind = kind or "generate"
    if not name or kind not in KINDS:
        raise ValueError("bad model %r: NAME or NAME=KIND, KIND one of %s"
                         % (spec, ", ".join(KINDS)))
    return name, kind


def _vector(seed, dims=384):
    """A deterministic L2-normalized pseudo-random vector."""
    rnd = random.Random(hashlib.sha256(seed.encode("utf-8")).hexdigest())
    values = [rnd.uniform(-1.0, 1.0) for _ in range(dims)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [float("%.7g" % (v / norm)) for v in values]


def _messages_tokens(messages):
    text = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    return 8 + len(text.split())


class _Reply(object):
    """A response: a plain body, or SSE events sent chunked (events is not None)."""

    def __init__(self, status, body=b"", ctype=None, headers=(), events=None):
        self.status, self.body, self.ctype = status, body, ctype
        self.headers, self.events = list(headers), events


def _head(flavour, reply, length=None, chunked=False):
    """The status line and headers, as uvicorn (vllm) or cpp-httplib (llamacpp) writes them."""
    date = email.utils.formatdate(usegmt=True)
    lines = ["HTTP/1.1 %d %s" % (reply.status, _REASONS.get(reply.status, "Unknown"))]
    fields = []
    if flavour in UVICORN:                     # uvicorn: date, server, then the app's
        fields += [("date", date), ("server", "uvicorn")]
        if length is not None:
            fields.append(("content-length", "%d" % length))
        if reply.ctype:
            fields.append(("content-type", reply.ctype))
        fields += [(k.lower(), v) for k, v in reply.headers]
        if chunked:
            fields.append(("transfer-encoding", "chunked"))
        fields.append(("connection", "close"))
    else:                                      # cpp-httplib
        fields += list(reply.headers)
        fields += [("Connection", "close")]
        if length is not None:
            fields.append(("Content-Length", "%d" % length))
        if reply.ctype:
            fields.append(("Content-Type", reply.ctype))
        if chunked:
            fields.append(("Transfer-Encoding", "chunked"))
        fields.append(("Date", date))
    lines += ["%s: %s" % kv for kv in fields]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _pieces(flavour, reply, head_only=False, http10=False):
    """The bytes of a reply, in the writes a server would make."""
    if reply.events is None:
        yield _head(flavour, reply, len(reply.body))
        if reply.body and not head_only:
            yield reply.body
        return
    chunked = not http10
    yield _head(flavour, reply, chunked=chunked)
    if head_only:
        return
    for event in reply.events:
        yield (b"%x\r\n%s\r\n" % (len(event), event)) if chunked else event
    if chunked:
        yield b"0\r\n\r\n"


# ---------------------------------------------------------------- HTTP plumbing

class _Handler(Handler):
    """emu_base.Handler, also reading chunked request bodies (as uvicorn and cpp-httplib do)."""

    def _read_body(self):
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            parts = []
            while True:
                line = self.rfile.readline(65537)
                try:
                    size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                except ValueError:
                    return b"".join(parts)
                if size <= 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass                  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline(65537)
        return Handler._read_body(self)


# ---------------------------------------------------------------- the emulator

class OpenAIEmulator(HTTPEmulator):
    """A vLLM or llama-server look-alike on a loopback port. See the module docstring."""

    handler = _Handler

    def __init__(self, flavour="vllm", mode="healthy", models=("qwen2.5-0.5b",),
                 load_seconds=0.0, token=None, host="127.0.0.1", port=None,
                 fault_on="all", max_model_len=32768, embeddings=False,
                 wrong_kind="200-nested", embedding_shape=None, router_max=None,
                 n_ctx=4096):
        if flavour not in FLAVOURS:
            raise ValueError("unknown flavour %r (one of %s)" % (flavour, ", ".join(FLAVOURS)))
        if mode not in MODE_NAMES:
            raise ValueError("unknown mode %r (one of %s)" % (mode, ", ".join(MODE_NAMES)))
        if wrong_kind not in WRONG_KIND:
            raise ValueError("unknown wrong_kind %r (one of %s)"
                             % (wrong_kind, ", ".join(WRONG_KIND)))
        if embedding_shape not in (None, "flat", "nested"):
            raise ValueError("embedding_shape is None, 'flat' or 'nested'")
        HTTPEmulator.__init__(self, mode, fault_on, host, port or 0, load_seconds)
        self.flavour = flavour
        specs = [_model_spec(m) for m in models]
        self.models = tuple(name for name, _ in specs)
        self.kinds = dict(specs)
        self.embeddings, self.wrong_kind = embeddings, wrong_kind
        self.embedding_shape = embedding_shape
        self.router_max = router_max    # llamacpp router mode: --models-max
        self.running = []               # router mode: loaded models, least recent first
        self.token = token
        self.max_model_len = max_model_len
        self.n_ctx = n_ctx              # llamacpp: the context of one slot (/props)
        self.version = VLLM_VERSION
        self.redirect_to = REDIRECT_TO
        self.litellm_delay = 5.0

    # -- lifecycle (HTTPEmulator.start binds now, listens after _listen_delay())

    def _listen_delay(self):
        """vllm, llama-cpp-python in mode loading: bound, not listening (refused) for load_seconds."""
        if self.flavour in UVICORN and self.mode == "loading":
            return self.load_seconds
        return 0.0

    @property
    def ready(self):
        """Whether the load phase is over (always, except in mode loading)."""
        if self.mode != "loading" or self._started_at is None:
            return self._started_at is not None
        return time.time() >= self._started_at + self.load_seconds

    def count(self, method, path):
        with self._lock:
            return sum(1 for r in self.requests if r["method"] == method and r["path"] == path)

    def posts(self):
        """(path, parsed JSON body) of every POST, in order."""
        with self._lock:
            found = [r for r in self.requests if r["method"] == "POST"]
        out = []
        for r in found:
            try:
                out.append((r["path"], json.loads(bytes.decode(r["body"], "utf-8"))))
            except ValueError:
                out.append((r["path"], None))
        return out

    def kind_of(self, name):
        """The kind of the model a request names (unknown or none: the first model's)."""
        if name in self.kinds:
            return self.kinds[name]
        return self.kinds[self.models[0]] if self.models else "generate"

    # -- per-request entry point (HTTPEmulator._serve calls these)

    def _record(self, h, method, path, target, body):
        """Log the request (see the module docstring); its headers are the context."""
        headers = {}
        for name, value in h.headers.items():
            name = name.lower()
            headers[name] = headers[name] + ", " + value if name in headers else value
        with self._lock:
            self.requests.append({"method": method, "path": path, "target": target,
                                  "headers": headers, "body": body, "time": time.time()})
        return headers

    def _pieces(self, reply, head_only, http10):
        return _pieces(self.flavour, reply, head_only, http10)

    def _huge_parts(self):
        if self.flavour in UVICORN:
            return b'{"object":"list","data":[', b'{"id":"x"},', b'{"id":"x"}]}'
        return b'{"data":[', b'{"id":"x"},', b'{"id":"x"}],"object":"list"}'

    def _huge_head(self, length):
        return _head(self.flavour, _Reply(200, b"", self._json_ct()), length)

    def _serve_mode(self, h, method, path, body, mode, headers):
        if mode == "hang":
            return self._hang(h)
        if mode == "redirect":
            return h.send(_Reply(302, b"", None, [("Location", self.redirect_to)]))
        if mode == "garbage":
            return h.send(_Reply(200, b"<html>oops</html>", self._json_ct()))
        if mode == "huge":
            return self._send_huge(h)
        reply = self._route(method, path, headers, body, mode)
        if mode == "trickle":
            self._trickle(h, reply)
        elif mode == "close_mid_body":
            full = reply.body if reply.events is None else b"".join(reply.events)
            cut = b"" if method == "HEAD" else full[:min(10, max(0, len(full) - 1))]
            plain = _Reply(reply.status, full, reply.ctype, reply.headers)
            h.wfile.write(_head(self.flavour, plain, len(full)) + cut)
        else:
            h.send(reply)

    def _json_ct(self):
        return VLLM_JSON if self.flavour in UVICORN else LLAMA_JSON

    def _route(self, method, path, headers, body, mode):
        if self.flavour == "vllm":
            return self._vllm_route(method, path, headers, body, mode)
        if self.flavour == "llama-cpp-python":
            return self._lcp_route(method, path, headers, body, mode)
        return self._llama_route(method, path, headers, body, mode)

    def _shape(self, kind, text, dims=384):
        """data[0].embedding: one vector, or one per token (pooling none)."""
        shape = self.embedding_shape or ("flat" if kind == "embed" else "nested")
        if shape == "flat":
            return _vector(text, dims)
        return [_vector("%s\0%d" % (text, i), dims) for i in range(_prompt_tokens(text))]

    def _inputs(self, value):
        """The texts of an embeddings input (string or list of strings)."""
        if isinstance(value, str):
            return [value]
        return [v if isinstance(v, str) else json.dumps(v) for v in value or []]

    # -- vLLM

    def _vllm_json(self, status, obj, extra=()):
        return _Reply(status, _vllm_dumps(obj), VLLM_JSON, extra)

    def _vllm_error(self, status, message, err_type, param=None):
        return self._vllm_json(status, {"error": {"message": message, "type": err_type,
                                                  "param": param, "code": status}})

    def _vllm_authorized(self, headers):
        """vLLM's AuthenticationMiddleware: scheme 'bearer' (any case), then the token."""
        scheme, _, param = (headers.get("authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and param == self.token

    def _other_server(self, path, mode):
        """sglang_starting, litellm, sleeping: the answers that differ from vLLM's."""
        if mode == "sglang_starting" and path == "/version":
            return self._vllm_json(404, {"detail": "Not Found"})
        if mode == "sglang_starting" and path == "/health":
            starting = time.time() < self._started_at + self.load_seconds
            return _Reply(503 if starting else 200, b"")
        if mode == "litellm" and path == "/health":
            time.sleep(self.litellm_delay)
            return self._vllm_json(200, {"healthy_endpoints": [{"model": self.models[0]}],
                                         "unhealthy_endpoints": [], "healthy_count": 1,
                                         "unhealthy_count": 0})
        if mode == "litellm" and path == "/health/readiness":
            return self._vllm_json(200, {"status": "healthy", "db": "Not connected"})
        if mode == "sleeping" and path == "/is_sleeping":
            return self._vllm_json(200, {"is_sleeping": True})
        if mode == "sleeping" and path in ("/v1/completions", "/v1/chat/completions"):
            return self._vllm_error(500, "CUDA error: an illegal memory access was "
                                    "encountered", "InternalServerError")
        return None

    def _vllm_route(self, method, path, headers, body, mode):
        other = self._other_server(path, mode)
        if other is not None:
            return other
        if self.token is not None and path.startswith("/v1") and method != "OPTIONS" \
                and not self._vllm_authorized(headers):
            return self._vllm_json(401, {"error": "Unauthorized"})
        methods = _VLLM_ROUTES.get(path)
        if (methods is None or (mode == "no_health" and path == "/health")
                or (mode == "chat_only" and path == "/v1/completions")):
            return self._vllm_json(404, {"detail": "Not Found"})
        if method not in methods or (mode == "completions_405" and path == "/v1/completions"):
            allowed = ("GET",) if mode == "completions_405" else methods
            return self._vllm_json(405, {"detail": "Method Not Allowed"},
                                   [("allow", ", ".join(allowed))])
        if path == "/health":
            return _Reply(503 if mode == "engine_dead" else 200, b"")
        if path == "/version":
            return self._vllm_json(200, {"version": self.version})
        if path == "/v1/models":
            return self._vllm_json(200, {"object": "list", "data": self._vllm_cards(mode)})
        if path == "/v1/embeddings":
            return self._vllm_embeddings(body, mode)
        return self._vllm_generate(body, mode, chat=path == "/v1/chat/completions")

    def _vllm_wrong_api(self, api):
        """vLLM's answer to an API the model's task lacks, by era (wrong_kind)."""
        message = VLLM_NO_API % api
        if self.wrong_kind == "404":
            return self._vllm_json(404, {"detail": "Not Found"})
        if self.wrong_kind == "501":
            return self._vllm_error(501, message, "NotImplementedError")
        if self.wrong_kind == "200-flat":
            return self._vllm_json(200, {"object": "error", "message": message,
                                         "type": "BadRequestError", "param": None,
                                         "code": 400})
        return self._vllm_json(200, {"error": {"message": message, "type": "BadRequestError",
                                               "param": None, "code": 400}})

    def _vllm_parse(self, body):
        """(request dict, None) or (None, the validation error reply)."""
        text = body.decode("utf-8", "replace")
        if not text.strip():
            return None, self._vllm_invalid([{"type": "missing", "loc": ("body",),
                                              "msg": "Field required", "input": None}])
        try:
            req = json.loads(text)
        except ValueError as exc:
            return None, self._vllm_invalid([{"type": "json_invalid", "loc": (
                "body", getattr(exc, "pos", 0)), "msg": "JSON decode error", "input": {},
                "ctx": {"error": getattr(exc, "msg", str(exc))}}])
        if not isinstance(req, dict):
            return None, self._vllm_invalid([{
                "type": "model_attributes_type", "loc": ("body",),
                "msg": "Input should be a valid dictionary or object to extract fields from",
                "input": req}])
        return req, None

    def _vllm_embeddings(self, body, mode):
        """POST /v1/embeddings (vllm/entrypoints/pooling/embed)."""
        req, refusal = self._vllm_parse(body)
        if refusal:
            return refusal
        if req.get("input") is None:
            return self._vllm_invalid([{"type": "missing", "loc": ("body", "input"),
                                        "msg": "Field required", "input": req}])
        name = req.get("model")
        if self.kind_of(name) != "embed":
            return self._vllm_wrong_api("Embeddings")
        if name and name not in self.models:
            return self._vllm_error(404, "The model `%s` does not exist." % name,
                                    "NotFoundError", "model")
        if mode == "engine_dead":
            return self._vllm_error(500, ENGINE_DEAD, "InternalServerError")
        if mode == "oom":
            return self._vllm_error(500, VLLM_OOM, "InternalServerError")
        served = name or self.models[0]
        texts = self._inputs(req["input"])
        tokens = sum(_prompt_tokens(t) for t in texts)
        data = [{"index": i, "object": "embedding",
                 "embedding": [] if mode == "empty_embedding" else self._shape(
                     "embed", served + "\0" + t)} for i, t in enumerate(texts)]
        return self._vllm_json(200, {
            "id": "embd-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()),
            "model": served, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}})

    def _vllm_cards(self, mode):
        if mode == "empty_models":
            return []
        now = int(time.time())
        return [{"id": name, "object": "model", "created": now, "owned_by": "vllm",
                 "root": name, "parent": None, "max_model_len": self.max_model_len,
                 "permission": [{"id": "modelperm-" + uuid.uuid4().hex,
                                 "object": "model_permission", "created": now,
                                 "allow_create_engine": False, "allow_sampling": True,
                                 "allow_logprobs": True, "allow_search_indices": False,
                                 "allow_view": True, "allow_fine_tuning": False,
                                 "organization": "*", "group": None, "is_blocking": False}]}
                for name in self.models]

    def _vllm_invalid(self, errors):
        """FastAPI RequestValidationError as vLLM's handler words it (400, 'Bad Request')."""
        return self._vllm_error(400, repr(errors), "Bad Request")

    def _vllm_generate(self, body, mode, chat):
        req, refusal = self._vllm_parse(body)
        if refusal:
            return refusal
        for field, ok, kind, word in (
                ("model", lambda v: isinstance(v, str), "string_type", "string"),
                ("max_tokens", _is_int, "int_type", "integer"),
                ("stream", lambda v: isinstance(v, bool), "bool_type", "boolean")):
            value = req.get(field)
            if value is not None and not ok(value):
                return self._vllm_invalid([{"type": kind, "loc": ("body", field),
                                            "msg": "Input should be a valid " + word,
                                            "input": value}])
        if chat and not isinstance(req.get("messages"), list):
            return self._vllm_invalid([{"type": "missing", "loc": ("body", "messages"),
                                        "msg": "Field required", "input": req}])
        if self.kind_of(req.get("model")) == "embed":     # the route's handler is None
            return self._vllm_wrong_api("Chat Completions" if chat else "Completions")
        if not chat and req.get("prompt") in (None, "", []):
            return self._vllm_error(400, "Either prompt or prompt_embeds must be provided "
                                         "and non-empty.", "BadRequestError")
        name = req.get("model")
        if name and name not in self.models:
            return self._vllm_error(404, "The model `%s` does not exist." % name,
                                    "NotFoundError", "model")
        max_tokens = req.get("max_tokens")
        if max_tokens is not None and max_tokens < 1:
            return self._vllm_error(400, "max_tokens must be at least 1, got %d." % max_tokens,
                                    "BadRequestError", "max_tokens")
        if mode == "engine_dead":
            return self._vllm_error(500, ENGINE_DEAD, "InternalServerError")
        if mode == "oom":
            return self._vllm_error(500, VLLM_OOM, "InternalServerError")
        if mode == "error_in_200":
            return self._vllm_json(200, {"object": "error", "message": VLLM_OOM,
                                         "type": "InternalServerError", "param": None,
                                         "code": 500})
        served = name or (self.models[0] if self.models else "")
        n = 16 if max_tokens is None else min(max_tokens, 16)
        prompt_tokens = (_messages_tokens(req["messages"]) if chat
                         else _prompt_tokens(req.get("prompt")))
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n,
                 "completion_tokens": n}
        created = int(time.time())
        if chat:
            rid = "chatcmpl-" + uuid.uuid4().hex
            content = " ".join(["Hello"] * n)
            if req.get("stream"):
                return self._sse(VLLM_SSE, _vllm_dumps, [
                    {"id": rid, "object": "chat.completion.chunk", "created": created,
                     "model": served, "choices": [{"index": 0, "delta": {
                         "role": "assistant", "content": content}, "logprobs": None,
                         "finish_reason": "length", "stop_reason": None}]}])
            return self._vllm_json(200, {
                "id": rid, "object": "chat.completion", "created": created, "model": served,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content,
                                                     "tool_calls": []},
                             "logprobs": None, "finish_reason": "length", "stop_reason": None}],
                "usage": usage})
        rid = "cmpl-" + uuid.uuid4().hex
        if req.get("stream"):
            chunks = [{"id": rid, "object": "text_completion", "created": created,
                       "model": served, "choices": [{
                           "index": 0, "text": " a", "logprobs": None,
                           "finish_reason": "length" if i == n - 1 else None,
                           "stop_reason": None}]} for i in range(n)]
            return self._sse(VLLM_SSE, _vllm_dumps, chunks)
        return self._vllm_json(200, {
            "id": rid, "object": "text_completion", "created": created, "model": served,
            "choices": [{"index": 0, "text": " a" * n, "logprobs": None,
                         "finish_reason": "length", "stop_reason": None}],
            "usage": usage})

    def _sse(self, ctype, dumps, objs):
        events = [b"data: " + dumps(obj) + b"\n\n" for obj in objs] + [b"data: [DONE]\n\n"]
        return _Reply(200, ctype=ctype, events=events)

    # -- llama.cpp

    def _llama_json(self, status, obj):
        return _Reply(status, _llama_dumps(obj), LLAMA_JSON)

    def _llama_error(self, status, message, err_type):
        return self._llama_json(status, {"error": {"code": status, "message": message,
                                                   "type": err_type}})

    def _llama_authorized(self, headers):
        """middleware_validate_api_key: Authorization (else X-Api-Key), 'Bearer ' stripped."""
        key = headers.get("authorization") or headers.get("x-api-key") or ""
        if key.startswith("Bearer "):
            key = key[len("Bearer "):]
        return key == self.token

    def _llama_route(self, method, path, headers, body, mode):
        if not self.ready and path not in _LLAMA_FRONTEND:
            return self._llama_error(503, "Loading model", "unavailable_error")
        if self.token is not None and method != "OPTIONS" and path not in _LLAMA_PUBLIC \
                and not self._llama_authorized(headers):
            return self._llama_error(401, "Invalid API Key", "authentication_error")
        methods = _LLAMA_ROUTES.get(path)
        if (methods is None or method not in methods
                or (mode == "no_health" and path in ("/health", "/v1/health"))
                or (mode == "chat_only" and path in ("/completions", "/v1/completions"))):
            return self._llama_error(404, "File Not Found", "not_found_error")
        if mode == "completions_405" and path in ("/completions", "/v1/completions"):
            return self._llama_error(405, "Method Not Allowed", "invalid_request_error")
        if path == "/":
            return _Reply(200, _LLAMA_INDEX, "text/html; charset=utf-8")
        if path in ("/health", "/v1/health"):
            if mode == "engine_dead":
                return self._llama_error(500, LLAMA_LOAD_FAILED, "server_error")
            return self._llama_json(200, {"status": "ok"})
        if path in ("/models", "/v1/models"):
            if self.router_max is not None:
                return self._llama_json(200, self._router_models(mode))
            return self._llama_json(200, self._llama_models(mode))
        if path == "/props" and self.router_max is None:
            return self._llama_json(200, self._llama_props())
        if self.router_max is not None and method == "POST":
            refusal = self._router_use(body)
            if refusal:
                return refusal
        if path in ("/embedding", "/embeddings", "/v1/embeddings"):
            return self._llama_embeddings(body, mode, oai=path != "/embedding")
        return self._llama_generate(body, mode, chat=path.endswith("/chat/completions"))

    def _llama_parse(self, body):
        """(request, None) or (None, nlohmann's parse error as llama-server answers it)."""
        text = body.decode("utf-8", "replace")
        if not text.strip():
            return None, self._llama_error(500, "[json.exception.parse_error.101] parse error "
                                                "at line 1, column 1: attempting to parse an "
                                                "empty input; check that your input string or "
                                                "stream contains the expected JSON",
                                           "server_error")
        try:
            req = json.loads(text)
        except ValueError as exc:
            pos = getattr(exc, "pos", 0)
            return None, self._llama_error(500, "[json.exception.parse_error.101] parse error "
                                                "at line 1, column %d: syntax error while "
                                                "parsing value - invalid literal; last read: "
                                                "'%s'" % (pos + 1, text[pos:pos + 1]),
                                           "server_error")
        if not isinstance(req, dict):
            return None, self._llama_error(500, "[json.exception.type_error.306] cannot use "
                                                "value() with %s" % (
                                                    "array" if isinstance(req, list)
                                                    else type(req).__name__), "server_error")
        return req, None

    def _llama_embeddings(self, body, mode, oai):
        """handle_embeddings_impl: --embeddings, then pooling, then the input."""
        if not self.embeddings:
            return self._llama_error(501, LLAMA_NO_EMBEDDINGS, "not_supported_error")
        kind = self.kind_of(None)                  # single-model: the loaded one
        if oai and kind != "embed" and self.embedding_shape is None:
            return self._llama_error(400, LLAMA_POOLING_NONE, "invalid_request_error")
        req, refusal = self._llama_parse(body)
        if refusal:
            return refusal
        value = req.get("input", req.get("content"))
        if value is None:
            return self._llama_error(400, "\"input\" or \"content\" must be provided",
                                     "invalid_request_error")
        if mode in ("engine_dead", "oom"):
            return self._llama_error(500, LLAMA_LOAD_FAILED if mode == "engine_dead"
                                     else LLAMA_OOM, "server_error")
        name = req.get("model") if isinstance(req.get("model"), str) else None
        model = name or (self.models[0] if self.models else "gpt-3.5-turbo")
        texts = self._inputs(value)
        tokens = sum(_prompt_tokens(t) for t in texts)
        data = [{"embedding": [] if mode == "empty_embedding" else self._shape(
            kind, model + "\0" + t), "index": i, "object": "embedding"}
            for i, t in enumerate(texts)]
        if not oai:
            return self._llama_json(200, [{"embedding": d["embedding"], "index": d["index"]}
                                          for d in data])
        return self._llama_json(200, {"data": data, "model": model, "object": "list",
                                      "usage": {"prompt_tokens": tokens,
                                                "total_tokens": tokens}})

    def _router_use(self, body):
        """router_validate_model, then autoload: the model runs, the least
        recently used one unloaded first when --models-max run already."""
        try:
            req = json.loads(body.decode("utf-8", "replace"))
        except ValueError:
            return None                          # the child answers it
        name = req.get("model") if isinstance(req, dict) else None
        if not isinstance(name, str) or not name:
            return self._llama_error(400, "model name is missing from the request",
                                     "invalid_request_error")
        if name not in self.models:
            return self._llama_error(400, "model '%s' not found" % name,
                                     "invalid_request_error")
        with self._lock:
            if name in self.running:
                self.running.remove(name)
            elif self.router_max:
                while len(self.running) >= self.router_max:
                    self.running.pop(0)
            self.running.append(name)
        return None

    def _router_models(self, mode):
        names = () if mode == "empty_models" else self.models
        now = int(time.time())
        with self._lock:
            running = list(self.running)
        return {"object": "list", "data": [
            {"id": name, "aliases": [], "tags": [], "object": "model", "owned_by": "llamacpp",
             "created": now, "status": {"value": "loaded" if name in running else "unloaded"}}
            for name in names]}

    def _llama_models(self, mode):
        names = () if mode == "empty_models" else self.models
        now = int(time.time())
        listed = [{"name": name, "model": name, "modified_at": "", "size": "", "digest": "",
                   "type": "model", "description": "", "tags": [""],
                   "capabilities": ["completion"], "parameters": "",
                   "details": {"parent_model": "", "format": "gguf", "family": "",
                               "families": [""], "parameter_size": "",
                               "quantization_level": ""}} for name in names]
        data = [{"id": name, "aliases": [], "tags": [], "object": "model", "created": now,
                 "owned_by": "llamacpp",
                 "meta": {"vocab_type": 2, "n_vocab": 151936, "n_ctx": 4096,
                          "n_ctx_train": self.max_model_len, "n_embd": 896,
                          "n_params": 494032768, "size": 994156544}} for name in names]
        return {"models": listed, "object": "list", "data": data}

    def _llama_props(self):
        """GET /props as tools/server/README.md shows it (get_props: n_ctx per slot)."""
        return {"default_generation_settings": {
            "id": 0, "id_task": -1, "n_ctx": self.n_ctx, "speculative": False,
            "is_processing": False, "params": {"n_predict": -1, "seed": 4294967295,
                                               "temperature": 0.800000011920929},
            "prompt": "", "next_token": {"has_next_token": True, "has_new_line": False,
                                         "n_remain": -1, "n_decoded": 0}},
            "total_slots": 1, "model_path": "/models/%s.gguf" % (self.models or ("m",))[0],
            "chat_template": "", "modalities": {"vision": False},
            "build_info": "b6000-0000000", "is_sleeping": False}

    def _llama_generate(self, body, mode, chat):
        if self.embeddings:               # PR #8420 (2024-07) to 2025 builds
            return self._llama_error(501, LLAMA_NO_COMPLETIONS, "not_supported_error")
        req, refusal = self._llama_parse(body)
        if refusal:
            return refusal
        if chat and not isinstance(req.get("messages"), list):
            return self._llama_error(400, "'messages' is required", "invalid_request_error")
        if not chat and "prompt" not in req:
            return self._llama_error(500, "\"prompt\" is required", "server_error")
        if mode == "engine_dead":
            return self._llama_error(500, LLAMA_LOAD_FAILED, "server_error")
        if mode == "oom":
            return self._llama_error(500, LLAMA_OOM, "server_error")
        if mode == "error_in_200":
            return self._llama_json(200, {"error": {"code": 500, "message": LLAMA_OOM,
                                                    "type": "server_error"}})
        limit = req.get("max_tokens", req.get("n_predict"))
        if _is_int(limit) and limit > 0:
            n, reason = min(limit, 16), "length"
        else:
            n, reason = 3, "stop"                # n_predict -1: until end of generation
        name = req.get("model") if isinstance(req.get("model"), str) else None
        model = name or (self.models[0] if self.models else "gpt-3.5-turbo")
        prompt_tokens = (_messages_tokens(req["messages"]) if chat
                         else _prompt_tokens(req.get("prompt")))
        usage = {"completion_tokens": n, "prompt_tokens": prompt_tokens,
                 "total_tokens": n + prompt_tokens}
        timings = {"prompt_n": prompt_tokens, "prompt_ms": 4.2,
                   "prompt_per_token_ms": 4.2 / prompt_tokens,
                   "prompt_per_second": prompt_tokens / 0.0042, "predicted_n": n,
                   "predicted_ms": 6.4 * n, "predicted_per_token_ms": 6.4,
                   "predicted_per_second": 156.25}
        created = int(time.time())
        rid = "chatcmpl-" + uuid.uuid4().hex
        if chat:
            content = " ".join(["Hello"] * n)
            if req.get("stream"):
                return self._sse(LLAMA_SSE, _llama_dumps, [
                    {"choices": [{"delta": {"content": content}, "finish_reason": reason,
                                  "index": 0}], "created": created, "id": rid,
                     "model": model, "object": "chat.completion.chunk",
                     "system_fingerprint": LLAMACPP_BUILD}])
            return self._llama_json(200, {
                "choices": [{"finish_reason": reason, "index": 0,
                             "message": {"content": content, "role": "assistant"}}],
                "created": created, "id": rid, "model": model, "object": "chat.completion",
                "system_fingerprint": LLAMACPP_BUILD, "timings": timings, "usage": usage})
        if req.get("stream"):
            chunks = [{"choices": [{"finish_reason": reason if i == n - 1 else None,
                                    "index": 0, "logprobs": None, "text": " a"}],
                       "created": created, "id": rid, "model": model,
                       "object": "text_completion", "system_fingerprint": LLAMACPP_BUILD}
                      for i in range(n)]
            return self._sse(LLAMA_SSE, _llama_dumps, chunks)
        return self._llama_json(200, {
            "choices": [{"finish_reason": reason, "index": 0, "logprobs": None,
                         "text": " a" * n}],
            "created": created, "id": rid, "model": model, "object": "text_completion",
            "system_fingerprint": LLAMACPP_BUILD, "timings": timings, "usage": usage})


    # -- llama-cpp-python (python -m llama_cpp.server, observed 0.3.36)

    def _lcp_json(self, status, obj):
        return _Reply(status, _vllm_dumps(obj), VLLM_JSON,
                      [("x-request-id", uuid.uuid4().hex)])

    def _lcp_error(self, status, message):
        """error_message_wrapper: an OpenAI error object, code null."""
        return self._lcp_json(status, {"error": {"message": message,
                                                 "type": "internal_server_error",
                                                 "param": None, "code": None}})

    def _lcp_route(self, method, path, headers, body, mode):
        if self.token is not None and path.startswith("/v1/") \
                and headers.get("authorization") != "Bearer " + self.token:
            return self._lcp_json(401, {"detail": "Invalid API key"})
        methods = _LCP_ROUTES.get(path)
        if methods is None or (mode == "chat_only" and path == "/v1/completions"):
            return self._lcp_json(404, {"detail": "Not Found"})
        if method not in methods or (mode == "completions_405" and path == "/v1/completions"):
            return self._lcp_json(405, {"detail": "Method Not Allowed"})
        if path == "/v1/models":
            names = () if mode == "empty_models" else self.models
            return self._lcp_json(200, {"object": "list", "data": [
                {"id": name, "object": "model", "owned_by": "me", "permissions": []}
                for name in names]})
        text = body.decode("utf-8", "replace")
        try:
            req = json.loads(text)
        except ValueError:                # malformed JSON: a plain-text 500
            return _Reply(500, b"Internal Server Error", "text/plain; charset=utf-8")
        if not isinstance(req, dict):
            req = {}
        field = {"/v1/completions": "prompt", "/v1/chat/completions": "messages",
                 "/v1/embeddings": "input"}.get(path)
        if field is None:                 # /extras/*: not what a preflight sends
            return self._lcp_json(200, {"tokens": [], "count": 0})
        if field not in req and field != "prompt":
            return self._lcp_error(500, "1 validation error:\n  {'type': 'missing', 'loc': "
                                        "('body', '%s'), 'msg': 'Field required', 'input': "
                                        "%r}" % (field, req))
        name = req.get("model") if isinstance(req.get("model"), str) else None
        model = name or (self.models[0] if self.models else "model.gguf")
        if mode in ("engine_dead", "oom"):
            return self._lcp_error(500, LLAMA_OOM)
        created = int(time.time())
        if field == "input":
            if not self.embeddings:
                return self._lcp_error(500, LCP_NO_EMBEDDINGS)
            texts = self._inputs(req["input"])
            tokens = sum(_prompt_tokens(t) for t in texts)
            kind = self.kind_of(None)      # the loaded model answers, whatever the name
            data = [{"object": "embedding", "embedding": [] if mode == "empty_embedding"
                     else self._shape(kind, model + "\0" + t, 64), "index": i}
                    for i, t in enumerate(texts)]
            return self._lcp_json(200, {"object": "list", "data": data, "model": model,
                                        "usage": {"prompt_tokens": tokens,
                                                  "total_tokens": tokens}})
        if mode == "error_in_200":
            return self._lcp_json(200, {"error": {"message": LLAMA_OOM,
                                                  "type": "internal_server_error",
                                                  "param": None, "code": None}})
        limit = req.get("max_tokens")
        n = min(limit, 16) if _is_int(limit) and limit > 0 else 16
        prompt_tokens = (_messages_tokens(req["messages"]) if field == "messages"
                         else _prompt_tokens(req.get("prompt")))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                 "total_tokens": prompt_tokens + n}
        if field == "messages":
            return self._lcp_json(200, {
                "id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion",
                "created": created, "model": model,
                "choices": [{"index": 0, "message": {"content": "n" * n, "role": "assistant"},
                             "logprobs": None, "finish_reason": "length"}], "usage": usage})
        return self._lcp_json(200, {
            "id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": created,
            "model": model, "choices": [{"text": "n" * n, "index": 0, "logprobs": None,
                                         "finish_reason": "length"}], "usage": usage})


# ---------------------------------------------------------------- command line

def main(argv=None):
    parser = cli_parser(
        "openai_emu.py", "Loopback emulator of vLLM / llama-server (for gpu_preflight tests).",
        MODES)
    parser.add_argument("--flavour", default="vllm", choices=FLAVOURS,
                        help="server to emulate (default vllm)")
    parser.add_argument("--port", type=int, default=None,
                        help="TCP port (default 8000 vllm, 8080 llamacpp; 0: any free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--mode", default="healthy", choices=MODE_NAMES, metavar="MODE",
                        help="behaviour, see below (default healthy)")
    parser.add_argument("--model", action="append", metavar="NAME[=KIND]",
                        help="a served model name, KIND generate (default) or embed "
                        "(repeatable; default qwen2.5-0.5b)")
    parser.add_argument("--embeddings", action="store_true",
                        help="llamacpp: started with --embeddings; llama-cpp-python: "
                        "with --embedding true")
    parser.add_argument("--wrong-kind", default="200-nested", choices=WRONG_KIND,
                        help="vllm: how a request of the wrong kind is answered "
                        "(default 200-nested)")
    parser.add_argument("--embedding-shape", default=None, choices=("flat", "nested"),
                        help="force one vector or one per token in data[].embedding")
    parser.add_argument("--load-seconds", type=float, default=5.0, metavar="S",
                        help="length of the loading phase of mode loading (default 5)")
    parser.add_argument("--router-max", type=int, default=None, metavar="N",
                        help="llamacpp: router mode with --models-max N (0: unlimited)")
    parser.add_argument("--token", default=None, metavar="KEY",
                        help="require Authorization: Bearer KEY (as --api-key does)")
    parser.add_argument("--fault-on", default="all", metavar="PATH",
                        help="apply the mode only to this path (default all)")
    args = parser.parse_args(argv)
    port = DEFAULT_PORTS[args.flavour] if args.port is None else args.port
    try:
        emu = OpenAIEmulator(flavour=args.flavour, mode=args.mode,
                             models=tuple(args.model or ("qwen2.5-0.5b",)),
                             load_seconds=args.load_seconds, token=args.token,
                             host=args.host, port=port, fault_on=args.fault_on,
                             embeddings=args.embeddings, wrong_kind=args.wrong_kind,
                             embedding_shape=args.embedding_shape,
                             router_max=args.router_max)
    except ValueError as exc:
        parser.error(str(exc))
    details = "flavour=%s mode=%s models=%s token=%s" % (
        emu.flavour, emu.mode,
        ",".join("%s(%s)" % (m, emu.kinds[m]) for m in emu.models) or "none",
        "set" if emu.token is not None else "none")
    return serve_until_signalled(emu, "openai emulator", "cannot bind", details)


if __name__ == "__main__":
    sys.exit(main())
