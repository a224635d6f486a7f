"""README's ops usage example runs as written."""

import contextlib
import io
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_ops_example_runs():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    ops_example = next(b for b in blocks if "plan_reads" in b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(ops_example, "README.md", "exec"), {})
    assert out.getvalue().strip() == "1"  # P rank 0 frees after D rank 0's one notification


def test_readme_token_slots_example_runs():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    example = next(b for b in blocks if "token_slots=True" in b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, "README.md", "exec"), {})
    assert out.getvalue().strip() == "True"
