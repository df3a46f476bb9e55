"""Unit tests of gpu_preflight's pure parts, imported in-process."""

import json
import os
import re
import shutil
import subprocess
import tempfile
import unittest
from unittest import mock

import ollama_emu
import support

gp = support.load_script()


class OllamaHostTest(unittest.TestCase):
    """OLLAMA_HOST as Ollama parses it: the whole table of ollama-api.md 9."""

    TABLE = [
        ("", "http://127.0.0.1:11434"),
        ("1.2.3.4", "http://1.2.3.4:11434"),
        (":1234", "http://:1234"),
        ("example.com:1234", "http://example.com:1234"),
        (":66000", "http://:11434"),
        (":-1", "http://:11434"),
        ("[::1]", "http://[::1]:11434"),
        ("::1", "http://[::1]:11434"),
        ("[::]", "http://[::]:11434"),
        ("[::1]:1337", "http://[::1]:1337"),
        (' "1.2.3.4" ', "http://1.2.3.4:11434"),
        ("'1.2.3.4'", "http://1.2.3.4:11434"),
        ("http://1.2.3.4", "http://1.2.3.4:80"),
        ("https://1.2.3.4", "https://1.2.3.4:443"),
        ("https://example.com/ollama", "https://example.com:443/ollama"),
        ("ollama.com", "https://ollama.com:443"),
        ("http://gpu1:11434/", "http://gpu1:11434"),
        ("gpu1", "http://gpu1:11434"),
    ]

    def test_table(self):
        for value, want in self.TABLE:
            with self.subTest(value=value):
                self.assertEqual(gp.parse_ollama_host(value)[0], want)

    def test_bad_port_warns_and_falls_back(self):
        url, warning = gp.parse_ollama_host(":66000")
        self.assertEqual(url, "http://:11434")
        self.assertIn("66000", warning)
        self.assertIsNone(gp.parse_ollama_host("h:1")[1])

    def test_host_flag_rejects_what_ollama_would_paper_over(self):
        self.assertEqual(gp.host_url("gpu1:8080/"), "http://gpu1:8080")
        with self.assertRaises(ValueError):
            gp.host_url("gpu1:99999")
        for bad in ("ftp://gpu1", "a b", "http://[::1", "user@gpu1:1", "gpu1/?x=1"):
            with self.assertRaises(ValueError, msg=bad):
                gp.host_url(bad)

    def test_loopback_detection(self):
        for host in ("127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]",
                     "0.0.0.0", "", "x.localhost"):
            self.assertTrue(gp.is_loopback(host), host)
        for host in ("10.0.0.1", "gpu1", "example.com", "128.0.0.1"):
            self.assertFalse(gp.is_loopback(host), host)


class MissingHintTest(unittest.TestCase):
    def test_a_typo_is_compared_with_a_bounded_number_of_names(self):
        """A server may list 80,000 names (comparing with each cost 2 s of CPU
        inside the tags stage, turning a 78 into a time-out): a missing name is
        compared with at most MAX_HINTED listed names within 3 characters of its
        length, so a close name past them is not found."""
        others = ["x%06d:latest" % i for i in range(gp.MAX_HINTED)]   # none close
        for missing, listed, hint in (
                (["lama3.2"], ["llama3.2:latest", "qwen3:latest"],
                 " (did you mean llama3.2?)"),
                (["lama3.2"], ["llama3.2:latest"] + others, " (did you mean llama3.2?)"),
                (["lama3.2"], others + ["llama3.2:latest"], " (ollama pull lama3.2)"),
                (["lama3.2"], ["a-much-longer-name:latest"] * 10 ** 4 + ["llama3.2:latest"],
                 " (did you mean llama3.2?)"),
                (["mistral"], ["qwen3:latest"], " (ollama pull mistral)"),
                (["lama3.2", "mistral", "qwen"], ["llama3.2:latest", "qwen3:latest"],
                 " (did you mean llama3.2 / qwen3?; ollama pull mistral)")):
            with self.subTest(missing=missing, listed=len(listed)):
                self.assertEqual(gp.missing_hint(missing, listed, True), hint)

    def test_no_pull_hint_where_the_api_has_no_pull(self):
        """Under --api openai there is no `ollama pull`: only the typo is said."""
        for missing, hint in ((["mistral"], ""),
                              (["lama3.2", "mistral"], " (did you mean llama3.2?)")):
            with self.subTest(missing=missing):
                self.assertEqual(gp.missing_hint(missing, ["llama3.2:latest"], False), hint)


class ModelNameTest(unittest.TestCase):
    def test_latest_is_implied(self):
        self.assertEqual(gp.normalise_model("llama3.2"), "llama3.2:latest")
        self.assertEqual(gp.normalise_model("user/m"), "user/m:latest")
        self.assertEqual(gp.normalise_model("qwen3:8b"), "qwen3:8b")
        self.assertEqual(gp.normalise_model("registry.ollama.ai/library/llama3.2"),
                         "llama3.2:latest")
        self.assertEqual(gp.normalise_model("myreg:5000/ns/m"), "myreg:5000/ns/m:latest")

    def test_same_model(self):
        self.assertTrue(gp.same_model("llama3.2", "llama3.2:latest"))
        self.assertTrue(gp.same_model("Llama3.2:Latest", "llama3.2"))
        self.assertFalse(gp.same_model("llama3.2:1b", "llama3.2"))
        self.assertFalse(gp.same_model("llama3", "llama3.2"))

    def test_cloud_models_as_ollama_tells_them(self):
        """remote_host in the /api/tags entry, or a reference Ollama sends to
        ollama.com (internal/modelref parseSourceSuffix: after the last colon)."""
        for name, entry, cloud in (
                ("gpt-oss:120b-cloud", {}, True), ("gpt-oss:20b:cloud", {}, True),
                ("kimi-k2:1t-CLOUD", {}, True), ("minimax-m2:cloud", {}, True),
                ("mine:latest", {"remote_host": "https://ollama.com:443"}, True),
                ("mine:latest", {"remote_host": ""}, False), ("qwen3:8b", {}, False),
                ("soundcloud", {}, False), ("x-cloud", {}, False),
                ("reg:5000/team/m-cloud", {}, False), ("m:a/b-cloud", {}, False)):
            with self.subTest(name=name, entry=entry):
                self.assertIs(gp.is_cloud(name, entry), cloud)


class RouterStateTest(unittest.TestCase):
    def test_only_a_status_object_with_a_string_value_says_a_load_state(self):
        """llama-server's router lists each model with status {"value": "loaded",
        "args": [...], ...} (multi-model.md B6); any other status, or none, says
        nothing (None) and raises nothing."""
        cases = [({"value": "loaded", "args": []}, "loaded"),
                 ({"value": "unloaded"}, "unloaded"), ("loaded", None), (1, None),
                 (0, None), (True, None), (["loaded"], None), (None, None), ({}, None),
                 ({"value": 7}, None), ({"value": ["loaded"]}, None)]
        for status, state in cases:
            with self.subTest(status=status):
                self.assertEqual(gp.router_state({"id": "m", "status": status}), state)
        self.assertIsNone(gp.router_state({"id": "m"}))


