"""Every benchmark command line of ``profiling/gpu_session.sh`` parses here, on CPU.

A GPU session is one device call of a few minutes, lent to a few sessions by chance: a renamed
flag or a mistyped value in its script would cost that session a whole step. The commands are
read out of the script itself (its ``step`` lines, and for ``bash $v <step>`` the command
``profiling/gpu_validate.sh`` runs for that step), then each is parsed by its benchmark's own
argument parser, without running the benchmark.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SESSION = os.path.join(ROOT, "profiling", "gpu_session.sh")
VALIDATE = os.path.join(ROOT, "profiling", "gpu_validate.sh")

# steps of gpu_validate.sh whose benchmark arguments come from elsewhere (the ncu look's from the
# ops sweep's results)
NOT_READ = {"ncu"}


def _joined(path: str) -> list[str]:
    """The script's lines, continuation lines joined."""
    with open(path) as f:
        return f.read().replace("\\\n", " ").splitlines()


def _benches(line: str) -> list[tuple[str, str]]:
    """(script, its argument text) of each ``python3 profiling/<script>.py`` in a shell line,
    up to its redirection or pipe."""
    return [
        (m.group(1), re.sub(r"\s\d$", "", m.group(2).rstrip()))  # the fd of a "2>&1" after it
        for m in re.finditer(r"python3 profiling/(\w+\.py)((?:[^>|&;\"]|\"[^\"]*\")*)", line)
    ]


def _validate_steps() -> dict[str, list[tuple[str, str]]]:
    """gpu_validate.sh's case blocks: step -> the benchmarks it runs (script, argument text)."""
    steps: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in _joined(VALIDATE):
        m = re.match(r"\s*([a-z]+)\)", line)
        if m:
            current = steps.setdefault(m.group(1), [])
        if current is not None:
            current.extend(_benches(line))
        if line.strip().endswith(";;"):
            current = None
    return steps


def _argv(text: str, step_args: list[str]) -> list[str]:
    """A benchmark's argument text as its shell would pass it: the step's own arguments for
    ``"${@:2}"``, the first of them (or the default) for ``"${2:-N}"``, OUT for paths in $out."""
    out: list[str] = []
    for w in shlex.split(text):
        if w == "${@:2}":
            out.extend(step_args)
        elif w.startswith("${2:-"):
            out.append(step_args[0] if step_args else w[5:-1])
        else:
            out.append("OUT" if w.startswith("$out") else w)
    return out


def _session_commands() -> list[tuple[str, str, list[str]]]:
    """(step name, benchmark script, argv) of every benchmark the session runs."""
    validate = _validate_steps()
    out = []
    for line in _joined(SESSION):
        m = re.match(r"\s*step\s+(\S+)\s+\d+\s+\d+\s+(.*)$", line)
        if not m:
            continue
        name, cmd = m.groups()
        words = shlex.split(cmd.split("  #")[0])  # a comment after the command left out
        if words[:1] == ["env"]:  # env NAME=VALUE ... COMMAND: the command
            words = words[1:]
            while words and "=" in words[0]:
                words = words[1:]
        if words[:2] == ["bash", "$v"]:
            step = words[2]
            assert step in validate, f"gpu_session.sh step {name!r} runs gpu_validate.sh {step}: no such step"
            if step not in NOT_READ:
                for k, (script, text) in enumerate(validate[step]):
                    out.append((f"{name}-{k}" if k else name, script, _argv(text, words[3:])))
            continue
        found = _benches(words[-1]) if words[-2:-1] == ["-c"] else []
        assert found or "pytest" in cmd, (
            f"gpu_session.sh step {name!r}: a command this test does not read: {cmd}"
        )
        for script, text in found:
            out.append((name, script, _argv(text.replace("'", ""), [])))
    return out


def test_the_session_runs_the_benchmarks_read_here():
    """The reading above found the session's benchmark steps (a change of the script's shape
    would otherwise leave this file checking nothing)."""
    got = {name: (script, argv) for name, script, argv in CASES}
    benches = ("launchhost", "interference", "ops", "transfer", "latency", "batching", "sweep", "hostcost")
    want = {*benches, "latency-1"}
    assert want <= set(got), sorted(got)
    assert got["latency-1"][1][:2] == ["--transport", "pg"]  # gpu_validate.sh's own pg line
    assert got["hostcost"] == ("bench_engine.py", ["--host-only", "--host-iters", "200"])
    assert got["ops"][1][:2] == ["--out", "OUT"] and "--models" in got["ops"][1]  # "${@:2}" filled in


# Runs in a fresh interpreter: imports the script without running it, then parses ``argv`` with
# its own parser (its module-level ``parse_args(argv)`` when it has one, which also runs the checks
# made after parsing; else its ``main`` until the parser returned).
_DRIVER = r"""
import argparse, json, runpy, sys
path, argv = sys.argv[1], json.loads(sys.argv[2])
sys.argv = [path]  # the parser's name in its messages
g = runpy.run_path(path, run_name="kvxfer_session_rehearsal")

class Parsed(Exception):
    pass

if "parse_args" in g:
    ns = g["parse_args"](argv)
else:
    real = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise Parsed(real(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_only
    sys.argv = [path, *argv]
    try:
        g["main"](argv) if g["main"].__code__.co_argcount else g["main"]()
        raise SystemExit("main() returned without parsing its arguments")
    except Parsed as e:
        ns = e.args[0]
print("PARSED", sorted(vars(ns)))
"""


CASES = _session_commands()


@pytest.mark.parametrize("name,script,argv", CASES, ids=[c[0] for c in CASES])
def test_session_command_parses(name, script, argv, tmp_path):
    import json

    argv = [str(tmp_path) if a == "OUT" else a for a in argv]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((ROOT, os.path.join(ROOT, "profiling")))}
    res = subprocess.run(
        [sys.executable, "-c", _DRIVER, os.path.join(ROOT, "profiling", script), json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert res.returncode == 0 and "PARSED" in res.stdout, (
        f"gpu_session.sh step {name}: {script} {' '.join(argv)}\n{res.stdout}\n{res.stderr[-3000:]}"
    )
