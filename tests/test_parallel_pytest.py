"""tools/parallel_pytest.py (the whole suite in several pytest processes at once): how it cuts the
tests into parts, runs over a small suite with a failing file and a stalled one, and the CPU
threads it gives each process."""

import os
import textwrap

from helpers import load_script

parallel_pytest = load_script("tools", "parallel_pytest")


def ids_of(counts):
    return {name: [f"{name}::test[{i}]" for i in range(count)] for name, count in counts.items()}


def test_tests_go_in_parts_of_at_most_the_part_size_longest_first():
    parts = parallel_pytest.split_tests(ids_of({"a.py": 3, "big.py": 10, "c.py": 4}), 4)
    assert [count for count, _ in parts] == [4, 4, 3, 3, 3]  # big.py in 3 parts of about equal size
    assert (3, ["big.py::test[0]", "big.py::test[1]", "big.py::test[2]"]) in parts
    assert (4, ["c.py"]) in parts and (3, ["a.py"]) in parts  # files within the size go whole
    big_ids = [argument for _, arguments in parts for argument in arguments if argument.startswith("big.py::")]
    assert sorted(big_ids) == sorted(ids_of({"big.py": 10})["big.py"])  # each test once


def write_suite(directory, files):
    for name, body in files.items():
        (directory / name).write_text(textwrap.dedent(body))


def test_a_run_reports_every_process_and_fails_when_one_fails(tmp_path, capsys):
    suite = tmp_path / "suite"
    suite.mkdir()
    write_suite(suite, {
        "test_one.py": """
            import pytest
            @pytest.mark.parametrize("i", range(5))
            def test_passes(i):
                assert i >= 0
        """,
        "test_two.py": """
            def test_fails():
                assert 1 == 2
        """,
    })
    logs = tmp_path / "logs"
    assert parallel_pytest.main(["--workers", "2", "--log-dir", str(logs), str(suite)]) == 1
    printed = capsys.readouterr().out
    assert "5 passed" in printed and "1 failed" in printed and str(suite / "test_two.py") in printed
    assert printed.rstrip().endswith("s") and "2 parts, 2 processes at once" in printed
    assert sorted(p.name for p in logs.iterdir()) == ["pytest_0.log", "pytest_1.log"]

    # Parts of at most 2 tests, one process at a time: test_one.py's tests go by id, each once.
    assert parallel_pytest.main(["--workers", "1", "--part-size", "2", "--log-dir", str(logs), str(suite)]) == 1
    printed = capsys.readouterr().out
    assert printed.count("2 passed") == 2 and "1 passed" in printed and "1 failed" in printed
    assert "4 parts, 1 processes at once" in printed

    # Tests named by id run alone, not their whole file.
    assert parallel_pytest.main(["--workers", "2", "--log-dir", str(logs), str(suite / "test_one.py") + "::test_passes[3]",
                                 str(suite / "test_two.py")]) == 1
    printed = capsys.readouterr().out
    assert "1 passed" in printed and "1 failed" in printed and "2 parts" in printed

    # pytest's own options after --, in the collection too: here one that deselects the failing test.
    assert parallel_pytest.main(["--workers", "3", "--log-dir", str(logs), str(suite), "--", "-k", "not fails"]) == 0
    printed = capsys.readouterr().out
    assert "5 passed" in printed and "1 parts" in printed and "test_two.py" not in printed

    # The caller's own -q neither hides the collected tests nor the processes' summaries.
    for quiet in ("-q", "-xq"):
        assert parallel_pytest.main(["--workers", "2", "--log-dir", str(logs), str(suite), "--", quiet, "-k",
                                     "not fails"]) == 0
        printed = capsys.readouterr().out
        assert "5 passed" in printed and "1 parts" in printed


def test_a_process_past_the_timeout_is_stopped_and_counts_as_failed(tmp_path, capsys):
    write_suite(tmp_path, {"test_slow.py": """
        import time
        def test_sleeps():
            time.sleep(60)
    """})
    assert parallel_pytest.main(["--workers", "1", "--timeout", "5", "--log-dir", str(tmp_path / "logs"),
                                 str(tmp_path / "test_slow.py")]) == 1
    assert "exit timed out" in capsys.readouterr().out

    # A part not started before the timeout counts as failed too.
    write_suite(tmp_path, {"test_slow_too.py": """
        import time
        def test_sleeps_too():
            time.sleep(60)
    """})
    assert parallel_pytest.main(["--workers", "1", "--timeout", "5", "--log-dir", str(tmp_path / "logs"),
                                 str(tmp_path / "test_slow.py"), str(tmp_path / "test_slow_too.py")]) == 1
    printed = capsys.readouterr().out
    assert "exit timed out" in printed and "exit not started before the timeout" in printed


def test_the_processes_share_the_cores_unless_the_caller_set_omp_num_threads(tmp_path, capsys, monkeypatch):
    (tmp_path / "test_threads_seen.py").write_text(textwrap.dedent("""
        import os
        def test_sees(request):
            assert os.environ["OMP_NUM_THREADS"] == os.environ["EXPECTED_THREADS"]
    """))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("EXPECTED_THREADS", str(max(1, (os.cpu_count() or 1) // 3)))
    assert parallel_pytest.main(["--workers", "3", "--log-dir", str(tmp_path / "logs"), str(tmp_path)]) == 0
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    monkeypatch.setenv("EXPECTED_THREADS", "5")
    assert parallel_pytest.main(["--workers", "3", "--log-dir", str(tmp_path / "logs"), str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("1 passed") == 2
