"""scripts/bench_ab.py, the A/B of builds in alternating bench processes: its ratios on
bench JSON files written here, and its runs with a stand-in bench module in each build."""

import json
import os
import textwrap

import pytest

from conftest import load_script

bench_ab = load_script("bench_ab")


def record(shape, impl, pas, median, queued, status="ok"):
    return {"shape": shape, "impl": impl, "pass": pas, "recipe": "native", "status": status,
            "median_ms": median if status == "ok" else None,
            "queued_ms": queued if status == "ok" else None}


def write(outdir, tag, rnd, records):
    with open(os.path.join(outdir, f"{tag}_{rnd}.json"), "w") as f:
        json.dump({"records": records}, f)


def row_of(rows, key):
    (row,) = [r for r in rows if r["key"] == key]
    return row


def test_ratios_are_sums_of_the_rounds_over_the_base(tmp_path):
    write(tmp_path, "old", 1, [record("s", "moe", "fwd", 2.0, 1.8)])
    write(tmp_path, "old", 2, [record("s", "moe", "fwd", 4.0, 3.8)])
    write(tmp_path, "new", 1, [record("s", "moe", "fwd", 1.5, 1.0)])
    write(tmp_path, "new", 2, [record("s", "moe", "fwd", 3.5, 2.0)])
    rows = bench_ab.compare(bench_ab.load(str(tmp_path)), "old")
    e = row_of(rows, ("s", "moe", "fwd", "native"))["builds"]
    assert e["new"]["blocked"] == [1.5, 3.5]
    assert e["new"]["blocked_ratio"] == pytest.approx(5.0 / 6.0)
    assert e["new"]["queued_ratio"] == pytest.approx(3.0 / 5.6)
    assert e["old"]["blocked_ratio"] == pytest.approx(1.0)
    text = bench_ab.format_table(rows, "old")
    assert "s, moe, fwd, native | new | 1.500, 3.500 | 1.000, 2.000 | 0.833 | 0.536" in text


def test_failed_or_missing_records_have_no_ratio(tmp_path):
    write(tmp_path, "old", 1, [record("s", "moe", "fwd", 2.0, 2.0),
                               record("s", "moe", "fwdbwd", 6.0, 6.0)])
    write(tmp_path, "old", 2, [record("s", "moe", "fwd", 2.0, 2.0),
                               record("s", "moe", "fwdbwd", 6.0, 6.0)])
    write(tmp_path, "new", 1, [record("s", "moe", "fwd", 1.0, 1.0),
                               record("s", "moe", "fwdbwd", 0, 0, status="error")])
    # new's second process wrote nothing: one round against two
    rows = bench_ab.compare(bench_ab.load(str(tmp_path)), "old")
    fwd = row_of(rows, ("s", "moe", "fwd", "native"))["builds"]["new"]
    bwd = row_of(rows, ("s", "moe", "fwdbwd", "native"))["builds"]["new"]
    assert fwd["blocked"] == [1.0] and fwd["blocked_ratio"] is None
    assert bwd["blocked"] is None and bwd["queued_ratio"] is None
    assert "| new | - | - | n/a | n/a" in bench_ab.format_table(rows, "old")
    with pytest.raises(ValueError, match="base build 'gone' has no runs"):
        bench_ab.compare(bench_ab.load(str(tmp_path)), "gone")


# A stand-in for mok_jax.bench: one record whose median is its build's number, and a
# line in the shared order log, so the test sees which build ran when and from where.
FAKE = textwrap.dedent("""
    import json, os, sys
    here = os.path.dirname(os.path.abspath(__file__))
    speed = float(open(os.path.join(here, "speed.txt")).read())
    with open(os.environ["AB_ORDER_LOG"], "a") as log:
        log.write(os.path.basename(os.path.dirname(here)) + " " + os.getcwd() + "\\n")
    out = sys.argv[sys.argv.index("--json") + 1]
    rec = {"shape": sys.argv[1], "impl": "moe", "pass": "fwd", "recipe": "native",
           "status": "ok", "median_ms": speed, "queued_ms": speed / 2}
    json.dump({"records": [rec]}, open(out, "w"))
""")


def fake_build(tmp_path, name, speed):
    pkg = tmp_path / name / "fakebench"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(FAKE)
    (pkg / "speed.txt").write_text(str(speed))
    return str(tmp_path / name)


