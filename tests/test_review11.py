"""Regression tests from a hostile review of issue 11 (several models,
embedding models, required capabilities).

Each test reproduces one finding: a real server version the check refuses
(vLLM with task-gated routes), two tags of one blob reported as evicted, a
--require that --warmup off, a failing /api/show or an observed model kind
silently waives, a llama-server router that unloads one model for the next,
a default model that ends in an internal error, a failure reason that does
not say which model failed, an environment --require that refuses what the
flag accepts, and a NaN taken for a vector. They fail on the
code the review looked at (3ccd4bc) and pass once each finding is fixed.
The real script in cron's environment (support.run_script) against the
emulators (tests/ollama_emu.py, tests/openai_emu.py) or a scripted server.
"""

import json

import ollama_emu
import support
from ollama_emu import Emulator, Model
from test_models import MID, OLD, ModelsCase, llama, nomic, qwen


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
        QWEN3:LATEST (as /api/tags says qwen3:latest) is the same model, as it
        was before issue 11, not an internal error (70, StopIteration)."""
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
        """--json "models": the evicted model's entry says why (the issue's
        entry fields include reason); an empty reason is what a fine model has."""
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
