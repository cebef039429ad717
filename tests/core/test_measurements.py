from __future__ import annotations

from pathlib import Path

import pytest

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.core.corrections import Phase
from fleetshift_daemon.core.measurements import (
    REQUIRED_COLUMNS,
    hardware_kind,
    inconsistent,
    load_measurements,
    screened,
)

HEADER = "model,hardware,prompt_size,batch_size,token_size,prompt_time,token_time,tensor_parallel"


def write(tmp_path: Path, *lines: str, header: str = HEADER) -> Path:
    path = tmp_path / "profile.csv"
    path.write_text("\n".join((header, *lines)) + "\n")
    return path


def test_the_reference_tables_runs_that_did_not_hold_their_batch_are_set_aside(
    perf_csv: Path,
) -> None:
    data = load_measurements(perf_csv)
    assert inconsistent(data) == {
        ("a100-80gb", 2, 512, 64),
        ("h100-80gb", 2, 512, 64),
        ("h100-80gb-pcap", 2, 512, 64),
    }
    kept, aside = screened(data)
    # each of the three configurations has one prefill and one decode median
    assert len(aside) == 6 and len(kept) == len(data) - 6
    assert {m.phase for m in aside} == {Phase.PREFILL, Phase.DECODE}


def test_hardware_names_map_onto_the_catalogue_and_a_cpu_is_never_a_gpu() -> None:
    assert hardware_kind("a100-80gb").name == "A100-SXM-80GB"
    assert hardware_kind("h100-80gb-pcap").name == "H100-SXM-PCAP70"
    assert hardware_kind("H200-SXM").name == "H200-SXM"
    assert hardware_kind("cpu").name == "CPU"
    with pytest.raises(InvalidArgument) as exc:
        hardware_kind("tpu-v5")
    assert exc.value.field == "hardware" and "tpu-v5" in exc.value.message


def test_medians_of_repeats_and_the_model_column(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "m,cpu,128,1,64,100,10,1",
        "m,cpu,128,1,64,300,30,1",
        "m,cpu,128,1,64,200,20,1",
    )
    data = load_measurements(path)
    prefill = [m for m in data if m.phase is Phase.PREFILL]
    decode = [m for m in data if m.phase is Phase.DECODE]
    assert [m.seconds for m in prefill] == [0.2] and [m.seconds for m in decode] == [0.02]
    assert {m.model for m in data} == {"m"} and data[0].kind.name == "CPU"


@pytest.mark.parametrize(
    ("lines", "header", "where", "field"),
    [
        (("m,cpu,128,1,64,100,10,1",), HEADER.replace(",token_time", ""), ":1:", "token_time"),
        (("m,cpu,128,1,64,100,10,1", "m,gpu9,128,1,64,100,10,1"), HEADER, ":3:", "hardware"),
        (("m,cpu,128,x,64,100,10,1",), HEADER, ":2:", "batch_size"),
        (("m,cpu,128,1,64,-5,10,1",), HEADER, ":2:", "prompt_time"),
        (("m,cpu,128,1,64,100,nan,1",), HEADER, ":2:", "token_time"),
        (("m,cpu,128,1,64,100,10,1", "n,cpu,128,1,64,100,10,1"), HEADER, "", "model"),
    ],
)
def test_bad_rows_name_file_line_and_field(
    tmp_path: Path, lines: tuple[str, ...], header: str, where: str, field: str
) -> None:
    path = write(tmp_path, *lines, header=header)
    with pytest.raises(InvalidArgument) as exc:
        load_measurements(path)
    assert exc.value.field == field
    assert exc.value.message.startswith(f"{path}{where}")
    assert field in exc.value.message


def test_every_required_column_is_named_when_missing(tmp_path: Path) -> None:
    for column in REQUIRED_COLUMNS:
        header = ",".join(c for c in HEADER.split(",") if c != column)
        path = write(tmp_path, header=header)
        with pytest.raises(InvalidArgument) as exc:
            load_measurements(path)
        assert exc.value.field == column