class ValueParserTest(unittest.TestCase):
    def test_keep_alive_forms_ollama_accepts(self):
        self.assertEqual(gp.parse_keep_alive("-1"), -1)
        self.assertIsInstance(gp.parse_keep_alive("-1"), int)
        self.assertEqual(gp.parse_keep_alive("600"), 600)
        self.assertEqual(gp.parse_keep_alive("1.5"), 1.5)
        self.assertEqual(gp.parse_keep_alive("10m"), "10m")
        self.assertEqual(gp.parse_keep_alive("1h30m"), "1h30m")
        self.assertEqual(gp.parse_keep_alive("-1m"), "-1m")
        for bad in ("abc", "10 m", "m", "", "10x"):
            with self.assertRaises(ValueError):
                gp.parse_keep_alive(bad)

    def test_ollama_option(self):
        self.assertEqual(gp.parse_ollama_option("num_ctx=8192"), ("num_ctx", 8192))
        self.assertEqual(gp.parse_ollama_option("use_mmap=false"), ("use_mmap", False))
        self.assertEqual(gp.parse_ollama_option("stop=[\"a\"]"), ("stop", ["a"]))
        self.assertEqual(gp.parse_ollama_option("name=abc"), ("name", "abc"))
        for bad in ("num_ctx", "=1", "Num-Ctx=1", "num_predict=5"):
            with self.assertRaises(ValueError):
                gp.parse_ollama_option(bad)

    def test_seconds_and_choices(self):
        self.assertEqual(gp.parse_seconds("2.5"), 2.5)
        for bad in ("0", "-1", "x", "nan", "inf"):
            with self.assertRaises(ValueError):
                gp.parse_seconds(bad)
        self.assertEqual(gp.parse_choice("token", "load", "off")("load"), "load")
        with self.assertRaises(ValueError):
            gp.parse_choice("token", "load", "off")("full")
        self.assertEqual(gp.parse_facility("local3"), 19)
        self.assertEqual(gp.parse_facility("USER"), 1)
        with self.assertRaises(ValueError):
            gp.parse_facility("local9")

    def test_syslog_address(self):
        self.assertEqual(gp.parse_syslog_address("/dev/log"), "/dev/log")
        self.assertEqual(gp.parse_syslog_address("logs.example:514"),
                         ("logs.example", 514))
        self.assertEqual(gp.parse_syslog_address("[::1]:5514"), ("::1", 5514))
        for bad in ("logs.example", "host:0", "host:x", ":514"):
            with self.assertRaises(ValueError):
                gp.parse_syslog_address(bad)

    def test_bool(self):
        self.assertTrue(gp.parse_bool("Yes"))
        self.assertFalse(gp.parse_bool("0"))
        with self.assertRaises(ValueError):
            gp.parse_bool("maybe")


class GenerateAnswerTest(unittest.TestCase):
    def test_single_object(self):
        final, error = gp.parse_generate(b'{"response":"x","done":true}')
        self.assertTrue(final["done"])
        self.assertIsNone(error)

    def test_ndjson_stream_and_error_line(self):
        stream = b'{"response":"a","done":false}\n{"response":"","done":true}\n'
        self.assertTrue(gp.parse_generate(stream)[0]["done"])
        broken = b'{"response":"a","done":false}\n{"error":"CUDA error: boom"}\n'
        self.assertEqual(gp.parse_generate(broken)[1], "CUDA error: boom")

    def test_openai_style_error_and_garbage(self):
        body = b'{"error":{"message":"Loading model","code":503}}'
        self.assertEqual(gp.parse_generate(body)[1], "Loading model")
        for bad in (b"<html>", b'{"done":tr', b"[1,2]", b""):
            with self.assertRaises(ValueError):
                gp.parse_generate(bad)


class ClassifyTest(unittest.TestCase):
    """Every error string of ollama-api.md section 8, and the HTTP answers."""

    RUNNER = [
        ("model requires more system memory (5.0 GiB) than is available (3.9 GiB)", 75),
        ("llama runner process has terminated: error loading model: unable to "
         "allocate CUDA0 buffer", 75),
        ("llama runner process has terminated: error loading model: unable to "
         "allocate backend buffer", 75),
        ("llama runner process has terminated: CUDA error: out of memory", 75),
        ("llama-server process has terminated: cudaMalloc failed: out of memory", 75),
        ("llama runner process has terminated: exit status 2", 69),
        ("llama runner process has terminated: exit status 0xc0000409", 69),
        ("model runner has unexpectedly stopped, this may be due to resource "
         "limitations or an internal error, check ollama server logs for details", 69),
        ('POST predict: Post "http://127.0.0.1:39149/completion": EOF', 69),
        ("an error was encountered while running the model: CUDA error: an "
         "illegal memory access was encountered", 69),
        ("llama runner process no longer running: 1 error", 69),
        ("server not responding", 69),
        ("timed out waiting for llama runner to start - progress 0.00 - ", 75),
        ("timed out waiting for llama-server to start - loading", 75),
        ("unable to load full model on GPU", 69),
        ('model "llama3.2" not found, try pulling it first', 78),
        ("model 'x' not found", 78),
        ('option "num_predict" must be of type integer', 78),
        ("server busy, please try again.  maximum pending requests exceeded", 75),
        ('"bert" does not support generate', 78),
        ("unexpected server status: llm busy - no slots available", 69),
        ("llama runner process has terminated: error loading model: key not "
         "found in model: llama.context_length", 69),
        ("llama runner process has terminated: GGML_ASSERT: this model does not "
         "support flash attention", 69),
        ('registry.ollama.ai/library/test:latest does not support insert', 78),
        ('"qwen3" does not support thinking', 78),
    ]

    def test_runner_errors(self):
        for message, code in self.RUNNER:
            with self.subTest(message=message):
                self.assertEqual(gp.classify_runner_error(message), code)

    def test_http_answers(self):
        gen, tags = "POST /api/generate", "GET /api/tags"
        cases = [
            (tags, 404, b"404 page not found", 78, "not an Ollama server"),
            (tags, 405, b"405 method not allowed", 78, "not an Ollama server"),
            (tags, 403, b"", 78, "host guard"),
            (tags, 500, b'{"error":"model list cache unavailable"}', 69, "HTTP 500"),
            (tags, 503, b'{"error":{"message":"Loading model","code":503}}', 75,
             "Loading model"),
            (gen, 404, b'{"error":"model \'x\' not found"}', 78, "not found"),
            (gen, 400, b'{"error":"time: missing unit in duration \\"10\\""}', 78,
             "missing unit"),
            (gen, 503, b'{"error":"server busy, please try again.  maximum pending '
             b'requests exceeded"}', 75, "server busy"),
            (gen, 500, b'{"error":"llama runner process has terminated: CUDA error: '
             b'out of memory"}', 75, "out of memory"),
            (gen, 500, b'{"error":"llama runner process has terminated: exit '
             b'status 2"}', 69, "exit status 2"),
            (gen, 401, b'{"detail":"Invalid API key"}', 78, "authentication"),
            (gen, 403, b'{"error":"ollama cloud is disabled: remote model is unavailable"}',
             78, "OLLAMA_NO_CLOUD"),
            (gen, 401, b'{"error":"unauthorized","signin_url":"https://ollama.com/connect'
             b'?name=h&key=c3No"}', 78, "run ollama signin on the server's host (it "
             "prints the link, https://ollama.com/connect?...)"),
            (gen, 401, b'{"error":"unauthorized"}', 78, "401 authentication required"),
            (gen, 403, b'{"error":"forbidden"}', 78, "host guard"),
        ]
        for what, status, body, code, text in cases:
            with self.subTest(status=status, body=body):
                got_code, reason = gp.classify_answer(what, status, body)
                self.assertEqual(got_code, code)
                self.assertIn(text, reason)

    def test_a_sign_in_link_and_a_gateways_401(self):
        """A sign-in link without a query is shown whole (no "?..."); under --api
        openai a 401 with a signin_url is a gateway refusing the token, not
        "run ollama signin"."""
        gen, bare = "POST /api/generate", b'{"error":"unauthorized","signin_url":' \
            b'"https://ollama.com/connect"}'
        code, reason = gp.classify_answer(gen, 401, bare)
        self.assertEqual(code, 78)
        self.assertIn("(it prints the link, https://ollama.com/connect)", reason)
        code, reason = gp.classify_answer("POST /v1/chat/completions", 401, bare, "openai")
        self.assertEqual(code, 78)
        self.assertIn("refuses the credentials", reason)
        self.assertNotIn("ollama signin", reason)


