"""A/B of builds of mok_jax on one machine through the bench, in alternating processes.

    python scripts/bench_ab.py OUTDIR --build TAG=DIR --build TAG=DIR [--rounds N]
        [--base TAG] [--module M] -- BENCH_ARGS...
    python scripts/bench_ab.py OUTDIR --compare [--base TAG]

DIR holds an installed mok_jax, e.g. from `pip install --no-deps --target DIR
mok_jax-*.whl`. Each round runs `python -m mok_jax.bench BENCH_ARGS --json
OUTDIR/TAG_ROUND.json` once per build, in the order given. DIR goes first on
PYTHONPATH and OUTDIR is the working directory, so no source tree's mok_jax shadows the
build. The log of each process goes to OUTDIR/TAG_ROUND.txt. The JSON files that an
earlier run left in OUTDIR for these TAGs are removed first, and the table after the
runs has these builds only: a process that fails before writing its JSON leaves no
earlier file in its place.

One GPU's processes differ by 1-3 % from one to the next, so a difference between
builds is only seen with both in the same rounds.

The table that follows (with --compare, from OUTDIR's JSON files alone) has one row
per (shape, impl, pass, recipe). It gives each build's medians over the rounds and
each build's time over the base's: the sum of its medians over the sum of the base's,
blocked (`median_ms`) and queued (`queued_ms`). Lower is faster. The base is the
first --build, or --base. A record that failed, or that some round lacks, has no
ratio. The exit status is 1 if a process failed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys

_FILE = re.compile(r"^(?P<tag>.+)_(?P<round>\d+)\.json$")


def record_key(rec: dict) -> tuple:
    """(shape, impl, pass, recipe): what a row of the table compares."""
    return rec["shape"], rec["impl"], rec["pass"], rec.get("recipe") or "native"


def load(outdir: str) -> dict[str, dict[int, dict[tuple, dict]]]:
    """OUTDIR's TAG_ROUND.json files: {tag: {round: {record_key: record}}}."""
    runs: dict[str, dict[int, dict[tuple, dict]]] = {}
    for path in sorted(glob.glob(os.path.join(outdir, "*.json"))):
        m = _FILE.match(os.path.basename(path))
        if m is None:
            continue
        with open(path) as f:
            records = json.load(f)["records"]
        by_key = {record_key(r): r for r in records}
        runs.setdefault(m["tag"], {})[int(m["round"])] = by_key
    return runs


def _values(rounds: dict[int, dict[tuple, dict]], key: tuple, field: str) -> list | None:
    """The field over the rounds in round order, or None if a round lacks it or failed."""
    out = []
    for r in sorted(rounds):
        rec = rounds[r].get(key)
        if rec is None or rec.get("status") != "ok" or rec.get(field) is None:
            return None
        out.append(float(rec[field]))
    return out


def compare(runs: dict, base: str) -> list[dict]:
    """One row per record key of any build: each build's blocked and queued medians over
    the rounds and its ratio to the base's (sum over sum; None where either build lacks
    a round's value or the two ran a different number of rounds)."""
    if base not in runs:
        raise ValueError(f"base build {base!r} has no runs; builds: {sorted(runs)}")
    keys = sorted({k for rounds in runs.values() for per in rounds.values() for k in per})
    rows = []
    fields = (("median_ms", "blocked"), ("queued_ms", "queued"))
    for key in keys:
        row = {"key": key, "builds": {}}
        refs = {field: _values(runs[base], key, field) for field, _ in fields}
        for tag, rounds in runs.items():
            entry = {}
            for field, name in fields:
                mine, ref = _values(rounds, key, field), refs[field]
                entry[name] = mine
                ok = mine is not None and ref is not None and len(mine) == len(ref)
                entry[name + "_ratio"] = sum(mine) / sum(ref) if ok and sum(ref) > 0 else None
            row["builds"][tag] = entry
        rows.append(row)
    return rows


