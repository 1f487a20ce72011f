#!/usr/bin/env python3
"""The docs say what the product is: README.md stays a front door, every link in README.md and
docs/**/*.md lands, every console command they name exists, every config key they name exists.

    python3 ci/check-docs.py            length and links (no build needed; ci/lint.sh runs this)
    python3 ci/check-docs.py --verbs    also console commands and config keys (needs the built
                                        `backstop`: scripts/test.sh runs this after its build)
    python3 ci/check-docs.py --all      the same as --verbs
    --root DIR                          check another tree (the self-test uses it)

One line per failure, `FILE:LINE: what`; the exit status is 1 when there is any.

What counts as naming a console command: an inline code span, or a line of a code fence (after
an optional `$ `, `# ` or `sudo ` and `NAME=value` words), that starts with the word `backstop`
followed by a space (`backstopd` and `backstop-agent` are other programs). The words after it
are walked through the real `backstop --help` tree (BACKSTOP_BIN, default target/debug/backstop;
`backstop --help`, then `backstop SUB --help` for each command that has subcommands). The global
options (--socket PATH, --json, --vm NAME, and any of them in `[...]`) are skipped wherever they
are. The walk stops at a command without subcommands (what follows is its arguments), at a word
starting with '-', and at an argument placeholder (a word with anything but [a-z0-9_-] in it:
`ID`, `<id>`, `[ID]`, `…`, `a|b`). Every word it did walk must be a command of the node before
it.

What counts as naming a config key:
  * every table header and key of a ```toml fence (one whose first line is `# not a backstop
    config` is skipped; a fence that is not valid TOML is a failure);
  * an inline code span `[TABLE]` or `[TABLE] key ...` (the key is the first word after the
    header, any `= value` ignored; `[TABLE] a, b | c` names each of a, b, c);
  * an inline code span that is a dotted name `a.b.c` (optionally `= value` after it) whose
    first part is a top-level table of the config (`vm.libvirt.uri`, `watchdog.boot_grace_s`),
    unless the product defines that very name as something else: it is a string literal in
    crates/ (journal entries such as `vm.adopted`, fault names), or a file name.
The key tree comes from the serde structs the config is deserialized into, read from the
source: the root is `Config` in crates/backstop-engine/src/config/mod.rs; a field whose type is
another `#[derive(Deserialize)]` struct (through Option/Vec/Box, path-qualified or not) is a
table; maps (toml::Table, BTreeMap, HashMap, toml::Value) are open tables; `#[serde(rename)]`,
`alias`, `rename_all`, `flatten` and `skip` are honoured. Two tables are kept raw by the engine
and parsed by another crate (TABLE_OWNERS below).
"""

import argparse
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

README_MAX_LINES = 250

# Top-level tables the engine keeps as raw TOML (`Option<toml::Table>`) and another crate parses
# strictly: (struct, field) → (file, struct).
TABLE_OWNERS = {
    ("Config", "kvm"): ("crates/backstop-kvm/src/config.rs", "KvmConfig"),
    ("Config", "offsite"): ("crates/backstop-offsite/src/config.rs", "Raw"),
}
CONFIG_ROOT = ("crates/backstop-engine/src/config/mod.rs", "Config")

# Global options of the console (crates/backstop-cli/src/cli.rs, `global = true`) and whether
# each takes a value.
GLOBAL_OPTIONS = {"--socket": True, "--vm": True, "--json": False}

FILE_SUFFIXES = (
    ".rs", ".toml", ".py", ".sh", ".json", ".jsonl", ".md", ".log", ".sock", ".bin", ".key",
    ".qcow2", ".img", ".service", ".sample", ".xml", ".txt", ".conf", ".yaml", ".yml", ".pem",
    ".html", ".socket", ".target", ".so", ".lock", ".d", ".gz", ".tar", ".deb",
)

failures = []
counts = {"links": 0, "commands": 0, "config keys": 0}


def fail(path, line, msg):
    failures.append(f"{path}:{line}: {msg}")


# ---------------------------------------------------------------- markdown


def strip_inline_code(text):
    return re.sub(r"(`+)(.+?)\1", "", text)


