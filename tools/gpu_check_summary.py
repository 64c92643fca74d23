"""Writes OUTDIR/summary.md for tools/gpu_check.sh: the device, each step's verdict with its pass / fail /
skip counts (from the junit reports) and seconds, the compute-sanitizer verdicts, the benchmark tables (KeyValueCache's and
the attention ops'), and every skipped step with its reason. Prints the summary too."""

import pathlib
import re
import sys
import xml.etree.ElementTree as ET


def counts(report: pathlib.Path) -> str:
    """'N passed, N failed, N skipped' from a pytest junit report ('' when there is none)."""
    if not report.is_file():
        return ""
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    return f"{total - failed - skipped} passed, {failed} failed, {skipped} skipped"


def sanitizer_verdicts(logs: pathlib.Path) -> list:
    """Lines of a table: each sanitizer step's log and the tool's own summary lines in it ("ERROR SUMMARY: 0 errors",
    "RACECHECK SUMMARY: ..."), each distinct line once with how many times it came (a process the tests start runs
    under the tool too); "none" where the tool printed none (it did not attach, or the step was killed)."""
    rows = []
    for log in sorted(logs.glob("sanitizer-*.log")):
        found = {}
        for line in log.read_text(errors="replace").splitlines():
            match = re.match(r"^=+ ([A-Z]* ?SUMMARY: .*)$", line.strip())
            if match:
                found[match.group(1)] = found.get(match.group(1), 0) + 1
        text = "; ".join(f"{line}{f' (x{count})' if count > 1 else ''}" for line, count in found.items()) or "none"
        rows.append(f"| {log.stem} | {text} |")
    return rows


def main(out: pathlib.Path) -> str:
    device = (out / "device.txt").read_text().strip() if (out / "device.txt").is_file() else "unknown"
    lines = ["# GPU check", "", f"Device: {device}", "", "| step | verdict | counts | detail | seconds |",
             "|---|---|---|---|---:|"]
    for row in (out / "steps.tsv").read_text().splitlines():
        name, status, detail, seconds = (row.split("\t") + ["", "", ""])[:4]
        lines.append(f"| {name} | {status} | {counts(out / 'logs' / f'{name}.xml')} | {detail} | {seconds} |")
    if (out / "seconds.txt").is_file():  # the whole check, the build included (steps may run side by side)
        lines += ["", f"The check took {(out / 'seconds.txt').read_text().strip()} s from its start to this summary."]
    verdicts = sanitizer_verdicts(out / "logs")
    if verdicts:
        lines += ["", "## compute-sanitizer", "", "| step | the tool's summary lines |", "|---|---|", *verdicts]
    for folder, title, name in (("bench", "Benchmark", "results.md"),
                                ("attention-bench", "Attention benchmark", "results.md"),
                                ("serving-bench", "Serving benchmark", "README.md"),
                                ("serving-bench-float16", "Serving benchmark, float16", "README.md"),
                                ("sampler-bench", "The sampling graph against the host's sampler", "README.md")):
        bench = out / folder / name
        if bench.is_file():
            lines += ["", f"## {title}", "", bench.read_text()]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


if __name__ == "__main__":
    print(main(pathlib.Path(sys.argv[1])))
