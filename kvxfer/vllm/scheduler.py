"""Scheduler side of the vLLM connector (no vLLM import; requests and blocks are duck-typed).

Lifecycle of a disaggregated request (P: prefill server, D: decode server):

1. The proxy sends the prompt to P with ``kv_transfer_params={"do_remote_decode": true}`` and
   ``max_tokens=1``. When P finishes it, :meth:`SchedulerSide.request_finished` returns
   ``(True, params)``: vLLM keeps the blocks, ``params`` (kvxfer params plus
   ``do_remote_prefill``, the exporter's block size and a prompt hash) become the response's
   ``kv_transfer_params``, and the next :meth:`build_connector_meta` tells P's workers to
   ``export``. The params exist one step before the export: D's load waits for it (bounded).
2. The proxy sends the same prompt to D with those params. :meth:`get_num_new_matched_tokens`
   offers the tokens D does not hold (all of them, or those after D's own prefix-cache hit),
   D allocates, :meth:`update_state_after_alloc` queues the load of P's params as they are
   (never sliced: the exporter accepts only the exact params it made) with D's block ids for
   the whole request and the local hit as ``num_computed_tokens``, and D's workers ``load``.
   A failed load is reported as the request's block ids, so vLLM's ``kv_load_failure_policy``
   applies.
3. P's workers report the request in ``finished_sending`` once every D rank notified (or the
   lease ended): vLLM frees P's blocks then. A D request that will not load (aborted before
   its blocks were allocated, rejected, a full local hit, a prompt mismatch) sends a release,
   so P frees them without waiting for the lease.

n>1: D's children (``"<i>_<parent>"``) share one params dict. The first child loads; the others
wait (``None`` from :meth:`get_num_new_matched_tokens`) until it has, then use D's prefix
cache and compute only the tail. A params dict with ``"children": [params_0, ...]`` (one
exported request per child) gives child ``i`` its own ``params_i``.

A model with state groups (Mamba, GDN, short conv) hands off N−1 of N prompt tokens
(:mod:`kvxfer.vllm.backoff`): :meth:`SchedulerSide.on_new_request` truncates P's request by one
token, P exports the N−1 tokens (the state h(N−1)), D loads them and computes token N. P never
hands off a prompt it did not truncate (one token), and D never loads a state export covering
its whole prompt.

D->P reuse (multi-turn): a D request whose params carry ``"hold_for_reuse": true`` keeps its
blocks when it finishes and returns ``{"reuse": params}``; the next turn's request to P carries
``{"do_remote_decode": true, "reuse": params}``, and P pulls the tokens it does not hold when
:func:`kvxfer.reuse.decide_reuse` says pulling beats recomputing (else it releases them).
"""

from __future__ import annotations

import array
import hashlib
import itertools
import logging
from dataclasses import dataclass
from typing import Any

from ..auth import EngineSecret
from ..grouped import export_ids
from ..groups.attention import GroupSet
from ..params import KVTransferParams, params_dict
from ..reuse import decide_reuse
from .backoff import truncate_for_prefill, was_truncated
from .config import ConnectorConfig
from .groups import VllmGroup, engine_groups, expand_group_ids, has_state
from .layout import KVLayout, KVLayoutMismatch, check_pair

# the step's metadata and the block-id facts live in transfer_meta.py (re-exported here)
from .transfer_meta import NULL_BLOCK_ID, NULL_BLOCK_WHY, ExportSpec, LoadSpec, TransferMeta, expand_block_ids

_LOG = logging.getLogger(__name__)

__all__ = [
    "NULL_BLOCK_ID",
    "NULL_BLOCK_WHY",
    "ExportSpec",
    "LoadSpec",
    "SchedulerSide",
    "TransferMeta",
    "expand_block_ids",
    "prompt_hash",
]

_NORMAL_FINISH = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
_CONSUMED_MAX = 65536
_CONSUMED_SLACK = _CONSUMED_MAX // 64  # the oldest forgotten in batches, as kvxfer.exports.GONE_SLACK