def md_lines(text):
    """(line number, line, kind, fence) of every line: kind is "text", "fence" (inside a code
    fence) or "marker" (a fence's own ``` line); fence is (marker, info string, fence number)."""
    fence = None  # (marker, info, id)
    fid = 0
    for n, line in enumerate(text.split("\n"), 1):
        m = re.match(r"^ {0,3}(`{3,}|~{3,})(.*)$", line)
        if fence is None and m:
            fid += 1
            fence = (m.group(1), m.group(2).strip(), fid)
            yield n, line, "marker", fence
            continue
        if fence is not None and m and m.group(1)[0] == fence[0][0] and len(m.group(1)) >= len(
            fence[0]
        ) and not m.group(2).strip():
            yield n, line, "marker", fence
            fence = None
            continue
        yield n, line, ("fence" if fence else "text"), fence


def github_slug(heading):
    """GitHub's anchor for a heading's text."""
    s = heading.strip()
    # Markup that does not reach the anchor: links keep their text, code keeps its content.
    s = re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"\1", s)
    s = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", s)
    s = re.sub(r"<[^>]+>", "", s)
    s = s.lower()
    s = "".join(c for c in s if c.isalnum() or c in "-_ ")
    return s.replace(" ", "-")


def anchors_of(text):
    seen = {}
    out = set()
    prev = None  # the text line before, for setext headings (`Title` over `===` or `---`)
    for _n, line, kind, _f in md_lines(text):
        if kind != "text":
            prev = None
            continue
        m = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            title = m.group(2)
        elif prev and re.match(r"^ {0,3}(=+|-+)\s*$", line) and not re.match(r"^\s*([-*+]|\d+\.)\s", prev):
            title = prev.strip()
        else:
            prev = line if line.strip() else None
            continue
        prev = None
        slug = github_slug(title)
        if slug in seen:
            seen[slug] += 1
            out.add(f"{slug}-{seen[slug]}")
        else:
            seen[slug] = 0
            out.add(slug)
    # Explicit HTML anchors.
    for m in re.finditer(r'<a\s+(?:name|id)="([^"]+)"', text):
        out.add(m.group(1))
    return out


LINK_RE = re.compile(r"(?<!\!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMG_RE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF_RE = re.compile(r"^ {0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+.*)?$")


def check_links(root, md_files):
    anchor_cache = {}

    def anchors(p):
        if p not in anchor_cache:
            anchor_cache[p] = anchors_of(p.read_text(encoding="utf-8"))
        return anchor_cache[p]

    for f in md_files:
        text = f.read_text(encoding="utf-8")
        rel = f.relative_to(root)
        for n, line, kind, _fence in md_lines(text):
            if kind != "text":
                continue
            targets = []
            prose = strip_inline_code(line)
            targets += LINK_RE.findall(prose) + IMG_RE.findall(prose)
            m = REF_DEF_RE.match(line)
            if m:
                targets.append(m.group(1))
            for t in targets:
                counts["links"] += 1
                if re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I):  # http:, https:, mailto:
                    continue
                path, _, frag = t.partition("#")
                if path:
                    dest = (f.parent / path).resolve()
                    if not dest.exists():
                        fail(rel, n, f"link to {t}: {path} does not exist")
                        continue
                else:
                    dest = f
                if frag:
                    if dest.is_dir() or dest.suffix != ".md":
                        fail(rel, n, f"link to {t}: an anchor into a file that is not markdown")
                        continue
                    if frag not in anchors(dest):
                        where = "this file" if dest == f else dest.relative_to(root)
                        fail(rel, n, f"link to {t}: no heading in {where} has the anchor #{frag}")


def check_readme_length(root):
    readme = root / "README.md"
    if not readme.exists():
        fail("README.md", 0, "missing")
        return
    n = len(readme.read_text(encoding="utf-8").splitlines())
    if n > README_MAX_LINES:
        fail("README.md", n, f"{n} lines: at most {README_MAX_LINES} (the rest belongs in docs/)")


# ---------------------------------------------------------------- console commands


