"""The engine: sessions in, tokens out, one batched step at a time.

Every step packs the pending tokens of all scheduled sessions into rows, runs the layers in
fixed-size row chunks, computes each session's attention on its own through its block table,
and samples one token for every session whose pending tokens are all done. Because prefill and
decode are the same code path (a decode is a one-token slice), recomputing a session's KV from
its token history gives the very bits the original run produced.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fleetshift_agent.engine import model as M
from fleetshift_agent.engine.config import (
    ENGINE_NAME,
    ENGINE_VERSION,
    EngineConfig,
    compile_enabled_by_env,
)
from fleetshift_agent.engine.delta import (
    DELTA_KEY,
    DeltaHeader,
    check_base,
    kv_start,
    tokens_digest,
)
from fleetshift_agent.engine.kv_cache import PagedKVCache
from fleetshift_agent.engine.sampling import SamplingParams, new_generator, sample
from fleetshift_agent.engine.scheduler import Scheduler, Slice
from fleetshift_agent.engine.session import Session, SessionExport, SessionState
from fleetshift_agent.engine.weights import torch_dtype
from fleetshift_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound

Clock = Callable[[], float]


@dataclass(frozen=True)
class TokenEvent:
    session_id: str
    index: int  # position among the session's generated tokens
    token: int
    finished: bool
    finish_reason: str = ""


@dataclass(frozen=True)
class Counters:
    prefill_tokens: int
    decode_tokens: int
    queue_depth: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    steps: int
    preemptions: int
    ttft_ms: tuple[float, ...]
    tbt_ms: tuple[float, ...]


_Layer = dict[str, torch.Tensor | None]


@dataclass(frozen=True)
class _Batch:
    plan: list[Slice]
    total: int  # real rows; the rest up to a whole chunk are padding
    tokens: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor  # where each real row's K/V goes in the pool
    read_slots: list[torch.Tensor]  # per slice: every position its session has seen


def make_deterministic(device: torch.device) -> None:
    """Process-wide settings without which the same inputs may give different bits."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.use_deterministic_algorithms(True, warn_only=True)