def prompt_hash(token_ids, num_tokens: int) -> str:
    """Hash of the first ``num_tokens`` token ids (both sides compute it; a mismatch means the
    exported KV is not this prompt's)."""
    ids = array.array("q", list(token_ids[:num_tokens]))
    return hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest()


@dataclass
class _Source:
    """A request's remote KV, parsed once."""

    kind: str  # "prefill" (P -> D) or "reuse" (D -> P)
    params: KVTransferParams
    raw: dict  # the params as the request carried them: loaded and released unmodified
    block_size: int  # exporter's block size (kvxfer / kernel blocks)
    num_tokens: int  # valid tokens of the export (its num_tokens may be rounded to whole blocks)
    key: tuple[str, str]  # (exporter engine id, exported request id)
    ok: bool = True  # False: never load it (release it)


class SchedulerSide:
    """The scheduler half of ``KvxferConnector``; see the module docstring for the lifecycle."""

    def __init__(self, cfg: ConnectorConfig, window: str = "", groups: list[VllmGroup] | None = None) -> None:
        self.cfg = cfg
        self.window = window  # the KV cache group's window, described ("": none known)
        self.groups = groups  # KV cache groups a request is a set of (None: one group)
        # the groups' windows as the engines apply them (their layers do not matter here)
        self._gs = None
        self.has_state = has_state(groups)  # the N−1 flow (kvxfer.vllm.backoff)
        if groups is not None:  # every layer numbered (a state group's spec counts its layers)
            where = {
                (g.index, n): i for i, (g, n) in enumerate((g, n) for g in groups for n in g.layer_names)
            }
            self._gs = GroupSet(engine_groups(groups, where), len(where))
        self.num_not_handed_off = 0  # finished requests not exported (blocks out of the window)
        self._secret: EngineSecret | None = self._engine_secret() if cfg.exports else None
        self.kernel_block_size = cfg.block_size  # updated by set_handshake (worker's registered caches)
        self.bytes_per_token = 0  # whole model, from the workers' handshake metadata
        self.layout: KVLayout | None = None  # the registered caches' layout (set_handshake)
        self.link_Bps = cfg.reuse_link_Bps  # updated from measured worker stats
        self._meta = TransferMeta()
        self._src: dict[str, _Source | None] = {}  # request id -> parsed remote source (None: none)
        self._done: set[str] = set()  # requests whose load/release was queued
        self._inflight: dict[tuple[str, str], str] = {}  # remote key -> local request loading it
        self._loading: dict[str, tuple[str, str]] = {}  # local request -> remote key
        self._consumed: dict[tuple[str, str], None] = {}  # remote keys already loaded (bounded)
        self._warned: set[str] = set()

    def _engine_secret(self) -> EngineSecret:
        """The secret the workers' engines share (kvxfer.auth: the host key file, or the cluster
        key). vLLM builds the scheduler after every worker registered its caches, so every
        worker's engine has read the key file by now: the file goes at once (a server stopped
        by a signal, whose workers never close their engines, leaves none behind). A file this
        call had to create (no worker started first: not vLLM's order) stays, for the workers
        to read; rank 0 removes it when it closes."""
        secret = EngineSecret(self.cfg.engine_id, self.cfg.base_port, tp_rank=-1)
        if secret.path is not None and not secret.created:
            secret.remove_file()
        return secret

    # ------------------------------------------------------------------ handshake
    def set_handshake(self, per_rank: dict[int, dict]) -> None:
        """Workers' metadata (``WorkerSide.handshake_info``), by TP rank."""
        sizes = {int(m["block_size"]) for m in per_rank.values()}
        if len(sizes) != 1:
            raise ValueError(f"handshake: TP ranks registered different block sizes {sorted(sizes)}")
        kbs = sizes.pop()
        if self.cfg.block_size % kbs:
            raise ValueError(
                f"handshake: kernel block size {kbs} does not divide block_size {self.cfg.block_size}"
            )
        layouts = {KVLayout.from_dict(m["kv_layout"]) for m in per_rank.values() if "kv_layout" in m}
        if len(layouts) > 1:
            raise ValueError(
                f"handshake: TP ranks registered different KV layouts {sorted(map(str, layouts))}"
            )
        self.kernel_block_size = kbs
        self.bytes_per_token = max(int(m.get("bytes_per_token", 0)) for m in per_rank.values())
        self.layout = layouts.pop() if layouts else None

    @property
    def ratio(self) -> int:
        return self.cfg.block_size // self.kernel_block_size

    def on_new_request(self, request) -> None:
        """vLLM's ``on_new_request``: on a server that exports, a model with state groups has
        its P requests (``do_remote_decode``) truncated by one token (the N−1 flow,
        :mod:`kvxfer.vllm.backoff`); nothing otherwise."""
        if self.has_state and self.cfg.exports:
            truncate_for_prefill(request)

    # ------------------------------------------------------------------ loading side
    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _LOG.warning(msg, *args)

    def _source(self, request, verify: bool = True) -> _Source | None:
        """The request's remote KV, parsed once (None: none). ``verify=False``: only what a
        release needs (a request that ends before it was ever scheduled, whose prompt may be
        vLLM's placeholder)."""
        rid = request.request_id
        if rid in self._src:
            return self._src[rid]
        src = None
        params = getattr(request, "kv_transfer_params", None)
        if params and self.cfg.loads:
            raw = None
            kind = ""
            if params.get("do_remote_prefill"):
                kind, raw = "prefill", params
                children = params.get("children")
                if children is not None:
                    raw = self._child_params(rid, children)
            elif isinstance(params.get("reuse"), dict):
                kind, raw = "reuse", params["reuse"]
            if raw is not None:
                src = self._parse(request, kind, raw, verify)
        self._src[rid] = src
        return src

    def _child_params(self, rid: str, children) -> dict | None:
        head = rid.split("_", 1)[0]
        if not isinstance(children, list) or not head.isdigit() or int(head) >= len(children):
            _LOG.warning(
                "kvxfer: request %s: params 'children' has no entry for this request (ids '<i>_<parent>' "
                "pick entry i); recomputing it",
                rid,
            )
            return None
        return children[int(head)]

    def _parse(self, request, kind: str, raw: dict, verify: bool = True) -> _Source | None:
        rid = request.request_id
        try:
            if not isinstance(raw, dict):
                raise ValueError(f"expected a dict, got {type(raw).__name__}")
            p = KVTransferParams.from_dict(raw)
            if isinstance(p, list):
                raise ValueError("expected one request's params, got a list")
            bs = raw.get("block_size")
            if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
                raise ValueError(f"block_size: must be a positive int, got {bs!r}")
            if (p.groups is None) != (self.groups is None):
                raise ValueError(
                    f"groups: the exporter's request is of {len(p.groups or ()) or 1} KV cache groups, this "
                    f"server's model has {len(self.groups or ()) or 1}"
                )
            if p.groups is None and len(p.block_ids) != -(-p.num_tokens // bs):
                raise ValueError(f"block_ids: {len(p.block_ids)} ids do not hold num_tokens={p.num_tokens}")
            if "kv_layout" not in raw:
                raise ValueError(
                    "kv_layout: missing (the exporter's KV layout; kvxfer connector params carry it)"
                )
            layout = KVLayout.from_dict(raw["kv_layout"])
            valid = raw.get("num_valid_tokens", p.num_tokens)
            if isinstance(valid, bool) or not isinstance(valid, int) or not 1 <= valid <= p.num_tokens:
                raise ValueError(f"num_valid_tokens: must be an int in [1, {p.num_tokens}], got {valid!r}")
            whole = -(-valid // bs) * bs
            if valid != p.num_tokens and not (layout.whole_blocks and p.num_tokens == whole):
                raise ValueError(
                    f"num_tokens={p.num_tokens} with num_valid_tokens={valid}: only a whole-block layout "
                    f"rounds, to {whole}"
                )
        except ValueError as e:
            _LOG.warning("kvxfer: request %s: unusable kv_transfer_params (%s); recomputing it", rid, e)
            return None
        prompt = getattr(request, "prompt_token_ids", None) or []
        src = _Source(kind, p, raw, bs, valid, (p.engine_id, p.request_id))
        want = raw.get("prompt_hash")
        if not verify:
            return src
        if self.layout is None:
            self._warn_once(
                "nolayout",
                "kvxfer: request %s: this server's KV layout is unknown (no handshake metadata from the "
                "workers); recomputing it and releasing the remote blocks",
                rid,
            )
            src.ok = False
            return src
        try:
            check_pair(layout, self.layout)
        except KVLayoutMismatch as e:
            _LOG.warning(
                "kvxfer: request %s: KVLayoutMismatch: %s; recomputing it and releasing the remote blocks",
                rid,
                e,
            )
            src.ok = False
            return src
        if self.has_state and kind == "prefill" and len(prompt) <= valid:
            _LOG.warning(
                "kvxfer: request %s: %s exported %d tokens of its %d-token prompt, but a model with state "
                "groups loads at most all but the last (this server computes the last prompt token from the "
                "loaded state: the N-1 flow); recomputing it and releasing the remote blocks",
                rid,
                p.engine_id,
                valid,
                len(prompt),
            )
            src.ok = False
        elif len(prompt) < valid:
            _LOG.warning(
                "kvxfer: request %s: its prompt has %d tokens, %s exported %d; recomputing it and "
                "releasing the remote blocks",
                rid,
                len(prompt),
                p.engine_id,
                valid,
            )
            src.ok = False
        elif self.cfg.verify_prompt and (type(want) is not str or prompt_hash(prompt, valid) != want):
            # kvxfer's exporters always send the hash: params without it were altered (loaded,
            # they would file another prompt's KV in this server's prefix cache under this one)
            why = (
                "its kv_transfer_params carry no prompt_hash (verify_prompt is on)"
                if type(want) is not str
                else f"its prompt is not the one {p.engine_id} computed (prompt hash differs)"
            )
            _LOG.warning("kvxfer: request %s: %s; recomputing it and releasing the remote blocks", rid, why)
            src.ok = False
        return src

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens to load beyond ``num_computed_tokens`` (the local, block-aligned hit), and
        whether asynchronously; ``(None, False)`` while an n>1 sibling loads the same KV."""
        rid = request.request_id
        if rid in self._done:
            return 0, False
        src = self._source(request)
        if src is None or not src.ok:
            return 0, False
        owner = self._inflight.get(src.key)
        if owner is not None and owner != rid:
            return None, False  # a sibling loads it; then the prefix cache has it
        if src.key in self._consumed:
            return 0, False
        k = num_computed_tokens
        if k >= src.num_tokens:
            return 0, False  # everything is here already: released in update_state_after_alloc
        if k % self.cfg.block_size or k % self.kernel_block_size:
            self._warn_once(
                "align",
                "kvxfer: a local prefix hit of %d tokens does not end on a block (block_size %d); such "
                "requests recompute their remaining tokens locally",
                k,
                self.cfg.block_size,
            )
            return 0, False
        if src.kind == "reuse" and not self._pull_pays(src.num_tokens - k):
            return 0, False
        self._inflight[src.key] = rid
        return src.num_tokens - k, True

    def _pull_pays(self, num_tokens: int) -> bool:
        if not self.bytes_per_token:
            return True  # nothing known about the model size yet: pulling is never worse than a guess
        d = decide_reuse(
            num_tokens,
            self.bytes_per_token,
            self.link_Bps,
            self.cfg.reuse_prefill_tokens_per_s,
            self.cfg.reuse_fixed_pull_s,
            min_gain=self.cfg.reuse_min_gain,
        )
        _LOG.debug(
            "kvxfer reuse of %d tokens: pull %.4fs vs recompute %.4fs", num_tokens, d.pull_s, d.recompute_s
        )
        return d.pull

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Queue the load of the offered tokens into the request's blocks, or the release of
        the remote KV when nothing will be loaded."""
        rid = request.request_id
        if rid in self._done:
            return
        src = self._source(request)
        if src is None:
            return
        self._done.add(rid)
        if num_external_tokens <= 0 or not src.ok:
            self._release(rid, src)
            return
        k = src.num_tokens - num_external_tokens
        bs = self.cfg.block_size
        need = -(-src.num_tokens // bs)
        if self.groups is not None:
            per = blocks.get_block_ids()  # a state group's list as it is (its state block and scratch)
            lists = [list(per[g.index]) if g.is_state else list(per[g.index])[:need] for g in self.groups]
            short = any(len(x) < need for g, x in zip(self.groups, lists) if not g.is_state)
            if k < 0 or k % bs or short:
                _LOG.warning(
                    "kvxfer: request %s: cannot place %d external tokens after %d local ones in the block "
                    "lists of its KV cache groups; not loading",
                    rid,
                    num_external_tokens,
                    k,
                )
                self._release(rid, src)
                return
            self._meta.loads.append(LoadSpec(rid, dict(src.raw), lists, k, src.num_tokens))
            self._inflight[src.key] = rid
            self._loading[rid] = src.key
            return
        ids = list(blocks.get_block_ids()[0])
        if k < 0 or k % bs or len(ids) < need:
            _LOG.warning(
                "kvxfer: request %s: cannot place %d external tokens after %d local ones in %d blocks; "
                "not loading",
                rid,
                num_external_tokens,
                k,
                len(ids),
            )
            self._release(rid, src)
            return
        # P's params go as they are; the local hit is skipped by the engine (num_computed_tokens)
        self._meta.loads.append(LoadSpec(rid, dict(src.raw), ids[:need], k))
        self._inflight[src.key] = rid
        self._loading[rid] = src.key

    def _release(self, rid: str, src: _Source) -> None:
        if self._inflight.get(src.key) == rid:
            del self._inflight[src.key]
        if src.key in self._consumed or src.key in self._inflight:
            return  # a sibling loaded it (P already freed it) or is loading it
        self._meta.releases.append(dict(src.raw))
        self._consume(src.key)

    def _consume(self, key: tuple[str, str]) -> None:
        self._consumed[key] = None
        if len(self._consumed) > _CONSUMED_MAX + _CONSUMED_SLACK:
            for old in list(itertools.islice(self._consumed, len(self._consumed) - _CONSUMED_MAX)):
                del self._consumed[old]

    # ------------------------------------------------------------------ exporting side
    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks of a finished prefill (or of a decode kept for reuse) and return the
        params the other server loads them with; release remote KV this request never loaded.
        ``block_ids``: the request's manager block ids; with KV cache groups, vLLM's tuple of
        one list per group (``request_finished_all_groups``)."""
        rid = request.request_id
        if rid not in self._done and rid not in self._loading:  # never allocated: aborted or rejected
            # Parsed here at the latest, only for the release: a request vLLM rejected before
            # admission reaches the connector as a pre-aborted request whose prompt is a
            # placeholder ([0], vLLM's notify_kv_transfer_request_rejected), so its prompt is
            # not checked (no false "prompt hash differs"); the release is skipped when the KV
            # was loaded or its load failed already (P knows).
            src = self._source(request, verify=False)
            if src is not None:
                self._done.add(rid)
                self._release(rid, src)
        # else its load or release was queued already (a load still running reports itself):
        # nothing is parsed again, so nothing is warned twice
        if rid not in self._loading:
            self._src.pop(rid, None)
        self._done.discard(rid)
        params = getattr(request, "kv_transfer_params", None) or {}
        want_decode = bool(params.get("do_remote_decode"))
        want_reuse = bool(params.get("hold_for_reuse"))
        if not (want_decode or want_reuse) or not self.cfg.exports:
            return False, None
        if self.has_state and not (want_decode and was_truncated(request)):
            self._warn_once(
                "state-" + ("decode" if want_decode else "reuse"),
                "kvxfer: request %s not handed off: %s; no kv_transfer_params (the other server computes "
                "the prompt). Warned once",
                rid,
                "a model with state groups hands off N-1 of N prompt tokens, and this prompt of "
                f"{getattr(request, 'num_prompt_tokens', '?')} tokens was not truncated (one token, or "
                "prompt logprobs)"
                if want_decode
                else "D->P reuse (hold_for_reuse) of a model with state groups is not carried yet",
            )
            return False, None
        status = getattr(getattr(request, "status", None), "name", str(getattr(request, "status", "")))
        span = len(block_ids) if block_ids else 0  # manager blocks held
        if self.groups is not None and span:  # the shortest of the attention groups' lists
            try:
                span = min(len(block_ids[g.index]) for g in self.groups if not g.is_state)
            except (IndexError, TypeError):
                span = 0
        if status not in _NORMAL_FINISH or not span:
            return False, None  # aborted or errored: nobody will read it
        bs, kbs = self.cfg.block_size, self.kernel_block_size
        n = min(int(request.num_computed_tokens), span * bs)
        if want_decode:
            n = min(n, int(getattr(request, "num_prompt_tokens", n)))
        if n < 1:
            return False, None
        if self.layout is None:
            self._warn_once(
                "nolayout-export",
                "kvxfer: request %s: this server's KV layout is unknown (no handshake metadata from the "
                "workers); not exporting",
                rid,
            )
            return False, None
        nkb = -(-n // kbs)  # kernel blocks holding the n valid tokens (the last may be partial)
        moved = nkb * kbs if self.layout.whole_blocks else n  # whole pages: the partial block whole
        if self.groups is not None:
            return self._finish_grouped(request, block_ids, n, moved, want_decode)
        mgr = list(block_ids[: -(-n // bs)])
        if NULL_BLOCK_ID in mgr:
            self._not_handed_off(rid, mgr)
            return False, None
        kids = expand_block_ids(mgr, self.ratio)[:nkb]
        tokens = getattr(request, "all_token_ids", None) or getattr(request, "prompt_token_ids", None) or []
        if self._secret is None:  # pragma: no cover - made at construction where this exports
            self._secret = self._engine_secret()
        token = self._secret.new_token(rid, moved, kids)  # every worker's export is bound to it
        out = params_dict(
            rid, self.cfg.engine_id, self.cfg.host, self.cfg.base_port, self.cfg.tp_size, kids, moved, token
        )
        out["block_size"] = kbs
        out["num_valid_tokens"] = n
        out["kv_layout"] = self.layout.to_dict()
        if len(tokens) >= n:
            out["prompt_hash"] = prompt_hash(tokens, n)
        self._meta.exports.append(ExportSpec(rid, mgr, moved, token))
        if want_decode:
            return True, {**out, "do_remote_prefill": True, "do_remote_decode": False}
        return True, {"reuse": out}

    def _finish_grouped(self, request, block_ids, n: int, moved: int, want_decode: bool):
        """:meth:`request_finished` for a model of several KV cache groups: each group's live
        blocks (:func:`kvxfer.grouped.export_ids`, windows ending at the ``n`` valid tokens),
        params carrying them with the count per group. A group whose window needs a block vLLM
        already freed (its null block stands there) is not handed off, naming it."""
        rid = request.request_id
        bs, kbs = self.cfg.block_size, self.kernel_block_size
        need = -(-n // bs)
        try:
            if not isinstance(block_ids, (list, tuple)) or len(block_ids) <= max(
                g.index for g in self.groups
            ):
                raise ValueError("block_ids: expected vLLM's one list per KV cache group")
            mgr = [
                list(block_ids[g.index]) if g.is_state else list(block_ids[g.index])[:need]
                for g in self.groups
            ]
            kernel = [
                ids if g.is_state else expand_group_ids(ids, self.ratio, NULL_BLOCK_ID)
                for g, ids in zip(self.groups, mgr)
            ]
            ids, sizes = export_ids(self._gs, kernel, moved, kbs, 1 << 62, computed=n)
        except ValueError as e:
            self.num_not_handed_off += 1
            _LOG.warning(
                "kvxfer: request %s not handed off (%s); no kv_transfer_params (the decode server computes "
                "the prompt itself). %d such requests so far",
                rid,
                e,
                self.num_not_handed_off,
            )
            return False, None
        tokens = getattr(request, "all_token_ids", None) or getattr(request, "prompt_token_ids", None) or []
        if self._secret is None:  # pragma: no cover - made at construction where this exports
            self._secret = self._engine_secret()
        kids = ids.tolist()
        token = self._secret.new_token(rid, moved, kids, sizes)  # every worker's export is bound to it
        out = params_dict(
            rid, self.cfg.engine_id, self.cfg.host, self.cfg.base_port, self.cfg.tp_size, kids, moved, token,
            groups=sizes,
        )  # fmt: skip
        out["block_size"] = kbs
        out["num_valid_tokens"] = n
        out["kv_layout"] = self.layout.to_dict()
        if len(tokens) >= n:
            out["prompt_hash"] = prompt_hash(tokens, n)
        self._meta.exports.append(ExportSpec(rid, mgr, moved, token, n))
        if want_decode:
            return True, {**out, "do_remote_prefill": True, "do_remote_decode": False}
        return True, {"reuse": out}

    def _not_handed_off(self, rid: str, mgr: list[int]) -> None:
        """A finished request whose blocks out of a sliding window vLLM already freed (its null
        block stands in for them): its KV is not whole, so it is not exported; P answers without
        ``kv_transfer_params`` and D computes the prompt itself. Warned on the first such
        request and every 100th after (a count)."""
        self.num_not_handed_off += 1
        n = self.num_not_handed_off
        if n == 1 or n % 100 == 0:
            _LOG.warning(
                "kvxfer: request %s not handed off: %d of its %d blocks are out of the sliding window "
                "(%s; vLLM freed them and its null block stands in), so its KV is not whole; no "
                "kv_transfer_params (the decode server computes the prompt itself). Moving only the "
                "in-window blocks is not supported yet. %d such requests so far",
                rid,
                mgr.count(NULL_BLOCK_ID),
                len(mgr),
                self.window or "a KV cache group that frees blocks",
                n,
            )

    # ------------------------------------------------------------------ per step
    def build_connector_meta(self) -> TransferMeta:
        """This step's loads, exports and releases (the state is reset)."""
        meta, self._meta = self._meta, TransferMeta()
        return meta

    def update_connector_output(self, finished_recving, stats: dict | None = None) -> None:
        """Loads reported finished (or failed) by every worker; measured link throughput."""
        for rid in finished_recving or ():
            key = self._loading.pop(rid, None)
            if key is None:
                continue
            self._src.pop(rid, None)
            if self._inflight.get(key) == rid:
                del self._inflight[key]
            self._consume(key)
        if stats and stats.get("bytes", 0) > 0 and stats.get("busy_s", 0) > 0:
            measured = stats["bytes"] / stats["busy_s"]
            self.link_Bps = 0.8 * self.link_Bps + 0.2 * measured

    def num_tracked(self) -> int:
        """Requests with scheduler-side state (0 once everything finished; for leak checks)."""
        return len(self._src) + len(self._done) + len(self._loading) + len(self._inflight)
