"""The documentation runs: every ```python block of README.md and docs/*.md.

Blocks of one file share a namespace and run top to bottom, as a reader would
paste them, in a fresh interpreter per file: a block that sets XLA_FLAGS before
importing jax gets the devices it asks for, and nothing of this pytest process
(its 8 host devices, imported modules) leaks in. The subprocess sees a CPU-only
machine (JAX_PLATFORMS=cpu), the one the documents are written for.

A block that is deliberately not runnable is fenced ```python no-run; such
blocks must be few and are listed in NO_RUN below. Any other info string that
looks like Python (```py, ```python3, ```pycon, ...) is an error, so that no
block is skipped silently.
"""

import glob
import os
import re
import subprocess
import sys

import pytest

from conftest import PRIVATE_DOC_REF, script_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT)
                             for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]

# (file, first line of the block's code) of every ```python no-run block.
NO_RUN: set[tuple[str, str]] = set()
MAX_NO_RUN = 3

TIMEOUT_S = 300

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,}|~{3,})(?P<info>.*)$")


def extract_blocks(text: str):
    """Every fenced block of a Markdown text: ``[(info, first line number, code)]``
    (info string stripped and lower-cased; code dedented by the fence's indent)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, info = m["indent"], m["ticks"], m["info"].strip().lower()
        start, body, i = i + 1, [], i + 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if (close and close["ticks"][0] == ticks[0] and len(close["ticks"]) >= len(ticks)
                    and not close["info"].strip()):
                break
            line = lines[i]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            i += 1
        else:
            raise ValueError(f"unclosed code fence opened on line {start}")
        blocks.append((info, start + 1, "\n".join(body) + "\n"))
        i += 1
    return blocks


def python_blocks(relpath: str):
    """``(runnable [(line, code)], no_run [(line, code)])`` of one document."""
    with open(os.path.join(ROOT, relpath), encoding="utf-8") as f:
        blocks = extract_blocks(f.read())
    runnable, no_run = [], []
    for info, line, code in blocks:
        words = info.split()
        lang = words[0] if words else ""
        if lang == "python":
            if words[1:] == ["no-run"]:
                no_run.append((line, code))
            elif words[1:]:
                raise AssertionError(f"{relpath}:{line}: unknown python fence options {words[1:]}")
            else:
                runnable.append((line, code))
        elif lang.startswith("py") or lang in ("ipython", "jupyter"):
            raise AssertionError(f"{relpath}:{line}: fence {info!r}: write ```python (it runs) "
                                 "or ```python no-run")
    return runnable, no_run


def _first_code_line(code: str) -> str:
    return next((ln.strip() for ln in code.splitlines() if ln.strip()), "")


def _script(relpath: str, blocks) -> str:
    parts = [f"# {relpath}, blocks in order\n"]
    for line, code in blocks:
        parts.append(f"print('--- {relpath}:{line}', flush=True)\n{code}")
    return "\n".join(parts)


def _env():
    # Not this process's 8 host devices: a document that wants them says so.
    env = script_env(host_devices=False)
    env["JAX_PLATFORMS"] = "cpu"
    return env


# --------------------------------------------------------------------------------------
# The extractor itself
# --------------------------------------------------------------------------------------


def test_extract_blocks():
    text = ("intro\n```python\na = 1\n```\n"
            "- item\n\n  ```python\n  b = a + 1\n    c = 2\n  ```\n"
            "````python no-run\nnot python ```\n````\n"
            "```bash\nls\n```\n~~~python\nd = 4\n~~~\n")
    blocks = extract_blocks(text)
    assert blocks == [("python", 3, "a = 1\n"), ("python", 8, "b = a + 1\n  c = 2\n"),
                      ("python no-run", 12, "not python ```\n"), ("bash", 15, "ls\n"),
                      ("python", 18, "d = 4\n")]
    with pytest.raises(ValueError, match="unclosed"):
        extract_blocks("```python\nx = 1\n")


def test_every_document_is_covered_and_no_run_blocks_are_few_and_listed():
    assert "docs/contract.md" in DOCS and "docs/training.md" in DOCS
    found = set()
    for relpath in DOCS:
        _, no_run = python_blocks(relpath)
        found |= {(relpath, _first_code_line(code)) for _, code in no_run}
    assert found == NO_RUN, f"```python no-run blocks found {sorted(found)}, listed {NO_RUN}"
    assert len(found) <= MAX_NO_RUN
    # The documents that must teach by running code do have runnable blocks.
    for relpath in ("README.md", "docs/contract.md", "docs/training.md"):
        assert python_blocks(relpath)[0], f"{relpath} has no runnable python block"


_PRIVATE_REF = PRIVATE_DOC_REF
_DIR, _DOC = "../" + "shar" + "ed", "DES" + "IGN"  # for the pattern's own test
_SCANNED = ["README.md", "CMakeLists.txt", "pyproject.toml", "docs", "mok_jax", "examples",
            "scripts", "tests", "ffi", "cmake"]
_SCANNED_EXT = (".md", ".py", ".sh", ".txt", ".toml", ".cc", ".cu", ".h", ".cuh", ".cmake")


def _scanned_files():
    for entry in _SCANNED:
        path = os.path.join(ROOT, entry)
        if os.path.isfile(path):
            yield entry
            continue
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = [d for d in dirnames if d not in ("runs", "__pycache__")]
            for name in filenames:
                if name.endswith(_SCANNED_EXT):
                    yield os.path.relpath(os.path.join(dirpath, name), ROOT)


def test_private_reference_pattern():
    for text in (f"see {_DIR}/{_DOC}.md", f"{_DOC} §3", f"({_DOC}.md §1)", f"{_DIR[3:]}/{_DOC}"):
        assert _PRIVATE_REF.search(text), text
    for text in ("docs/contract.md", "a safer design", "shared headers", "Design notes"):
        assert not _PRIVATE_REF.search(text), text


def test_no_reference_to_a_private_design_document():
    # The contract is docs/contract.md; nothing in the repository points outside it.
    hits = []
    for relpath in _scanned_files():
        with open(os.path.join(ROOT, relpath), encoding="utf-8", errors="replace") as f:
            hits += [f"{relpath}:{n}: {line.strip()}" for n, line in enumerate(f, 1)
                     if _PRIVATE_REF.search(line) and " not in " not in line]  # not a guard
    assert not hits, "\n".join(hits)


def readme_commands():
    """The shell commands at the top of README.md (its first ```bash block), each
    without its trailing `# comment`."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        _, _, code = next(b for b in extract_blocks(f.read()) if b[0] == "bash")
    return [re.sub(r"\s+#.*$", "", line).strip() for line in code.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command_and_the_slow_tests_beside_the_cuda_build():
    """The README's test command is a CPU-only build and the fast set in two
    processes; .ci/run starts a CUDA wheel build that fails without nvcc in the
    background (at a lower priority, its session's autogroup's included, as its
    own process group, which an EXIT trap ends should a step fail before the
    wait), runs that very line, then the slow set (every
    file but the two that test the installed build, in two processes), then
    installs the wheel and runs those two files, fast and slow, on it (their fast
    tests ran on the CPU-only build already)."""
    test_command = next(c for c in readme_commands() if "pytest" in c)
    assert test_command.startswith("MOK_ENABLE_CUDA=OFF pip install "), test_command
    assert test_command.endswith('pytest -q -m "not slow" -n 2'), test_command
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        lines = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    runs = [i for i, ln in enumerate(lines) if ln == test_command or ln.startswith(test_command + " ||")]
    # Its own session, whose autogroup (where the kernel has them) is lowered too: a
    # niced process in a new autogroup still takes an equal share of the cores.
    cuda = [i for i, ln in enumerate(lines[:-1])
            if ln.startswith("setsid -w sh -c '{ echo 19 > /proc/self/autogroup; }")
            and 'exec nice -n 10 "$@"\'' in ln
            and lines[i + 1].startswith("env MOK_ENABLE_CUDA=ON pip wheel ")]
    end_build = """trap 'kill -- -"$cuda" 2> /dev/null || true' EXIT"""
    trap = [i for i, ln in enumerate(lines) if ln == end_build]
    slow = [i for i, ln in enumerate(lines) if ln.startswith("pytest -q -m slow")]
    build_files = ("tests/test_build.py", "tests/test_platform.py")
    rest = [i for i in slow if "-n 2" in lines[i]
            and all(f"--ignore={f}" in lines[i] for f in build_files)
            and not any(w.startswith("tests/") for w in lines[i].split())]
    install = [i for i, ln in enumerate(lines) if ln.startswith("pip install --no-deps ")]
    on_cuda = [i for i, ln in enumerate(lines)
               if ln.startswith("pytest -q ") and "-m" not in ln.split()
               and all(f in ln.split() for f in build_files)]
    assert runs and cuda and trap and rest and install and on_cuda, lines
    assert cuda[0] < trap[0] < runs[0] < min(slow) < install[0] < on_cuda[0], lines
    assert len(slow) == 1, lines  # the slow set once: nothing run twice or left out


# --------------------------------------------------------------------------------------
# The documents run
# --------------------------------------------------------------------------------------


# Every document's blocks, README's included, with -m slow.
@pytest.mark.parametrize("relpath", [d for d in DOCS if python_blocks(d)[0]])
@pytest.mark.slow
def test_python_blocks_run(relpath, tmp_path):
    runnable, _ = python_blocks(relpath)
    script = tmp_path / (re.sub(r"\W", "_", relpath) + ".py")
    script.write_text(_script(relpath, runnable), encoding="utf-8")
    # cwd: a scratch directory, so that `import mok_jax` cannot pick up an unbuilt
    # source tree by accident and nothing is written into the repository.
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    ran = re.findall(r"^--- (\S+)$", result.stdout, flags=re.M)
    assert result.returncode == 0, (
        f"{relpath}: the block at {ran[-1] if ran else '?'} failed (exit {result.returncode})"
        f"\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-6000:]}")
    assert len(ran) == len(runnable), (ran, len(runnable))
