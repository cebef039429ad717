"""Turn the daemon's configured models and prices into what the placement core needs.

Architectures come from a Hugging Face ``config.json`` (a file, or the model directory that
holds it) or from a named preset, so the performance model works for any model of a family
``core.hf_config`` reads, without weights on the daemon's machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fleetshift_common.bounds import MAX_CONTEXT_TOKENS
from fleetshift_common.config import ConfigError, DaemonConfig, ModelConfig
from fleetshift_daemon.core.errors import InvalidModelArch
from fleetshift_daemon.core.gpus import GpuCatalogue, default_catalogue
from fleetshift_daemon.core.perfmodel import CONTEXT_WINDOWS, PRESETS, Dtype, ModelArch
from fleetshift_daemon.core.placement import ServedModel
from fleetshift_daemon.core.planner import SloTarget

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


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
    path, raw = _hf_config(model)
    try:
        return ModelArch.from_hf_config(model.name, raw)
    except InvalidModelArch as err:
        # A config the daemon cannot read stops it at start, naming the config.json key: a
        # guessed architecture would misplace every worker of this model without a word.
        raise ConfigError(
            f"model {model.name!r}: hf_config {path}: {err} (key {err.field})",
            field="models.hf_config",
        ) from None


def _hf_config(model: ModelConfig) -> tuple[Path, Any]:
    path = Path(model.hf_config)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"model {model.name!r}: cannot read hf_config {path}: {err}", field="models.hf_config"
        ) from None
    return path, raw


def context_tokens(model: ModelConfig) -> int:
    """The model's context length as its config states it (Route's bound on a request's
    length); the API's static bound when the config names none. Called after ``model_arch``
    accepted the model, so its preset is known and its config readable."""
    if model.preset:
        return CONTEXT_WINDOWS.get(model.preset, MAX_CONTEXT_TOKENS)
    _, raw = _hf_config(model)
    for key in CONTEXT_KEYS:
        value = raw.get(key) if isinstance(raw, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return min(value, MAX_CONTEXT_TOKENS)
    return MAX_CONTEXT_TOKENS


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
                context_tokens=context_tokens(model),
                engine=model.engine,
                engine_args_json=model.engine_args.to_json() if model.engine != "reference" else "",
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
