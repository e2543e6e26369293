"""The documentation describes the product as it is, and the repository holds source.

- README.md, docs/*.md and the --help of dbs_ps, dbs_worker and deploy/local_cluster.py carry no
  label of a stage of the project's own development ("session 31", "since run 17", "issue 11",
  a result set named after one: "grid_s31");
- README.md is at most 150 lines, each page of docs/ at most 500;
- every relative link in them names a file that exists, and an anchor that its page has;
- bench/results holds at most 50 files and 2 MB: the summaries the docs cite, not raw output.
"""

import os
import re
import subprocess
import sys
import unittest

RUNFILES = os.path.join(os.environ.get("TEST_SRCDIR", ""), os.environ.get("TEST_WORKSPACE", "dbs"))
if not os.path.isdir(RUNFILES):
    RUNFILES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_root():
    # The runfiles hold links into the source tree; follow one back.
    readme = os.path.realpath(os.path.join(RUNFILES, "README.md"))
    root = os.path.dirname(readme)
    if not os.path.exists(os.path.join(root, "WORKSPACE")):
        raise RuntimeError(f"README.md does not lead back to the source tree ({readme})")
    return root


ROOT = source_root()
README_LINES = 150
PAGE_LINES = 500
RESULTS_FILES = 50
RESULTS_BYTES = 2 * 1024 * 1024

# Text that labels a stage of the project's development rather than describing the product.
STAGE_LABELS = [
    (re.compile(r"\bsessions? [0-9]", re.I), "a session number"),
    (re.compile(r"\b(since|until|before|after|in|from) (run|commit) [0-9a-f]", re.I),
     "a run or commit as a point in time"),
    (re.compile(r"\b(grid )?runs? [0-9]+(-[0-9]+)?\b(?! (rounds?|steps?|epochs?|times|workers?))",
                re.I), "a numbered benchmark run"),
    (re.compile(r"\bissue [0-9]+", re.I), "an issue number"),
    (re.compile(r"[a-z0-9]_s[0-9]{1,3}(?![0-9])"), "a result set named after a session"),
    (re.compile(r"\b(kept for comparison|the emulation before|an older dbs)", re.I),
     "a path kept for history"),
]


def stage_labels(text):
    """[(line number, label kind, line)] for every stage label in `text`."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern, kind in STAGE_LABELS:
            if pattern.search(line):
                found.append((n, kind, line.strip()))
    return found


def markdown_pages():
    pages = ["README.md"] + sorted(
        os.path.join("docs", p) for p in os.listdir(os.path.join(ROOT, "docs")) if p.endswith(".md"))
    return pages + sorted(
        os.path.relpath(os.path.join(d, f), ROOT)
        for d, _, files in os.walk(os.path.join(ROOT, "bench", "results")) for f in files
        if f.endswith(".md"))


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def anchors(text):
    """The anchors a page offers: its headings as GitHub makes them, and explicit ids."""
    found = set(re.findall(r'<a id="([^"]+)"', text))
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            base, k = slug, 1
            while slug in found:
                slug, k = f"{base}-{k}", k + 1
            found.add(slug)
    return found


def links(text):
    """Relative links in markdown text, outside code."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1)
        if not re.match(r"[a-z]+:", target):
            yield target


class StageLabelTest(unittest.TestCase):
    def test_the_pattern_finds_labels_and_leaves_descriptions(self):
        for text in ("measured in session 31", "since run 17 the grid", "as issue 11 asks",
                     "see grid_s31_rounds2/README.md", "the emulation before 2026, kept for comparison"):
            self.assertTrue(stage_labels(text), text)
        for text in ("two runs of 20 steps", "run 3 rounds", "each worker's session",
                     "a push session lasts many steps", "3 runs each", "runs 2 workers"):
            self.assertFalse(stage_labels(text), text)

    def test_readme_and_docs_carry_no_stage_labels(self):
        problems = [f"{page}:{n}: {kind}: {line}"
                    for page in markdown_pages() for n, kind, line in stage_labels(read(page))]
        self.assertFalse(problems, "docs describe the product as it is; history belongs in git "
                                   "log and issue notes:\n" + "\n".join(problems))

    def help_text(self, argv):
        r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=60)
        self.assertIn(r.returncode, (0, 1), r.stdout[-2000:])
        self.assertGreater(len(r.stdout.splitlines()), 20, f"{argv[-2]} --help lists its flags")
        return r.stdout

    def test_help_texts_carry_no_stage_labels(self):
        for name, argv in (
                ("dbs_ps", [os.path.join(RUNFILES, "server", "dbs_ps"), "--help"]),
                ("dbs_worker", [os.path.join(RUNFILES, "worker", "dbs_worker"), "--help"]),
                ("local_cluster.py", [sys.executable,
                                      os.path.join(RUNFILES, "deploy", "local_cluster.py"),
                                      "--help"])):
            with self.subTest(name):
                found = stage_labels(self.help_text(argv))
                self.assertFalse(found, f"{name} --help: " + "; ".join(l for _, _, l in found))


class SizeTest(unittest.TestCase):
    def test_readme_is_a_front_door(self):
        n = len(read("README.md").splitlines())
        self.assertLessEqual(n, README_LINES, f"README.md has {n} lines; move detail into docs/")

    def test_readme_starts_with_the_two_setup_commands(self):
        block = read("README.md").split("```")[1].splitlines()
        commands = [l for l in block[1:] if l.strip()]
        self.assertEqual(len(commands), 2, block)
        self.assertTrue(commands[0].startswith("./deploy/run_local_cluster.sh"), commands[0])
        self.assertTrue(commands[1].startswith("./deploy/run_tests.sh"), commands[1])

    def test_every_doc_page_is_at_most_500_lines(self):
        long = {p: len(read(p).splitlines()) for p in markdown_pages() if p.startswith("docs")}
        long = {p: n for p, n in long.items() if n > PAGE_LINES}
        self.assertFalse(long, f"pages over {PAGE_LINES} lines: {long}")

    def test_bench_results_hold_only_summaries(self):
        files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, "bench", "results"))
                 for f in fs]
        size = sum(os.path.getsize(f) for f in files)
        self.assertLessEqual(len(files), RESULTS_FILES,
                             "bench/results keeps the summaries the docs cite; raw output goes "
                             "under out/")
        self.assertLessEqual(size, RESULTS_BYTES, f"bench/results holds {size} bytes")
        raw = [f for f in files if f.endswith((".log", ".port")) or "/runs/" in f]
        self.assertFalse(raw, "raw run output in bench/results")


class LinkTest(unittest.TestCase):
    def test_every_relative_link_resolves(self):
        problems = []
        for page in markdown_pages():
            for target in links(read(page)):
                path, _, anchor = target.partition("#")
                full = (os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path))
                        if path else os.path.join(ROOT, page))
                if not os.path.exists(full):
                    problems.append(f"{page}: {target}: no such file")
                elif anchor and full.endswith(".md") and anchor not in anchors(read(full)):
                    problems.append(f"{page}: {target}: no such anchor")
        self.assertFalse(problems, "\n".join(problems))

    def test_every_result_summary_is_cited(self):
        cited = "\n".join(read(p) for p in markdown_pages() if not p.startswith("bench/results"))
        for d in sorted(os.listdir(os.path.join(ROOT, "bench", "results"))):
            if os.path.isdir(os.path.join(ROOT, "bench", "results", d)):
                self.assertIn(f"results/{d}/", cited, f"bench/results/{d} is cited by no doc")


if __name__ == "__main__":
    unittest.main()