class HealthJudgeTest(unittest.TestCase):
    """A 503 at the health path: 69 only for a vLLM still answering an empty 503."""

    class Client(object):
        def __init__(self, version, again):
            self.answers = {"/version": version, "/health": again}

        def call(self, method, path, budget):
            answer = self.answers[path]
            if isinstance(answer, Exception):
                raise answer
            return answer

        def json(self, method, path, budget):
            return self.call(method, path, budget)

    def test_a_503_is_not_ready_unless_vllm_answers_it_twice(self):
        empty = gp.Fail(75, "503", status=503, detail="")
        missing = gp.Fail(78, "404", status=404, detail="Not Found")
        cases = [  # (first detail, /version, second /health, code)
            ("", {"version": "0.9.2"}, empty, 69),
            ("", {"version": "0.9.2"}, b"", 75),            # it came back
            ("", {"version": "0.9.2"}, gp.TimedOut(), 75),
            ("", {"version": 1}, empty, 75),
            ("", {}, empty, 75),
            ("", missing, empty, 75),                       # SGLang: no /version
            ("", gp.TimedOut(), empty, 75),
            ("Loading model", {"version": "0.9.2"}, empty, 75),
        ]
        for detail, version, again, code in cases:
            with self.subTest(detail=detail, version=version, again=again):
                first = gp.Fail(75, "503", status=503, detail=detail)
                got, reason = gp.health_503(self.Client(version, again), "/health",
                                            first, lambda: 1.0)
                self.assertEqual(got, code, reason)
                self.assertIn("the engine is dead" if code == 69 else "not ready", reason)

    def test_health_path_values(self):
        for good in ("/health", "/health/readiness", "/ping", "none", "/"):
            self.assertEqual(gp.parse_health_path(good), good)
        for bad in ("", "health", "None", "/a b", "/health\n", "/a\tb", "/a\x7f", "/\u00e9",
                    "/" + "x" * 200, "http://h/health"):
            with self.subTest(bad=bad):
                self.assertRaises(ValueError, gp.parse_health_path, bad)

    def test_an_empty_503_alone_is_temporary(self):
        code, reason = gp.classify_answer("GET /health", 503, b"", "openai")
        self.assertEqual(code, 75, reason)


class ContextJudgeTest(unittest.TestCase):
    """The judges of the context window and of a warm-up that reloaded a runner."""

    def test_reload_names_num_ctx_only_where_the_numbers_show_it(self):
        for loaded, sent, named in ((32768, 2048, "num_ctx 2048 differs from the loaded "
                                     "runner's 32768"), (32768, 32768, "runner options"),
                                    (None, 2048, "runner options"),
                                    (None, None, "runner options"),
                                    (4096, None, "runner options")):
            with self.subTest(loaded=loaded, sent=sent):
                text = gp.reload_problem("qwen3:latest", 12.34, loaded, sent)
                self.assertIn("warm-up reloaded qwen3:latest (load_duration 12.3s)", text)
                self.assertIn(named, text)
                self.assertIn("--ollama-option", text)

    def test_runner_options_send_the_loaded_context_unless_the_job_names_one(self):
        opts = gp.argparse.Namespace(ollama_option={"num_gpu": 99})
        for loaded, ctx, given, sent in ((True, 32768, {}, 32768), (False, 32768, {}, None),
                                         (True, None, {}, None), (None, 32768, {}, None),
                                         (True, 32768, {"num_ctx": 2048}, 2048)):
            with self.subTest(loaded=loaded, ctx=ctx, given=given):
                opts.ollama_option = dict(given, num_gpu=99)
                model = gp.Model("m", {})
                model.was_loaded, model.context_length = loaded, ctx
                options = gp.runner_options(opts, model)
                self.assertEqual((options.get("num_ctx"), options["num_gpu"]), (sent, 99))

    def test_read_context_takes_a_count_up_to_the_bound_and_notes_the_rest(self):
        for value, ctx, noted in ((None, None, False), (0, None, False), (8192, 8192, False),
                                  (2 ** 24, 2 ** 24, False), (2 ** 24 + 1, None, True),
                                  (2 ** 63 - 1, None, True), (-1, None, True),
                                  ("8192", None, True), (4096.0, None, True),
                                  (True, None, True), ([8192], None, True)):
            with self.subTest(value=value):
                run, model = gp.argparse.Namespace(problems=[]), gp.Model("m", {})
                gp.read_context(run, model, {"n_ctx": value}, "n_ctx", "GET /props")
                self.assertEqual(model.context_length, ctx)
                self.assertEqual(run.problems, [model.context_bad] if noted else [])
                if noted:
                    self.assertIn("GET /props: n_ctx of m is ", model.context_bad)

    def test_min_context_fails_under_n_and_notes_what_is_not_reported(self):
        def judge(least, contexts, api="ollama", kinds=(), loaded=()):
            models = [gp.Model("m%d" % i, {}) for i in range(len(contexts))]
            for model, c, kind, was in zip(models, contexts, list(kinds) + [None] * 9,
                                           list(loaded) + [None] * 9):
                model.context_length, model.kind, model.was_loaded = c, kind, was
            run = gp.argparse.Namespace(opts=gp.argparse.Namespace(min_context=least),
                                        api=api, problems=[], models=models)
            try:
                gp.check_context(run)
            except gp.Fail as exc:
                return exc.code, exc.reason, run.problems
            return 0, "", run.problems
        self.assertEqual(judge(None, [4096]), (0, "", []))
        self.assertEqual(judge(4096, [4096, 8192]), (0, "", []))
        code, reason, problems = judge(8192, [4096, None, 8192])
        self.assertEqual((code, problems), (78, ["context not checked: the server does "
                                                 "not report the context window of m1"]))
        self.assertIn("m0 runs with a 4096-token context, the job needs 8192", reason)
        self.assertNotIn("m2", reason)
        self.assertIn("OLLAMA_CONTEXT_LENGTH=8192", reason)
        self.assertIn("--max-model-len 8192", judge(8192, [4096], "openai")[1])
        self.assertEqual(judge(8192, [8192, 2048, None], kinds=("generate", "embed", "embed")),
                         (0, "", []))
        self.assertEqual(judge(8192, [None, None], loaded=(False, True))[2], [
            "context not checked: m0 not loaded, so no context is known yet",
            "context not checked: the server does not report the context window of m1"])