def help_commands(binary, path):
    """The subcommands clap lists under `Commands:` in `backstop PATH... --help`."""
    out = subprocess.run(
        [binary, *path, "--help"], capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"}
    )
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(['backstop', *path, '--help'])}` exited {out.returncode}: {out.stderr.strip()}")
    cmds = []
    section = False
    for line in out.stdout.splitlines():
        if re.match(r"^\S.*:$", line):
            section = line == "Commands:"
            continue
        if section:
            m = re.match(r"^  (\S+)", line)
            if m:
                # `name, alias` or `name`.
                for name in m.group(1).split(","):
                    if name:
                        cmds.append(name)
    return cmds


def command_tree(binary):
    tree = {}

    def walk(path, node):
        for c in help_commands(binary, path):
            node[c] = {}
            if c != "help":
                walk(path + [c], node[c])

    walk([], tree)
    return tree


def command_words(words):
    """The command path a `backstop ...` line names."""
    path = []
    i = 0
    while i < len(words):
        w = words[i]
        if w.startswith("[-"):
            # An optional global option, `[--vm NAME]`: skip to its closing bracket.
            while i < len(words) and not words[i].endswith("]"):
                i += 1
            i += 1
            continue
        opt = w.split("=", 1)[0]
        if opt in GLOBAL_OPTIONS:
            i += 1 if "=" in w or not GLOBAL_OPTIONS[opt] else 2
            continue
        if w.startswith("-") or not re.fullmatch(r"[a-z0-9_-]+", w):
            break
        path.append(w)
        i += 1
    return path


def backstop_mentions(root, md_files):
    """(file, line, words after `backstop`) of every command the docs name."""
    for f in md_files:
        text = f.read_text(encoding="utf-8")
        rel = f.relative_to(root)
        for n, line, kind, _fence in md_lines(text):
            if kind == "text":
                for m in re.finditer(r"(`+)(.+?)\1", line):
                    yield rel, n, m.group(2).strip()
            elif kind == "fence":
                yield rel, n, line.strip()


def command_of(snippet):
    words = snippet.split()
    while words and (words[0] in ("$", "#", "sudo") or re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0])):
        words = words[1:]
    if len(words) >= 1 and words[0] == "backstop" and snippet.rstrip() != "backstop":
        return words[1:]
    return None


def check_verbs(root, md_files, binary):
    try:
        tree = command_tree(binary)
    except (OSError, RuntimeError) as e:
        fail(binary, 0, f"cannot read the console's commands ({e}); build it first: cargo build -p backstop-cli (or set BACKSTOP_BIN)")
        return
    for rel, n, snippet in backstop_mentions(root, md_files):
        words = command_of(snippet)
        if words is None:
            continue
        counts["commands"] += 1
        node = tree
        walked = []
        for w in command_words(words):
            if not node:
                break  # a command without subcommands: the rest are its arguments
            if w not in node:
                where = "backstop " + " ".join(walked) if walked else "backstop"
                fail(rel, n, f"`{snippet}`: `{where}` has no command `{w}` (it has: {', '.join(sorted(node))})")
                break
            walked.append(w)
            node = node[w]


# ---------------------------------------------------------------- config keys


def rust_structs(root):
    """{(crate dir, struct name): (file, body, struct attrs)} of every struct deriving
    Deserialize under crates/*/src."""
    out = {}
    for f in sorted((root / "crates").glob("*/src/**/*.rs")):
        text = f.read_text(encoding="utf-8")
        code = re.sub(r"//[^\n]*", "", text)
        for m in re.finditer(r"((?:#\[[^\]]*(?:\[[^\]]*\][^\]]*)*\]\s*)+)(?:pub(?:\([^)]*\))?\s+)?struct\s+(\w+)\s*\{", code):
            attrs, name = m.group(1), m.group(2)
            if "Deserialize" not in attrs:
                continue
            depth, i = 1, m.end()
            while depth and i < len(code):
                depth += {"{": 1, "}": -1}.get(code[i], 0)
                i += 1
            crate = f.relative_to(root).parts[1]
            out[(crate, name)] = (f, code[m.end() : i - 1], attrs)
    return out


def split_top(body, sep=","):
    parts, depth, cur = [], 0, ""
    for c in body:
        if c in "<([{":
            depth += 1
        elif c in ">)]}":
            depth -= 1
        if c == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
    if cur.strip():
        parts.append(cur)
    return parts


def serde_args(attrs):
    """Every `key = "value"` or bare word inside #[serde(...)] attributes."""
    args = []
    for a in re.findall(r"#\[serde\((.*?)\)\]", attrs, re.S):
        for part in split_top(a):
            part = part.strip()
            m = re.match(r'(\w+)\s*=\s*"([^"]*)"', part)
            args.append((m.group(1), m.group(2)) if m else (part, None))
    return args


def rename_all(name, rule):
    if rule == "kebab-case":
        return name.replace("_", "-")
    if rule == "lowercase":
        return name.lower()
    if rule == "UPPERCASE":
        return name.upper()
    return name


OPEN = "open"  # a table that takes any key


