#!/usr/bin/env python3
"""Runs a pytest suite in several pytest processes at once, test files split among them by their
collected test counts, each process's log in its own file. On one GPU the suite's calls are small,
so several processes share it: on an H100 (2026-12-06) the whole suite's processes took about
1,600 s together, four at a time, no file failing for running beside the others.

  python3 tools/parallel_pytest.py --workers 8 --log-dir OUT tests [-- extra pytest options]

Prints each process's files and its last pytest line; exits 0 only when every process passed (a
process cut by --timeout counts as failed and says how far it got)."""
import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path


def collected_counts(paths, pytest_args):
    """{test file's path: number of tests pytest collects from it}. The collection's rootdir is the
    paths' common folder, so that each test id begins with its file's path below it. The verbosity
    comes after the caller's options: their own -q would otherwise make pytest list counts, not ids."""
    base = Path(os.path.commonpath([os.path.abspath(p) for p in paths]))
    if base.is_file():
        base = base.parent
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider",
                             f"--rootdir={base}", *pytest_args, "--verbosity=-1", *paths], capture_output=True,
                            text=True)
    counts = {}
    for line in result.stdout.splitlines():
        if "::" in line:
            name = str(base / line.split("::", 1)[0])
            counts[name] = counts.get(name, 0) + 1
    if not counts:
        raise SystemExit(f"pytest collected no tests from {' '.join(paths)}:\n{result.stdout}{result.stderr}")
    return counts


def split_files(counts, workers):
    """The files in `workers` groups of about equal test counts (largest first, each to the
    lightest group); empty groups are dropped."""
    groups = [[0, []] for _ in range(workers)]
    for name, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        lightest = min(groups, key=lambda group: group[0])
        lightest[0] += count
        lightest[1].append(name)
    return [(total, files) for total, files in groups if files]


def last_summary(log: Path) -> str:
    """pytest's closing line (passed/failed counts), or how far the dots got."""
    text = log.read_text(errors="replace") if log.exists() else ""
    for line in reversed(text.splitlines()):
        if re.search(r"\b(passed|failed|error|errors|skipped|no tests ran)\b", line):
            return line.strip("= ")
    progress = re.findall(r"\[\s*(\d+)%\]", text)
    return f"no summary (reached {progress[-1]}%)" if progress else "no summary"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="test files or directories (pytest's own options after --)")
    parser.add_argument("--workers", type=int, default=8, help="pytest processes at once (default: 8)")
    parser.add_argument("--log-dir", type=Path, required=True, help="where pytest_<n>.log go")
    parser.add_argument("--timeout", type=float, default=0,
                        help="seconds after which unfinished processes are stopped (default: 0, none)")
    argv = sys.argv[1:] if argv is None else list(argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    args.log_dir.mkdir(parents=True, exist_ok=True)

    groups = split_files(collected_counts(args.paths, pytest_args), args.workers)
    # -q unless the caller set a verbosity (a second -q drops the summary line last_summary reads),
    # alone or among other short flags (-xq).
    sets_verbosity = any(re.match(r"-[a-zA-Z]*[qv]", a) or a.startswith(("--quiet", "--verbose", "--verbosity"))
                         for a in pytest_args)
    quiet = [] if sets_verbosity else ["-q"]
    start = time.monotonic()
    running = []
    for index, (total, files) in enumerate(groups):
        log = args.log_dir / f"pytest_{index}.log"
        with open(log, "w") as stream:
            process = subprocess.Popen([sys.executable, "-m", "pytest", *quiet, "-p", "no:cacheprovider",
                                        *pytest_args, *files], stdout=stream, stderr=subprocess.STDOUT)
        running.append((process, log, total, files))

    failed = False
    for process, log, total, files in running:
        remaining = None if args.timeout <= 0 else max(0.0, args.timeout - (time.monotonic() - start))
        try:
            status = process.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            status = "timed out"
        failed |= status != 0
        shown = " ".join(os.path.relpath(f) if f.startswith(os.getcwd() + os.sep) else f for f in files)
        print(f"{log.name}: {total} tests in {shown}\n  exit {status}: {last_summary(log)}")
    print(f"{len(running)} processes, {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
