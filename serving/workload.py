"""Synthetic request sets with the structure of real traffic: a few shared system prompts, user turns of
different lengths, staggered arrival. Deterministic for a seed."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Workload:
    """Prompts (token ids), the step each arrives at, and each one's tenant salt (``None``: shared)."""

    prompts: list
    arrival_steps: list
    salts: list


def shared_prefix_workload(count: int, vocab_size: int, *, seed: int = 0, system_prompts: int = 3,
                           system_length: int = 40, user_length: tuple = (3, 30), arrivals_per_step: int = 2,
                           tenants: int = 1) -> Workload:
    """``count`` prompts: system prompt ``i % system_prompts`` followed by a random user part of
    ``user_length`` tokens (half-open range); ``arrivals_per_step`` arrive per step. With ``tenants > 1``
    request ``i`` belongs to tenant ``i % tenants`` (its salt), and only requests of one tenant share pages."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, vocab_size, system_length).tolist() for _ in range(system_prompts)]
    prompts = [systems[i % system_prompts] + rng.integers(0, vocab_size, rng.integers(*user_length)).tolist()
               for i in range(count)]
    salts = [None if tenants == 1 else f"tenant-{i % tenants}" for i in range(count)]
    return Workload(prompts, [i // arrivals_per_step for i in range(count)], salts)