class Engine:
    def __init__(
        self,
        model: M.LlamaModel,
        config: EngineConfig,
        *,
        model_id: str,
        weights_digest: str,
        clock: Clock = time.monotonic,
    ) -> None:
        self.model = model
        self.mcfg = model.config
        self.config = config
        self.model_id = model_id
        self.weights_digest = weights_digest
        self.clock = clock
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.dtype or self.mcfg.torch_dtype)
        make_deterministic(self.device)
        self.kv = PagedKVCache(
            num_layers=self.mcfg.num_hidden_layers,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            kv_heads=self.mcfg.num_key_value_heads,
            head_dim=self.mcfg.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.scheduler = Scheduler(
            self.kv, max_running=config.max_running, max_step_tokens=config.max_step_tokens
        )
        self.sessions: dict[str, Session] = {}
        self.staged: dict[str, Session] = {}  # imported, holding KV, not scheduled yet
        self.cos, self.sin = M.rope_table(self.mcfg, self.device)
        self.compiled = compile_enabled_by_env(config.compile)
        self._fns = _step_functions(self.compiled)
        self._layers = [_layer_tensors(layer) for layer in model.model.layers]
        self._embed = model.model.embed_tokens.weight.detach()
        self._norm = model.model.norm.weight.detach()
        self._head = model.lm_head.weight.detach()
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.steps = 0
        self._ttft: deque[float] = deque(maxlen=2048)
        self._tbt: deque[float] = deque(maxlen=2048)

    # ---- sessions -------------------------------------------------------------------------

    def add_session(
        self,
        session_id: str,
        prompt: Sequence[int],
        max_new_tokens: int,
        params: SamplingParams,
        stop_token_ids: Sequence[int] = (),
    ) -> Session:
        if session_id in self.sessions or session_id in self.staged:
            raise AlreadyExists(f"session {session_id!r} exists", field="session_id")
        self._check_tokens(prompt, "prompt_tokens", allow_empty=False)
        self._check_tokens(stop_token_ids, "stop_token_ids", allow_empty=True)
        if max_new_tokens <= 0:
            raise InvalidArgument("max_new_tokens must be positive", field="max_new_tokens")
        self._check_fits(len(prompt) + max_new_tokens)
        s = Session(
            session_id=session_id,
            tokens=[int(t) for t in prompt],
            prompt_len=len(prompt),
            max_new_tokens=max_new_tokens,
            params=params,
            stop_token_ids=tuple(int(t) for t in stop_token_ids),
            generator=new_generator(params.seed),
            created_at=self.clock(),
        )
        self.sessions[session_id] = s
        self.scheduler.enqueue(s)
        return s

    def _check_tokens(self, tokens: Sequence[int], name: str, *, allow_empty: bool) -> None:
        if not tokens and not allow_empty:
            raise InvalidArgument(f"{name} must not be empty", field=name)
        bad = [t for t in tokens if not 0 <= t < self.mcfg.vocab_size]
        if bad:
            raise InvalidArgument(
                f"{name} holds {bad[0]}, outside the vocabulary [0, {self.mcfg.vocab_size})",
                field=name,
            )

    def _check_fits(self, total_tokens: int) -> None:
        if total_tokens > self.mcfg.max_position_embeddings:
            raise InvalidArgument(
                f"prompt + max_new_tokens = {total_tokens} exceeds the model's "
                f"{self.mcfg.max_position_embeddings} positions",
                field="max_new_tokens",
            )
        if self.kv.blocks_for(total_tokens) > self.kv.num_blocks:
            raise InvalidArgument(
                f"{total_tokens} tokens can never fit the KV cache "
                f"({self.kv.num_blocks} blocks of {self.kv.block_size})",
                field="max_new_tokens",
            )

    def get(self, session_id: str) -> Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise NotFound(f"no live session {session_id!r}", field="session_id") from None

    def cancel(self, session_id: str) -> Session:
        """Ends a live or a staged session and frees its KV."""
        s = self.staged.pop(session_id, None)
        if s is None:
            s = self.get(session_id)
            del self.sessions[session_id]
        self.scheduler.remove(s)
        s.state = SessionState.FINISHED
        s.finish_reason = "cancelled"
        return s

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        plan = self.scheduler.plan()
        if not plan:
            return []
        with torch.inference_mode():
            logits = self._forward(plan)
        self.steps += 1
        return self._advance(plan, logits)

    def _forward(self, plan: list[Slice]) -> dict[str, torch.Tensor]:
        batch = self._pack(plan)
        x = self._embed[batch.tokens]
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        for i, w in enumerate(self._layers):
            q, k, v = self._chunks_pre(w, x, cos, sin)
            self.kv.write(i, batch.write_slots, k[: batch.total], v[: batch.total])
            x = self._chunks_post(w, x, self._attention(i, q, batch))
        return self._logits(plan, x)

    def _pack(self, plan: list[Slice]) -> _Batch:
        """Every scheduled token as one row, padded to a whole number of row chunks."""
        tokens: list[int] = []
        positions: list[int] = []
        for sl in plan:
            s = sl.session
            tokens.extend(s.tokens[s.cached : s.cached + sl.tokens])
            positions.extend(range(s.cached, s.cached + sl.tokens))
        total = len(tokens)
        pad = [0] * (-(-total // self.config.rows) * self.config.rows - total)
        return _Batch(
            plan=plan,
            total=total,
            tokens=torch.tensor(tokens + pad, device=self.device),
            positions=torch.tensor(positions + pad, device=self.device),
            write_slots=torch.cat(
                [self.kv.slots(sl.session.blocks, sl.session.cached, sl.end) for sl in plan]
            ),
            read_slots=[self.kv.slots(sl.session.blocks, 0, sl.end) for sl in plan],
        )

    def _chunks_pre(
        self, w: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pre = self._fns[0]
        eps, hd, rows = self.mcfg.rms_norm_eps, self.mcfg.head_dim, self.config.rows
        parts = [
            pre(x[c : c + rows], w["ln1"], w["wq"], w["wk"], w["wv"], w["bq"], w["bk"], w["bv"],
                cos[c : c + rows], sin[c : c + rows], eps, hd)
            for c in range(0, x.shape[0], rows)
        ]  # fmt: skip
        q, k, v = zip(*parts, strict=True)
        return torch.cat(q), torch.cat(k), torch.cat(v)

    def _chunks_post(self, w: _Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        post = self._fns[1]
        eps, rows = self.mcfg.rms_norm_eps, self.config.rows
        return torch.cat([
            post(x[c : c + rows], attn[c : c + rows], w["wo"], w["ln2"], w["wg"], w["wu"],
                 w["wd"], eps)
            for c in range(0, x.shape[0], rows)
        ])  # fmt: skip

    def _attention(self, layer: int, q: torch.Tensor, batch: _Batch) -> torch.Tensor:
        """Each session on its own, each query over exactly the keys it sees."""
        attn = torch.zeros(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        row = 0
        for sl, slots in zip(batch.plan, batch.read_slots, strict=True):
            keys, values = self.kv.read(layer, slots)
            for j in range(sl.tokens):
                seen = sl.session.cached + j + 1
                attn[row + j] = M.attend(q[row + j], keys[:seen], values[:seen])
            row += sl.tokens
        return attn

    def _logits(self, plan: list[Slice], x: torch.Tensor) -> dict[str, torch.Tensor]:
        rows = self.config.rows
        ends: list[int] = []
        sampled: list[str] = []
        row = 0
        for sl in plan:
            row += sl.tokens
            if sl.session.cached + sl.tokens == len(sl.session.tokens):
                ends.append(row - 1)
                sampled.append(sl.session.session_id)
        if not ends:
            return {}
        padded = -(-len(ends) // rows) * rows
        idx = torch.tensor(ends + [0] * (padded - len(ends)), device=self.device)
        h = x[idx]
        _, _, final = self._fns
        logits = torch.cat(
            [
                final(h[c : c + rows], self._norm, self._head, self.mcfg.rms_norm_eps)
                for c in range(0, padded, rows)
            ]
        ).cpu()
        return {sid: logits[i] for i, sid in enumerate(sampled)}

    def _advance(self, plan: list[Slice], logits: dict[str, torch.Tensor]) -> list[TokenEvent]:
        now = self.clock()
        events: list[TokenEvent] = []
        for sl in plan:
            s = sl.session
            decode = sl.tokens == 1 and len(s.tokens) > s.prompt_len
            if decode:
                self.decode_tokens += 1
            else:
                self.prefill_tokens += sl.tokens
            s.cached += sl.tokens
            row = logits.get(s.session_id)
            if row is None:
                continue
            token = sample(row, s.params, s.generator)
            s.tokens.append(token)
            if s.last_token_at is None:
                self._ttft.append((now - s.created_at) * 1000.0)
            else:
                self._tbt.append((now - s.last_token_at) * 1000.0)
            s.last_token_at = now
            reason = self._finish_reason(s, token)
            if reason:
                self.scheduler.remove(s)
                s.state = SessionState.FINISHED
                s.finish_reason = reason
                del self.sessions[s.session_id]
            events.append(
                TokenEvent(s.session_id, len(s.generated) - 1, token, bool(reason), reason)
            )
        return events

    @staticmethod
    def _finish_reason(s: Session, token: int) -> str:
        if token in s.stop_token_ids:
            return "stop"
        if len(s.generated) >= s.max_new_tokens:
            return "length"
        return ""

    # ---- export / import ------------------------------------------------------------------

    def platform(self) -> dict[str, Any]:
        """What must match for KV computed here to be reused elsewhere."""
        return {
            "engine": f"{ENGINE_NAME}/{ENGINE_VERSION}",
            "weights_digest": self.weights_digest,
            "dtype": str(self.dtype).removeprefix("torch."),
            "rows": self.config.rows,
            "device_type": self.device.type,
            "torch": torch.__version__,
            "compiled": self.compiled,
        }

    def export_session(
        self, session_id: str, *, with_kv: bool, from_token: int = 0
    ) -> SessionExport:
        """The whole session, or with ``from_token`` > 0 only what changed since that token."""
        s = self.get(session_id)
        if from_token:
            return self._export_delta(s, with_kv=with_kv, from_token=from_token)
        export = SessionExport(
            description=s.describe(),
            rng_state=s.generator.get_state(),
            platform=self.platform(),
        )
        if with_kv and s.cached:
            export.k, export.v = self.kv.export(s.blocks, s.cached)
        else:
            export.description["cached"] = 0
        return export

    def _export_delta(self, s: Session, *, with_kv: bool, from_token: int) -> SessionExport:
        if not 0 < from_token <= len(s.tokens):
            raise InvalidArgument(
                f"from_token {from_token} is past the session's {len(s.tokens)} tokens",
                field="from_token",
            )
        start = kv_start(from_token, self.kv.block_size)
        header = DeltaHeader(from_token, tokens_digest(s.tokens[:from_token]), start)
        description = {
            "session_id": s.session_id,
            "tokens": s.tokens[from_token:],
            "cached": 0,
            DELTA_KEY: header.to_json(),
        }
        export = SessionExport(description, s.generator.get_state(), self.platform())
        if with_kv and s.cached > start:  # else the target recomputes from its staged KV on
            export.k, export.v = self.kv.export(s.blocks, s.cached, start)
            description["cached"] = s.cached
        return export

    def kv_mismatch(self, platform: dict[str, Any]) -> list[str]:
        """Platform fields that differ; KV from a differing platform is recomputed instead."""
        here = self.platform()
        return sorted(k for k in here if platform.get(k) != here[k])

    def _check_weights(self, export: SessionExport) -> None:
        if export.platform.get("weights_digest") != self.weights_digest:
            raise FailedPrecondition(
                "session was made with other weights: weights_digest "
                f"{export.platform.get('weights_digest')!r} != {self.weights_digest!r}",
                field="weights_digest",
            )

    def import_session(
        self, export: SessionExport, *, use_kv: bool = True, staged: bool = False
    ) -> Session:
        """Adds an exported session; returns it. KV is used when present, allowed and valid.

        ``staged``: hold it (KV loaded) without scheduling it, until ``apply_delta``.
        """
        if DELTA_KEY in export.description:
            raise InvalidArgument(
                "blob is a delta: apply it to a staged session (delta_for)", field="delta_for"
            )
        self._check_weights(export)
        s = Session.from_description(export.description, export.rng_state)
        if s.session_id in self.sessions or s.session_id in self.staged:
            raise AlreadyExists(f"session {s.session_id!r} exists", field="session_id")
        if s.state is SessionState.FINISHED:
            raise FailedPrecondition(f"session {s.session_id!r} has finished", field="session_id")
        self._check_tokens(s.tokens, "tokens", allow_empty=False)
        self._check_fits(s.prompt_len + s.max_new_tokens)
        cached = int(export.description.get("cached", 0))
        _check_portable(s, cached)
        if use_kv and export.has_kv and cached and not self.kv_mismatch(export.platform):
            assert export.k is not None and export.v is not None
            self._check_kv_shape(export.k, cached)
            self.kv.grow(s.blocks, cached)
            self.kv.load(s.blocks, export.k, export.v)
            s.cached = cached
        if staged:
            self.staged[s.session_id] = s
        else:
            self._schedule(s)
        return s

    def _schedule(self, s: Session) -> None:
        s.created_at = self.clock()
        s.last_token_at = s.created_at if s.generated else None
        self.sessions[s.session_id] = s
        self.scheduler.enqueue(s)

    def apply_delta(
        self, session_id: str, delta: SessionExport, *, schedule: bool = True
    ) -> Session:
        """Brings a staged session up to the delta's tokens; schedules it unless told not to.

        Everything is checked before anything changes: a refused delta leaves the staged copy
        as it was.
        """
        s = self.staged.get(session_id)
        if s is None:
            raise NotFound(f"delta_for: no staged session {session_id!r}", field="delta_for")
        header = DeltaHeader.from_description(delta.description)
        self._check_weights(delta)
        check_base(
            header,
            delta_session=str(delta.description.get("session_id", "")),
            staged_session=session_id,
            staged_tokens=s.tokens,
        )
        tail = [int(t) for t in delta.description.get("tokens", [])]
        self._check_tokens(tail, "tokens", allow_empty=True)
        tokens = s.tokens + tail
        if len(tokens) - s.prompt_len >= s.max_new_tokens:
            raise InvalidArgument("max_new_tokens leaves nothing to generate", field="tokens")
        cached = s.cached
        delta_cached = int(delta.description.get("cached", 0))
        use_kv = (
            delta.has_kv
            and s.cached >= header.kv_start
            and header.kv_start < delta_cached < len(tokens)
            and not self.kv_mismatch(delta.platform)
        )
        if use_kv:
            assert delta.k is not None and delta.v is not None
            self._check_kv_shape(delta.k, delta_cached - header.kv_start)
            self._check_kv_shape(delta.v, delta_cached - header.kv_start)
        generator = new_generator(s.params.seed)
        try:
            generator.set_state(delta.rng_state.to(device="cpu", dtype=torch.uint8).clone())
        except RuntimeError as exc:
            raise InvalidArgument(f"bad rng_state: {exc}", field="blob") from exc
        if use_kv:
            assert delta.k is not None and delta.v is not None
            self.kv.grow(s.blocks, delta_cached)  # the last check: raises before any change
            cached = delta_cached
            self.kv.load(s.blocks, delta.k, delta.v, header.kv_start)
        s.tokens, s.cached, s.generator = tokens, cached, generator
        if schedule:
            del self.staged[session_id]
            self._schedule(s)
        return s

    def _check_kv_shape(self, k: torch.Tensor, cached: int) -> None:
        want = (
            self.mcfg.num_hidden_layers,
            cached,
            self.mcfg.num_key_value_heads,
            self.mcfg.head_dim,
        )
        if tuple(k.shape) != want:
            raise InvalidArgument(f"KV has shape {tuple(k.shape)}, expected {want}", field="kv")

    def live_sessions(self) -> list[Session]:
        """Running sessions first, then the queue in order: the order a restore re-enqueues."""
        return [*self.scheduler.running, *self.scheduler.waiting]

    # ---- counters -------------------------------------------------------------------------

    def counters(self) -> Counters:
        return Counters(
            prefill_tokens=self.prefill_tokens,
            decode_tokens=self.decode_tokens,
            queue_depth=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            kv_blocks_used=self.kv.used_blocks,
            kv_blocks_total=self.kv.num_blocks,
            steps=self.steps,
            preemptions=self.scheduler.preemptions,
            ttft_ms=tuple(self._ttft),
            tbt_ms=tuple(self._tbt),
        )

    def warm_up(self) -> None:
        """Runs each step function once on dummy rows so compilation happens before serving."""
        rows = self.config.rows
        w = self._layers[0]
        x = torch.zeros(rows, self.mcfg.hidden_size, dtype=self.dtype, device=self.device)
        pre, post, final = self._fns
        eps, hd = self.mcfg.rms_norm_eps, self.mcfg.head_dim
        with torch.inference_mode():
            q, _, _ = pre(
                x,
                w["ln1"],
                w["wq"],
                w["wk"],
                w["wv"],
                w["bq"],
                w["bk"],
                w["bv"],
                self.cos[:rows],
                self.sin[:rows],
                eps,
                hd,
            )
            attn = q.reshape(rows, -1)
            post(x, attn, w["wo"], w["ln2"], w["wg"], w["wu"], w["wd"], eps)
            final(x, self._norm, self._head, eps)


def _check_portable(s: Session, cached: int) -> None:
    """A carried session must be one this engine could have produced: else name the field."""
    if not s.session_id:
        raise InvalidArgument("session_id must not be empty", field="session_id")
    if not 1 <= s.prompt_len <= len(s.tokens):
        raise InvalidArgument(
            f"prompt_len {s.prompt_len} does not fit the tokens", field="prompt_len"
        )
    if s.max_new_tokens <= 0 or len(s.generated) >= s.max_new_tokens:
        raise InvalidArgument("max_new_tokens leaves nothing to generate", field="max_new_tokens")
    if not 0 <= cached < len(s.tokens):
        raise InvalidArgument(
            f"cached {cached} must be below {len(s.tokens)} tokens", field="cached"
        )


def _layer_tensors(layer: M.DecoderLayer) -> _Layer:
    a, m = layer.self_attn, layer.mlp

    def bias(lin: torch.nn.Linear) -> torch.Tensor | None:
        return None if lin.bias is None else lin.bias.detach()

    return {
        "ln1": layer.input_layernorm.weight.detach(),
        "wq": a.q_proj.weight.detach(),
        "wk": a.k_proj.weight.detach(),
        "wv": a.v_proj.weight.detach(),
        "bq": bias(a.q_proj),
        "bk": bias(a.k_proj),
        "bv": bias(a.v_proj),
        "wo": a.o_proj.weight.detach(),
        "ln2": layer.post_attention_layernorm.weight.detach(),
        "wg": m.gate_proj.weight.detach(),
        "wu": m.up_proj.weight.detach(),
        "wd": m.down_proj.weight.detach(),
    }


def _step_functions(compiled: bool) -> tuple[Callable[..., Any], ...]:
    fns = (M.pre_attention, M.post_attention, M.final_logits)
    if not compiled:
        return fns
    return tuple(torch.compile(f, dynamic=False, fullgraph=True) for f in fns)