class GpuParseTest(unittest.TestCase):
    """nvidia-smi CSV, GPU selection and the GPU verdict (pure functions)."""

    CSV = ("0, GPU-aaaa, NVIDIA H200, 00000000:61:00.0, 143771, 0, 143229, [N/A], 29\n"
           "Unable to determine the device handle for GPU 00000000:62:00.0: GPU is lost. "
           "Reboot the system to recover this GPU\n"
           "2, GPU-cccc, NVIDIA H200, 00000000:63:00.0, 143771, 102400, 40829, 97, "
           "[Not Supported]\n"
           "Failed to initialize NVML: Unknown Error\n")

    def opts(self, **kw):
        values = dict(min_free_mib=None, max_util=None, max_procs=None, max_temp=None,
                      strict_gpu=False, gpu_need="all")
        values.update(kw)
        return type("Opts", (), values)

    def test_smi_csv_keeps_unknown_apart_from_zero(self):
        gpus, lost = gp.parse_smi_csv(self.CSV)
        self.assertEqual([(g.index, g.uuid, g.free_mib, g.util_pct, g.temp_c)
                          for g in gpus],
                         [(0, "GPU-aaaa", 143229, None, 29), (2, "GPU-cccc", 40829, 97, None)])
        self.assertEqual(lost, [(None, "00000000:62:00.0",
                                 "GPU is lost. Reboot the system to recover this GPU")])
        gpus, lost = gp.parse_smi_csv(
            "Unable to determine the device handle for GPU1: 0000:62:00.0: GPU is lost.  "
            "Reboot the system to recover this GPU\n")
        self.assertEqual(lost, [(1, "0000:62:00.0", "GPU is lost.  Reboot the system to "
                                 "recover this GPU")])

    def test_gpu_record_crosses_json_as_a_probe_child_sends_it(self):
        """A Gpu record through JSON (a forked probe's output) comes back with
        the same fields; a key it has no field for is dropped, and a field the
        GPU stage never set (selected) stays absent."""
        gpu = gp.Gpu(1, "GPU-b", "x", total=143771, free=900, util=3, procs=1, temp=30,
                     pci="00000000:62:00.0")
        gpu.parent, gpu.fit = "GPU-a", False
        text = json.dumps({"gpus": [gpu]}, default=gp.Gpu.as_dict)
        self.assertEqual(json.loads(text), {"gpus": [gpu.as_dict()]})
        back = gp.Gpu.from_dict(dict(json.loads(text)["gpus"][0], surplus=1))
        self.assertEqual(back.as_dict(), gpu.as_dict())
        self.assertEqual(back, gpu)
        self.assertNotIn("surplus", back.as_dict())
        self.assertFalse(hasattr(back, "selected"))
        self.assertEqual(sorted(gp.Gpu(0, None, None).as_dict()), sorted(
            ("index", "uuid", "name", "pci", "total_mib", "free_mib", "util_pct", "procs",
             "proc_mib", "runner_mib", "temp_c", "mig", "parent", "access", "error",
             "health", "fabric", "pending")))

    def test_smi_apps_counts_per_uuid_and_empty_output(self):
        self.assertEqual(gp.parse_smi_apps("GPU-a, 1\nGPU-a, 2\nGPU-b, 3\n"),
                         {"GPU-a": 2, "GPU-b": 1})
        self.assertEqual(gp.parse_smi_apps(""), {})

    def test_gpu_ids_and_stub_path(self):
        self.assertEqual(gp.parse_gpu_ids("0, GPU-8f3a,MIG-12"), ["0", "GPU-8f3a", "MIG-12"])
        for bad in ("", "gpu0", "0;1", "-1"):
            with self.assertRaises(ValueError):
                gp.parse_gpu_ids(bad)
        for bad in ("/usr/local/cuda/lib64/stubs/libnvidia-ml.so", "libnvidia-ml.so.1",
                    "./libnvidia-ml.so.1", "lib/libnvidia-ml.so.1"):   # dlopen searches
            with self.assertRaises(ValueError):
                gp.parse_nvml_lib(bad)
        self.assertEqual(gp.parse_nvml_lib("/opt/l.so"), "/opt/l.so")

    def test_selection(self):
        gpus = [gp.Gpu(i, "GPU-" + c, "x") for i, c in enumerate("abc")]
        gpus.append(gp.Gpu(2, "MIG-1234", "slice"))
        gpus[3].parent = gpus[2].uuid
        gpus.append(gp.Gpu(3, None, None, error="Insufficient Permissions"))
        gpus[4].access = False
        pick = lambda ids, env=None: [g.uuid for g in gp.select_gpus(gpus, ids, env or {})[0]]
        self.assertEqual(pick(["2", "GPU-a"]), ["GPU-a", "GPU-c"])
        self.assertEqual(pick(["MIG-12"]), ["MIG-1234"])
        self.assertEqual(pick(["MIG-GPU-b/1/0"]), ["GPU-b"])
        self.assertEqual(pick(None), ["GPU-a", "GPU-b", "GPU-c"])
        self.assertEqual(gp.select_gpus(gpus, None, {})[2],
                         ["GPU 3: Insufficient Permissions, not checked"])
        self.assertEqual(pick(None, {"CUDA_VISIBLE_DEVICES": "GPU-b"}), ["GPU-b"])
        self.assertEqual(pick(None, {"NVIDIA_VISIBLE_DEVICES": "all"}), ["GPU-a", "GPU-b", "GPU-c"])
        selected, unmatched, notes = gp.select_gpus(gpus, None, {"CUDA_VISIBLE_DEVICES": "1"})
        self.assertEqual((len(selected), unmatched), (3, []))
        self.assertIn("need not be NVML's order", notes[0])
        self.assertEqual(gp.select_gpus(gpus, None, {"CUDA_VISIBLE_DEVICES": "1",
                                                     "NVIDIA_VISIBLE_DEVICES": "GPU-a"})[2], [])
        self.assertEqual(gp.select_gpus(gpus, ["7", "0"], {})[1], ["7"])

    def test_too_few_gpus_counts_whole_gpus_only(self):
        gpus = [gp.Gpu(i, "GPU-%d" % i, "x") for i in range(3)]
        gpus[2].parent = "GPU-1"        # a MIG device is no GPU of its own
        for expected, reason in ((None, None), (1, None), (2, None),
                                 (3, "2 of 3 GPUs visible (--expect-gpus)")):
            self.assertEqual(gp.too_few_gpus(gpus, expected), reason, expected)

    def test_pci_address_reads_every_backends_spelling(self):
        for text, address in (("00000000:3B:00.0", (0, 0x3b, 0, 0)),   # NVML, nvidia-smi
                              ("0000:3b:00.0", (0, 0x3b, 0, 0)),       # sysfs, lost GPUs
                              ("0001:C1:1f.1", (1, 0xc1, 0x1f, 1)),
                              ("00010000:3b:00.0", (0x10000, 0x3b, 0, 0)),
                              ("[N/A]", None), ("", None), (None, None),
                              ("0000:3b:00.0\n", None), ("0000:3b:00.8", None),
                              ("000000000:3b:00.0", None), ("3b:00.0", None)):
            self.assertEqual(gp.pci_address(text), address, text)

    def test_unseen_gpus_names_sysfs_addresses_the_driver_lacks(self):
        def gpus(*buses):
            return [gp.Gpu(i, "GPU-%d" % i, "x", pci=bus) for i, bus in enumerate(buses)]
        sysfs = ["0000:%02x:00.0" % bus for bus in range(0x61, 0x69)]
        seven = gpus(*["00000000:%02X:00.0" % bus for bus in range(0x61, 0x68)])
        mig = gp.Gpu(0, "MIG-a", "slice")
        mig.parent = "GPU-0"           # no bus id of its own, and no GPU
        lost = gpus(*["00000000:%02X:00.0" % bus for bus in range(0x61, 0x67)] + [None])
        for name, found, present, backend, want in (
                ("one missing", seven, sysfs, "nvml", "; not seen by NVML: 0000:68:00.0"),
                ("a MIG device", seven + [mig], sysfs, "nvml",
                 "; not seen by NVML: 0000:68:00.0"),
                ("smi", seven, sysfs, "nvidia-smi", "; not seen by nvidia-smi: 0000:68:00.0"),
                ("sysfs agrees", seven, sysfs[:7], "nvml", ""),
                ("sysfs unreadable", seven, [], "nvml", ""),
                ("a GPU without a bus id", lost, sysfs, "nvml", ""),
                ("AMD", gpus(None), sysfs, "amd-sysfs", ""),
                ("junk in sysfs", seven, ["0000:68:00.0", "junk", "0000:68:00.0"], "nvml",
                 "; not seen by NVML: 0000:68:00.0"),
                ("capped", gpus("0000:01:00.0"), sysfs + ["0001:00:00.0", "0002:00:00.0"],
                 "nvml", "; not seen by NVML: 0000:61:00.0, 0000:62:00.0, 0000:63:00.0, "
                 "0000:64:00.0, 0000:65:00.0, 0000:66:00.0, 0000:67:00.0, 0000:68:00.0 "
                 "and 2 more")):
            self.assertEqual(gp.unseen_gpus(found, present, backend), want, name)

    def test_verdict_need_all_and_any(self):
        free = gp.Gpu(0, "GPU-a", "x", free=900, util=0, procs=0, temp=30)
        busy = gp.Gpu(1, "GPU-b", "x", free=10, util=99, procs=2, temp=30)
        lost = gp.Gpu(2, None, "x", error="GPU is lost")
        mig = gp.Gpu(3, "GPU-d", "x", free=900, util=None)
        mig.mig = True
        judge = lambda gpus, **kw: gp.judge_gpus(gpus, self.opts(**kw))[:2]
        self.assertEqual(judge([free, busy], max_util=50)[0], 75)
        self.assertEqual(judge([free, busy], max_util=50, gpu_need="any")[0], 0)
        self.assertEqual(judge([free, lost])[0], 69)
        self.assertEqual(judge([free, lost], gpu_need="any")[0], 0)
        self.assertEqual(judge([busy, lost], max_util=50, gpu_need="any")[0], 75)
        self.assertEqual(judge([lost], gpu_need="any")[0], 69)
        code, reason, notes = gp.judge_gpus([mig], self.opts(max_util=50))
        self.assertEqual((code, notes), (0, ["GPU 3 (GPU-d): util_pct unknown (MIG)"]))
        self.assertEqual(judge([mig], max_util=50, strict_gpu=True),
                         (75, "GPU 3 (GPU-d): util_pct unknown (MIG) (--strict-gpu)"))
        self.assertEqual(judge([busy], min_free_mib=100)[1],
                         "GPU 1 (GPU-b): 10 MiB free, limit 100 (--min-free-mib)")

    def test_figure_is_a_whole_number_or_none_never_an_error(self):
        for text, want in (("143771", 143771), ("97.6", 97), ("-3.7", -3), ("[N/A]", None),
                           ("[Not Supported]", None), ("", None), ("1e5", None),
                           ("9" * 16, None), ("9" * 400, None), ("-" + "9" * 400, None),
                           ("-" + "1" * 20, -11111111111111110656)):
            self.assertEqual(gp.figure(text), want, text[:30])

    def test_nvml_health_judges_the_figures_without_a_library(self):
        # (rows pending, rows failed, pages pending, uncorrected ECC); None: unsupported
        self.assertIsNone(gp.nvml_health(None, None, None, None))
        self.assertIsNone(gp.nvml_health(0, 0, 0, 0))
        self.assertIn("row remapping failed", gp.nvml_health(1, 2, 1, 7))   # worst first
        self.assertIn("row remapping pending", gp.nvml_health(3, 0, 1, 7))
        self.assertIn("retired pages pending", gp.nvml_health(None, None, 1, 7))
        self.assertEqual(gp.nvml_health(0, 0, 0, 7), "7 uncorrectable ECC errors since "
                         "the driver loaded: the GPU needs a reset")
        # a GPU with a health problem is unfit whatever its figures, and not busy but broken
        sick = gp.Gpu(0, "GPU-a", "x", free=900, util=0, procs=0, temp=30)
        sick.health = gp.nvml_health(0, 0, 1, 0)
        self.assertEqual(gp.judge_gpus([sick], self.opts())[:2],
                         (69, "GPU 0 (GPU-a): retired pages pending: the GPU needs a reset"))

    def test_driver_health_reads_the_recovery_action_and_fabric_state(self):
        # (recovery action, fabric state, fabric error, index)
        #     -> (action asked, fabric failed, fabric pending)
        fabric = "NVLink fabric registration %s: the fabric manager has not finished " \
                 "(systemctl status nvidia-fabricmanager)"
        failed = ("NVLink fabric registration failed: Unknown Error (NVML error 999) "
                  "(journalctl -u nvidia-fabricmanager)")
        reboot = "the driver's recovery action: node reboot required"
        for args, want in (
                ((None, None, None, 0), (None, None, None)),    # an older driver: no word
                ((0, 3, None, 0), (None, None, None)),          # NONE, registered
                ((0, 0, None, 0), (None, None, None)),          # no NVSwitch fabric
                ((1, None, None, 3), ("the driver's recovery action: GPU reset required "
                                      "(nvidia-smi -r -i 3)", None, None)),
                ((2, None, None, 0), (reboot, None, None)),
                ((4, None, None, 1), ("the driver's recovery action: drain the GPU's work "
                                      "and reset it (nvidia-smi -r -i 1)", None, None)),
                ((7, None, None, 0), ("the driver's recovery action: system reboot "
                                      "required", None, None)),
                ((12, None, None, 0), ("the driver's recovery action: 12 (see nvml.h)",
                                       None, None)),
                ((0, 1, None, 0), (None, None, fabric % "not started")),
                ((0, 2, None, 0), (None, None, fabric % "in progress")),
                ((0, 3, "Unknown Error (NVML error 999)", 0), (None, failed, None)),
                ((2, 3, "Unknown Error (NVML error 999)", 0), (reboot, failed, None)),
                ((2, 2, None, 0), (reboot, None, fabric % "in progress"))):
            with self.subTest(args=args):
                self.assertEqual(gp.driver_health(*args), want)
        # where CUDA starts on every GPU, a failed registration is a problem note
        gpu = gp.Gpu(0, "GPU-a", "x")
        gpu.fabric = failed
        self.assertEqual(gp.fabric_doubts([gpu, gp.Gpu(1, "GPU-b", "x")]), [
            "GPU 0 (GPU-a): %s, but CUDA starts on every GPU: only NVLink between GPUs "
            "may be down" % failed])
        self.assertIsNone(gpu.fabric)
        # pending is a reason to wait (75), not a broken GPU; hard outranks it
        waiting = gp.Gpu(0, "GPU-a", "x", free=900, util=0, procs=0, temp=30)
        waiting.pending = fabric % "in progress"
        self.assertEqual(gp.judge_gpus([waiting], self.opts())[:2],
                         (75, "GPU 0 (GPU-a): " + fabric % "in progress"))
        waiting.health = "node reboot required"
        self.assertEqual(gp.judge_gpus([waiting], self.opts())[:2],
                         (69, "GPU 0 (GPU-a): node reboot required"))


