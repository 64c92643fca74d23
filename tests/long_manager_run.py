"""Dedicated long run of the cache-manager state machines (plain, windowed, StreamingLLM shift and
re-evaluate) with the coverage they reached: ``python3 tests/long_manager_run.py [EXAMPLES]``.

Every step of every example runs the op's reference and all of the machines' checks; any violation
raises, so a run that prints its last line saw none.
"""

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

import test_manager_stateful as plain  # noqa: E402
import test_manager_streaming as streaming  # noqa: E402


def main(examples: int) -> None:
    config = settings(max_examples=examples, stateful_step_count=50, deadline=None,
                      suppress_health_check=list(HealthCheck))
    start = time.time()
    for key in plain.COVERAGE:
        plain.COVERAGE[key] = 0
    run_state_machine_as_test(plain.ManagerMachine, settings=config)
    run_state_machine_as_test(plain.WindowedManagerMachine, settings=config)
    print(f"plain + windowed: {plain.COVERAGE} ({time.time() - start:.0f} s)", flush=True)
    for mode, machine in (("shift", streaming.StreamingMachine), ("reevaluate", streaming.ReevaluateMachine)):
        streaming.COVERAGE[mode] = {}
        start = time.time()
        run_state_machine_as_test(machine, settings=config)
        print(f"streaming {mode}: {streaming.COVERAGE[mode]} ({time.time() - start:.0f} s)", flush=True)
    print(f"{examples} examples per machine, 0 violations")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000)
