#!/usr/bin/env python3
"""The licences of the crates the Debian packages are built from, against deny.toml.

    python3 ci/check-licenses.py                          check (ci/lint.sh runs this)
    python3 ci/check-licenses.py --copyright PKG OUT      write package PKG's copyright file
    python3 ci/check-licenses.py --licenses PKG           the licences that file names, one a line

The check reads `cargo metadata` (Cargo.lock as it is: --locked) and deny.toml's [licenses] and
[sources], and fails with one line per crate whose `license` expression the `allow` list (plus
its `exceptions`) cannot satisfy, per crate with no SPDX `license` and no [[licenses.clarify]]
entry, per crate from anywhere but crates.io, and per `allow` entry no crate needs. It covers
what building the packages compiles: the normal and build dependencies of backstopd (with the
libvirt backend), backstop-cli, backstop-dist and backstop-agent. Build dependencies and
backstop-dist are not shipped, but cargo-deny checks them with the same deny.toml, and building
the package from source runs them.

--copyright writes the package's copyright file (machine-readable format 1.0): its committed head
(dist/debian/copyright, dist/backstop-agent/copyright), then one Files: paragraph per crate linked
into the package's binaries (normal dependencies only: a build script or a proc-macro runs on
the build host; a proc-macro's expansion is listed with the crate that asked for it), then one
License: paragraph per licence named. Written at package time, it cannot go stale.

Dependency features are cargo metadata's, unified over the workspace: a crate enabled only by
another workspace member's feature may be listed although the package does not link it. The
list errs towards too many, never too few.
"""

import json
import os
import re
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRIPLE = "x86_64-unknown-linux-gnu"
CRATES_IO = "registry+https://github.com/rust-lang/crates.io-index"

# What each Debian package ships, and the head of its copyright file.
PACKAGES = {
    "backstop": {"roots": ["backstopd", "backstop-cli"], "head": "dist/debian/copyright"},
    "backstop-agent": {"roots": ["backstop-agent"], "head": "dist/backstop-agent/copyright"},
}
# What the check covers: everything building the packages compiles.
CHECKED_ROOTS = ["backstopd", "backstop-cli", "backstop-dist", "backstop-agent"]
FEATURES = ["backstopd/libvirt"]  # scripts/package.sh's default build

# Licences Debian ships in /usr/share/common-licenses; the others' texts are in dist/licenses/.
COMMON_LICENSES = {"Apache-2.0": "Apache-2.0", "LGPL-2.1": "LGPL-2.1", "CC0-1.0": "CC0-1.0",
                   "MPL-2.0": "MPL-2.0", "GPL-2.0": "GPL-2", "GPL-3.0": "GPL-3",
                   "LGPL-3.0": "LGPL-3"}
LICENSE_NAMES = {"Apache-2.0": "the Apache License, Version 2.0",
                 "LGPL-2.1": "the GNU Lesser General Public License, version 2.1",
                 "CC0-1.0": "the Creative Commons CC0 1.0 Universal license",
                 "MPL-2.0": "the Mozilla Public License, version 2.0",
                 "GPL-2.0": "the GNU General Public License, version 2",
                 "GPL-3.0": "the GNU General Public License, version 3",
                 "LGPL-3.0": "the GNU Lesser General Public License, version 3"}


class ExprError(Exception):
    pass


# --- SPDX expressions ----------------------------------------------------------------------------
# A parsed expression is ("id", "MIT"), ("with", "Apache-2.0", "LLVM-exception"), or
# ("or" | "and", [children]).

TOKEN = re.compile(r"\s*(?:(\()|(\))|(/)|([A-Za-z0-9][A-Za-z0-9.+\-]*))")


def tokenize(text):
    tokens, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = TOKEN.match(text, pos)
        if not m:
            raise ExprError(f"unexpected {text[pos:]!r}")
        pos = m.end()
        if m.group(1) or m.group(2):
            tokens.append(m.group(0).strip())
        elif m.group(3):
            tokens.append("OR")  # the legacy "MIT/Apache-2.0"
        else:
            word = m.group(4)
            tokens.append(word.upper() if word.upper() in ("OR", "AND", "WITH") else word)
    return tokens