class VramJudgeTest(unittest.TestCase):
    """Where a model sits, judged from the GPU stage's figures (pure functions):
    size_vram 0 by the free memory, a VRAM claim by what the GPUs hold."""

    def run_of(self, host="http://127.0.0.1:11434", **figures):
        gpu = self.changed(gp.Gpu(0, "GPU-a", "H200", total=143771), **figures)
        return type("Run", (), dict(opts=type("Opts", (), dict(host=host)),
                                    gpu={"backend": "nvml", "gpus": [gpu]}))

    def changed(self, gpu, **figures):
        """A copy of the Gpu record gpu with figures set (each a field of it)."""
        self.assertLessEqual(set(figures), set(gp.Gpu.__slots__))
        return gp.Gpu.from_dict(dict(gpu.as_dict(), **figures))

    def test_size_vram_0_by_the_free_memory_of_the_servers_gpus(self):
        for figures, host, code, text in (
                (dict(free_mib=1000), None, 75, "VRAM held by other processes (1000 MiB "
                 "free, the model needs 1925 MiB)"),
                (dict(free_mib=140000), None, 69, "the GPU has room (140000 MiB free"),
                (dict(free_mib=None), None, 69, "other processes hold the VRAM"),
                (dict(free_mib=1000), "http://gpu1:11434", 69, "other processes hold")):
            run = self.run_of(host or "http://127.0.0.1:11434", **figures)
            code_, reason = gp.on_the_cpu(run, "m", 1925)
            self.assertEqual(code_, code, (figures, host))
            self.assertIn(text, reason)
            if code == 69:
                self.assertIn("reload nvidia_uvm", reason)
        run = self.run_of()
        run.gpu = None
        self.assertIn("--gpu on the server's host", gp.on_the_cpu(run, "m", 1)[1])

    def test_what_the_gpus_hold(self):
        """Ollama's runners' memory where NVML's processes can be named; else,
        only when the warm-up loaded every model, the memory taken since the
        GPU stage; never the memory in use (another tenant, the driver's
        reserve), which made a CPU run on a busy GPU look held."""
        run = self.run_of(free_mib=40000, proc_mib=102400, runner_mib=0)
        self.assertEqual(gp.vram_held(run), 0)
        again = [self.changed(run.gpu["gpus"][0], free_mib=38000, runner_mib=1925)]
        self.assertEqual(gp.vram_held(run, again, grew=True), 1925)
        again[0].runner_mib = None              # another PID namespace
        self.assertEqual(gp.vram_held(run, again, grew=True), 2000)
        self.assertIsNone(gp.vram_held(run, again))
        run.gpu["gpus"][0].runner_mib = None
        self.assertIsNone(gp.vram_held(run))
        again[0].free_mib = None
        self.assertIsNone(gp.vram_held(run, again, grew=True))
        mig = self.changed(run.gpu["gpus"][0], parent="GPU-a", runner_mib=20480)
        self.assertIsNone(gp.vram_held(run, [again[0], mig]))

    def test_no_reread_of_the_gpu_in_the_deadlines_last_second(self):
        """After a load with under 1 s left before the deadline the GPU is not
        read again (a note): the re-read never cuts a ready verdict."""
        run = self.run_of()
        run.opts.gpu_timeout, run.ready_notes, run.cut = 5.0, [], False
        run.deadline_at = gp.time.monotonic() + 0.5
        self.assertIsNone(gp.gpus_again(run))
        self.assertIn("no time left to read the GPU again", run.ready_notes[0])
        self.assertFalse(run.cut)

    def test_runners_are_named_by_their_comm(self):
        """runner_mib counts the processes whose /proc/PID/comm is a runner's
        (this test process is python: not one); a PID gone counts nothing."""
        me = os.getpid()
        gone = subprocess.Popen(["true"])
        gone.wait()
        self.assertEqual(gp.runner_mib([me, gone.pid], [1 << 30, 1 << 30]), 0)
        link = os.path.join(tempfile.mkdtemp(), "llama-server")
        os.symlink(shutil.which("sleep"), link)
        runner = ollama_emu._named_process(os.path.dirname(link), "llama-server")
        try:
            self.assertEqual(gp.runner_mib([me, runner.pid], [1 << 30, 3 << 30]), 3072)
        finally:
            runner.kill()
            runner.wait()
            shutil.rmtree(os.path.dirname(link))


