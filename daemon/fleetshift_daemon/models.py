"""Turn the daemon's configured models and prices into what the placement core needs.

Architectures come from a Hugging Face ``config.json`` (a file, or the model directory that
holds it) or from a named preset, so the performance model works for any Llama/GPT-style model
without weights on the daemon's machine.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from fleetshift_common.config import ConfigError, DaemonConfig, ModelConfig
from fleetshift_daemon.core.gpus import GpuCatalogue, default_catalogue
from fleetshift_daemon.core.perfmodel import Dtype, ModelArch, llama2_70b, llama31_70b
from fleetshift_daemon.core.placement import ServedModel
from fleetshift_daemon.core.planner import SloTarget

PRESETS: dict[str, Callable[[], ModelArch]] = {
    "llama2-70b": llama2_70b,
    "llama31-70b": llama31_70b,
}


def model_arch(model: ModelConfig) -> ModelArch:
    if model.preset:
        if model.preset not in PRESETS:
            raise ConfigError(
                f"model {model.name!r}: unknown preset {model.preset!r} "
                f"(known: {', '.join(sorted(PRESETS))})",
                field="models.preset",
            )
        arch = PRESETS[model.preset]()
        return ModelArch(**{**arch.__dict__, "name": model.name})
    path = Path(model.hf_config)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"model {model.name!r}: cannot read hf_config {path}: {err}", field="models.hf_config"
        ) from None
    return ModelArch.from_hf_config(model.name, raw)


def served_models(config: DaemonConfig) -> list[ServedModel]:
    out = []
    for model in config.models:
        try:
            dtypes = tuple(Dtype(d) for d in model.dtypes)
        except ValueError:
            raise ConfigError(
                f"model {model.name!r}: dtypes must be among {[d.value for d in Dtype]}",
                field="models.dtypes",
            ) from None
        out.append(
            ServedModel(
                arch=model_arch(model),
                dtypes=dtypes,
                tp_options=model.tp_options,
                min_workers=model.min_workers,
                slo=SloTarget(model.slo_ttft_ms, model.slo_tbt_ms),
                model_dir=model.model_dir,
            )
        )
    return out


def catalogue(config: DaemonConfig) -> GpuCatalogue:
    base = default_catalogue()
    prices = {p.kind: {"price_per_hour": p.per_hour} for p in config.gpu_prices}
    for kind in prices:
        if kind not in base:
            raise ConfigError(
                f"gpu_prices names unknown GPU kind {kind!r}", field="gpu_prices.kind"
            )
    return base.extended(prices)
