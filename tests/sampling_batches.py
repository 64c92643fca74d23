"""Batches of logits and requests that the host sampler's tests and the sampling graph's share: rows spread, tied,
clipped or holding a NaN, each with a request mixing temperature, top-k, top-p and min-p; and the draw as first
written, to hold the samplers to; and the host sampler's tokens for given uniforms."""

import numpy as np

from kvcache_op.serving import SamplingParams
from kvcache_op.serving.sampling import choose_tokens


def counted_draws(probs, generators):
    """One draw a row as first written: how many running sums are at most the uniform times the total."""
    cumulative = np.cumsum(probs, axis=1)
    u = np.array([g.random() for g in generators])[:, None] * cumulative[:, -1:]
    return np.minimum((cumulative <= u).sum(axis=1), probs.shape[1] - 1)


def mixed_batch(rng, width: int):
    """Rows of logits (spread, tied small integers, around +-1e38 to be clipped, or holding a NaN) and a request for
    each."""
    pool = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=0.01),
            SamplingParams(temperature=1.3, top_k=5), SamplingParams(temperature=1.0, top_k=1),
            SamplingParams(temperature=1.0, top_k=width + 3), SamplingParams(temperature=1.0, top_p=0.8),
            SamplingParams(temperature=4.0, top_p=0.999), SamplingParams(temperature=0.9, top_p=0.05),
            SamplingParams(temperature=0.5, min_p=0.1),
            SamplingParams(temperature=2.0, top_k=12, top_p=0.6, min_p=0.02),
            SamplingParams(temperature=3.0, top_k=300, top_p=0.97),
            SamplingParams(temperature=0.8, top_k=40, min_p=0.3)]  # min-p above the k-th
    count = int(rng.integers(1, 9))
    kinds = rng.integers(0, 4, count)
    logits = np.stack([rng.standard_normal(width) * rng.uniform(0.1, 6) if k in (0, 3) else
                       rng.integers(-2, 3, width).astype(np.float64) if k == 1 else
                       rng.choice([-3e38, 3e38, 0.0], width) for k in kinds]).astype(np.float32)
    logits[kinds == 3, rng.integers(0, width)] = np.nan
    return logits, [pool[i] for i in rng.integers(0, len(pool), count)]


class FixedUniform:
    """A stand-in for a request's generator whose one draw is ``u``."""

    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


def host_tokens(logits, params, uniforms) -> list:
    """The host sampler's tokens for ``logits``, each sampled row r drawing ``uniforms[r]``."""
    return choose_tokens(logits, params, [((), ())] * len(params), [FixedUniform(u) for u in uniforms])[0]
