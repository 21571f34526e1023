"""tools/parallel_pytest.py (the whole suite in several pytest processes at once): how it splits
the files, and a run over a small suite with a failing file and a stalled one."""

import textwrap

from helpers import load_script

parallel_pytest = load_script("tools", "parallel_pytest")


def test_files_split_into_groups_of_about_equal_test_counts():
    groups = parallel_pytest.split_files({"a.py": 10, "b.py": 6, "c.py": 5, "d.py": 1}, 2)
    assert groups == [(11, ["a.py", "d.py"]), (11, ["b.py", "c.py"])]
    assert parallel_pytest.split_files({"a.py": 3}, 4) == [(3, ["a.py"])]  # no empty groups


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
    assert printed.rstrip().endswith("s") and "2 processes" in printed
    assert sorted(p.name for p in logs.iterdir()) == ["pytest_0.log", "pytest_1.log"]

    # pytest's own options after --, in the collection too: here one that deselects the failing test.
    assert parallel_pytest.main(["--workers", "3", "--log-dir", str(logs), str(suite), "--", "-k", "not fails"]) == 0
    printed = capsys.readouterr().out
    assert "5 passed" in printed and "1 processes" in printed and "test_two.py" not in printed

    # The caller's own -q neither hides the collected tests nor the processes' summaries.
    for quiet in ("-q", "-xq"):
        assert parallel_pytest.main(["--workers", "2", "--log-dir", str(logs), str(suite), "--", quiet, "-k",
                                     "not fails"]) == 0
        printed = capsys.readouterr().out
        assert "5 passed" in printed and "1 processes" in printed


def test_a_process_past_the_timeout_is_stopped_and_counts_as_failed(tmp_path, capsys):
    write_suite(tmp_path, {"test_slow.py": """
        import time
        def test_sleeps():
            time.sleep(60)
    """})
    assert parallel_pytest.main(["--workers", "1", "--timeout", "5", "--log-dir", str(tmp_path / "logs"),
                                 str(tmp_path / "test_slow.py")]) == 1
    assert "exit timed out" in capsys.readouterr().out
