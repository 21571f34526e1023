#!/usr/bin/env python3
"""Runs a pytest suite in several pytest processes at once: the collected tests go in parts (a file
whole, or a long file's test ids in parts of at most --part-size), the longest parts first, and each
process that ends makes room for the next part, so that no one slow file bounds the wall time. One
log a part; OMP_NUM_THREADS, unless set, shares the CPU's cores among the processes. On one GPU the
suite's calls are small, so several processes share it: on an H100 (2026-12-06) the whole suite's
processes took about 1,600 s together, four at a time. test_dropout's CUDA-graph tests fail now
and then under load, never alone (a suspect in torch before 2.13: docs/PERFORMANCE.md, Next steps;
tools/graph_dropout_replays.py); rerun a failure alone to see whether it depends on the load.

  python3 tools/parallel_pytest.py --workers 8 --log-dir OUT tests [-- extra pytest options]

Prints each part's files and its last pytest line; exits 0 only when every part passed (a part
cut by --timeout, or never started before it, counts as failed and says how far it got)."""
import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path


def collected_ids(paths, pytest_args):
    """{test file's path: the ids of the tests pytest collects from it, each beginning with that
    path}. The collection's rootdir is the paths' common folder, so that each test id begins with its
    file's path below it. The verbosity comes after the caller's options: their own -q would
    otherwise make pytest list counts, not ids."""
    base = Path(os.path.commonpath([os.path.abspath(p) for p in paths]))
    if base.is_file():
        base = base.parent
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider",
                             f"--rootdir={base}", *pytest_args, "--verbosity=-1", *paths], capture_output=True,
                            text=True)
    ids = {}
    for line in result.stdout.splitlines():
        if "::" in line:
            file, rest = line.split("::", 1)
            name = str(base / file)
            ids.setdefault(name, []).append(f"{name}::{rest}")
    if not ids:
        raise SystemExit(f"pytest collected no tests from {' '.join(paths)}:\n{result.stdout}{result.stderr}")
    return ids


def split_tests(ids, part_size, named_by_id=()):
    """The tests in parts of at most `part_size`, longest first, each a (count, pytest arguments)
    pair: a file whole, as its path, when it holds no more and the caller did not name some of its
    tests by id (files in `named_by_id`); else its test ids in parts of about equal size."""
    parts = []
    for name, tests in ids.items():
        if len(tests) <= part_size and name not in named_by_id:
            parts.append((len(tests), [name]))
        else:
            count = -(-len(tests) // part_size)
            bounds = [len(tests) * i // count for i in range(count + 1)]
            parts += [(end - begin, tests[begin:end]) for begin, end in zip(bounds, bounds[1:])]
    return sorted(parts, key=lambda part: (-part[0], part[1][0]))


def shown_path(path: str) -> str:
    return os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path


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
    parser.add_argument("paths", nargs="+",
                        help="test files, directories or test ids (pytest's own options after --)")
    parser.add_argument("--workers", type=int, default=8, help="pytest processes at once (default: 8)")
    parser.add_argument("--log-dir", type=Path, required=True, help="where pytest_<n>.log go")
    parser.add_argument("--part-size", type=int, default=150,
                        help="most tests of one file in one pytest process (default: 150)")
    parser.add_argument("--timeout", type=float, default=0,
                        help="seconds from the start (the collection included) after which unfinished "
                             "processes are stopped (default: 0, none)")
    argv = sys.argv[1:] if argv is None else list(argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.part_size < 1:
        parser.error("--part-size must be at least 1")
    args.log_dir.mkdir(parents=True, exist_ok=True)

    start = time.monotonic()  # --timeout counts the collection too
    named_by_id = {os.path.abspath(path.split("::", 1)[0]) for path in args.paths if "::" in path}
    parts = split_tests(collected_ids(args.paths, pytest_args), args.part_size, named_by_id)
    # -q unless the caller set a verbosity (a second -q drops the summary line last_summary reads),
    # alone or among other short flags (-xq).
    sets_verbosity = any(re.match(r"-[a-zA-Z]*[qv]", a) or a.startswith(("--quiet", "--verbose", "--verbosity"))
                         for a in pytest_args)
    quiet = [] if sets_verbosity else ["-q"]
    # The CPU's cores shared among the processes (unless the caller set it): each torch process would
    # otherwise start a thread a core, and the CPU-bound tests (the fp64 oracles) crawl.
    environment = dict(os.environ)
    environment.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.workers)))
    waiting = list(enumerate(parts))
    running = []
    failed = False

    def report(index, status):
        count, arguments = parts[index]
        log = args.log_dir / f"pytest_{index}.log"
        shown = " ".join(sorted({shown_path(a.split("::", 1)[0]) for a in arguments}))
        print(f"{log.name}: {count} tests in {shown}\n  exit {status}: {last_summary(log)}", flush=True)
        return status != 0

    while waiting or running:
        timed_out = args.timeout > 0 and time.monotonic() - start > args.timeout
        while waiting and len(running) < args.workers and not timed_out:
            index, (_, arguments) = waiting.pop(0)
            with open(args.log_dir / f"pytest_{index}.log", "w") as stream:
                running.append((index, subprocess.Popen(
                    [sys.executable, "-m", "pytest", *quiet, "-p", "no:cacheprovider", *pytest_args, *arguments],
                    stdout=stream, stderr=subprocess.STDOUT, env=environment)))
        if timed_out:
            for index, process in running:
                process.kill()
                process.wait()
                failed |= report(index, "timed out")
            for index, _ in waiting:
                failed |= report(index, "not started before the timeout")
            break
        for entry in [entry for entry in running if entry[1].poll() is not None]:
            running.remove(entry)
            failed |= report(entry[0], entry[1].returncode)
        time.sleep(0.2)
    print(f"{len(parts)} parts, {min(args.workers, len(parts))} processes at once, {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