def test_runs_alternate_the_builds_each_from_its_own_directory(tmp_path, monkeypatch, capsys):
    a, b = fake_build(tmp_path, "buildA", 2.0), fake_build(tmp_path, "buildB", 3.0)
    out = tmp_path / "out"
    order = tmp_path / "order.log"
    monkeypatch.setenv("AB_ORDER_LOG", str(order))
    monkeypatch.chdir(tmp_path)  # OUTDIR given relative to here
    rc = bench_ab.main(["out", "--build", f"a={a}", "--build", f"b={b}", "--rounds", "2",
                        "--module", "fakebench", "--", "shapeX"])
    assert rc == 0
    lines = order.read_text().split()
    assert lines[0::2] == ["buildA", "buildB", "buildA", "buildB"]
    assert set(lines[1::2]) == {str(out)}
    assert sorted(os.listdir(out)) == ["a_1.json", "a_1.txt", "a_2.json", "a_2.txt",
                                       "b_1.json", "b_1.txt", "b_2.json", "b_2.txt"]
    text = capsys.readouterr().out
    assert "shapeX, moe, fwd, native | b | 3.000, 3.000 | 1.500, 1.500 | 1.500 | 1.500" in text
    # The table again from the files alone, against b.
    assert bench_ab.main([str(out), "--compare", "--base", "b"]) == 0
    assert "| a | 2.000, 2.000 | 1.000, 1.000 | 0.667 | 0.667" in capsys.readouterr().out


def test_bad_arguments_are_refused(tmp_path, capsys):
    d = str(tmp_path)
    for argv, message in (
            ([d, "--build", f"a={d}"], "two --build"),
            ([d, "--build", f"a_b={d}", "--build", f"c={d}"], "without underscores"),
            ([d, "--build", f"a={d}/missing", "--build", f"b={d}"], "is not a directory"),
            ([d, "--build", f"a={d}", "--build", f"a={d}"], "tags repeat"),
            ([d, "--build", f"a={d}", "--build", f"b={d}", "--base", "c"], "--base 'c'"),
            ([d, "--build", f"a={d}", "--build", f"b={d}", "--", "--json", "x"], "--json"),
            ([d, "--build", f"a={d}", "--build", f"b={d}", "--", "--json=x"], "--json"),
            ([d, "--compare"], "needs --base"),
            ([d, "--compare", "--base", "a", "--rounds", "3"], "--compare with --rounds"),
            ([d, "--compare", "--base", "a", "--module", "m"], "--compare with --module"),
            ([d, "--compare", "--base", "a", "--", "--shapes", "ep"],
             "--compare with BENCH_ARGS")):
        with pytest.raises(SystemExit):
            bench_ab.main(argv)
        assert message in capsys.readouterr().err


def test_a_run_compares_only_the_json_of_its_own_processes(tmp_path, monkeypatch, capsys):
    """JSON files an earlier run left in OUTDIR (another build's, a round beyond
    --rounds, and the file of a process that now fails before writing) stay out of
    this run's table."""
    out = tmp_path / "out"
    out.mkdir()
    for tag, rnd, median in (("a", 1, 50.0), ("a", 3, 70.0), ("b", 1, 10.0),
                             ("b", 3, 30.0), ("c", 1, 5.0)):
        write(out, tag, rnd, [record("shapeX", "moe", "fwd", median, median)])
    a = fake_build(tmp_path, "buildA", 2.0)
    b = fake_build(tmp_path, "buildB", 3.0)
    (tmp_path / "buildB" / "fakebench" / "__main__.py").write_text(
        "import sys\nsys.exit(3)\n")  # fails before writing its JSON
    monkeypatch.setenv("AB_ORDER_LOG", str(tmp_path / "order.log"))
    rc = bench_ab.main([str(out), "--build", f"a={a}", "--build", f"b={b}", "--rounds", "1",
                        "--module", "fakebench", "--", "shapeX"])
    assert rc == 1
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("shapeX")]
    assert rows == ["shapeX, moe, fwd, native | a | 2.000 | 1.000 | 1.000 | 1.000"], text


def test_a_base_without_runs_is_a_clear_error_not_a_traceback(tmp_path, monkeypatch, capsys):
    write(tmp_path, "old", 1, [record("s", "moe", "fwd", 2.0, 2.0)])
    with pytest.raises(SystemExit):
        bench_ab.main([str(tmp_path), "--compare", "--base", "gone"])
    assert "base build 'gone' has no runs" in capsys.readouterr().err
    # A run whose base build fails in every round: its failures, and no table.
    a = fake_build(tmp_path, "buildA", 2.0)
    (tmp_path / "buildA" / "fakebench" / "__main__.py").write_text("import sys\nsys.exit(3)\n")
    b = fake_build(tmp_path, "buildB", 3.0)
    monkeypatch.setenv("AB_ORDER_LOG", str(tmp_path / "order.log"))
    rc = bench_ab.main([str(tmp_path / "out"), "--build", f"a={a}", "--build", f"b={b}",
                        "--rounds", "1", "--module", "fakebench", "--", "s"])
    assert rc == 1
    captured = capsys.readouterr()
    assert "a round 1: rc=3" in captured.out
    assert "base build 'a' has no runs" in captured.err
