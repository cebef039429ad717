"""The compatibility key of a snapshot, and the verdict of comparing two keys.

A restore on hardware or software that differs from the snapshot's origin must never fail
silently: the wrong compiled graph or a KV cache laid out for another tensor-parallel split
produces garbage, not an error. So the key records everything a warm restore depends on, and
``compare`` names every field that differs, so the caller can tell an operator exactly why a
move became a cold start.

Three levels of reuse follow from the fields:

* weights (model, digest, dtype, quantisation, TP layout) survive a change of GPU model;
* compiled artifacts need the identical platform (GPU product, compute capability, driver,
  CUDA, torch, engine name and version);
* a warm restore (weights + compiled graphs + KV cache + sessions) needs every field equal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from fleetshift_common.errors import InvalidArgument

# Fields whose equality lets weights be reused across GPU models.
WEIGHTS_FIELDS: tuple[str, ...] = (
    "model_id",
    "weights_digest",
    "dtype",
    "quantization",
    "tensor_parallel",
)
# Fields whose equality lets compiled artifacts (graphs, kernels, caches) be reused.
PLATFORM_FIELDS: tuple[str, ...] = (
    "gpu_product",
    "compute_capability",
    "driver_version",
    "cuda_version",
    "torch_version",
    "engine_name",
    "engine_version",
)
_INT_FIELDS = frozenset({"gpu_count", "tensor_parallel"})


@dataclass(frozen=True)
class CompatKey:
    """Everything a warm restore of a worker depends on."""

    gpu_product: str
    gpu_count: int
    compute_capability: str
    driver_version: str
    cuda_version: str
    torch_version: str
    engine_name: str
    engine_version: str
    model_id: str
    weights_digest: str
    dtype: str
    quantization: str
    tensor_parallel: int

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _INT_FIELDS:
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise InvalidArgument(
                        f"compat key field {f.name!r} must be a positive integer, got {value!r}",
                        field=f.name,
                    )
            elif not isinstance(value, str):
                raise InvalidArgument(
                    f"compat key field {f.name!r} must be a string, got {value!r}", field=f.name
                )

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_json(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.field_names()}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> CompatKey:
        """Build a key from its JSON form, naming any missing or unknown field."""
        if not isinstance(data, Mapping):
            raise InvalidArgument(f"compat key must be a JSON object, got {type(data).__name__}")
        names = cls.field_names()
        missing = [n for n in names if n not in data]
        if missing:
            raise InvalidArgument(
                f"compat key misses field(s): {', '.join(missing)}", field=missing[0]
            )
        unknown = sorted(k for k in data if k not in names)
        if unknown:
            raise InvalidArgument(
                f"compat key has unknown field(s): {', '.join(unknown)}", field=unknown[0]
            )
        values = {n: data[n] for n in names}
        return cls(**values)  # type: ignore[arg-type]  # __post_init__ checks the types

    def summary(self) -> str:
        """One line for listings: what runs, on what."""
        return (
            f"{self.model_id}@{self.weights_digest[:12]} {self.dtype}/{self.quantization} "
            f"tp={self.tensor_parallel} on {self.gpu_count}x {self.gpu_product} "
            f"(cc {self.compute_capability}) {self.engine_name} {self.engine_version}"
        )


@dataclass(frozen=True)
class FieldDifference:
    field: str
    snapshot: str
    destination: str


@dataclass(frozen=True)
class CompatVerdict:
    differences: tuple[FieldDifference, ...]
    warm_ok: bool
    weights_reusable: bool
    compiled_ok: bool

    @property
    def differing_fields(self) -> tuple[str, ...]:
        return tuple(d.field for d in self.differences)

    def describe(self) -> str:
        """A sentence an operator can act on; names every differing field."""
        if not self.differences:
            return "compatible: every field of the key matches (warm restore possible)"
        diffs = "; ".join(
            f"{d.field}: snapshot {d.snapshot!r} != destination {d.destination!r}"
            for d in self.differences
        )
        reuse = []
        reuse.append("weights reusable" if self.weights_reusable else "weights NOT reusable")
        reuse.append(
            "compiled artifacts reusable" if self.compiled_ok else "compiled artifacts NOT reusable"
        )
        return f"incompatible ({len(self.differences)} field(s) differ: {diffs}); " + ", ".join(
            reuse
        )


def compare(snapshot: CompatKey, destination: CompatKey) -> CompatVerdict:
    """Compare a snapshot's key with the destination's; every differing field is reported."""
    differences = tuple(
        FieldDifference(
            field=name,
            snapshot=str(getattr(snapshot, name)),
            destination=str(getattr(destination, name)),
        )
        for name in CompatKey.field_names()
        if getattr(snapshot, name) != getattr(destination, name)
    )
    differing = {d.field for d in differences}
    return CompatVerdict(
        differences=differences,
        warm_ok=not differences,
        weights_reusable=not differing.intersection(WEIGHTS_FIELDS),
        compiled_ok=not differing.intersection(PLATFORM_FIELDS),
    )
