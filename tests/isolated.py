"""Running a check in a fresh interpreter, for inputs that make a broken kernel write through a wild
pointer: a crash then fails the test instead of killing pytest."""

import os
import subprocess
import sys

DONE = "isolated check passed"


def assert_passes_isolated(module: str, call: str, timeout: int = 300) -> None:
    """Runs ``module.<call>`` (e.g. ``check('x', 3)``) in a subprocess; fails on any error or crash."""
    code = f"import {module} as m; m.{call}; print({DONE!r})"
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, *sys.path]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0 and DONE in proc.stdout, (
        f"{module}.{call}: exit status {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