def parse(text):
    tokens = tokenize(text)
    if not tokens:
        raise ExprError("empty expression")
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def take():
        nonlocal pos
        if pos >= len(tokens):
            raise ExprError("unexpected end")
        pos += 1
        return tokens[pos - 1]

    def compound(op, sub):
        items = [sub()]
        while peek() == op:
            take()
            items.append(sub())
        return items[0] if len(items) == 1 else (op.lower(), items)

    def primary():
        tok = take()
        if tok == "(":
            node = compound("OR", conjunction)
            if take() != ")":
                raise ExprError("unbalanced parenthesis")
        elif tok in ("OR", "AND", "WITH", ")"):
            raise ExprError(f"unexpected {tok}")
        else:
            node = ("id", tok)
        if peek() == "WITH":
            take()
            exc = take()
            if node[0] != "id" or exc in ("(", ")", "OR", "AND", "WITH"):
                raise ExprError("WITH needs a licence and an exception")
            node = ("with", node[1], exc)
        return node

    def conjunction():
        return compound("AND", primary)

    node = compound("OR", conjunction)
    if pos != len(tokens):
        raise ExprError(f"unexpected {tokens[pos]}")
    return node


def reduce(node, allowed):
    """The part of `node` the allowed licences satisfy (None: not satisfiable). Alternatives not
    allowed are dropped: the crate is used under the ones that are."""
    kind = node[0]
    # SPDX ids match case-insensitively; the result spells them as deny.toml does.
    spelling = {a.lower(): a for a in allowed}
    if kind == "id":
        return ("id", spelling[node[1].lower()]) if node[1].lower() in spelling else None
    if kind == "with":
        # An exception only adds permissions: the licence alone being allowed is enough.
        if f"{node[1]} WITH {node[2]}".lower() in spelling or node[1].lower() in spelling:
            return ("with", spelling.get(node[1].lower(), node[1]), node[2])
        return None
    children = [reduce(c, allowed) for c in node[1]]
    if kind == "and":
        if any(c is None for c in children):
            return None
    else:
        children = [c for c in children if c is not None]
        plain = {c[1] for c in children if c[0] == "id"}
        # "Apache-2.0 OR Apache-2.0 WITH LLVM-exception": the plain licence says it all.
        children = [c for c in children if not (c[0] == "with" and c[1] in plain)]
    unique = []
    for c in children:
        if c not in unique:
            unique.append(c)
    if not unique:
        return None
    return unique[0] if len(unique) == 1 else (kind, unique)


def license_ids(node):
    if node[0] == "id":
        return {node[1]}
    if node[0] == "with":
        return {node[1]}
    return set().union(*(license_ids(c) for c in node[1]))


def debian_expr(node):
    """Debian copyright syntax: lower-case operators, a comma lowering the next one's precedence."""
    if node[0] == "id":
        return node[1]
    if node[0] == "with":
        return f"{node[1]} with {node[2].removesuffix('-exception')} exception"
    if node[0] == "or":
        return " or ".join(debian_expr(c) for c in node[1])
    # Alternatives first: "MIT or Apache-2.0, and Unicode-3.0".
    children = sorted(node[1], key=lambda c: c[0] != "or")
    sep = ", and " if any(c[0] == "or" for c in children) else " and "
    return sep.join(debian_expr(c) for c in children)


def selftest():
    """The parser on the shapes crates.io has, so a parser bug fails CI, not a crate."""
    allowed = {"MIT", "Apache-2.0", "ISC", "Unicode-3.0"}
    cases = {
        "MIT/Apache-2.0": "MIT or Apache-2.0",
        "mit or apache-2.0": "MIT or Apache-2.0",
        "(MIT OR Apache-2.0) AND Unicode-3.0": "MIT or Apache-2.0, and Unicode-3.0",
        "Apache-2.0 WITH LLVM-exception OR Apache-2.0 OR MIT": "Apache-2.0 or MIT",
        "Apache-2.0 WITH LLVM-exception": "Apache-2.0 with LLVM exception",
        "CC0-1.0 OR (Apache-2.0)": "Apache-2.0",
        "MIT AND (ISC OR BSD-3-Clause)": "MIT and ISC",
        "GPL-2.0+ AND MIT": None,
        "LGPL-2.1": None,
    }
    for text, want in cases.items():
        got = reduce(parse(text), allowed)
        got = got and debian_expr(got)
        assert got == want, f"{text!r} reduced to {got!r}, expected {want!r}"
    for bad in ("MIT OR", "(MIT", "MIT)", "OR MIT", "MIT WITH", "MIT Apache-2.0", "MIT, ISC", ""):
        try:
            parse(bad)
        except ExprError:
            continue
        raise AssertionError(f"{bad!r} parsed")


