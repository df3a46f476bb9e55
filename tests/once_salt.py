"""The README's Salt states, applied by the real `salt-call --local`.

The README's states (the plain copy or the fast layout, then the cron entry;
read from README.md, not retyped) go into one SLS file in a temporary
file_roots, with gpu_preflight.py as salt://gpu/gpu_preflight.py, and
`salt-call --local state.apply` applies them twice in a private mount
namespace (a minion config of the test's own: file_client local, root_dir in
the temp dir, so Salt's cache, pki and log stay there); what it deployed is
then checked and run by the real cron (tests/cfg_harness.py). Salt comes from
PyPI (.ci/run installs it into the CI venv and exports SALT_CALL).

Run once per suite (not per interpreter), as root:
    cd tests && /usr/bin/python3 -m unittest -v once_salt
"""

import json
import os
import shutil
import unittest

import cfg_harness
import support


class SaltTest(cfg_harness.DeployChecks, unittest.TestCase):
    TOOL = "Salt"

    def prepare(self):
        return cfg_harness.tool_path(self, "salt-call", "SALT_CALL")

    def apply(self, host, tool, text):
        state = os.path.join(host.dir, "state", "salt")
        roots = os.path.join(state, "srv")
        if not os.path.isdir(roots):
            os.makedirs(os.path.join(roots, "gpu"))
            os.makedirs(os.path.join(state, "conf"))
            shutil.copy(support.SCRIPT, os.path.join(roots, "gpu", "gpu_preflight.py"))
            with open(os.path.join(roots, "gpu_preflight_recipe.sls"), "w") as handle:
                handle.write(text)
            with open(os.path.join(state, "conf", "minion"), "w") as handle:
                handle.write("file_client: local\nid: recipe-test\nroot_dir: %s\n"
                             "file_roots:\n  base:\n    - %s\n" % (
                                 json.dumps(os.path.join(state, "root")),
                                 json.dumps(roots)))
        result = os.path.join(state, "result.json")
        if os.path.exists(result):
            os.unlink(result)
        env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8",
               "HOME": os.path.join(state, "home")}
        status, out = host.run(
            [tool, "--local", "--config-dir", os.path.join(state, "conf"),
             "--retcode-passthrough", "--out", "json", "--out-file", result,
             "state.apply", "gpu_preflight_recipe"], env=env)
        self.assertEqual(status, 0, out)
        with open(result) as handle:
            states = json.load(handle)["local"]
        self.assertIsInstance(states, dict, states)
        self.assertEqual(len(states), text.count("file.managed:")
                         + text.count("file.directory:"), states)
        failed = [key for key, value in states.items() if value.get("result") is not True]
        self.assertEqual(failed, [], json.dumps(states, indent=1))
        return any(value.get("changes") for value in states.values()), \
            json.dumps(states, indent=1)


if __name__ == "__main__":
    unittest.main()
