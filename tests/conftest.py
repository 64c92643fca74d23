"""Shared test configuration: hypothesis profiles and the one place GPU tests are skipped.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (default, bounded time), ``dev`` (quick), ``long``
(dedicated runs: many more examples).
"""

import os
import sys
import pathlib

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # tests' own helpers (naive reference, strategies)

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=True)
settings.register_profile("dev", max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
