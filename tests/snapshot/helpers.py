"""Sample keys, tensors and parts shared by the snapshot tests."""

from __future__ import annotations

import dataclasses

import torch

from fleetshift_common.compat import CompatKey

torch.set_num_threads(1)


def make_key(**changes: object) -> CompatKey:
    base = CompatKey(
        gpu_product="NVIDIA H100 80GB HBM3",
        gpu_count=1,
        compute_capability="9.0",
        driver_version="550.54.15",
        cuda_version="12.4",
        torch_version="2.13.0",
        engine_name="fleetshift-ref",
        engine_version="0.1.0",
        model_id="tiny-llama",
        weights_digest="sha256:" + "ab" * 32,
        dtype="bfloat16",
        quantization="none",
        tensor_parallel=1,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def sample_tensors(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(16, 24, generator=g)
    return {
        "weights": {
            "embed": torch.randn(32, 16, generator=g).to(torch.bfloat16),
            "layers.0.attn.q": torch.randn(16, 16, generator=g, dtype=torch.float16),
            "layers.0.mlp.up": wide.t(),  # non-contiguous
            "norm": torch.randn(16, generator=g, dtype=torch.float64),
            "scale": torch.tensor(0.5),  # 0-d
        },
        "kv": {
            "pool": torch.randn(4, 2, 8, 16, generator=g).to(torch.bfloat16),
            "block_table": torch.randint(0, 100, (3, 7), generator=g, dtype=torch.int32),
            "lengths": torch.randint(0, 9, (3,), generator=g, dtype=torch.int64),
            "valid": torch.rand(5, generator=g) > 0.5,
            "codes": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
            "empty": torch.zeros(0, 4),
        },
    }


JSON_PARTS = {
    "sessions": [{"id": "s1", "tokens": [1, 2, 3], "seed": 7}, {"id": "s2", "tokens": []}],
    "queue": [],
}
ARTIFACTS = {"compile_cache.bin": bytes(range(256)) * 3}