def format_table(rows: list[dict], base: str) -> str:
    """The rows as text: a line per (record, build)."""
    fmt = lambda v: "-" if v is None else ", ".join(f"{x:.3f}" for x in v)  # noqa: E731
    ratio = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [f"time / {base}'s: sum of the rounds' medians over the base's (lower is faster)",
             "shape, impl, pass, recipe | build | blocked ms | queued ms | blocked ratio | "
             "queued ratio"]
    for row in rows:
        for tag, e in row["builds"].items():
            lines.append(f"{', '.join(row['key'])} | {tag} | {fmt(e['blocked'])} | "
                         f"{fmt(e['queued'])} | {ratio(e['blocked_ratio'])} | "
                         f"{ratio(e['queued_ratio'])}")
    return "\n".join(lines)


def run(outdir: str, builds: list[tuple[str, str]], rounds: int, bench_args: list[str],
        module: str = "mok_jax.bench") -> int:
    """The alternating processes; returns how many failed. The TAG_ROUND.json files
    of these builds' tags already in `outdir` are removed first."""
    tags = {tag for tag, _ in builds}
    for path in glob.glob(os.path.join(outdir, "*.json")):
        m = _FILE.match(os.path.basename(path))
        if m is not None and m["tag"] in tags:
            os.remove(path)
    failed = 0
    for r in range(1, rounds + 1):
        for tag, build_dir in builds:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (os.path.abspath(build_dir), env.get("PYTHONPATH")) if p)
            stem = os.path.join(outdir, f"{tag}_{r}")
            cmd = [sys.executable, "-m", module, *bench_args, "--json", stem + ".json"]
            with open(stem + ".txt", "w") as log:
                rc = subprocess.run(cmd, cwd=outdir, env=env, stdout=log,
                                    stderr=subprocess.STDOUT).returncode
            print(f"{tag} round {r}: rc={rc}", flush=True)
            failed += rc != 0
    return failed


def _build(text: str) -> tuple[str, str]:
    tag, sep, path = text.partition("=")
    if not sep or not tag or not path or "_" in tag:
        raise argparse.ArgumentTypeError(
            f"--build takes TAG=DIR with a TAG without underscores, got {text!r}")
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"--build {tag}: {path!r} is not a directory")
    return tag, path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--build", type=_build, action="append", default=[],
                    help="TAG=DIR: a build to time (repeatable; the first is the base)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="processes per build, alternating (default 2)")
    ap.add_argument("--base", help="the build the ratios are to (default: the first)")
    ap.add_argument("--module", default=None,
                    help="the module each process runs (default mok_jax.bench)")
    ap.add_argument("--compare", action="store_true",
                    help="no runs: the table from OUTDIR's JSON files")
    args = ap.parse_args(argv)
    # Absolute: each process runs in OUTDIR and is given its JSON path.
    args.outdir = os.path.abspath(args.outdir)
    if any(a == "--json" or a.startswith("--json=") for a in bench_args):
        ap.error("the bench's --json is set per process; leave it out of BENCH_ARGS")
    if args.rounds is not None and args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.compare:  # what only a run uses would be ignored
        for given, name in ((args.rounds is not None, "--rounds"),
                            (args.module is not None, "--module"),
                            (bool(bench_args), "BENCH_ARGS")):
            if given:
                ap.error(f"--compare with {name}: --compare runs nothing, it reads "
                         "OUTDIR's JSON files")
    failed = 0
    if not args.compare:
        if len(args.build) < 2:
            ap.error("an A/B needs two --build TAG=DIR or more")
        tags = [t for t, _ in args.build]
        if len(set(tags)) != len(tags):
            ap.error(f"--build tags repeat: {tags}")
        if args.base is not None and args.base not in tags:  # before the runs, not after
            ap.error(f"--base {args.base!r} is none of the --build tags {tags}")
        os.makedirs(args.outdir, exist_ok=True)
        failed = run(args.outdir, args.build, args.rounds or 2, bench_args,
                     args.module or "mok_jax.bench")
    runs = load(args.outdir)
    if not args.compare:  # this run's builds only
        runs = {tag: rounds for tag, rounds in runs.items() if tag in tags}
    base = args.base or (args.build[0][0] if args.build else None)
    if base is None:
        ap.error("--compare needs --base TAG")
    try:
        rows = compare(runs, base)
    except ValueError as err:  # the base has no JSON file
        if args.compare:
            ap.error(str(err))
        print(f"no table: {err}", file=sys.stderr)
        return 1
    print(format_table(rows, base))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
