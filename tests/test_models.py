"""Several models, embedding models and capabilities, proven together.

The real script as a subprocess in cron's environment (support.run_script,
a real syslog socket) against the Ollama emulator (tests/ollama_emu.py:
models with kinds and capabilities, answers by server version, a scheduler
that evicts) and the OpenAI emulator (tests/openai_emu.py). Each test states
the contract point it proves and asserts the exit status, the reason, the
syslog line, the requests the server saw and the time against --deadline.
"""

import json
import os
import re
import shutil
import tempfile
import time
import urllib.error
import urllib.request

import ollama_emu
import support
from ollama_emu import Emulator, Model, _canonical_model
from openai_emu import OpenAIEmulator
from test_contract import SLACK, ContractCase
from test_job import strict_parse

#: What the capability names of Ollama are (types/model/capability.go).
KNOWN_CAPABILITIES = ("completion", "tools", "insert", "vision", "embedding", "thinking",
                      "image", "audio")
#: Ollama releases the tests answer as: capabilities in /api/tags (>= 0.30.0),
#: only in /api/show (>= 0.6.4), none (with /api/embed), none and no /api/embed.
NEW, MID, OLD, OLDER = "0.32.15", "0.12.3", "0.5.7", "0.2.1"
DEADLINE = 20
WARMUPS = ("/api/generate", "/api/chat", "/api/embed", "/api/embeddings")


def qwen(caps=("completion", "tools", "thinking"), **kwargs):
    return Model("qwen3:latest", "generate", list(caps), size=5200000000, **kwargs)


def llama(caps=("completion", "tools"), **kwargs):
    return Model("llama3.2:latest", "generate", list(caps), size=2019393189, **kwargs)


def nomic(**kwargs):
    return Model("nomic-embed-text:latest", "embed", **kwargs)


def canon(name):
    return _canonical_model(name) if isinstance(name, str) else name


def refuse(emu, model):
    """What this server answers /api/generate for model (the scenario's premise)."""
    request = urllib.request.Request(
        emu.url + "/api/generate", method="POST",
        data=json.dumps({"model": model, "prompt": "test", "stream": False}).encode())
    try:
        urllib.request.urlopen(request, timeout=5).read()
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read().decode("utf-8"))["error"]
    return None


