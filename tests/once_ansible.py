"""The README's Ansible recipe, applied by the real ansible-playbook.

The README's tasks (the plain copy or the fast layout, then the cron entry;
read from README.md, not retyped) go into a playbook for localhost with the
local connection, gpu_preflight.py into the playbook's files/, and
ansible-playbook applies it twice in a private mount namespace; what it
deployed is then checked and run by the real cron (tests/cfg_harness.py).
ansible-core comes from PyPI (.ci/run installs it into the CI venv and
exports ANSIBLE_PLAYBOOK). Modules run on Debian's /usr/bin/python3: with
pyenv's shims on PATH, interpreter discovery would pick a shim that fails.

Run once per suite (not per interpreter), as root:
    cd tests && /usr/bin/python3 -m unittest -v once_ansible
"""

import os
import re
import shutil
import unittest

import cfg_harness
import support

RECAP = re.compile(r"^localhost\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)"
                   r"\s+failed=(\d+)", re.M)


class AnsibleTest(cfg_harness.DeployChecks, unittest.TestCase):
    TOOL = "Ansible"

    def prepare(self):
        return cfg_harness.tool_path(self, "ansible-playbook", "ANSIBLE_PLAYBOOK")

    def apply(self, host, tool, text):
        play = os.path.join(host.dir, "play")
        if not os.path.isdir(play):
            os.makedirs(os.path.join(play, "files"))
            shutil.copy(support.SCRIPT, os.path.join(play, "files", "gpu_preflight.py"))
            tasks = "".join("    " + line + "\n" if line else "\n"
                            for line in text.rstrip("\n").split("\n"))
            with open(os.path.join(play, "ansible.cfg"), "w") as handle:
                handle.write("[defaults]\n")       # only the defaults, whatever /etc has
            with open(os.path.join(play, "site.yml"), "w") as handle:
                handle.write("- hosts: localhost\n  gather_facts: false\n  tasks:\n"
                             + tasks)
        home = os.path.join(host.dir, "state", "home")
        env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": home,
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "ANSIBLE_NOCOLOR": "1",
               "ANSIBLE_HOME": os.path.join(home, ".ansible"),
               "ANSIBLE_LOCAL_TEMP": os.path.join(home, "tmp"),
               # absolute: "~/.ansible/tmp" becomes ~root's, whatever HOME says
               "ANSIBLE_REMOTE_TEMP": os.path.join(home, "remote-tmp"),
               "ANSIBLE_CONFIG": os.path.join(play, "ansible.cfg"),
               # each module logs its invocation to syslog (the machine's
               # /dev/log) unless told not to (ansible.cfg no_target_syslog)
               "ANSIBLE_NO_TARGET_SYSLOG": "True"}
        status, out = host.run(
            [tool, "-i", "localhost,", "-c", "local",
             "-e", "ansible_python_interpreter=" + cfg_harness.DEBIAN_PYTHON,
             os.path.join(play, "site.yml")], env=env)
        recap = RECAP.findall(out)
        self.assertEqual((status, len(recap)), (0, 1), out)
        ok, changed, unreachable, failed = (int(n) for n in recap[0])
        self.assertEqual((unreachable, failed), (0, 0), out)
        self.assertEqual(ok, text.count("- name:"), "a task did not run:\n" + out)
        return changed > 0, out


if __name__ == "__main__":
    unittest.main()