# --- the dependency graph ------------------------------------------------------------------------

def metadata():
    cmd = ["cargo", "metadata", "--format-version", "1", "--locked", "--filter-platform", TRIPLE]
    for f in FEATURES:
        cmd += ["--features", f]
    try:
        out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as e:
        sys.exit(f"check-licenses: {' '.join(cmd)} failed:\n{e.stderr.strip()}")
    return json.loads(out)


def reachable(meta, roots, kinds):
    """Package ids reachable from the workspace packages `roots` over edges of `kinds`."""
    nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
    members = {p["name"]: p["id"] for p in meta["packages"] if p["id"] in meta["workspace_members"]}
    missing = [r for r in roots if r not in members]
    if missing:
        sys.exit(f"check-licenses: no workspace package {', '.join(missing)}")
    seen, stack = set(), [members[r] for r in roots]
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        for dep in nodes[pid]["deps"]:
            if any(k["kind"] in kinds for k in dep["dep_kinds"]):
                stack.append(dep["pkg"])
    return seen


def load_config():
    with open(os.path.join(ROOT, "deny.toml"), "rb") as f:
        deny = tomllib.load(f)
    lic = deny.get("licenses", {})
    allowed = set(lic.get("allow", []))
    exceptions = {}
    for e in lic.get("exceptions", []):
        exceptions.setdefault(e.get("crate", e.get("name")), set()).update(e.get("allow", []))
    clarify = {c.get("crate", c.get("name")): c["expression"] for c in lic.get("clarify", [])}
    sources = deny.get("sources", {})
    registries = {"registry+" + r for r in sources.get("allow-registry",
                                                       ["https://github.com/rust-lang/crates.io-index"])}
    if sources.get("unknown-registry") != "deny" or sources.get("unknown-git") != "deny":
        sys.exit("check-licenses: deny.toml's [sources] must deny unknown-registry and unknown-git")
    return allowed, exceptions, clarify, registries


def declared(pkg, clarify):
    """The crate's licence expression: deny.toml's clarification ("NAME" for any version, or
    "NAME@VERSION"), else its Cargo.toml's `license`."""
    text = clarify.get(f"{pkg['name']}@{pkg['version']}", clarify.get(pkg["name"]))
    return pkg.get("license") if text is None else text


def expression(pkg, clarify):
    """(parsed expression, None) or (None, why not)."""
    text = declared(pkg, clarify)
    if text is None:
        if pkg.get("license_file"):
            return None, (f"has no SPDX `license`, only license-file {pkg['license_file']}: "
                          "name its expression in deny.toml's [[licenses.clarify]]")
        return None, "declares no licence"
    try:
        return parse(text), None
    except ExprError as e:
        return None, f"license {text!r} is not an SPDX expression ({e})"


def check():
    selftest()
    meta = metadata()
    allowed, exceptions, clarify, registries = load_config()
    pkgs = {p["id"]: p for p in meta["packages"]}
    failures, checked = [], []
    ids = reachable(meta, CHECKED_ROOTS, {None, "build"})
    for pid in sorted(ids, key=lambda i: (pkgs[i]["name"], pkgs[i]["version"])):
        pkg = pkgs[pid]
        if pkg["source"] is None:
            continue  # the workspace's own crates: Apache-2.0, dist/*/copyright's Files: *
        name = f"{pkg['name']} {pkg['version']}"
        if pkg["source"] not in registries:
            failures.append(f"{name}: comes from {pkg['source']}, not crates.io")
        node, why = expression(pkg, clarify)
        if node is None:
            failures.append(f"{name}: {why}")
            continue
        crate_allowed = allowed | exceptions.get(pkg["name"], set())
        got = reduce(node, crate_allowed)
        if got is None:
            failures.append(f"{name}: license {declared(pkg, clarify)!r} "
                            "is not satisfied by deny.toml's allow list")
            continue
        checked.append((pkg["name"], node))
    # An entry is needed when some crate is not satisfied without it (rustls's
    # "Apache-2.0 OR ISC OR MIT" alone needs none of the three).
    needed = {lic for lic in allowed
              if any(reduce(node, (allowed - {lic}) | exceptions.get(crate, set())) is None
                     for crate, node in checked)}
    for lic in sorted(allowed - needed):
        failures.append(f"deny.toml: allow lists {lic}, which no crate needs (remove it)")
    for line in failures:
        print(f"check-licenses: {line}", file=sys.stderr)
    if failures:
        return 1
    print(f"check-licenses: {len([i for i in ids if pkgs[i]['source']])} crates from crates.io, "
          f"licences within deny.toml's {len(allowed)}: {', '.join(sorted(allowed))}")
    return 0