class ModelsCase(ContractCase):
    def setUp(self):
        ContractCase.setUp(self)
        self.dir = tempfile.mkdtemp(prefix="gpfl-models-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def ollama(self, *models, **kwargs):
        """An Ollama emulator with these models, none loaded, cold loads of 0.2 s."""
        kwargs.setdefault("loaded", ())
        kwargs.setdefault("load_seconds", 0.2)
        emu = Emulator(models=models, **kwargs).start()
        self.addCleanup(emu.stop)
        return emu

    def openai(self, flavour="vllm", **kwargs):
        emu = OpenAIEmulator(flavour=flavour, **kwargs).start()
        self.addCleanup(emu.stop)
        return emu

    def check(self, url, *args, **kwargs):
        """The script against url with --timeout 5 --deadline 20 unless args say."""
        args = list(args)
        cut = args.index("--") if "--" in args else len(args)
        for flag, value in (("--timeout", "5"), ("--deadline", str(DEADLINE))):
            if flag not in args[:cut]:
                args[:0] = [flag, value]
        return self.run_gp(["--host", url] + args, env=kwargs.get("env"))

    def verdict(self, res, code, *texts, **kwargs):
        """Exit status, silence under cron (unless --json), time, and the syslog line
        with this code and every text in its reason; the line's fields."""
        self.assertEqual(res.code, code, res)
        if kwargs.get("quiet", True):
            self.assertEqual((res.stdout, res.stderr), ("", ""), "not silent under cron")
        priority, fields = self.log()
        self.assertInTime(res, kwargs.get("deadline", DEADLINE), fields)
        self.assertEqual(priority, 8 + (6 if code == 0 else 3 if code in (70, 78) else 4))
        self.assertEqual((fields["result"], fields["code"]),
                         ("ready" if code == 0 else "skip", str(code)))
        for text in texts:
            self.assertIn(text, fields["reason"])
        return fields

    def drain(self):
        """Forget syslog lines of an earlier run (a subtest that failed left its own)."""
        self.sink.messages(wait=0.01)

    def json_models(self, res):
        """The "models" list of a --json answer."""
        doc = json.loads(res.stdout)
        self.assertIn("models", doc, "no \"models\" in --json: %r" % sorted(doc))
        return doc["models"]

    def assertModelsField(self, fields, *entries):
        """models="NAME KIND MSms, ..." with these (name, kind) in this order."""
        self.assertIn("models", fields, "no models= field in the log line: %r" % fields)
        parts = fields["models"].split(", ")
        self.assertEqual(len(parts), len(entries), fields["models"])
        for part, (name, kind) in zip(parts, entries):
            self.assertRegex(part, r"^%s %s \d+ms$" % (re.escape(name), kind))

    def warmups(self, emu):
        """(path, model as Ollama means it, status) of every warm-up request, in order."""
        return [(r.path, canon(r.model), r.status) for r in emu.posts(*WARMUPS)]

    def assertOneLatePs(self, emu):
        """No GET /api/ps while a warm-up was in flight, and one after the last."""
        self.assertEqual(emu.ps_during_warmup, [], "GET /api/ps sent during a warm-up")
        warm = emu.posts(*WARMUPS)
        self.assertTrue(warm)
        last = max(r.ended for r in warm)
        late = [r for r in emu.requests if r.path == "/api/ps" and r.started >= last]
        self.assertEqual(len(late), 1, [(r.path, r.started) for r in emu.requests])

    def assertOneAfterAnother(self, emu):
        """Warm-ups never overlap: each starts after the one before answered."""
        warm = emu.posts(*WARMUPS)
        for before, after in zip(warm, warm[1:]):
            self.assertGreaterEqual(after.started, before.ended, "warm-ups overlap")


class SeveralOllamaModelsTest(ModelsCase):
    def test_two_generative_models_that_fit_together_are_ready(self):
        """--model repeatable; warmed one after another; one /api/ps lists both."""
        emu = self.ollama(qwen(), llama(), vram_mib=16384)
        fields = self.verdict(self.check(emu.url, "--model", "qwen3", "--model", "llama3.2"), 0)
        self.assertEqual(fields["model"], "qwen3:latest")          # the first model
        self.assertModelsField(fields, ("qwen3:latest", "generate"),
                               ("llama3.2:latest", "generate"))
        self.assertEqual(self.warmups(emu), [("/api/generate", "qwen3:latest", 200),
                                             ("/api/generate", "llama3.2:latest", 200)])
        self.assertOneAfterAnother(emu)
        self.assertOneLatePs(emu)
        self.assertEqual((emu.evictions, emu.loaded),
                         ([], {"qwen3:latest", "llama3.2:latest"}))

    def test_chat_and_embedding_model_kinds_from_api_tags(self):
        """>= 0.30: the kind from /api/tags capabilities, no /api/show; the embedding
        model warmed by POST /api/embed {"model", "input": "test"} and nothing else."""
        emu = self.ollama(qwen(), nomic(), version=NEW)
        res = self.check(emu.url, "--model", "qwen3", "--model", "nomic-embed-text")
        fields = self.verdict(res, 0)
        self.assertModelsField(fields, ("qwen3:latest", "generate"),
                               ("nomic-embed-text:latest", "embed"))
        self.assertEqual(self.warmups(emu), [("/api/generate", "qwen3:latest", 200),
                                             ("/api/embed", "nomic-embed-text:latest", 200)])
        body = dict(emu.posts("/api/embed")[0].body)
        self.assertEqual(canon(body.pop("model")), "nomic-embed-text:latest")
        self.assertEqual(body, {"input": "test"})
        self.assertEqual(emu.count("POST", "/api/show"), 0, "/api/tags said the kinds")
        self.assertOneAfterAnother(emu)
        self.assertOneLatePs(emu)

    def test_kinds_from_api_show_on_a_server_without_them_in_tags(self):
        """0.6.4 to 0.29: POST /api/show says each model's kind before anything is
        sent to it; no generate request reaches the embedding model."""
        emu = self.ollama(qwen(), nomic(), version=MID)
        res = self.check(emu.url, "--model", "qwen3", "--model", "nomic-embed-text")
        fields = self.verdict(res, 0)
        self.assertModelsField(fields, ("qwen3:latest", "generate"),
                               ("nomic-embed-text:latest", "embed"))
        self.assertEqual(self.warmups(emu), [("/api/generate", "qwen3:latest", 200),
                                             ("/api/embed", "nomic-embed-text:latest", 200)])
        for name in ("qwen3:latest", "nomic-embed-text:latest"):
            shows = [r for r in emu.posts("/api/show")
                     if canon(r.body.get("model") or r.body.get("name")) == name]
            first = [r for r in emu.posts(*WARMUPS) if canon(r.model) == name][0]
            self.assertTrue(shows and shows[0].ended <= first.started,
                            "no /api/show for %s before its warm-up" % name)
        self.assertOneLatePs(emu)

    def test_kind_from_the_refusal_on_a_server_without_capabilities(self):
        """< 0.6.4: '"M" does not support generate' means an embedding model: it is
        warmed as one, the run does not fail, and an empty input is never the proof."""
        emu = self.ollama(qwen(), nomic(), version=OLD)
        res = self.check(emu.url, "--model", "qwen3", "--model", "nomic-embed-text")
        fields = self.verdict(res, 0)
        self.assertModelsField(fields, ("qwen3:latest", "generate"),
                               ("nomic-embed-text:latest", "embed"))
        nomic_calls = [w for w in self.warmups(emu) if w[1] == "nomic-embed-text:latest"]
        self.assertEqual(nomic_calls, [("/api/generate", "nomic-embed-text:latest", 400),
                                       ("/api/embed", "nomic-embed-text:latest", 200)])
        self.assertEqual([r.body["input"] for r in emu.posts("/api/embed")], ["test"])
        self.assertOneLatePs(emu)

    def test_legacy_api_embeddings_on_servers_without_api_embed(self):
        """< 0.2.6: /api/embed is 404, so POST /api/embeddings {"model", "prompt":
        "test"}; both refusal texts of those releases mean an embedding model."""
        for version, refusal in (("0.2.1", "nomic-embed-text:latest does not support "
                                           "generate"),
                                 ("0.1.48", "embedding models do not support generate")):
            with self.subTest(version=version):
                self.drain()
                emu = self.ollama(qwen(), nomic(), version=version, max_loaded=3)
                res = self.check(emu.url, "--model", "qwen3", "--model", "nomic-embed-text")
                fields = self.verdict(res, 0)
                self.assertModelsField(fields, ("qwen3:latest", "generate"),
                                       ("nomic-embed-text:latest", "embed"))
                self.assertEqual([w for w in self.warmups(emu) if w[0] != "/api/generate"],
                                 [("/api/embed", "nomic-embed-text:latest", 404),
                                  ("/api/embeddings", "nomic-embed-text:latest", 200)])
                body = dict(emu.posts("/api/embeddings")[0].body)
                self.assertEqual(canon(body.pop("model")), "nomic-embed-text:latest")
                self.assertEqual(body, {"prompt": "test"})
                generate = [r.status for r in emu.posts("/api/generate")
                            if canon(r.model) == "nomic-embed-text:latest"]
                self.assertEqual(generate, [400])
                self.assertOneLatePs(emu)
                self.assertEqual(refuse(emu, "nomic-embed-text:latest"), refusal)

    def test_keep_alive_and_options_go_with_the_embedding_warmup(self):
        """--keep-alive and --ollama-option reach /api/embed as they reach generate."""
        emu = self.ollama(qwen(), nomic(), version=NEW)
        res = self.check(emu.url, "--model", "qwen3", "--model", "nomic-embed-text",
                         "--keep-alive", "10m", "--ollama-option", "num_ctx=2048")
        self.verdict(res, 0)
        body = emu.posts("/api/embed")[0].body
        self.assertEqual((body["input"], body["keep_alive"]), ("test", "10m"))
        options = dict(body["options"])
        options.pop("num_predict", None)           # harmless on an embedding model
        self.assertEqual(options, {"num_ctx": 2048})
        self.assertEqual(emu.posts("/api/generate")[0].body["options"],
                         {"num_ctx": 2048, "num_predict": 1})

    def test_one_model_without_model_flags_is_as_before(self):
        """No --model: one model chosen as today; --json "models" has one entry."""
        emu = self.ollama(llama(), qwen(), loaded=("llama3.2:latest",))
        res = self.check(emu.url, "--json")
        self.assertEqual(res.code, 0, res)
        self.assertEqual(json.loads(res.stdout)["model"], "llama3.2:latest")
        models = self.json_models(res)
        self.assertEqual([(m["name"], m["kind"]) for m in models],
                         [("llama3.2:latest", "generate")])
        self.assertEqual(self.warmups(emu), [("/api/generate", "llama3.2:latest", 200)])
        fields = self.verdict(res, 0, quiet=False)
        self.assertNotIn("models", fields)          # only with more than one model


class EvictionTest(ModelsCase):
    def test_a_model_unloaded_by_the_next_is_temporary_and_named(self):
        """One /api/ps after the warm-ups lacks a model: 75 naming it, the likely
        causes and the fix; /api/ps never read during a warm-up."""
        cases = (("OLLAMA_MAX_LOADED_MODELS=1", dict(max_loaded=1), "max_loaded"),
                 ("VRAM for one", dict(vram_mib=6144), "vram"),
                 ("0.1.48 loads one at a time", dict(version="0.1.48"), "max_loaded"))
        for label, kwargs, cause in cases:
            with self.subTest(case=label):
                self.drain()
                emu = self.ollama(qwen(), llama(), **kwargs)
                res = self.check(emu.url, "--model", "qwen3", "--model", "llama3.2")
                self.verdict(res, 75, "qwen3:latest", "OLLAMA_MAX_LOADED_MODELS", "VRAM")
                self.assertEqual(emu.evictions, [("qwen3:latest", "llama3.2:latest", cause)])
                self.assertEqual(emu.loaded, {"llama3.2:latest"})
                self.assertOneLatePs(emu)

    def test_json_says_which_model_is_resident(self):
        """--json "models": resident false and size_vram null for the evicted one."""
        emu = self.ollama(qwen(), nomic(), max_loaded=1)
        res = self.check(emu.url, "--model", "qwen3", "--model", "nomic-embed-text", "--json")
        self.assertEqual(res.code, 75, res)
        entries = dict((m["name"], m) for m in self.json_models(res))
        self.assertEqual(sorted(entries), ["nomic-embed-text:latest", "qwen3:latest"])
        self.assertIs(entries["qwen3:latest"]["resident"], False)
        self.assertIsNone(entries["qwen3:latest"]["size_vram"])
        self.assertIs(entries["nomic-embed-text:latest"]["resident"], True)
        self.assertEqual(entries["nomic-embed-text:latest"]["size_vram"], 274302450)
        self.verdict(res, 75, "qwen3:latest", quiet=False)

    def test_cpu_fallback_and_partial_offload_are_judged_per_model(self):
        """size_vram 0 of any one model: 69 naming it (--allow-cpu: 0); a partial
        offload of one is a note on a ready run."""
        emu = self.ollama(qwen(), nomic(gpu_pct=0))
        args = ("--model", "qwen3", "--model", "nomic-embed-text")
        self.verdict(self.check(emu.url, *args), 69, "nomic-embed-text:latest", "CPU")
        emu = self.ollama(qwen(), nomic(gpu_pct=0))
        self.verdict(self.check(emu.url, "--allow-cpu", *args), 0)
        emu = self.ollama(qwen(gpu_pct=45), nomic())
        self.verdict(self.check(emu.url, *args), 0, "partial offload")


class PlacementTest(ModelsCase):
    def test_min_vram_pct_makes_a_partial_offload_temporary(self):
        """--min-vram-pct P: a model with less than P % of it in VRAM is 75
        naming it and both shares (even with --allow-cpu); at or under its
        share, and without the option, a partial offload is a note."""
        emu = self.ollama(qwen(gpu_pct=45), nomic())
        args = ("--model", "qwen3", "--model", "nomic-embed-text")
        for extra in (("--min-vram-pct", "100"), ("--allow-cpu", "--min-vram-pct", "46")):
            with self.subTest(extra=extra):
                self.drain()
                fields = self.verdict(self.check(emu.url, *(args + extra)), 75,
                                      "qwen3:latest: partial offload 45 %% < %s %%" % extra[-1])
                self.assertEqual(fields["stage"], "placement")
        for extra in (("--min-vram-pct", "45"), ()):
            with self.subTest(extra=extra):
                self.drain()
                self.verdict(self.check(emu.url, *(args + extra)), 0,
                             "partial offload: 45% of qwen3:latest in VRAM")
        self.drain()
        res = self.check(emu.url, "--min-vram-pct", "101")
        self.assertEqual((res.code, res.stdout), (64, ""), res)
        self.assertIn("--min-vram-pct", res.stderr)

    def test_allow_cpu_takes_a_model_on_the_cpu_whatever_min_vram_pct_says(self):
        """--allow-cpu --min-vram-pct 50: a model wholly on the CPU (size_vram
        0) is what --allow-cpu accepts, not a partial offload of 0 %."""
        emu = self.ollama(llama(gpu_pct=0))
        self.verdict(self.check(emu.url, "--model", "llama3.2", "--allow-cpu",
                                "--min-vram-pct", "50"), 0)

    def test_size_vram_0_without_the_gpu_stage_names_both_causes(self):
        """Without --gpu nothing tells VRAM held by other processes (Ollama fits
        layers to the free VRAM) from a GPU Ollama cannot use (after suspend:
        nvidia_uvm), so the reason names both and the remedies of each."""
        emu = self.ollama(llama(gpu_pct=0))
        fields = self.verdict(self.check(emu.url, "--model", "llama3.2"), 69,
                              "llama3.2:latest runs on the CPU (size_vram 0)",
                              "other processes hold the VRAM", "--gpu", "reload nvidia_uvm",
                              "reboot", "--allow-cpu")
        self.assertNotIn("restart ollama,", fields["reason"])


class MissingAndBadModelsTest(ModelsCase):
    def test_every_missing_model_is_named_and_nothing_is_warmed(self):
        emu = self.ollama(qwen(), nomic())
        res = self.check(emu.url, "--model", "qwen3", "--model", "mistral",
                         "--model", "bge-m3")
        self.verdict(res, 78, "mistral", "bge-m3")
        self.assertEqual(emu.posts(*WARMUPS), [])

    def test_a_typo_gets_the_close_name_not_a_pull_hint(self):
        """A name close to a listed one is a typo: "did you mean" that one; a name
        like none of them keeps Ollama's pull hint. An OpenAI server too."""
        emu = self.ollama(qwen(), nomic(), llama())
        for args, said, unsaid in (
                (["--model", "lama3.2"], "(did you mean llama3.2?)", "ollama pull"),
                (["--model", "lama3.2,mistral"], "(did you mean llama3.2?; ollama pull "
                 "mistral)", "pull lama3.2"),
                (["--model", "mistral"], "(ollama pull mistral)", "did you mean")):
            with self.subTest(args=args):
                self.drain()
                fields = self.verdict(self.check(emu.url, *args), 78, said)
                self.assertNotIn(unsaid, fields["reason"])
                self.assertEqual(fields["stage"], "tags")
        self.drain()
        served = self.openai(models=("qwen2.5-0.5b",))
        fields = self.verdict(self.check(served.url, "--api", "openai", "--model",
                                         "qwen2.5-05b"), 78, "(did you mean qwen2.5-0.5b?)")
        self.assertEqual(fields["stage"], "models")
        self.assertEqual(emu.posts(*WARMUPS), [])

    def test_model_lists_from_the_environment_and_the_config_file(self):
        """GPU_PREFLIGHT_MODEL and the config key model: comma-separated lists."""
        emu = self.ollama(qwen(), nomic(), llama())
        env = support.cron_env(GPU_PREFLIGHT_MODEL="qwen3,nomic-embed-text")
        fields = self.verdict(self.check(emu.url, env=env), 0)
        self.assertModelsField(fields, ("qwen3:latest", "generate"),
                               ("nomic-embed-text:latest", "embed"))
        conf = os.path.join(self.dir, "gp.conf")
        with open(conf, "w") as handle:
            handle.write("[gpu_preflight]\nmodel = llama3.2, nomic-embed-text\n")
        fields = self.verdict(self.check(emu.url, "--config", conf), 0)
        self.assertModelsField(fields, ("llama3.2:latest", "generate"),
                               ("nomic-embed-text:latest", "embed"))
        env = support.cron_env(GPU_PREFLIGHT_MODEL="qwen3,mistral,bge-m3")
        self.verdict(self.check(emu.url, env=env), 78, "mistral", "bge-m3")

    def test_empty_and_duplicate_model_names(self):
        """Flags: 64 on stderr. Environment and config file: 78, logged, stage config."""
        emu = self.ollama(qwen(), nomic())
        for args in (["--model", ""], ["--model", "qwen3", "--model", " "],
                     ["--model", "qwen3", "--model", "qwen3"],
                     ["--model", "qwen3", "--model", "qwen3:latest"]):
            with self.subTest(args=args):
                self.drain()
                res = self.check(emu.url, *args)
                self.assertEqual((res.code, res.stdout), (64, ""), res)
                self.assertEqual(len(res.stderr.splitlines()), 1, res.stderr)
                self.assertIn("model", res.stderr)
        for value in ("qwen3,qwen3", "qwen3,,nomic-embed-text", "qwen3, qwen3:latest"):
            with self.subTest(env=value):
                self.drain()
                res = self.check(emu.url, env=support.cron_env(GPU_PREFLIGHT_MODEL=value))
                fields = self.verdict(res, 78, "GPU_PREFLIGHT_MODEL")
                self.assertEqual(fields["stage"], "config")
        self.drain()
        conf = os.path.join(self.dir, "dup.conf")
        with open(conf, "w") as handle:
            handle.write("[gpu_preflight]\nmodel = nomic-embed-text, nomic-embed-text\n")
        fields = self.verdict(self.check(emu.url, "--config", conf), 78, "model")
        self.assertEqual(fields["stage"], "config")
        self.assertEqual(emu.posts(*WARMUPS), [])


class CapabilityTest(ModelsCase):
    def test_required_capability_declared_by_the_chat_model(self):
        """--require CAP applies to the generative models only (the embedding model
        has no tools and needs none); --require MODEL=CAP,CAP to one model."""
        for version in (NEW, MID):
            with self.subTest(version=version):
                self.drain()
                emu = self.ollama(qwen(), nomic(), version=version)
                args = ("--model", "qwen3", "--model", "nomic-embed-text")
                fields = self.verdict(self.check(emu.url, *(args + ("--require", "tools"))), 0)
                self.assertModelsField(fields, ("qwen3:latest", "generate"),
                                       ("nomic-embed-text:latest", "embed"))
                self.verdict(self.check(emu.url, *(args + ("--require", "qwen3=tools,thinking",
                                                           "--require", "tools"))), 0)

    def test_a_missing_capability_names_the_model_and_the_capability(self):
        for version in (NEW, MID):
            with self.subTest(version=version):
                self.drain()
                emu = self.ollama(llama(caps=("completion",)), nomic(), qwen(),
                                  version=version)
                res = self.check(emu.url, "--model", "llama3.2", "--model",
                                 "nomic-embed-text", "--require", "tools")
                self.verdict(res, 78, "llama3.2", "tools")
                res = self.check(emu.url, "--model", "qwen3", "--model", "nomic-embed-text",
                                 "--require", "qwen3=vision")
                self.verdict(res, 78, "qwen3", "vision")

    def test_a_server_without_capabilities_is_noted_not_failed(self):
        """< 0.6.4 reports no capabilities: ready, with a problem= note."""
        emu = self.ollama(llama(caps=("completion",)), nomic(), version=OLD)
        res = self.check(emu.url, "--model", "llama3.2", "--model", "nomic-embed-text",
                         "--require", "tools")
        fields = self.verdict(res, 0)
        self.assertIn("problem", fields, fields)
        self.assertIn("capabilit", fields["problem"])

    def test_unreadable_capabilities_with_json_are_a_note_not_an_internal_error(self):
        """A garbled POST /api/show (optional stage) is noted; --json still
        answers (the failure kept for --require is no JSON value)."""
        emu = self.ollama(llama(caps=("completion",)), version=MID, mode="garbage",
                          fault_on="/api/show")
        res = self.check(emu.url, "--model", "llama3.2", "--json")
        fields = self.verdict(res, 0, "capabilities of llama3.2:latest unknown",
                              quiet=False)
        self.assertEqual(res.stderr, "")
        doc = json.loads(res.stdout)
        self.assertEqual((doc["exit_code"], doc["reason"]), (0, fields["reason"]))
        self.assertEqual([m["name"] for m in doc["models"]], ["llama3.2:latest"])

    def test_an_unknown_capability_is_a_usage_error_listing_the_known_ones(self):
        emu = self.ollama(qwen(), nomic())
        for value in ("teleport", "qwen3=tools,teleport", "tools,"):
            with self.subTest(require=value):
                self.drain()
                res = self.check(emu.url, "--model", "qwen3", "--require", value)
                self.assertEqual((res.code, res.stdout), (64, ""), res)
                self.assertEqual(len(res.stderr.splitlines()), 1, res.stderr)
                for name in KNOWN_CAPABILITIES:
                    self.assertIn(name, res.stderr)
        self.assertEqual(emu.requests, [])


class EmbeddingProofTest(ModelsCase):
    def test_an_embedding_answer_without_a_vector_is_unavailable(self):
        """embeddings[0] must be a non-empty list of numbers (a load-only answer,
        {"embeddings":[]}, proves nothing): 69 naming the field."""
        for mode in ("empty_embedding", "empty_vector"):
            with self.subTest(mode=mode):
                self.drain()
                emu = self.ollama(qwen(), nomic(), mode=mode)
                res = self.check(emu.url, "--model", "qwen3", "--model", "nomic-embed-text")
                self.verdict(res, 69, "embeddings")
        self.drain()
        emu = self.ollama(qwen(), nomic(), mode="empty_embedding", version=OLDER)
        res = self.check(emu.url, "--model", "qwen3", "--model", "nomic-embed-text")
        self.verdict(res, 69, "embedding")

    def test_deadline_holds_with_a_cold_second_model(self):
        """All warm-ups within --deadline: the cold one is cut, named, and its load
        aborted (the client left)."""
        emu = self.ollama(qwen(), nomic(load_seconds=30), loaded=("qwen3:latest",))
        res = self.check(emu.url, "--model", "qwen3", "--model", "nomic-embed-text",
                         "--timeout", "10", "--deadline", "6")
        self.verdict(res, 75, "nomic-embed-text", "deadline of 6s", deadline=6)
        ends = time.monotonic() + 10        # the emulator sees the hang-up soon
        while emu._loading and time.monotonic() < ends:
            time.sleep(0.05)
        self.assertEqual(emu._loading, {}, "the load went on after the client left")
        self.assertNotIn("nomic-embed-text:latest", emu.loaded)

    def test_each_cold_model_within_the_load_bound(self):
        """Each model /api/ps did not list has --load-timeout of its own."""
        emu = self.ollama(qwen(load_seconds=0.5), nomic(load_seconds=30))
        res = self.check(emu.url, "--model", "qwen3", "--model", "nomic-embed-text",
                         "--timeout", "1", "--load-timeout", "2")
        fields = self.verdict(res, 75, "nomic-embed-text", "timed out after 2s",
                              "did not load within --load-timeout 2s")
        # the warm-ups' own time: qwen3's 0.5 s load and nomic's 2 s, not its 30 s
        self.assertLess(int(fields["warmup_ms"]), (0.5 + 2 + SLACK) * 1000, fields)
        self.assertIn("qwen3:latest", emu.loaded)


class AgentJobTest(ModelsCase):
    def test_done_when_the_job_runs_only_when_all_holds(self):
        """gpu_preflight --model qwen3 --model nomic-embed-text --require tools -- JOB:
        JOB runs only when both answered, sit in VRAM together and qwen3 has tools."""
        marker = os.path.join(self.dir, "ran")
        job = ["--", "/bin/sh", "-c", "echo ran >> '%s'" % marker]
        args = ["--model", "qwen3", "--model", "nomic-embed-text", "--require", "tools"]
        cases = (("ready", (qwen(), nomic()), {}, 0, ()),
                 ("no tools", (qwen(caps=("completion",)), nomic()), {}, 78, ("tools",)),
                 ("evicted", (qwen(), nomic()), {"max_loaded": 1}, 75, ("qwen3:latest",)),
                 ("not pulled", (qwen(),), {}, 78, ("nomic-embed-text",)))
        for label, models, kwargs, code, texts in cases:
            with self.subTest(case=label):
                self.drain()
                if os.path.exists(marker):
                    os.unlink(marker)
                emu = self.ollama(*models, **kwargs)
                res = self.check(emu.url, *(args + job))
                self.verdict(res, code, *texts)
                self.assertEqual(os.path.exists(marker), code == 0, label)


def gpt_oss_cloud():
    """gpt-oss:120b-cloud as `ollama pull` leaves it: listed with remote_host."""
    return Model("gpt-oss:120b-cloud", "cloud", ["completion", "tools", "thinking"])


class CloudModelTest(ModelsCase):
    """Ollama cloud models (/api/tags remote_host, or a NAME:cloud / -cloud
    reference) run on ollama.com: they never prove this host's GPU, never sit
    in /api/ps, and their refusals (cloud off, not signed in) are named."""

    def test_a_cloud_model_is_a_configuration_error_and_nothing_is_sent_to_it(self):
        """Listed with remote_host: 78 naming it and --allow-cloud, at the tags
        stage; no warm-up, no /api/show, no /api/ps (today: 0 "answered a token")."""
        emu = self.ollama(gpt_oss_cloud(), llama())
        entry = json.loads(urllib.request.urlopen(emu.url + "/api/tags").read())["models"][0]
        self.assertEqual((entry["remote_model"], entry["remote_host"]),
                         ("gpt-oss:120b", "https://ollama.com:443"))
        emu.requests[:] = []
        fields = self.verdict(self.check(emu.url, "--model", "gpt-oss:120b-cloud"), 78,
                              "gpt-oss:120b-cloud is an Ollama cloud model (runs on "
                              "ollama.com, not on this host's GPU)", "--allow-cloud")
        self.assertEqual(fields["stage"], "tags")
        self.assertEqual([(r.method, r.path) for r in emu.requests], [("GET", "/api/tags")])

    def test_allowed_it_is_warmed_reported_cloud_and_left_out_of_placement(self):
        """--allow-cloud: one relayed generate, ready with cloud=yes (log, --json);
        no GET /api/ps after it (it is never there), no "not resident" note."""
        emu = self.ollama(gpt_oss_cloud())
        res = self.check(emu.url, "--model", "gpt-oss:120b-cloud", "--allow-cloud", "--json")
        fields = self.verdict(res, 0, "gpt-oss:120b-cloud answered a token", "ollama.com",
                              quiet=False)
        self.assertEqual(fields["cloud"], "yes")
        self.assertNotIn("resident", fields["reason"])
        doc = json.loads(res.stdout)
        self.assertIs(doc["cloud"], True)
        self.assertEqual([(m["name"], m["cloud"]) for m in doc["models"]],
                         [("gpt-oss:120b-cloud", True)])
        self.assertNotIn("placement", [s["name"] for s in doc["stages"]])
        self.assertEqual(self.warmups(emu), [("/api/generate", "gpt-oss:120b-cloud", 200)])
        answer = emu.posts()[0]
        self.assertEqual([r.path for r in emu.requests if r.started >= answer.ended], [])
        self.assertEqual(emu.loaded, set())

    def test_a_local_embedding_model_beside_a_cloud_chat_model_is_judged_alone(self):
        """The agent pair: the embedder resident is ready (today 75 "do not fit
        together"), and its own placement still counts: on the CPU it is 69."""
        args = ("--model", "gpt-oss:120b-cloud", "--model", "nomic-embed-text",
                "--allow-cloud")
        emu = self.ollama(gpt_oss_cloud(), nomic())
        fields = self.verdict(self.check(emu.url, *args), 0, "nomic-embed-text:latest a vector")
        self.assertEqual((fields["cloud"], fields["vram_pct"]), ("yes", "100"))
        self.assertEqual(self.warmups(emu), [("/api/generate", "gpt-oss:120b-cloud", 200),
                                             ("/api/embed", "nomic-embed-text:latest", 200)])
        self.assertOneLatePs(emu)
        self.assertEqual(emu.loaded, {"nomic-embed-text:latest"})
        self.drain()
        emu = self.ollama(gpt_oss_cloud(), nomic(gpu_pct=0))
        self.verdict(self.check(emu.url, *args), 69, "nomic-embed-text:latest", "CPU")

    def test_an_unlisted_cloud_reference_is_a_cloud_model_not_a_pull(self):
        """NAME:TAG-cloud and NAME:cloud need no pull (Ollama 0.17.6 on): 78 cloud,
        never "ollama pull", nothing warmed; --allow-cloud warms it (relayed)."""
        emu = self.ollama(llama())
        for ref in ("qwen3-coder:480b-cloud", "deepseek-v3.1:671b-cloud", "gpt-oss:20b:cloud"):
            with self.subTest(ref=ref):
                self.drain()
                res = self.check(emu.url, "--model", ref)
                fields = self.verdict(res, 78, "%s is an Ollama cloud model" % ref)
                self.assertNotIn("pull", fields["reason"])
        self.assertEqual(emu.posts(), [])
        self.drain()
        res = self.check(emu.url, "--model", "qwen3-coder:480b-cloud", "--allow-cloud")
        self.assertEqual(self.verdict(res, 0)["cloud"], "yes")
        self.assertEqual(self.warmups(emu), [("/api/generate", "qwen3-coder:480b-cloud", 200)])

    def test_a_slow_answer_from_ollama_com_gets_the_load_bound(self):
        """ollama.com may queue or cold-start a cloud model: its warm-up gets
        --load-timeout and the default deadline grows by as much, so a relay
        answering after 5 s with the default --timeout (3 s) is ready (before: 75
        "timed out after 3s")."""
        emu = self.ollama(Model("gpt-oss:120b-cloud", "cloud", load_seconds=5))
        res = self.run_gp(["--host", emu.url, "--model", "gpt-oss:120b-cloud",
                           "--allow-cloud"])
        self.verdict(res, 0, "gpt-oss:120b-cloud answered a token", "ollama.com")
        self.assertEqual(self.warmups(emu), [("/api/generate", "gpt-oss:120b-cloud", 200)])

    def test_cloud_turned_off_on_the_server_names_ollama_no_cloud(self):
        """403 "ollama cloud is disabled": 78 naming OLLAMA_NO_CLOUD, not Ollama's
        host guard (the 403 of a wrong Host header)."""
        emu = self.ollama(gpt_oss_cloud(), cloud="disabled")
        self.assertEqual(refuse(emu, "gpt-oss:120b-cloud"),
                         "ollama cloud is disabled: remote model is unavailable")
        emu.requests[:] = []
        res = self.check(emu.url, "--model", "gpt-oss:120b-cloud", "--allow-cloud")
        fields = self.verdict(res, 78, "403 ollama cloud is disabled", "OLLAMA_NO_CLOUD")
        self.assertNotIn("host guard", fields["reason"])
        self.assertEqual(self.warmups(emu), [("/api/generate", "gpt-oss:120b-cloud", 403)])

    def test_a_server_not_signed_in_says_run_ollama_signin(self):
        """401 {"error":"unauthorized","signin_url":...}: 78 "run ollama signin",
        the link without its query (the host name and the server's key)."""
        emu = self.ollama(gpt_oss_cloud(), cloud="signed_out")
        res = self.check(emu.url, "--model", "gpt-oss:120b-cloud", "--allow-cloud")
        fields = self.verdict(res, 78, "401 unauthorized", "run ollama signin",
                              "https://ollama.com/connect")
        self.assertNotIn("key=", fields["reason"])
        self.assertNotIn("gpu-host", fields["reason"])


class ResultAndMetricsTest(ModelsCase):
    def test_metrics_carry_the_model_list_and_one_warmup_family_per_model(self):
        metrics = os.path.join(self.dir, "gpu.prom")
        emu = self.ollama(qwen(), nomic())
        res = self.check(emu.url, "--model", "qwen3:latest", "--model",
                         "nomic-embed-text:latest", "--metrics-file", metrics,
                         "--state-dir", os.path.join(self.dir, "state"))
        self.verdict(res, 0)
        with open(metrics) as handle:
            families = strict_parse(handle.read())
        labels = 'host="%s",model="qwen3:latest,nomic-embed-text:latest"' % emu.url
        self.assertEqual(families["gpu_preflight_ready"], [(labels, "1")])
        self.assertEqual(families["gpu_preflight_exit_code"], [(labels, "0")])
        samples = families.get("gpu_preflight_model_warmup_seconds")
        self.assertIsNotNone(samples, "no gpu_preflight_model_warmup_seconds family")
        found = []
        for text, value in samples:
            pairs = dict(re.findall(r'(\w+)="([^"]*)"', text))
            found.append((pairs.get("host"), pairs.get("model"), pairs.get("kind")))
            self.assertGreaterEqual(float(value), 0.0)
        self.assertEqual(sorted(found), sorted([
            (emu.url, "qwen3:latest", "generate"),
            (emu.url, "nomic-embed-text:latest", "embed")]))

    def test_json_entries_carry_kind_capabilities_and_placement(self):
        emu = self.ollama(qwen(), nomic(), version=NEW)
        res = self.check(emu.url, "--model", "qwen3", "--model", "nomic-embed-text", "--json")
        self.assertEqual((res.code, res.stderr), (0, ""), res)
        models = self.json_models(res)
        self.assertEqual([(m["name"], m["kind"]) for m in models],
                         [("qwen3:latest", "generate"), ("nomic-embed-text:latest", "embed")])
        for entry in models:
            self.assertLessEqual({"name", "kind", "capabilities", "warmup_ms", "resident",
                                  "size_vram", "reason"}, set(entry), entry)
            self.assertIsInstance(entry["warmup_ms"], (int, float))
            self.assertIs(entry["resident"], True)
        self.assertEqual(models[0]["capabilities"], ["completion", "tools", "thinking"])
        self.assertEqual(models[1]["capabilities"], ["embedding"])
        self.assertEqual((models[0]["size_vram"], models[1]["size_vram"]),
                         (5200000000, 274302450))
        self.verdict(res, 0, quiet=False)
        old = self.ollama(qwen(), nomic(), version=OLD)
        res = self.check(old.url, "--model", "qwen3", "--model", "nomic-embed-text", "--json")
        self.assertEqual(res.code, 0, res)
        self.assertEqual([m["capabilities"] for m in self.json_models(res)], [None, None])
        self.log()

    def test_a_shared_verdict_covers_the_model_list_and_the_requirements(self):
        emu = self.ollama(qwen(), nomic(), llama())
        base = ["--state-dir", os.path.join(self.dir, "state"), "--share-result", "60"]
        both = ["--model", "qwen3", "--model", "nomic-embed-text"]
        self.verdict(self.check(emu.url, *(base + both)), 0)
        for other in (["--model", "qwen3"], both + ["--model", "llama3.2"],
                      both + ["--require", "tools"]):
            with self.subTest(args=other):
                self.drain()
                sent = len(emu.posts(*WARMUPS))
                fields = self.verdict(self.check(emu.url, *(base + other)), 0)
                self.assertNotEqual(fields.get("shared"), "reused")
                self.assertGreater(len(emu.posts(*WARMUPS)), sent)
        self.drain()
        sent = len(emu.requests)
        fields = self.verdict(self.check(emu.url, *(base + both)), 0)
        self.assertEqual(fields.get("shared"), "reused")
        self.assertEqual(len(emu.requests), sent)


class OpenAIModelsTest(ModelsCase):
    def check_openai(self, emu, *args):
        return self.check(emu.url, "--api", "openai", *args)

    def test_completion_and_embedding_models_by_the_wrong_kind_text(self):
        """Every --model in /v1/models; the generative one proven by a 1-token
        completion, the embedding one (its completion answered with vLLM's "does not
        support Completions API", whatever the status) by POST /v1/embeddings."""
        for era in ("200-nested", "200-flat", "501"):
            with self.subTest(vllm=era):
                self.drain()
                emu = self.openai(models=("qwen2.5-0.5b", "bge-m3=embed"), wrong_kind=era)
                res = self.check_openai(emu, "--model", "qwen2.5-0.5b", "--model", "bge-m3")
                fields = self.verdict(res, 0)
                self.assertModelsField(fields, ("qwen2.5-0.5b", "generate"),
                                       ("bge-m3", "embed"))
                posts = emu.posts()
                self.assertEqual([(p, b["model"]) for p, b in posts], [
                    ("/v1/completions", "qwen2.5-0.5b"), ("/v1/completions", "bge-m3"),
                    ("/v1/embeddings", "bge-m3")])
                self.assertEqual(posts[0][1]["max_tokens"], 1)
                self.assertEqual(posts[2][1], {"model": "bge-m3", "input": "test"})
                self.assertEqual(emu.count("GET", "/v1/models"), 1)

    def test_chat_completions_when_the_server_has_no_completions(self):
        """/v1/completions 404 or 405: one user message "test", max_tokens 1."""
        for mode, status in (("chat_only", 404), ("completions_405", 405)):
            with self.subTest(mode=mode):
                self.drain()
                emu = self.openai(mode=mode)
                res = self.check_openai(emu, "--model", "qwen2.5-0.5b")
                self.verdict(res, 0)
                posts = emu.posts()
                self.assertEqual([p for p, _ in posts],
                                 ["/v1/completions", "/v1/chat/completions"])
                chat = dict(posts[1][1])
                if chat.get("stream") is False:
                    del chat["stream"]
                self.assertEqual(chat, {"model": "qwen2.5-0.5b", "max_tokens": 1, "messages": [
                    {"role": "user", "content": "test"}]})

    def test_llama_server_in_embeddings_mode(self):
        """llama-server --embeddings answers completions 501 "does not support
        completions": the model is proven through /v1/embeddings."""
        emu = self.openai("llamacpp", models=("bge-m3=embed",), embeddings=True)
        res = self.check_openai(emu, "--model", "bge-m3", "--json")
        self.assertEqual((res.code, res.stderr), (0, ""), res)
        self.assertEqual([(m["name"], m["kind"]) for m in self.json_models(res)],
                         [("bge-m3", "embed")])
        self.assertEqual([p for p, _ in emu.posts()], ["/v1/completions", "/v1/embeddings"])
        self.assertEqual(emu.posts()[1][1], {"model": "bge-m3", "input": "test"})
        self.verdict(res, 0, quiet=False)

    def test_a_list_of_per_token_vectors_counts(self):
        """data[0].embedding as a list of lists (pooling none) is a proof too."""
        emu = self.openai(models=("bge-m3=embed",), embedding_shape="nested")
        self.verdict(self.check_openai(emu, "--model", "bge-m3"), 0)
        self.assertEqual([p for p, _ in emu.posts()], ["/v1/completions", "/v1/embeddings"])

    def test_an_empty_embedding_is_unavailable(self):
        emu = self.openai(models=("qwen2.5-0.5b", "bge-m3=embed"), mode="empty_embedding")
        res = self.check_openai(emu, "--model", "qwen2.5-0.5b", "--model", "bge-m3")
        self.verdict(res, 69, "embedding")

    def test_a_200_whose_body_is_an_error_is_a_failure(self):
        """vLLM answered errors with status 200 for a while: never ready."""
        emu = self.openai(mode="error_in_200")
        res = self.check_openai(emu, "--model", "qwen2.5-0.5b")
        self.verdict(res, 75, "out of memory")

    def test_a_status_that_is_not_an_object_is_an_unknown_load_state(self):
        """Two models, one listed with llama-server's router status object, the other
        with a status that is a string, a number, a list or true: no internal error
        (70). That model's load state is unknown (ready, and said so); the other,
        when its status says unloaded, is still not ready (75)."""
        for status in ("loaded", 1, ["loaded"], True):
            for state, code, text in (("loaded", 0, "load state of b not reported"),
                                      ("unloaded", 75, "a was unloaded")):
                with self.subTest(status=status, other=state):
                    self.drain()
                    listing = json.dumps({"data": [{"id": "a", "status": {"value": state}},
                                                   {"id": "b", "status": status}]}).encode()
                    url = self.scripted_server(lambda method, path, n, listing=listing: (
                        200, listing if path == "/v1/models" else b'{"choices": [{}]}'))
                    res = self.check(url, "--api", "openai", "--model", "a", "--model", "b")
                    fields = self.verdict(res, code, text)
                    self.assertEqual(fields["stage"], "placement" if code else "-")

    def test_every_missing_model_is_named(self):
        emu = self.openai(models=("qwen2.5-0.5b",))
        res = self.check_openai(emu, "--model", "qwen2.5-0.5b", "--model", "bge-m3",
                                "--model", "e5-large")
        self.verdict(res, 78, "bge-m3", "e5-large")
        self.assertEqual(emu.posts(), [])

    def test_llama_cpp_python_with_embeddings_on_proves_a_generative_model_by_completion(self):
        """llama-cpp-python started with --embedding true still completes: the model
        is generative and /v1/embeddings is not needed (the real-server case)."""
        emu = self.openai("llama-cpp-python", models=("tiny",), embeddings=True)
        res = self.check_openai(emu, "--model", "tiny", "--json")
        self.assertEqual(res.code, 0, res)
        self.assertEqual([(m["name"], m["kind"]) for m in self.json_models(res)],
                         [("tiny", "generate")])
        self.assertEqual([p for p, _ in emu.posts()], ["/v1/completions"])
        self.verdict(res, 0, quiet=False)



class OddContextEmulator(Emulator):
    """An Ollama whose /api/ps says context_length is odd (a proxy's or a
    broken build's: Ollama's own is an int, api.ProcessModelResponse)."""

    def __init__(self, odd, **kwargs):
        self.odd = odd
        Emulator.__init__(self, **kwargs)

    def _ps_entries(self, mode):
        entries = Emulator._ps_entries(self, mode)
        for entry in entries:
            entry["context_length"] = self.odd
        return entries


class ContextTest(ModelsCase):
    """--min-context N and the runner's context: the window each server reports
    (Ollama /api/ps context_length, vLLM max_model_len, llama-server /props n_ctx),
    and a warm-up that reuses the job's runner instead of reloading it."""

    def test_ollama_context_below_the_minimum_is_78_naming_both_numbers_and_the_fixes(self):
        emu = self.ollama(qwen(), loaded=("qwen3:latest",))      # the server default: 4096
        fields = self.verdict(self.check(emu.url, "--min-context", "32768"), 78,
                              "qwen3:latest runs with a 4096-token context",
                              "the job needs 32768", "OLLAMA_CONTEXT_LENGTH=32768",
                              "PARAMETER num_ctx 32768", "--ollama-option num_ctx=32768",
                              "/v1 API cannot set num_ctx")
        self.assertEqual((fields["stage"], fields["ctx"]), ("context", "4096"))
        self.assertEqual(emu.reloads, [])

    def test_ollama_context_at_the_minimum_is_ready_and_reported(self):
        """ctx= in the line and context_length in --json, also without --min-context."""
        emu = self.ollama(qwen(), llama(), loaded=("qwen3:latest",), context_length=65536)
        fields = self.verdict(self.check(emu.url, "--model", "qwen3", "--min-context",
                                         "65536"), 0)
        self.assertEqual((fields["ctx"], fields.get("problem")), ("65536", None))
        self.drain()
        res = self.check(emu.url, "--model", "qwen3", "--model", "llama3.2", "--json")
        doc = json.loads(res.stdout)
        self.assertEqual(doc["context_length"], 65536)
        self.assertEqual([m["context_length"] for m in doc["models"]], [65536, 65536])
        self.verdict(res, 0, quiet=False)

    def test_a_server_that_does_not_report_the_context_is_a_problem_not_a_failure(self):
        emu = self.ollama(qwen(), loaded=("qwen3:latest",), version="0.9.0")
        fields = self.verdict(self.check(emu.url, "--min-context", "32768"), 0)
        self.assertIn("context not checked", fields["problem"])
        self.assertNotIn("ctx", fields)

    def test_a_model_not_loaded_under_warmup_off_is_said_not_loaded(self):
        """--warmup off and a cold model: its context is unknown because no
        runner has one yet, not because the server does not report it."""
        emu = self.ollama(qwen())
        fields = self.verdict(self.check(emu.url, "--min-context", "8192", "--warmup",
                                         "off"), 0)
        self.assertIn("context not checked: qwen3:latest not loaded", fields["problem"])
        self.assertNotIn("does not report", fields["problem"])

    def test_vllm_max_model_len_is_the_context(self):
        emu = self.openai("vllm", max_model_len=8192)
        fields = self.verdict(self.check(emu.url, "--api", "openai", "--min-context",
                                         "32768"), 78,
                              "runs with a 8192-token context", "the job needs 32768",
                              "--max-model-len")
        self.assertEqual(fields["ctx"], "8192")
        self.drain()
        fields = self.verdict(self.check(emu.url, "--api", "openai", "--min-context",
                                         "8192"), 0)
        self.assertEqual(fields["ctx"], "8192")
        self.assertEqual(emu.count("GET", "/props"), 0)

    def test_llama_server_props_n_ctx_is_the_context_and_other_servers_say_none(self):
        emu = self.openai("llamacpp", n_ctx=4096)
        fields = self.verdict(self.check(emu.url, "--api", "openai", "--min-context",
                                         "8192"), 78, "runs with a 4096-token context",
                              "the job needs 8192", "--ctx-size")
        self.assertEqual((fields["ctx"], fields["props_ms"].isdigit()), ("4096", True))
        self.drain()
        emu = self.openai("llamacpp", n_ctx=16384)
        fields = self.verdict(self.check(emu.url, "--api", "openai", "--min-context",
                                         "8192"), 0)
        self.assertEqual(fields["ctx"], "16384")
        self.drain()
        emu = self.openai("llama-cpp-python")             # no max_model_len, no /props
        fields = self.verdict(self.check(emu.url, "--api", "openai", "--min-context",
                                         "8192"), 0)
        self.assertIn("context not checked", fields["problem"])

    def test_the_warmup_reuses_the_jobs_runner_at_its_context(self):
        """A job loaded qwen3 with num_ctx 32768; the warm-up sends no option of
        its own, yet asks for that num_ctx, so Ollama does not reload the runner."""
        emu = self.ollama(qwen(), loaded=("qwen3:latest",), load_seconds=2.0,
                          runner_options={"qwen3:latest": {"num_ctx": 32768}})
        fields = self.verdict(self.check(emu.url, "--model", "qwen3"), 0)
        self.assertEqual(emu.reloads, [])
        self.assertEqual(emu.posts("/api/generate")[0].body["options"],
                         {"num_ctx": 32768, "num_predict": 1})
        self.assertEqual((fields["ctx"], fields.get("problem")), ("32768", None))

    def test_a_warmup_that_still_reloads_the_runner_says_which_option_differed(self):
        emu = self.ollama(qwen(), loaded=("qwen3:latest",), load_seconds=1.5,
                          runner_options={"qwen3:latest": {"num_ctx": 32768}})
        fields = self.verdict(self.check(emu.url, "--model", "qwen3", "--ollama-option",
                                         "num_ctx=2048"), 0)
        self.assertEqual(len(emu.reloads), 1)
        self.assertIn("warm-up reloaded qwen3:latest", fields["problem"])
        self.assertIn("num_ctx 2048 differs from the loaded runner's 32768", fields["problem"])
        self.assertEqual(fields["ctx"], "2048")

    def test_min_context_judges_the_chat_model_not_its_embedding_model(self):
        """An agent's chat + embed pair: nomic-embed-text runs at 2048 (its
        training context), which says nothing of the chat's; with the warm-up
        and without, loaded or not."""
        emu = self.ollama(qwen(), nomic(), loaded=("qwen3:latest", "nomic-embed-text:latest"),
                          context_length=8192)
        for args in ((), ("--warmup", "off")):
            with self.subTest(args=args):
                self.drain()
                fields = self.verdict(self.check(emu.url, "--model", "qwen3", "--model",
                                                 "nomic-embed-text", "--min-context",
                                                 "8192", *args), 0)
                self.assertEqual((fields["ctx"], fields.get("problem")), ("8192", None))
        self.drain()
        self.verdict(self.check(emu.url, "--model", "qwen3", "--model", "nomic-embed-text",
                                "--min-context", "16384"), 78,
                     "qwen3:latest runs with a 8192-token context")

    def test_a_warmup_whose_num_ctx_reloads_the_runner_is_bounded_as_a_load(self):
        """The 78's own advice, --ollama-option num_ctx=8192 for a runner at
        4096, makes Ollama reload it: the warm-up gets --load-timeout (not
        --timeout, which threw the load away), the default deadline grows by
        it, and a reload that misses it says why it was a load."""
        emu = self.ollama(qwen(), loaded=("qwen3:latest",), load_seconds=4.0)
        args = ["--host", emu.url, "--model", "qwen3", "--ollama-option", "num_ctx=8192"]
        res = self.run_gp(args + ["--load-timeout", "30", "--json"])
        self.assertEqual(json.loads(res.stdout)["deadline_s"], 40, res)
        fields = self.verdict(res, 0, quiet=False, deadline=40)
        self.assertEqual((len(emu.reloads), fields["ctx"]), (1, "8192"))
        self.assertIn("num_ctx 8192 differs from the loaded runner's 4096", fields["problem"])
        self.drain()
        emu = self.ollama(qwen(), loaded=("qwen3:latest",), load_seconds=4.0)
        args[1] = emu.url
        self.verdict(self.run_gp(args + ["--load-timeout", "1"]), 75,
                     "timed out after 1s", "reload: num_ctx 8192 differs from the loaded "
                     "runner's 4096", "--load-timeout")

    def odd_ollama(self, odd, **kwargs):
        emu = OddContextEmulator(odd, models=[qwen()], loaded=("qwen3:latest",),
                                 load_seconds=0.2, **kwargs).start()
        self.addCleanup(emu.stop)
        return emu

    def test_an_odd_context_is_a_problem_and_fails_only_under_min_context(self):
        """A context_length or max_model_len that is no count does not fail a run
        without --min-context; under it the run fails (69) at stage context."""
        for odd in ("8192", -1, 4096.0, True):
            with self.subTest(odd=odd):
                self.drain()
                emu = self.odd_ollama(odd)
                fields = self.verdict(self.check(emu.url), 0)
                self.assertIn("context_length of qwen3:latest is %r, not a context window"
                              % odd, fields["problem"])
                self.drain()
                fields = self.verdict(self.check(emu.url, "--min-context", "8192"), 69,
                                      "not a context window", "--min-context cannot")
                self.assertEqual(fields["stage"], "context")
        for odd in ("32k", -1):
            with self.subTest(odd=odd):
                self.drain()
                emu = self.openai("vllm", max_model_len=odd)
                fields = self.verdict(self.check(emu.url, "--api", "openai", "--warmup",
                                                 "off"), 0)
                self.assertIn("max_model_len of", fields["problem"])
                self.drain()
                fields = self.verdict(self.check(emu.url, "--api", "openai", "--min-context",
                                                 "8192"), 69, "not a context window")
                self.assertEqual(fields["stage"], "context")


    def test_an_absurd_context_is_not_sent_back_as_num_ctx(self):
        """/api/ps context_length 1e12 or 2**63-1 is no runner's: the warm-up
        sends no num_ctx (the server's own default stands) and says why."""
        for odd in (10 ** 12, 2 ** 63 - 1):
            with self.subTest(odd=odd):
                self.drain()
                emu = self.odd_ollama(odd)
                fields = self.verdict(self.check(emu.url, "--model", "qwen3"), 0)
                self.assertEqual(emu.posts("/api/generate")[0].body["options"],
                                 {"num_predict": 1})
                self.assertEqual(emu.reloads, [])
                self.assertIn("context_length of qwen3:latest is %d, not a context window"
                              % odd, fields["problem"])


def fields_or_stderr(case, res):
    """The reason of a run that may end as a usage error (64, stderr only) or
    as a logged verdict: the text that names why."""
    if res.code == 64:
        return res.stderr
    return case.log()[1]["reason"]


class OpenAIKindsTest(ModelsCase):
    def test_task_gated_vllm_proves_an_embedding_model_by_embeddings(self):
        """vLLM 2026 main registers routes per task: a pooling model has no
        /v1/completions and no /v1/chat/completions (404 {"detail":"Not Found"},
        multi-model.md B5). Both refusals mean "not a generative model": the
        model is proven by POST /v1/embeddings, not refused as 'not an
        OpenAI-compatible server' (78)."""
        emu = self.openai(models=("qwen2.5-0.5b", "bge-m3=embed"), wrong_kind="404")
        res = self.check(emu.url, "--api", "openai", "--model", "qwen2.5-0.5b",
                         "--model", "bge-m3")
        fields = self.verdict(res, 0)
        self.assertModelsField(fields, ("qwen2.5-0.5b", "generate"), ("bge-m3", "embed"))
        self.assertEqual([p for p, b in emu.posts() if b["model"] == "bge-m3"][-1],
                         "/v1/embeddings")

    def test_an_observed_kind_that_contradicts_require_is_a_configuration_error(self):
        """--require MODEL=completion where the server itself refused generation
        (llama-server started with --embeddings --pooling mean on a chat model:
        501 'does not support completions', then vectors) is not met: 78, not a
        ready verdict with 'capabilities not checked'. The same on an Ollama
        before 0.6.4, whose refusal '"M" does not support generate' says it."""
        emu = self.openai("llamacpp", models=("qwen2.5-7b-instruct",), embeddings=True,
                          embedding_shape="flat")
        res = self.check(emu.url, "--api", "openai", "--model", "qwen2.5-7b-instruct",
                         "--require", "qwen2.5-7b-instruct=completion")
        self.verdict(res, 78, "qwen2.5-7b-instruct", "completion")
        emu = self.ollama(qwen(), nomic(), version=OLD)
        res = self.check(emu.url, "--model", "qwen3", "--model", "nomic-embed-text",
                         "--require", "nomic-embed-text=completion")
        self.verdict(res, 78, "nomic-embed-text", "completion")


class RouterTest(ModelsCase):
    def test_llama_server_router_unloading_a_model_is_not_ready(self):
        """llama-server router mode unloads the least recently used model when
        --models-max run (by count, multi-model.md B6): after proving both,
        GET /v1/models says the first is "unloaded". The job would reload a
        model on every call, as on an Ollama that evicts: 75 naming it
        (reference section 3: status.value == "loaded" for every id)."""
        emu = self.openai("llamacpp", models=("qwen2.5-7b", "llama3.1-8b"), router_max=1)
        res = self.check(emu.url, "--api", "openai", "--model", "qwen2.5-7b",
                         "--model", "llama3.1-8b")
        self.verdict(res, 75, "qwen2.5-7b")
        self.assertEqual(emu.running, ["llama3.1-8b"])
        emu = self.openai("llamacpp", models=("qwen2.5-7b", "llama3.1-8b"), router_max=4)
        res = self.check(emu.url, "--api", "openai", "--model", "qwen2.5-7b",
                         "--model", "llama3.1-8b")
        self.verdict(res, 0)


class AliasTest(ModelsCase):
    def test_two_tags_of_one_blob_share_one_runner_and_are_resident(self):
        """qwen3:latest and qwen3:8b with one digest share one runner; /api/ps
        lists it once, under the name that loaded it (multi-model.md A5, section
        3: 'aliases of one blob collapse into one entry'). Nothing was
        evicted: ready, not 75 'qwen3:8b was unloaded'."""
        emu = self.ollama(Model("qwen3:latest", "generate", ["completion", "tools"], blob="q3"),
                          Model("qwen3:8b", "generate", ["completion", "tools"], blob="q3"),
                          nomic())
        res = self.check(emu.url, "--model", "qwen3", "--model", "qwen3:8b",
                         "--model", "nomic-embed-text")
        self.verdict(res, 0)
        self.assertEqual(emu.evictions, [])
        self.assertOneLatePs(emu)


class RequireNotWaivedTest(ModelsCase):
    def test_warmup_off_still_holds_the_models_to_require(self):
        """--warmup off skips the warm-up, not --require: /api/tags (0.30+)
        declares the capabilities without loading anything. A model lacking one,
        or a MODEL= that names no model of the check, is not ready."""
        emu = self.ollama(llama(caps=("completion",)), nomic())
        res = self.check(emu.url, "--model", "llama3.2", "--warmup", "off",
                         "--require", "tools")
        self.assertIn(res.code, (64, 78), res)
        self.assertIn("tools", fields_or_stderr(self, res))
        res = self.check(emu.url, "--model", "llama3.2", "--warmup", "off",
                         "--require", "qwen3=tools")
        self.assertIn(res.code, (64, 78), res)
        self.assertIn("qwen3", fields_or_stderr(self, res))
        self.assertEqual(emu.posts(), [])

    def test_a_failing_api_show_does_not_waive_require(self):
        """0.6.4 to 0.29 declare capabilities in /api/show only. When that answer
        is broken the capabilities are unknown, not absent: --require cannot be
        met and the run is not ready (the 'server declares none' note is for
        servers before 0.6.4)."""
        emu = self.ollama(llama(caps=("completion",)), nomic(), version=MID, mode="garbage",
                          fault_on="/api/show")
        res = self.check(emu.url, "--model", "llama3.2", "--model", "nomic-embed-text",
                         "--require", "tools")
        self.assertIn(res.code, (69, 75, 78), res)
        self.assertIn("/api/show", self.log()[1]["reason"])

    def test_a_model_declaring_completion_and_embedding_is_held_to_require(self):
        """A manifest's config.capabilities may declare both (multi-model.md
        A4): the model generates, so --require tools applies to it; it is not
        exempt as an embedding model."""
        emu = self.ollama(Model("llama3.2:latest", "generate", ["completion", "embedding"]),
                          version=MID)
        res = self.check(emu.url, "--model", "llama3.2", "--require", "tools")
        self.verdict(res, 78, "llama3.2", "tools")

    def test_require_in_the_environment_takes_a_space_after_a_comma(self):
        """GPU_PREFLIGHT_REQUIRE="tools, thinking" means what --require
        "tools, thinking" means (and GPU_PREFLIGHT_MODEL="a, b" already does)."""
        emu = self.ollama(qwen(), nomic())
        res = self.check(emu.url, "--model", "qwen3",
                         env=support.cron_env(GPU_PREFLIGHT_REQUIRE="tools, thinking"))
        self.verdict(res, 0)


class CaseOfPs(Emulator):
    """/api/ps lists the runner under the name in the case a client asked for
    it (ShortName is built from the request's name), /api/tags as pulled."""

    def _ps_entries(self, mode):
        entries = Emulator._ps_entries(self, mode)
        for entry in entries:
            entry["name"] = entry["model"] = entry["name"].upper()
        return entries


class OneModelOOM(Emulator):
    """The load of llama3.2:latest alone fails with a CUDA allocation error."""

    def _fault(self, mode, raw_name, name):
        if name == "llama3.2:latest":
            return ollama_emu._error(*ollama_emu._GENERATE_ERRORS["oom"])
        return Emulator._fault(self, mode, raw_name, name)


class ReportTest(ModelsCase):
    def start(self, cls, *models, **kwargs):
        emu = cls(models=models, loaded=kwargs.pop("loaded", ()), load_seconds=0.1,
                  **kwargs).start()
        self.addCleanup(emu.stop)
        return emu

    def test_default_model_loaded_under_another_case_is_warmed(self):
        """No --model: the model already loaded is chosen; /api/ps naming it
        QWEN3:LATEST (as /api/tags says qwen3:latest) is the same model, not
        an internal error (70, StopIteration)."""
        emu = self.start(CaseOfPs, Model("qwen3:latest"), loaded=("qwen3:latest",))
        res = self.check(emu.url)
        self.verdict(res, 0)

    def test_the_reason_names_the_model_that_failed(self):
        """Two models, the second fails to load: the reason says which (the log
        line's model= is the first model, which answered)."""
        emu = self.start(OneModelOOM, Model("qwen3:latest"), Model("llama3.2:latest"))
        res = self.check(emu.url, "--model", "qwen3", "--model", "llama3.2")
        self.verdict(res, 75, "llama3.2", "unable to allocate")

    def test_json_gives_each_model_its_reason(self):
        """--json "models": the evicted model's entry says why (each entry has
        a reason field); an empty reason is what a fine model has."""
        emu = self.ollama(qwen(), nomic(), max_loaded=1)
        res = self.check(emu.url, "--model", "qwen3", "--model", "nomic-embed-text", "--json")
        self.assertEqual(res.code, 75, res)
        entries = dict((m["name"], m) for m in json.loads(res.stdout)["models"])
        self.assertIn("unloaded", entries["qwen3:latest"]["reason"])
        self.assertEqual(entries["nomic-embed-text:latest"]["reason"], "")
        self.log()


class VectorTest(ModelsCase):
    def test_nan_is_not_a_vector(self):
        """A server that writes NaN (Python's json.dumps does) gave no usable
        embedding: data[0].embedding must be finite numbers, not NaN (which is
        not even JSON)."""
        answers = {
            ("GET", "/health"): b"",
            ("GET", "/v1/models"): b'{"object":"list","data":[{"id":"bge-m3","object":"model"}]}',
            ("POST", "/v1/completions"): b'{"object":"error","message":"The model does not '
                                         b'support Completions API","type":"BadRequestError",'
                                         b'"param":null,"code":400}',
            ("POST", "/v1/embeddings"): b'{"object":"list","data":[{"index":0,"object":'
                                        b'"embedding","embedding":[NaN,NaN,NaN]}]}',
        }

        def answer(method, path, calls):
            body = answers.get((method, path))
            return (404, b'{"detail":"Not Found"}') if body is None else (200, body)
        url = self.scripted_server(answer)
        res = self.check(url, "--api", "openai", "--model", "bge-m3")
        self.verdict(res, 69, "embedding")


if __name__ == "__main__":
    import unittest
    unittest.main()
