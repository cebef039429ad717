"""The router's choices on a seeded fleet, pinned: a change meant to make Route cheaper must
leave every decision (worker, pair, reason with its figures, candidates scored) as it was.

The digest was recorded with the router of main at cfef245 (before the per-call cost work of
fs-17d). A change to the scoring policy itself changes it on purpose: record the new digest
then, and say so in the commit.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from fleetshift_daemon.core.estimator import OutputLengthEstimator
from fleetshift_daemon.core.gpus import A100_SXM_80GB, H100_SXM, H200_SXM
from fleetshift_daemon.core.perfmodel import Dtype, ModelArch, PerfModel, llama2_70b
from fleetshift_daemon.core.routing import (
    Role,
    Router,
    RouterConfig,
    RouteRequest,
    Slo,
    WorkerView,
    _draw,
    _sample_setsize,
)

SMALL = ModelArch("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 128)
MODELS = [llama2_70b(), SMALL]
ROLES = (Role.MIXED, Role.PREFILL, Role.DECODE)
GPUS = (A100_SXM_80GB, H100_SXM, H200_SXM)
# sha256 of every decision below, on the router before fs-17d's per-call cost work
PINNED = "740d6fdc9d56fa2e59a2cf396e5fe3c783d5d66d5404a9e752fd697db5ad1df2"


def fleet(rng: random.Random, nodes: int) -> list[WorkerView]:
    out = []
    for n in range(nodes):
        for g in range(2):
            arch = MODELS[(n + g) % 2]
            # a third of the workers from a few values only: equal counters, tied scores
            few = n % 3 == 0
            out.append(
                WorkerView(
                    id=f"n{n}-w{g}",
                    node=f"n{n}",
                    model=arch.name,
                    role=ROLES[rng.randrange(3)],
                    gpu=GPUS[n % 3],
                    tp=4,
                    dtype=Dtype.FP8 if n % 7 == 0 else Dtype.BF16,
                    queue_tokens=rng.choice((0, 4096)) if few else rng.randrange(0, 20_000),
                    kv_used_tokens=rng.choice((0, 8192)) if few else rng.randrange(0, 100_000),
                    kv_total_tokens=None if n % 5 else rng.randrange(50_000, 200_000),
                    live_sessions=rng.choice((0, 2)) if few else rng.randrange(0, 64),
                    healthy=n % 31 != 0,
                    cordoned=n % 37 == 0,
                )
            )
    return out


def decisions() -> str:
    rng = random.Random(17)
    workers = fleet(rng, 200)
    estimator = OutputLengthEstimator()
    for _ in range(200):
        model = MODELS[rng.randrange(2)].name
        estimator.observe_completion(model, rng.randrange(50, 4000), rng.randrange(10, 900))
    router = Router(PerfModel(), MODELS, estimator=estimator)
    skipped = {s.worker_id for s in router.update_fleet(workers)}
    assert len(skipped) < len(workers) // 4  # the odd ones (FP8 on an A100) only
    workers = [w for w in workers if w.id not in skipped]
    digest = hashlib.sha256()
    for i in range(3000):
        if i % 50 == 0:  # a heartbeat replaces some counters between calls
            for w in rng.sample(workers, 20):
                router.update_load(
                    w.id,
                    queue_tokens=rng.randrange(0, 30_000),
                    kv_used_tokens=rng.randrange(0, 100_000),
                    live_sessions=rng.randrange(0, 64),
                    healthy=rng.random() > 0.05,
                    cordoned=rng.random() < 0.05,
                )
        model = MODELS[i % 2].name
        slo = (None, Slo(ttft_ms=500.0), Slo(tbt_ms=60.0), Slo(1000.0, 80.0))[i % 4]
        d = router.route(
            RouteRequest(
                model=model,
                prompt_tokens=rng.randrange(1, 8000),
                expected_output_tokens=None if i % 3 == 0 else rng.randrange(1, 2000),
                slo=slo,
                preferred_worker_id=rng.choice(workers).id if i % 5 == 0 else None,
            )
        )
        row = (d.worker_id, d.prefill_worker_id, d.decode_worker_id, d.reason)
        digest.update(repr((*row, d.candidates_scored)).encode())
    return digest.hexdigest()


def test_choices_on_a_seeded_fleet_are_unchanged() -> None:
    assert decisions() == PINNED


@pytest.mark.parametrize("n", [9, 20, 85, 86, 222, 700])
def test_the_routers_draw_is_random_sample(n: int) -> None:
    """The router draws its per-class sample with an inlined copy of ``Random.sample`` (its
    method calls cost more than the scoring); the same generator must give the same workers
    on both branches of it (a list below the set size, a set above), draw after draw."""
    population = list(range(n))
    k = RouterConfig().per_class_samples
    small = n <= _sample_setsize(k)
    ours, theirs = random.Random(n), random.Random(n)
    for _ in range(200):
        drawn = _draw(ours.getrandbits, population, n, k, small)  # type: ignore[arg-type]
        assert drawn == theirs.sample(population, k)  # type: ignore[comparison-overlap]
