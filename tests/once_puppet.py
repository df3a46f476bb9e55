"""The README's Puppet manifests, applied by the real `puppet apply`.

The README's manifest (the plain copy or the fast layout, then the cron entry;
read from README.md, not retyped) is applied twice with `puppet apply
--detailed-exitcodes` in a private mount namespace, its
puppet:///modules/gpu/gpu_preflight.py served from a temporary module path
(modules/gpu/files/), Puppet's own directories (confdir, vardir, codedir,
logdir, rundir, publicdir) in the temp dir; what it deployed is then checked and run by
the real cron (tests/cfg_harness.py). Puppet 7 is Debian's `puppet` package
(.ci/run installs it when missing).

Run once per suite (not per interpreter), as root:
    cd tests && /usr/bin/python3 -m unittest -v once_puppet
"""

import os
import shutil
import unittest

import cfg_harness
import support


class PuppetTest(cfg_harness.DeployChecks, unittest.TestCase):
    TOOL = "Puppet"

    def prepare(self):
        return cfg_harness.tool_path(self, "puppet", "PUPPET")

    def apply(self, host, tool, text):
        state = os.path.join(host.dir, "state", "puppet")
        manifest = os.path.join(state, "site.pp")
        files = os.path.join(state, "modules", "gpu", "files")
        if not os.path.isdir(files):
            os.makedirs(files)
            shutil.copy(support.SCRIPT, os.path.join(files, "gpu_preflight.py"))
            with open(manifest, "w") as handle:
                handle.write(text)
        argv = [tool, "apply", "--detailed-exitcodes", "--color=false",
                "--modulepath", os.path.join(state, "modules")]
        for setting in ("confdir", "vardir", "codedir", "logdir", "rundir", "publicdir"):
            argv += ["--" + setting, os.path.join(state, setting)]
        env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8",
               "HOME": os.path.join(state, "home")}
        status, out = host.run(argv + [manifest], env=env)
        # --detailed-exitcodes: 0 nothing changed, 2 changes, 4 or 6 failures
        self.assertIn(status, (0, 2), out)
        # Facter cannot read /proc/1/environ in some containers (this machine):
        # an error about the facts, not about the manifest
        errors = [line for line in out.split("\n") if line.startswith("Error:")
                  and not line.startswith("Error: Facter: Permission denied")]
        self.assertEqual(errors, [], out)
        self.assertIn("Notice: Applied catalog in ", out)
        return status == 2, out


if __name__ == "__main__":
    unittest.main()