def build_key_tree(root):
    structs = rust_structs(root)

    def find(crate, ty):
        ty = re.sub(r"\s+", "", ty)
        for wrapper in ("Option", "Vec", "Box"):
            m = re.fullmatch(rf"(?:std::\w+::)?{wrapper}<(.*)>", ty)
            if m:
                return find(crate, m.group(1))
        segs = ty.split("<")[0].split("::")
        last = segs[-1]
        if last in ("Table", "BTreeMap", "HashMap", "Map", "Value") and (
            last != "Value" or "toml" in segs
        ):
            return OPEN
        if segs[0].startswith("backstop_"):
            crate = segs[0].replace("_", "-")
        if (crate, last) in structs:
            return (crate, last)
        matches = [k for k in structs if k[1] == last]
        return matches[0] if len(matches) == 1 else None

    def table(key, stack=()):
        if key in stack:
            return OPEN
        f, body, attrs = structs[key]
        rule = dict(serde_args(attrs)).get("rename_all")
        fields = {}
        for item in split_top(body):
            m = re.match(r"\s*((?:#\[[^\]]*(?:\[[^\]]*\][^\]]*)*\]\s*)*)(?:pub(?:\([^)]*\))?\s+)?(\w+)\s*:\s*(.+)$", item, re.S)
            if not m:
                continue
            fattrs, fname, fty = m.group(1), m.group(2), m.group(3).strip()
            args = serde_args(fattrs)
            names = [rename_all(fname, rule)] if rule else [fname]
            skip = False
            flatten = False
            for k, v in args:
                if k == "rename" and v:
                    names[0] = v
                elif k == "alias" and v:
                    names.append(v)
                elif k in ("skip", "skip_deserializing"):
                    skip = True
                elif k == "flatten":
                    flatten = True
            if skip:
                continue
            owner = TABLE_OWNERS.get((key[1], fname))
            if owner:
                crate = Path(owner[0]).parts[1]
                target = (crate, owner[1])
                if target not in structs:
                    raise SystemExit(f"check-docs: {owner[0]} has no Deserialize struct {owner[1]} (TABLE_OWNERS)")
            else:
                target = find(key[0], fty)
            sub = table(target, stack + (key,)) if isinstance(target, tuple) else (OPEN if target == OPEN else None)
            if flatten and isinstance(sub, dict):
                fields.update(sub)
                continue
            for n in names:
                fields[n] = sub
        return fields

    crate = Path(CONFIG_ROOT[0]).parts[1]
    if (crate, CONFIG_ROOT[1]) not in structs:
        raise SystemExit(f"check-docs: no struct {CONFIG_ROOT[1]} in {CONFIG_ROOT[0]}")
    return table((crate, CONFIG_ROOT[1]))


def lookup(tree, parts):
    """None when the key path exists; else the first part that does not."""
    node = tree
    for i, p in enumerate(parts):
        if node == OPEN:
            return None
        if not isinstance(node, dict) or p not in node:
            return ".".join(parts[: i + 1])
        node = node[p]
    return None


def string_literals(root):
    lits = set()
    for f in (root / "crates").glob("*/src/**/*.rs"):
        lits.update(re.findall(r'"([a-z][a-z0-9_]*(?:\.[a-z0-9_-]+)+)"', f.read_text(encoding="utf-8")))
    return lits


def check_toml_value(tree, rel, n, prefix, value):
    """Every key under `prefix` in a parsed TOML document exists."""
    for k, v in value.items():
        parts = prefix + [k]
        counts["config keys"] += 1
        bad = lookup(tree, parts)
        if bad:
            fail(rel, n, f"config key `{'.'.join(parts)}`: no `{bad}` in the config")
            continue
        node = tree
        for p in parts:
            node = node[p] if isinstance(node, dict) else OPEN
        if node == OPEN:
            continue
        items = v if isinstance(v, list) else [v]
        for item in items:
            if isinstance(item, dict):
                if node is None:
                    fail(rel, n, f"config key `{'.'.join(parts)}` is a value, not a table")
                else:
                    check_toml_value(tree, rel, n, parts, item)