# --- the copyright file --------------------------------------------------------------------------

def indent(text):
    """A licence text as a field body: every line indented, empty lines as " ."."""
    return "\n".join(f" {line}".rstrip() if line.strip() else " ." for line in text.strip("\n").splitlines())


def license_paragraph(lic):
    if lic in COMMON_LICENSES:
        body = (f"On Debian systems, the full text of {LICENSE_NAMES[lic]} is in\n"
                f"/usr/share/common-licenses/{COMMON_LICENSES[lic]}.")
        return f"License: {lic}\n{indent(body)}\n"
    path = os.path.join(ROOT, "dist", "licenses", lic)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        sys.exit(f"check-licenses: no text for {lic}: add dist/licenses/{lic} "
                 "(or map it to /usr/share/common-licenses in COMMON_LICENSES)")
    return f"License: {lic}\n{indent(text)}\n"


def crate_paragraphs(meta, package):
    """(the Files: paragraphs, the licence ids they name) for the crates `package` links."""
    allowed, exceptions, clarify, _ = load_config()
    pkgs = {p["id"]: p for p in meta["packages"]}
    ids = reachable(meta, PACKAGES[package]["roots"], {None})
    out, used = [], set()
    for pid in sorted(ids, key=lambda i: (pkgs[i]["name"], pkgs[i]["version"])):
        pkg = pkgs[pid]
        if pkg["source"] is None:
            continue
        node, why = expression(pkg, clarify)
        got = None if node is None else reduce(node, allowed | exceptions.get(pkg["name"], set()))
        if got is None:
            sys.exit(f"check-licenses: {pkg['name']} {pkg['version']}: "
                     f"{why or 'not satisfied by deny.toml'} (run python3 ci/check-licenses.py)")
        used |= license_ids(got)
        authors = [a.strip() for a in pkg.get("authors") or [] if a.strip()]
        holders = authors or [f"the {pkg['name']} authors"]
        para = [f"Files: vendor/{pkg['name']}-{pkg['version']}/*",
                "Copyright: " + "\n ".join(holders),
                f"License: {debian_expr(got)}"]
        if debian_expr(node) != debian_expr(got):  # an alternative dropped, not only spelling
            para.append(f"Comment: declared as {declared(pkg, clarify)!r}.")
        out.append("\n".join(para) + "\n")
    return out, used


def copyright_file(package):
    meta = metadata()
    with open(os.path.join(ROOT, PACKAGES[package]["head"]), encoding="utf-8") as f:
        head = f.read().rstrip("\n") + "\n"
    files, used = crate_paragraphs(meta, package)
    own = {p["license"] for p in meta["packages"] if p["source"] is None and p.get("license")}
    for lic in own:
        used |= license_ids(parse(lic))
    licenses = [license_paragraph(lic) for lic in sorted(used)]
    return "\n".join([head] + files + licenses), sorted(used)


def main(argv):
    if argv == []:
        return check()
    if len(argv) == 3 and argv[0] == "--copyright" and argv[1] in PACKAGES:
        text, _ = copyright_file(argv[1])
        with open(argv[2], "w", encoding="utf-8") as f:
            f.write(text)
        return 0
    if len(argv) == 2 and argv[0] == "--licenses" and argv[1] in PACKAGES:
        _, used = copyright_file(argv[1])
        print("\n".join(used))
        return 0
    print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
    print(f"(PKG: {' or '.join(PACKAGES)})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
