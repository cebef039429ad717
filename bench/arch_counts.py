"""Parameter counts from ModelArch.from_hf_config against published sizes and transformers.

For every published model in ``tests/core/published_models.py`` (one or more per family the
reader claims), prints the published size, the count of the model ``transformers`` builds from
the same config (on torch's meta device: no memory, no download), today's reader and, as the
baseline measured in the same run, the reader as it was before issue 12 (kept verbatim below),
each with its error against the published size. MoE models add their active parameters.

    .venv/bin/python bench/arch_counts.py [--json]

Nothing here is tuned: the published sizes are the models' own, the tolerance (1 %, or the
published figure's own rounding where coarser) is fixed by issue 12.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetshift_daemon.core.archs import ModelArch
from fleetshift_daemon.core.errors import InvalidModelArch
from tests.core.published_models import PUBLISHED, figure, transformers_count


def reader_before_issue_12(name: str, cfg: Mapping[str, Any]) -> ModelArch:
    """ModelArch.from_hf_config at be82904, verbatim but for the class it builds."""

    def pick(*keys: str, default: Any = None) -> Any:
        for k in keys:
            if k in cfg and cfg[k] is not None:
                return cfg[k]
        if default is None:
            raise InvalidModelArch(f"config lacks {keys[0]}", field=keys[0])
        return default

    hidden = pick("hidden_size", "n_embd", "d_model")
    n_heads = pick("num_attention_heads", "n_head")
    for key, value in (("hidden_size", hidden), ("num_attention_heads", n_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidModelArch(f"{key} must be a positive integer", field=key)
    model_type = str(cfg.get("model_type", ""))
    act = str(cfg.get("hidden_act", cfg.get("activation_function", "silu")))
    gated = model_type not in ("gpt_neox", "gpt2", "gptj") and "gelu" not in act
    return ModelArch(
        name=name,
        n_layers=pick("num_hidden_layers", "n_layer", "num_layers"),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=pick("num_key_value_heads", "num_kv_heads", default=n_heads),
        intermediate=pick("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden),
        vocab=pick("vocab_size"),
        head_dim=pick("head_dim", default=hidden // n_heads if hidden % n_heads == 0 else -1),
        gated_mlp=gated,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def _error(count: int | None, published: float) -> str:
    return "refused" if count is None else f"{100 * (count - published) / published:+.1f}%"


def rows() -> list[dict[str, Any]]:
    out = []
    for model, pub in PUBLISHED.items():
        cfg = pub.config()
        arch = ModelArch.from_hf_config(model, cfg)
        try:
            before: int | None = reader_before_issue_12(model, cfg).param_count()
        except InvalidModelArch:
            before = None
        total, tolerance = figure(pub.total)
        row: dict[str, Any] = {
            "model": model,
            "model_type": cfg["model_type"],
            "published": pub.total,
            "transformers": transformers_count(cfg),
            "count": arch.param_count(),
            "error_pct": 100 * (arch.param_count() - total) / total,
            "within": abs(arch.param_count() - total) <= tolerance,
            "before_issue_12": before,
            "before_error": _error(before, total),
        }
        if arch.moe is not None:
            row["active"] = arch.active_param_count()
            row["forward"] = arch.forward_param_count()
            row["published_active"] = pub.active
        out.append(row)
    return out


def _b(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.3f}B"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per model")
    args = parser.parse_args()
    table = rows()
    if args.json:
        for row in table:
            print(json.dumps(row))
        return 0
    print(
        f"{'model':18} {'published':>9} {'transformers':>13} {'count':>13} {'error':>7} "
        f"{'before #12':>13} {'error':>8}  active / forward (published)"
    )
    for r in table:
        moe = (
            f"  {_b(r['active'])} / {_b(r['forward'])} ({r['published_active'] or '-'})"
            if "active" in r
            else ""
        )
        print(
            f"{r['model']:18} {r['published']:>9} {_b(r['transformers']):>13} "
            f"{_b(r['count']):>13} {r['error_pct']:+6.2f}% {_b(r['before_issue_12']):>13} "
            f"{r['before_error']:>8}{moe}"
        )
    exact = sum(r["count"] == r["transformers"] for r in table)
    within = sum(r["within"] for r in table)
    print(
        f"\n{exact}/{len(table)} equal to what transformers builds; {within}/{len(table)} within "
        "1 % (or the published rounding) of the published size"
    )
    return 0 if exact == within == len(table) else 1


if __name__ == "__main__":
    sys.exit(main())
