from __future__ import annotations

import pytest

from fleetshift_common.errors import InvalidArgument, NotFound
from fleetshift_daemon.core.errors import UnknownGpuKind
from fleetshift_daemon.core.gpus import default_catalogue, gpu_kind_from_mapping


def test_published_figures_of_the_default_kinds() -> None:
    cat = default_catalogue()
    a100, h100, h200, l40s = (cat.get(n) for n in ("A100-SXM-80GB", "H100-SXM", "H200-SXM", "L40S"))
    assert (a100.bf16_tflops, a100.fp8_tflops, a100.hbm_gb, a100.hbm_tbps) == (312, None, 80, 2.0)
    assert (h100.bf16_tflops, h100.fp8_tflops, h100.hbm_tbps) == (989, 1979, 3.35)
    assert (h200.hbm_gb, h200.hbm_tbps) == (141, 4.8)
    # L40S datasheet figures are with sparsity; the catalogue keeps dense ones and no NVLink.
    assert (l40s.bf16_tflops, l40s.fp8_tflops, l40s.nvlink_gbps) == (181, 366, 0)
    assert l40s.interconnect_gbps == l40s.pcie_gbps > 0


@pytest.mark.parametrize(
    ("product", "expected"),
    [
        ("NVIDIA A100-SXM4-80GB", "A100-SXM-80GB"),
        ("NVIDIA A100 80GB PCIe", None),
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA H200", "H200-SXM"),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA L40S", "L40S"),
        ("Tesla T4", None),
    ],
)
def test_nvml_product_names_map_to_kinds(product: str, expected: str | None) -> None:
    kind = default_catalogue().for_product(product)
    assert (kind.name if kind else None) == expected


def test_unknown_kind_is_a_typed_not_found_naming_the_kind() -> None:
    with pytest.raises(UnknownGpuKind, match="B200") as exc:
        default_catalogue().get("B200")
    assert isinstance(exc.value, NotFound) and isinstance(exc.value, KeyError)
    assert exc.value.field == "gpu_kind"
    assert str(exc.value).startswith("gpu kind 'B200' is not in the catalogue")


def test_config_adds_a_kind_and_overrides_a_price() -> None:
    cat = default_catalogue().extended(
        {
            "B200": {
                "product_patterns": ["B200"],
                "bf16_tflops": 2250,
                "fp8_tflops": 4500,
                "int8_tops": 4500,
                "hbm_gb": 180,
                "hbm_tbps": 8.0,
                "nvlink_gbps": 1800,
                "tdp_w": 1000,
                "price_per_hour": 6.0,
            },
            "H100-SXM": {"price_per_hour": 2.25},
        }
    )
    assert cat.for_product("NVIDIA B200").name == "B200"  # type: ignore[union-attr]
    assert cat.get("H100-SXM").price_per_hour == 2.25
    assert cat.get("H100-SXM").hbm_tbps == 3.35
    assert default_catalogue().get("H100-SXM").price_per_hour != 2.25


@pytest.mark.parametrize(
    ("fields", "bad"),
    [
        ({"hbm_gb": -1}, "gpus.X.hbm_gb"),
        ({"hbm_tbps": "fast"}, "gpus.X.hbm_tbps"),
        ({"colour": "green"}, "gpus.X.colour"),
        ({"bf16_tflops": None}, "gpus.X.bf16_tflops"),
    ],
)
def test_bad_config_names_the_key(fields: dict[str, object], bad: str) -> None:
    base: dict[str, object] = {
        "product_patterns": ["X"],
        "bf16_tflops": 1,
        "int8_tops": 1,
        "hbm_gb": 1,
        "hbm_tbps": 1,
        "nvlink_gbps": 1,
        "tdp_w": 1,
        "price_per_hour": 1,
    }
    base.update(fields)
    with pytest.raises(InvalidArgument) as exc:
        default_catalogue().extended({"X": base})
    assert exc.value.field == bad
    assert bad in str(exc.value)


def test_missing_required_key_is_named() -> None:
    with pytest.raises(InvalidArgument) as exc:
        gpu_kind_from_mapping({"name": "Y", "product_patterns": []}, where="gpus.Y")
    assert exc.value.field == "gpus.Y.bf16_tflops"