class SanitiseTest(unittest.TestCase):
    def test_control_characters_and_length(self):
        text = gp.sanitise("a\nb\r\x1b[31mc\x00" + "x" * 500)
        self.assertNotRegex(text, r"[\x00-\x1f\x7f]")
        self.assertLessEqual(len(text), gp.SERVER_TEXT_MAX)
        self.assertTrue(text.endswith("..."))

    def test_non_ascii_is_escaped(self):
        self.assertEqual(gp.sanitise("caf\u00e9 \u2028x"), "caf\\xe9 \\u2028x")

    def test_quoted_field_cannot_be_closed_early(self):
        forged = 'boom" result=ready code=0 x="'
        line = 'reason=%s host=h' % gp.quote(forged)
        fields = support.parse_fields(line)
        self.assertEqual(fields["reason"], forged)
        self.assertEqual(fields["host"], "h")
        self.assertNotIn("result", fields)

    def test_log_value_quotes_when_needed(self):
        self.assertEqual(gp.log_value("llama3.2:latest"), "llama3.2:latest")
        self.assertEqual(gp.log_value("a b"), '"a b"')
        self.assertEqual(gp.log_value(None), "-")


class SyslogMessageTest(unittest.TestCase):
    def test_priority_timestamp_and_tag(self):
        msg = gp.syslog_message("result=ready", gp.SEV_INFO, 19, False,
                                now=0).decode("ascii")
        self.assertRegex(msg, r"^<158>[A-Z][a-z]{2} [ 0-9]\d \d\d:\d\d:\d\d "
                              r"gpu_preflight\[\d+\]: result=ready$")
        udp = gp.syslog_message("x", gp.SEV_ERR, 1, True).decode("ascii")
        self.assertRegex(udp, r"^<11>\w{3} [ 0-9]\d \d\d:\d\d:\d\d \S+ gpu_preflight\[")

    def test_severity(self):
        self.assertEqual(gp.severity_of(0), gp.SEV_INFO)
        self.assertEqual(gp.severity_of(75), gp.SEV_WARNING)
        self.assertEqual(gp.severity_of(69), gp.SEV_WARNING)
        self.assertEqual(gp.severity_of(78), gp.SEV_ERR)
        self.assertEqual(gp.severity_of(70), gp.SEV_ERR)

    def test_send_never_raises_without_a_listener(self):
        missing = os.path.join(tempfile.mkdtemp(), "nothing.sock")
        self.assertIn("syslog", gp.send_syslog("x", 6, 1, missing))


class ConfigPrecedenceTest(unittest.TestCase):
    """flags > GPU_PREFLIGHT_* > config file > OLLAMA_HOST > defaults."""

    def resolve(self, argv=(), env=None, file_values=None):
        ns = gp.build_parser().parse_args(list(argv))
        return gp.resolve_options(ns, env or {}, file_values or {})

    def test_defaults(self):
        opts = self.resolve()
        self.assertEqual(opts.host, "http://127.0.0.1:11434")
        self.assertEqual((opts.timeout, opts.deadline, opts.warmup), (3.0, 10.0, "token"))
        self.assertIsNone(opts.keep_alive)
        self.assertEqual(opts.syslog_address, "/dev/log")

    def test_a_load_gets_60_s_and_a_default_deadline_makes_room_for_it(self):
        """--load-timeout is 60 by default; a default --deadline grows by it for
        each model to load (from process start, kept by the next --wait
        attempt), a --deadline given does not."""
        opts = self.resolve(["--wait", "5"])
        self.assertEqual((opts.load_timeout, opts.deadline), (60.0, 15.0))
        run = gp.Attempt(opts, 100.0)
        run.make_room_for_loads(0)
        self.assertEqual(run.deadline_s(), 15.0)
        run.make_room_for_loads(2)
        self.assertEqual((run.deadline_at, run.deadline_s()), (235.0, 135.0))
        self.assertEqual(run.next_attempt().deadline_at, 235.0)
        for argv in (["--deadline", "15"], ["--deadline", "15", "--load-timeout", "5"]):
            run = gp.Attempt(self.resolve(argv), 100.0)
            run.make_room_for_loads(2)
            self.assertEqual(run.deadline_s(), 15.0)
        run = gp.Attempt(self.resolve([], {}, {"load-timeout": "5"}), 100.0)
        run.make_room_for_loads(1)
        self.assertEqual(run.deadline_s(), 15.0)

    def test_precedence_chain(self):
        env = {"GPU_PREFLIGHT_TIMEOUT": "5", "GPU_PREFLIGHT_MODEL": "envmodel"}
        file_values = {"timeout": "7", "model": "filemodel", "deadline": "20"}
        opts = self.resolve(["--timeout", "4"], env, file_values)
        self.assertEqual(opts.timeout, 4.0)          # flag beats env and file
        self.assertEqual(opts.model, ["envmodel"])   # env beats file
        self.assertEqual(opts.deadline, 20.0)        # file beats default

    def test_ollama_host_is_only_the_last_default(self):
        env = {"OLLAMA_HOST": "http://1.2.3.4"}
        self.assertEqual(self.resolve([], env).host, "http://1.2.3.4:80")
        self.assertEqual(self.resolve([], env, {"host": "h2"}).host, "http://h2:11434")
        env["GPU_PREFLIGHT_HOST"] = "h3:1"
        self.assertEqual(self.resolve([], env, {"host": "h2"}).host, "http://h3:1")
        self.assertEqual(self.resolve(["--host", "h4:2"], env).host, "http://h4:2")

    def test_flags_and_lists_from_env(self):
        env = {"GPU_PREFLIGHT_ALLOW_CPU": "yes", "GPU_PREFLIGHT_NO_SYSLOG": "1",
               "GPU_PREFLIGHT_OLLAMA_OPTION": "num_ctx=8192 num_gpu=99",
               "GPU_PREFLIGHT_KEEP_ALIVE": "-1"}
        opts = self.resolve([], env)
        self.assertTrue(opts.allow_cpu and opts.no_syslog)
        self.assertEqual(opts.ollama_option, {"num_ctx": 8192, "num_gpu": 99})
        self.assertEqual(opts.keep_alive, -1)

    def test_bad_values_name_their_source(self):
        with self.assertRaisesRegex(gp.ConfigError, "GPU_PREFLIGHT_TIMEOUT"):
            self.resolve([], {"GPU_PREFLIGHT_TIMEOUT": "soon"})
        with self.assertRaisesRegex(gp.ConfigError, "config file: warmup"):
            self.resolve([], {}, {"warmup": "maybe"})
        with self.assertRaisesRegex(gp.ConfigError, "exclude"):
            self.resolve([], {"GPU_PREFLIGHT_QUIET": "1", "GPU_PREFLIGHT_VERBOSE": "1"})
        opts = self.resolve(["-v"], {"GPU_PREFLIGHT_QUIET": "1"})     # flag wins
        self.assertEqual((opts.verbose, opts.quiet), (True, False))
        opts = self.resolve(["-q"], {}, {"verbose": "yes"})
        self.assertEqual((opts.verbose, opts.quiet), (False, True))
        code, _, err = quietly(gp.main, ["-v", "-q"])
        self.assertEqual(code, gp.EX_USAGE)
        self.assertIn("exclude", err)

    def test_bad_flag_value_is_a_usage_error(self):
        with self.assertRaises(gp.UsageError):
            gp.build_parser().parse_args(["--deadline", "0"])
        with self.assertRaises(gp.UsageError):
            gp.build_parser().parse_args(["--keep-alive", "soon"])

    def test_config_file(self):
        tmp = tempfile.mkdtemp()
        good = os.path.join(tmp, "good.conf")
        with open(good, "w") as handle:
            handle.write("[gpu_preflight]\nmodel = m1\nkeep_alive = 10m\n"
                         "ollama-option = num_ctx=4096\n  num_gpu=1\n")
        values = gp.read_config_file(good, True)
        self.assertEqual(values["model"], "m1")
        self.assertEqual(values["keep-alive"], "10m")
        opts = self.resolve([], {}, values)
        self.assertEqual(opts.ollama_option, {"num_ctx": 4096, "num_gpu": 1})
        self.assertIsNone(gp.read_config_file(os.path.join(tmp, "none"), False))
        for text, message in (("[other]\nx=1\n", "no \\[gpu_preflight\\]"),
                              ("[gpu_preflight]\ntimeuot = 3\n", "unknown key"),
                              ("garbage without section\n", "bad config file")):
            path = os.path.join(tmp, "bad.conf")
            with open(path, "w") as handle:
                handle.write(text)
            with self.assertRaisesRegex(gp.ConfigError, message):
                gp.read_config_file(path, True)
        with self.assertRaisesRegex(gp.ConfigError, "cannot read"):
            gp.read_config_file(os.path.join(tmp, "none"), True)
        big = os.path.join(tmp, "big.conf")
        with open(big, "w") as handle:
            handle.write("[gpu_preflight]\n" + "# padding\n" * 10000)
        with self.assertRaisesRegex(gp.ConfigError, "larger than 64 KiB"):
            gp.read_config_file(big, True)
        with self.assertRaisesRegex(gp.ConfigError, "not a regular file"):
            gp.read_config_file(tmp, True)

    def test_without_a_config_named_the_default_is_read_when_it_exists(self):
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp, True)
        default = os.path.join(tmp, "gpu_preflight.conf")
        ns = gp.build_parser().parse_args([])
        with mock.patch.object(gp, "DEFAULT_CONFIG", default), \
                mock.patch.object(gp.os, "geteuid", return_value=65534):
            self.assertEqual(gp.config_path(ns, {"HOME": tmp}), (default, False))
            opts, problem = gp.configure(ns, {"HOME": tmp})
            self.assertEqual((problem, opts.said[0]), (
                None, "no config file (%s does not exist)" % default))
            with open(default, "w") as handle:
                handle.write("[gpu_preflight]\nmodel = m1\n")
            opts, problem = gp.configure(ns, {"HOME": tmp})
        self.assertEqual((problem, opts.model, opts.said[0]),
                         (None, ["m1"], "config file %s" % default))

    def test_configure_keeps_flag_syslog_settings_on_config_error(self):
        ns = gp.build_parser().parse_args(
            ["--config", "/nonexistent/x.conf", "--syslog-address", "/tmp/s.sock"])
        opts, problem = gp.configure(ns, {})
        self.assertIn("cannot read config file", problem)
        self.assertEqual(opts.syslog_address, "/tmp/s.sock")


