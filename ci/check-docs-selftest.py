#!/usr/bin/env python3
"""ci/check-docs.py catches what it is for, and only that: each case is a small tree in a temp
directory (the real crates/ and vmm-config/ linked in for the config structs), checked by the
script itself; `backstop` is a stand-in printing clap-shaped help."""

import os
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECK = REPO / "ci/check-docs.py"

# What the stand-in console answers to `backstop [PATH...] --help`.
FAKE_TREE = {
    (): ["status", "vms", "events", "snapshot", "trigger", "halt", "help"],
    ("snapshot",): ["create", "list", "help"],
    ("halt",): ["clear", "help"],
}
FAKE_BIN = """#!/usr/bin/env python3
import sys
tree = %r
path = tuple(a for a in sys.argv[1:] if a != "--help")
if path not in tree and path[:-1] not in tree:
    sys.exit(2)
print("About\\n\\nUsage: backstop [OPTIONS] <COMMAND>\\n")
if path in tree:
    print("Commands:")
    for c in tree[path]:
        print(f"  {c:10}  what {c} does")
    print()
print("Options:\\n      --json  JSON\\n  -h, --help  Print help")
"""


class CheckDocs(unittest.TestCase):
    def run_check(self, files, *args):
        with tempfile.TemporaryDirectory() as d:
            root = Path(d)
            (root / "crates").symlink_to(REPO / "crates")
            (root / "vmm-config").symlink_to(REPO / "vmm-config")
            for name, text in files.items():
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                (root / name).write_text(textwrap.dedent(text))
            fake = root / "backstop"
            fake.write_text(FAKE_BIN % (FAKE_TREE,))
            fake.chmod(0o755)
            out = subprocess.run(
                [sys.executable, CHECK, "--root", root, *args],
                capture_output=True,
                text=True,
                env={**os.environ, "BACKSTOP_BIN": str(fake)},
            )
            return out.returncode, out.stdout.splitlines()

    def test_a_clean_tree_passes(self):
        rc, lines = self.run_check(
            {
                "README.md": "# backstop\n\nSee [the manual](docs/manual.md#config-1) and [drift](docs/drift.md).\n",
                "docs/manual.md": "# Manual\n\n## Config\n\n## Config\n\n## The `userfaultfd` trade-off\n\n[up](#the-userfaultfd-trade-off), [readme](../README.md#backstop)\n",
                "docs/drift.md": "# Drift\n",
            },
            "--verbs",
        )
        self.assertEqual((rc, lines), (0, []))

    def test_a_readme_over_250_lines_fails(self):
        rc, lines = self.run_check({"README.md": "x\n" * 250})
        self.assertEqual((rc, lines), (0, []))
        rc, lines = self.run_check({"README.md": "x\n" * 251})
        self.assertEqual(rc, 1)
        self.assertEqual(lines, ["README.md:251: 251 lines: at most 250 (the rest belongs in docs/)"])

    def test_a_broken_link_fails(self):
        rc, lines = self.run_check({"README.md": "[gone](docs/missing.md)\n\n```\n[in a fence](nowhere.md)\n```\n[web](https://example.com/x.md)\n"})
        self.assertEqual(rc, 1)
        self.assertEqual(lines, ["README.md:1: link to docs/missing.md: docs/missing.md does not exist"])

    def test_a_bad_anchor_fails_and_duplicate_headings_count_up(self):
        rc, lines = self.run_check(
            {
                "README.md": "# Top\n\n[ok](docs/m.md#config-1) [bad](docs/m.md#config-2) [here](#nope) [ok](#top)\n",
                "docs/m.md": "# M\n\n## Config\n\nConfig\n------\n\n```\n## Config\n```\n",
            }
        )
        self.assertEqual(rc, 1)
        self.assertEqual(
            lines,
            [
                "README.md:3: link to docs/m.md#config-2: no heading in docs/m.md has the anchor #config-2",
                "README.md:3: link to #nope: no heading in this file has the anchor #nope",
            ],
        )

    def test_console_commands_are_walked_through_the_help_tree(self):
        readme = """\
            `backstop snapshot create`, `backstop --vm db1 snapshot list --json`, `backstop [--vm NAME] events --follow`,
            `backstop halt clear --to ID`, `backstop trigger force_rollback --reason R`, `backstopd --check-config`,
            `backstop status`, `backstop <command>`, `backstop snapshot`

            ```sh
            $ backstop vms
            BACKSTOP_VM=db1 backstop snapshot remove OLD
            ```

            `backstop frobnicate --now`
            """
        rc, lines = self.run_check({"README.md": readme}, "--verbs")
        self.assertEqual(rc, 1)
        self.assertEqual(
            lines,
            [
                "README.md:7: `BACKSTOP_VM=db1 backstop snapshot remove OLD`: `backstop snapshot` has no command `remove` (it has: create, help, list)",
                "README.md:10: `backstop frobnicate --now`: `backstop` has no command `frobnicate` (it has: events, halt, help, snapshot, status, trigger, vms)",
            ],
        )

    def test_a_missing_console_binary_is_one_clear_line(self):
        with tempfile.TemporaryDirectory() as d:
            out = subprocess.run(
                [sys.executable, CHECK, "--verbs", "--root", REPO],
                capture_output=True,
                text=True,
                env={**os.environ, "BACKSTOP_BIN": str(Path(d) / "backstop")},
            )
        self.assertEqual(out.returncode, 1)
        self.assertTrue(any("build it first" in l for l in out.stdout.splitlines()), out.stdout)

    def test_config_keys_are_checked_against_the_structs(self):
        readme = """\
            `vm.libvirt.uri`, `watchdog.boot_grace_s`, `[vm.libvirt] uri, domain | uuid`, `[rollback] standby = true`,
            `vm.adopted`, `rollback.completed.epoch`, `vm.unprivileged_userfaultfd=1`, `[hosts]`, `[offsite.retention]`

            `vm.libvirt.url`, `[vm.watchdog]`, `[rollback] standbye = true`, `daemon.vms_dirs`

            ```toml
            [vm]
            name = "a"
            [[vm.disks]]
            id = "d"
            sizee = 1
            [kvm.guest]
            max_ticks = 0
            [devices.qemu]
            anything = 1
            ```

            ```toml
            # not a backstop config: the fleet trust file
            [hosts]
            host-a = "ed25519:00"
            ```
            """
        rc, lines = self.run_check({"README.md": readme}, "--verbs")
        self.assertEqual(rc, 1)
        self.assertEqual(
            lines,
            [
                "README.md:4: `vm.libvirt.url`: no key `vm.libvirt.url` in the config",
                "README.md:4: `[vm.watchdog]`: no table `vm.watchdog` in the config",
                "README.md:4: `[rollback] standbye = true`: no key `rollback.standbye` in the config",
                "README.md:4: `daemon.vms_dirs`: no key `daemon.vms_dirs` in the config",
                "README.md:7: config key `vm.disks.sizee`: no `vm.disks.sizee` in the config",
            ],
        )


if __name__ == "__main__":
    unittest.main()