def check_config_keys(root, md_files):
    tree = build_key_tree(root)
    # The shipped samples load (crates/backstop-engine/tests/shipped_samples.rs): a key of
    # theirs missing from the tree is this script misreading the structs.
    samples = sorted((root / "vmm-config").glob("*.toml")) + sorted((root / "vmm-config").glob("vms.d/*.toml.sample"))
    counted = counts["config keys"]
    for f in samples:
        before = len(failures)
        check_toml_value(tree, f.relative_to(root), 0, [], tomllib.loads(f.read_text(encoding="utf-8")))
        counts["config keys"] = counted
        if len(failures) > before:
            failures.append(f"{f.relative_to(root)}: check-docs misreads the config structs (this file loads)")
    literals = string_literals(root)
    tops = set(tree)
    for f in md_files:
        text = f.read_text(encoding="utf-8")
        rel = f.relative_to(root)
        fences = {}
        for n, line, kind, fence in md_lines(text):
            if kind == "fence" and fence[1].split()[:1] == ["toml"]:
                fences.setdefault(fence[2], [n, []])[1].append(line)
            if kind == "text":
                for m in re.finditer(r"(`+)(.+?)\1", line):
                    check_inline_key(tree, tops, literals, rel, n, m.group(2).strip())
        for start, lines in fences.values():
            if lines and lines[0].strip().lower().startswith("# not a backstop config"):
                continue
            try:
                doc = tomllib.loads("\n".join(lines))
            except tomllib.TOMLDecodeError as e:
                fail(rel, start, f"```toml fence is not valid TOML ({e}); mark an example that is not a config with `# not a backstop config`")
                continue
            check_toml_value(tree, rel, start, [], doc)


def check_inline_key(tree, tops, literals, rel, n, span):
    m = re.fullmatch(r"\[\[?([a-z_][a-z0-9_.]*)\]\]?(.*)", span)
    if m:
        table = m.group(1).split(".")
        rest = m.group(2).strip()
        if table[0] not in tops:
            return  # another file's table (the fleet trust file's `[hosts]`)
        counts["config keys"] += 1
        bad = lookup(tree, table)
        if bad:
            fail(rel, n, f"`{span}`: no table `{bad}` in the config")
            return
        # `[TABLE] key`, `[TABLE] key = value`, `[TABLE] a, b | c`.
        for key in re.split(r"[,|]", rest.split("=", 1)[0]):
            words = key.split()
            if words and re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z0-9_]+)*", words[0]):
                counts["config keys"] += 1
                bad = lookup(tree, table + words[0].split("."))
                if bad:
                    fail(rel, n, f"`{span}`: no key `{bad}` in the config")
        return
    m = re.fullmatch(r"([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)(\s*=\s*.*)?", span)
    if not m:
        return
    name = m.group(1)
    parts = name.split(".")
    if parts[0] not in tops or name.endswith(FILE_SUFFIXES):
        return
    counts["config keys"] += 1
    bad = lookup(tree, parts)
    if not bad:
        return
    # Where it leaves the config it may be a name the product defines as something else (a
    # journal entry and its fields, `rollback.completed.epoch`; a fault), or a sysctl of the
    # host (`vm.unprivileged_userfaultfd`).
    first = bad.count(".") + 1
    if any(".".join(parts[:i]) in literals for i in range(first, len(parts) + 1)):
        counts["config keys"] -= 1
        return
    if Path("/proc/sys", *parts).exists():
        counts["config keys"] -= 1
        return
    if bad:
        fail(rel, n, f"`{span}`: no key `{bad}` in the config")


# ---------------------------------------------------------------- main


def check_error_codes(root):
    """Every error code backstop defines (codes.rs) is in the console reference's table."""
    src = root / "crates/backstop-common/src/codes.rs"
    doc = root / "docs/console.md"
    if not src.exists() or not doc.exists():
        return
    codes = re.findall(r'=\s*"([A-Z_]+)",\s*\w+,', src.read_text())
    text = doc.read_text()
    for c in codes:
        counts["error codes"] = counts.get("error codes", 0) + 1
        if f"| `{c}` |" not in text:
            fail("docs/console.md", 0, f"error code {c} (codes.rs) is not in the error code table")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verbs", action="store_true", help="also console commands and config keys")
    ap.add_argument("--all", action="store_true", help="the same as --verbs")
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    args = ap.parse_args()
    root = Path(args.root).resolve()
    md_files = [p for p in [root / "README.md"] if p.exists()] + sorted((root / "docs").glob("**/*.md"))

    check_readme_length(root)
    check_links(root, md_files)
    check_error_codes(root)
    if args.verbs or args.all:
        binary = os.environ.get("BACKSTOP_BIN") or str(root / "target/debug/backstop")
        check_verbs(root, md_files, binary)
        check_config_keys(root, md_files)

    for line in failures:
        print(line)
    checked = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    print(f"check-docs: checked {checked}", file=sys.stderr)
    if failures:
        print(f"check-docs: {len(failures)} failure(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