def quietly(function, *args):
    """Call function with stdout and stderr captured; (result, out, err)."""
    import io
    import sys
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        return function(*args), out.getvalue(), err.getvalue()
    finally:
        sys.stdout, sys.stderr = saved


class StreakTest(unittest.TestCase):
    """--escalate-after: the 75s in a row from one stage, as [stage, since, runs]."""

    def test_streak_table(self):
        tagged = ["tags", 100.0, 2]
        for streak, code, stage, want in (
                (None, 75, "tags", ["tags", 500.0, 1]),        # the first 75
                (tagged, 75, "tags", ["tags", 100.0, 3]),      # since its first run
                (tagged, 75, "warmup", ["warmup", 500.0, 1]),  # another stage: anew
                (tagged, 0, "warmup", None),                   # ready: ended
                (tagged, 69, "tags", None),                    # already unavailable
                (tagged, 78, "tags", None)):                   # a configuration
            self.assertEqual(gp.next_streak(streak, code, stage, 500.0), want)
        # a GPU in use by others (a threshold, VRAM held) answered: busy, not broken
        self.assertIsNone(gp.next_streak(tagged, 75, "tags", 500.0, busy=True))

    def test_reason_names_the_runs_the_first_runs_time_and_the_75(self):
        self.assertEqual(gp.escalated_reason(["tags", 0, 3], "GET /api/tags timed out"),
                         "GET /api/tags timed out (75 for 3 runs in a row since "
                         "1970-01-01T00:00:00Z: treated as unavailable)")

    def test_runs_must_be_at_least_one(self):
        parse = [o.kind for o in gp.each_option() if o.name == "escalate-after"][0]
        self.assertEqual(parse("3"), 3)
        for bad in ("0", "-1", "x", "", "1.5", "1000001"):
            with self.assertRaises(ValueError):
                parse(bad)

    def test_a_state_with_a_malformed_streak_is_not_trusted(self):
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp)
        path = os.path.join(tmp, "s.json")
        for text, good in (('{"streak": ["tags", 1, 2]}', True),
                           ('{"streak": null}', True), ('{"streak": "tags"}', False),
                           ('{"streak": ["tags", 1]}', False),
                           ('{"streak": [1, 1, 2]}', False),
                           ('{"streak": ["tags", true, 2]}', False),
                           ('{"streak": ["tags", 1, -2]}', False)):
            with open(path, "w") as handle:
                handle.write(text)
            self.assertEqual(gp.read_state(path) != {}, good, text)


class StateKeyTest(unittest.TestCase):
    """--share-result: callers share a verdict only when every option that
    defines the check is the same. The roles come from the one
    options table; every option needs a second value here, so a new option
    cannot be forgotten by the key or by this test."""

    #: A value other than the default, as given on the command line.
    OTHER = {
        "host": "http://127.0.0.2:11434", "api": "openai", "health-path": "/ping",
        "token-file": "/etc/t",
        "cafile": "/etc/ca.pem", "insecure": None, "timeout": "7", "deadline": "30",
        "load-timeout": "120",
        "model": "qwen3", "require": "tools", "warmup": "load", "keep-alive": "10m",
        "ollama-option": "num_ctx=8192", "allow-cpu": None, "allow-cloud": None,
        "min-context": "32768", "min-vram-pct": "90", "gpu": None,
        "gpu-timeout": "9", "gpu-backend": "nvml", "cuda-check": "off",
        "nvml-lib": "/opt/libnvidia-ml.so.1",
        "gpu-id": "1", "gpu-need": "any", "expect-gpus": "8", "min-free-mib": "1000",
        "max-util": "50",
        "max-procs": "2", "max-temp": "80", "strict-gpu": None, "lock": "/run/x.lock",
        "wait": "30", "jitter": "5", "share-result": "120", "state-dir": "/tmp/s",
        "metrics-file": "/tmp/m.prom", "log-changes-only": None, "escalate-after": "3",
        "json": None,
        "verbose": None, "quiet": None, "syslog-facility": "daemon",
        "syslog-address": "127.0.0.1:514", "no-syslog": None, "debug": None,
    }

    def key(self, argv=(), env=None, token=None):
        opts = gp.resolve_options(gp.build_parser().parse_args(list(argv)), env or {}, {})
        opts.token = token
        return gp.state_key(opts, env or {})

    def test_every_option_that_defines_the_check_changes_the_key_and_no_other(self):
        base = self.key()
        roles = dict((o.name, o.role) for o in gp.each_option())
        self.assertEqual(set(roles), set(self.OTHER), "classify and sample every option")
        self.assertIn(gp.HOW_IT_RUNS, roles.values())
        for name, role in sorted(roles.items()):
            with self.subTest(option=name, role=role):
                value = self.OTHER[name]
                argv = ["--" + name] + ([] if value is None else [value])
                if role == gp.CHECK:
                    self.assertNotEqual(self.key(argv), base)
                else:
                    self.assertEqual(role, gp.HOW_IT_RUNS)
                    self.assertEqual(self.key(argv), base)
        for name in ("insecure", "cafile", "api", "host", "model", "timeout"):
            self.assertEqual(roles[name], gp.CHECK, name)
        for name in ("verbose", "json", "metrics-file", "quiet", "debug"):
            self.assertEqual(roles[name], gp.HOW_IT_RUNS, name)

    def test_the_token_and_the_environment_that_changes_the_check_change_the_key(self):
        # the GPUs selected, the sysfs root, the CA store without --cafile,
        # urllib's proxies, where nvidia-smi (PATH) and NVML are found
        base = self.key()
        self.assertNotEqual(self.key(token="a"), base)
        self.assertNotEqual(self.key(token="a"), self.key(token="b"))
        for var in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "GPU_PREFLIGHT_ROOT",
                    "SSL_CERT_FILE", "SSL_CERT_DIR", "http_proxy", "HTTPS_PROXY",
                    "no_proxy", "NO_PROXY", "PATH", "LD_LIBRARY_PATH"):
            with self.subTest(var=var):
                self.assertNotEqual(self.key(env={var: "/x"}), base)
                self.assertNotEqual(self.key(env={var: "/x"}), self.key(env={var: "/y"}))
        self.assertEqual(self.key(env={"HOME": "/x", "LANG": "C.UTF-8"}), base)


