"""The README quotes the results (docs/results.md, an index, and a file per subject in docs/results/) and nothing
else: every figure in the README's "## Results" section is one that the results hold, written the same way;
every command in the README's results table is one they give; and every link into them lands on a heading of
the file it names, as every figure image they show exists. Text only: no Ray, no models."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
RESULTS = REPO / "docs" / "results.md"
SUBJECTS = sorted((REPO / "docs" / "results").glob("*.md"))

# A figure: a date (2026-11-27), a decimal (0.0069, 1.000), a power of ten (1.7e-5) or an integer, standing
# alone: not part of a name (smollm2, bf16, r_X) and not the head of a longer number.
_FIGURE = r"\d{4}-\d{2}-\d{2}|\d+(?:\.\d+)?(?:e-\d+)?"
_BEFORE, _AFTER = r"(?<![\w.])", r"(?![\w]|\.\d)"
FIGURE = re.compile(f"{_BEFORE}(?:{_FIGURE}){_AFTER}")
CODE_SPAN = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
LINK = re.compile(r"\]\(([^)\s#]+\.md)#([^)\s]+)\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
PAIR = re.compile(r"(base|smollm2):(\w+)")


def results_text() -> str:
    """The index and every subject file, one after the other."""
    return "\n".join(p.read_text() for p in [RESULTS, *SUBJECTS])


def section(text: str, heading: str) -> list[tuple[int, str]]:
    """The lines of a `## ` section (numbered as in the file), up to the next `## ` heading."""
    lines = text.splitlines()
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return [(i + 1, lines[i]) for i in range(start + 1, end)]


def figures(line: str) -> list[str]:
    """The figures a line of prose or of a table quotes: commands (code spans) and link targets left out."""
    return FIGURE.findall(LINK_TARGET.sub("]", CODE_SPAN.sub(" ", line)))


def holds(text: str, figure: str) -> bool:
    return re.search(_BEFORE + re.escape(figure) + _AFTER, text) is not None


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def parts_about(results: str, pair: str) -> str:
    """The parts of docs/results.md (each from one heading to the next) that name a pair's specialist: `base:qa`
    for the demo family's, the bare name (`qa`, `qa_alora`) for the real family's."""
    family, name = pair.split(":")
    named = re.compile(rf"{family}:{name}(?!\w)" if family == "base" else rf"(?<!\w){name}(?!\w)")
    parts = re.split(r"\n(?=#)", results)
    return "\n".join(part for part in parts if named.search(part))


def missing_figures(readme: str, results: str) -> list[str]:
    """'README.md:LINE: FIGURE ...' for each figure in the README's results that docs/results.md does not hold:
    a table row's figures in the parts about its pair, the prose's anywhere."""
    missing = []
    for n, line in section(readme, "## Results"):
        pair = PAIR.search(line.split("|")[1]) if line.startswith("| ") else None
        scope = parts_about(results, pair[0]) if pair else results
        missing += [f"README.md:{n}: {fig!r} " + (f"({pair[0]}) is in no part of docs/results.md about {pair[2]}"
                                                   if pair else "is nowhere in docs/results.md")
                    for fig in figures(line) if not holds(scope, fig)]
    return missing


def test_every_figure_in_the_readme_results_is_in_docs_results():
    missing = missing_figures(README.read_text(), results_text())
    assert not missing, ("figures the README quotes that docs/results.md does not hold (quote results.md's "
                         "current figure, written the same way):\n" + "\n".join(missing))


def test_the_check_finds_a_figure_results_does_not_hold_for_that_pair():
    readme = "## Results\n\n| pair | KL |\n|---|---|\n| base:qa | 0.0069 x at 0.040 (`--samples 48`) |\nF1 0.5\n"
    results = "# R\n## qa\n| base:qa | **0.0069** | 0.040 |\n## F1\nF1 0.5\n"
    assert missing_figures(readme, results) == []
    assert missing_figures(readme, results.replace("0.040", "0.0401")) == [  # 0.040 only as the head of 0.0401
        "README.md:5: '0.040' (base:qa) is in no part of docs/results.md about qa"]
    assert missing_figures(readme, results.replace("0.040", "0.4").replace("F1 0.5", "F1 0.5, 0.040")) == [
        "README.md:5: '0.040' (base:qa) is in no part of docs/results.md about qa"]  # held, but not about qa
    assert missing_figures(readme, results.replace("F1 0.5", "F1 0.50")) == [
        "README.md:6: '0.5' is nowhere in docs/results.md"]


def test_every_command_in_the_readme_results_table_is_one_docs_results_gives():
    results = " ".join(results_text().split())
    table = [(n, line) for n, line in section(README.read_text(), "## Results") if line.startswith("| ")]
    commands = [(n, span.strip("`")) for n, line in table for span in CODE_SPAN.findall(line)
                if span.startswith(("`scd ", "`python "))]
    assert commands, "no commands found in the README's results table"
    # docs/results.md may give one command for every pair of a family: `--pair base:X`.
    missing = [f"README.md:{n}: {cmd}" for n, cmd in commands
               if cmd not in results and re.sub(r"--pair (\w+):\w+", r"--pair \1:X", cmd) not in results]
    assert not missing, "commands the README quotes that docs/results.md does not give:\n" + "\n".join(missing)


def test_links_into_docs_results_land_on_a_heading_and_its_figures_exist():
    assert len(SUBJECTS) > 5, f"the results' subject files are missing: {SUBJECTS}"
    docs = [README, *sorted((REPO / "docs").glob("*.md")), *SUBJECTS]
    results = {p.resolve() for p in [RESULTS, *SUBJECTS]}
    broken = []
    for path in docs:
        for target, anchor in LINK.findall(path.read_text()):
            dest = (path.parent / target).resolve()
            if not dest.is_file():
                broken.append(f"{path.relative_to(REPO)}: {target} does not exist")
            elif dest in results and anchor not in {slug(line.lstrip("#")) for line in dest.read_text().splitlines()
                                                    if line.startswith("#")}:
                broken.append(f"{path.relative_to(REPO)}: {target}#{anchor} is no heading of it")
    assert not broken, "links into the results that land nowhere:\n" + "\n".join(broken)
    absent = [f"{p.relative_to(REPO)}: {image}" for p in [RESULTS, *SUBJECTS] for image in IMAGE.findall(p.read_text())
              if not (p.parent / image).is_file()]
    assert not absent, f"figures the results show that do not exist: {absent}"
