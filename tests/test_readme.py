"""README's usage examples run as written."""

import contextlib
import io
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_example(marker: str) -> str:
    """Run README's Python block that contains ``marker``; what it printed."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    example = next(b for b in blocks if marker in b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, "README.md", "exec"), {})
    return out.getvalue().strip()


def test_readme_ops_example_runs():
    assert _run_example("plan_reads") == "1"  # P rank 0 frees after D rank 0's one notification


def test_readme_token_slots_example_runs():
    assert _run_example("token_slots=True") == "True"