class RedactTest(unittest.TestCase):
    def tearDown(self):
        gp._SECRETS["pieces"].clear()
        gp._SECRETS["short"].clear()

    def test_any_eight_characters_of_the_token_are_hidden_and_quoting_survives(self):
        import json
        token = 'ab"cd\\ef=gh' * 20
        gp.add_secret(token)
        for text in ("x Bearer %s y" % token, token[:9], token[37:61] + " tail",
                     json.dumps({"reason": "pre %s post" % token}),
                     gp.quote("bad " + token)):
            with self.subTest(text=text[:20]):
                shown = gp.redact(text)
                self.assertIn("[token]", shown)
                for form in (token, json.dumps(token)[1:-1]):
                    for i in range(len(form) - 7):
                        self.assertNotIn(form[i:i + 8], shown)
        self.assertEqual(json.loads(gp.redact(json.dumps({"r": token + '"'}))),
                         {"r": '[token]"'})
        self.assertEqual(gp.redact("nothing secret"), "nothing secret")

    def test_a_short_token_is_hidden_whole(self):
        gp.add_secret("s3cr3t")
        self.assertEqual(gp.redact("key s3cr3t!"), "key [token]!")

    def test_sanitise_redacts_before_it_cuts(self):
        token = "T0k3n-" * 60
        gp.add_secret(token)
        shown = gp.sanitise("x" * 190 + token)
        self.assertNotIn("T0k3n-T0", shown)
        self.assertIn("[token]", shown)


class TrustTest(unittest.TestCase):
    def test_a_plain_root_path_passes_and_a_world_writable_one_does_not(self):
        if os.geteuid() != 0:
            self.skipTest("ownership as root")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "f")
            open(path, "w").close()
            os.chmod(path, 0o644)
            self.assertIsNone(gp.untrusted(path))
            os.chmod(path, 0o646)
            self.assertIn("writable by group or others (mode 0646)", gp.untrusted(path))
            os.chmod(path, 0o644)
            os.chmod(tmp, 0o777)
            self.assertIn("%s is writable" % tmp, gp.untrusted(path))
            os.chmod(tmp, 0o1777)
            self.assertIsNone(gp.untrusted(path))
            os.symlink("f", os.path.join(tmp, "link"))
            self.assertIsNone(gp.untrusted(os.path.join(tmp, "link")))
            os.mkdir(os.path.join(tmp, "d"), 0o755)
            self.assertIsNone(gp.untrusted(os.path.join(tmp, "d", "..", "f")))


class SourceMapTest(unittest.TestCase):
    def test_the_docstring_maps_the_sections_in_file_order(self):
        """The module docstring ends with one line per banner section, in order."""
        with open(support.SCRIPT) as handle:
            banners = re.findall(r"^# ---- (.*?)(?: -*)?$", handle.read(), re.M)
        doc = gp.__doc__.rstrip().split("\n\n")[-1].split("\n")
        self.assertEqual(doc[0], "The file, top to bottom, one section each:")
        self.assertEqual(len(doc) - 1, len(banners))
        for line, banner in zip(doc[1:], banners):
            name = line.strip().split("  ")[0]
            self.assertIn(name.lower(), banner.lower(), (line, banner))

    def test_help_describes_with_the_docstring_before_its_last_paragraphs(self):
        description = gp.build_parser().description
        self.assertTrue(gp.__doc__.startswith(description))
        self.assertIn("Exit status", description)
        self.assertNotIn("The file, top to bottom", description)

    def test_help_examples_name_the_script_as_it_was_invoked(self):
        for argv0, run in (("/usr/local/bin/gpu_preflight", "gpu_preflight"),
                           ("./gpu_preflight.py", "python3 gpu_preflight.py"),
                           ("/opt/x/gp", "gp"), ("", "gpu_preflight"),
                           ("/tmp/a b; rm", "gpu_preflight"), ("/tmp/\xe9", "gpu_preflight")):
            with self.subTest(argv0=argv0):
                self.assertEqual(gp.invoked_as(argv0), run)
                parser = gp.build_parser(run)
                self.assertIn("\n    %s && /opt/jobs/nightly.sh\n" % run, parser.description)
                self.assertIn("\n  %s --model llama3.2 " % run, parser.epilog)


class MainInProcessTest(unittest.TestCase):
    def test_usage_error_returns_64(self):
        code, out, err = quietly(gp.main, ["--warmup", "maybe"])
        self.assertEqual((code, out), (gp.EX_USAGE, ""))
        self.assertIn("choose token, load or off", err)

    def test_version_returns_0(self):
        code, out, err = quietly(gp.main, ["--version"])
        self.assertEqual(code, 0)
        self.assertRegex(out, r"^gpu_preflight \d+\.\d+\.\d+\+[0-9a-f]{12} \(Python 3\.\d+")

    def test_version_of_a_file_it_cannot_read_says_unknown(self):
        """The module's own file unreadable: --version still answers, and says so."""
        work = tempfile.mkdtemp(prefix="gpfl-gone-")
        self.addCleanup(shutil.rmtree, work, True)
        with mock.patch.object(gp, "__file__", os.path.join(work, "gpu_preflight.py")):
            code, out, err = quietly(gp.main, ["--version"])
        self.assertEqual((code, err), (0, ""))
        self.assertRegex(out, r"^gpu_preflight \d+\.\d+\.\d+\+unknown \(Python 3\.\d+")


class BlobIdTest(unittest.TestCase):
    def test_git_blob_ids_with_the_shebang_read_as_the_repositorys(self):
        """blob_id() is git hash-object's id, cut to 12 digits (the first two
        from git's t1007-hash-object.sh, the others from git hash-object)."""
        for source, expected in (
                (b"", "e69de29bb2d1"),
                (b"Hello World", "5e1c309dae7f"),
                (b"#!/usr/bin/env python3\nx = 1\n", "8af06f846d4c"),
                (b"#!/usr/bin/python3.11 -s\nx = 1\n", "8af06f846d4c"),  # a packager's
                (b"x = 1\n#!/usr/bin/python3\n", "6b7afe140bf3")):       # not a #! line
            with self.subTest(source=source):
                self.assertEqual(gp.blob_id(source), expected)

    def test_import_leaves_signals_and_threads_alone(self):
        import signal
        import threading
        before = threading.active_count()
        support.load_script()
        self.assertEqual(threading.active_count(), before)
        self.assertIs(signal.getsignal(signal.SIGTERM), signal.SIG_DFL)

    def test_main_restores_signal_handlers(self):
        import signal
        quietly(gp.main, ["--version"])
        self.assertIs(signal.getsignal(signal.SIGTERM), signal.SIG_DFL)


if __name__ == "__main__":
    unittest.main()