def test_a_cpu_profile_takes_the_peaks_its_sidecar_measured(tmp_path: Path) -> None:
    import json

    path = write(tmp_path, "m,cpu-amd-epyc,128,1,64,100,10,1")
    nominal = load_measurements(path)[0].kind
    assert nominal.name == "cpu-amd-epyc" and nominal.bf16_tflops == 0.333  # CPU_HOST's
    path.with_suffix(".json").write_text(
        json.dumps(
            {
                "host": {"measured_peaks": {"matmul_tflops": 0.09, "copy_gbps": 24.0}},
                "worker": {"dtype": "float32"},
            }
        )
    )
    kind = load_measurements(path)[0].kind
    # an FP32 worker runs at half bf16_tflops in the model: the measured FP32 rate, doubled
    assert kind.name == "cpu-amd-epyc" and kind.bf16_tflops == 0.18
    assert kind.hbm_tbps == 0.024 and kind.nvlink_gbps == 0.0


PROBED = HEADER + ",host_matmul_gflops,host_copy_gbps"


def _sidecar(path: Path, **probe: float) -> None:
    import json

    peaks = {"matmul_tflops": 0.09, "copy_gbps": 24.0, **probe}
    path.with_suffix(".json").write_text(
        json.dumps({"host": {"measured_peaks": peaks}, "worker": {"dtype": "float32"}})
    )


def test_a_cpu_rows_host_speed_scales_its_sidecars_peaks(tmp_path: Path) -> None:
    """Each configuration's kind is the sidecar's peaks times the host speed probed around
    the run whose time is the median, over the same probe at the start."""
    path = write(
        tmp_path,
        "m,cpu-x,128,1,64,100,10,1,50,6",
        "m,cpu-x,128,1,64,400,40,1,12.5,1.5",  # the median run: a quarter of the start's speed
        "m,cpu-x,128,1,64,900,90,1,5,1",
        "m,cpu-x,256,1,64,200,20,1,50,6",  # at the start's speed: the sidecar's peaks
        header=PROBED,
    )
    _sidecar(path, probe_matmul_gflops=50.0, probe_copy_gbps=6.0)
    by = {(m.prompt_size, m.phase): m for m in load_measurements(path)}
    slow = by[(128, Phase.PREFILL)]
    assert slow.seconds == pytest.approx(0.4) and by[(128, Phase.DECODE)].seconds == 0.04
    assert slow.kind.name == "cpu-x"
    assert slow.kind.bf16_tflops == pytest.approx(0.18 / 4)  # FP32 rate doubled, a quarter
    assert slow.kind.hbm_tbps == pytest.approx(0.024 / 4)
    assert by[(128, Phase.DECODE)].kind == slow.kind
    start = by[(256, Phase.PREFILL)].kind
    assert start.bf16_tflops == pytest.approx(0.18) and start.hbm_tbps == pytest.approx(0.024)


def test_host_speeds_are_optional_and_never_apply_to_a_gpu(tmp_path: Path) -> None:
    # an even count pairs the two middle runs' mean time with their mean speed
    path = write(
        tmp_path,
        "m,cpu-x,128,1,64,100,10,1,40,",
        "m,cpu-x,128,1,64,300,30,1,20,",
        header=PROBED,
    )
    _sidecar(path)  # no probe at the start: the row's own figure is the peak
    m = load_measurements(path)[0]
    assert m.seconds == pytest.approx(0.2)
    assert m.kind.bf16_tflops == pytest.approx(2 * 0.030)  # 30 GFLOP/s float32
    assert m.kind.hbm_tbps == pytest.approx(0.024)  # no copy figure: the sidecar's
    gpu = write(tmp_path, "m,h100-80gb,128,1,64,100,10,1,20,2", header=PROBED)
    assert load_measurements(gpu)[0].kind.name == "H100-SXM"
    assert load_measurements(gpu)[0].kind.bf16_tflops > 900


def test_a_bad_host_speed_is_refused_naming_line_and_column(tmp_path: Path) -> None:
    for bad in ("fast", "0", "-3", "nan"):
        path = write(
            tmp_path, "m,cpu-x,128,1,64,100,10,1,50,6", f"m,cpu-x,128,1,64,100,10,1,{bad},6",
            header=PROBED,
        )  # fmt: skip
        with pytest.raises(InvalidArgument) as exc:
            load_measurements(path)
        assert exc.value.field == "host_matmul_gflops"
        assert exc.value.message.startswith(f"{path}:3: host_matmul_gflops"), exc.value.message
