"""Qwen3-MoE: Qwen3 attention; sparse MoE blocks replace the MLP on most layers."""

from __future__ import annotations

import time

import numpy as np

from kestrel_cli.models import llama, qwen3
from kestrel_cli.runtime import kernels as K


class MoeBlock:
    """Router softmax over experts, top-k, optional renormalisation, weighted SwiGLU experts.

    Called as the dense MLP is. Experts are read as the checkpoint stores them
    (`experts.E.{gate,up,down}_proj`, memory-mapped views; a GGUF's stacked ffn_*_exps are
    served as per-expert views by the loader), or with --repack in the x16 decode layout
    made at load (kernels.ExpertTable); only the tokens routed to an expert are gathered
    for its matmuls, and only the selected experts' weights are read.
    """

    def __init__(self, cfg, store, p, norm):
        H, E = cfg.hidden_size, cfg.num_experts
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.norm, self.eps = norm, cfg.rms_norm_eps  # (H,) the layer's
        self.gate = store.matrix(f"{p}.gate.weight", (E, H))  # router (E, H)
        self.router = K.Projection([self.gate])
        self.experts = [
            llama.MLP(cfg, store, f"{p}.experts.{e}", cfg.moe_intermediate_size) for e in range(E)
        ]
        # decode's kernel; with --repack, every expert in the decode layout now (when the
        # weights fit the memory: Engine.load decides), its file pages let go
        self.table = K.ExpertTable(
            [(m.gate_proj, m.up_proj, m.down_proj) for m in self.experts],
            repack=store.repack_x16 and store.experts_at_load,
            on_pack=lambda e, ws: self.experts[e].use_weights(*ws),
            threads=store.threads,
        )

    def __call__(self, x, fwd, residual=None) -> np.ndarray:
        """MoE of RMSNorm(x), x (T, H); with `residual` (T, H), the output is added into it
        (and it is returned)."""
        T = x.shape[0]
        x = llama.rms_norm(x, self.norm, self.eps, fwd.threads)  # the experts' input
        (logits,) = fwd.project(self.router, x)  # (T, E)
        # softmax, top k, renormalised: the kernel the native decode routes with too
        top, w = K.moe_route(
            np.ascontiguousarray(logits), self.top_k, self.norm_topk_prob
        )  # (T, k) each
        if T == 1:
            return self._decode(x, top[0], w[0], fwd, residual)
        out = np.zeros_like(x)
        flat = top.reshape(-1)
        order = np.argsort(flat, kind="stable")
        rows = (order // self.top_k).astype(np.int64)  # token of each routed slot
        weights = w.reshape(-1)[order].astype(np.float32)
        experts, starts = np.unique(flat[order], return_index=True)
        t0 = time.perf_counter()
        # every expert's gathered tokens in one kernel call (kernels.ExpertTable.prefill),
        # then their weighted sum, expert by expert in ascending order
        y = self.table.prefill(
            x, experts, np.append(starts, len(order)), rows, fwd.threads, fwd.act_q8
        )
        K.scatter_add(out, y, rows, weights, fwd.threads)
        fwd.prof.matmul += time.perf_counter() - t0
        if residual is None:
            return out
        residual += out
        return residual

    def native_spec(self) -> K.MoeSpec:
        """This block for kernels.DecodeStack."""
        return K.MoeSpec(self.router, self.table, self.norm, self.top_k, bool(self.norm_topk_prob))

    def _decode(self, x, top, w, fwd, residual) -> np.ndarray:
        """One token: the selected experts in ascending order, one kernel call
        (kernels.ExpertTable.decode: each expert's SwiGLU scaled by its routing weight,
        then its down_proj added straight into the output; down is linear:
        down(w*g) = w*down(g)); no gather, no scatter."""
        out = np.zeros_like(x) if residual is None else residual
        order = np.argsort(top)
        t0 = time.perf_counter()
        self.table.decode(x, top[order], w[order].astype(np.float32), out, fwd.threads, fwd.act_q8)
        fwd.prof.matmul += time.perf_counter() - t0
        return out


class DecoderLayer(llama.DecoderLayer):
    def native_mlp(self):
        """A MoE block as its kernels.MoeSpec (in gate_up's place) and None (down)."""
        if type(self.mlp) is MoeBlock:
            return self.mlp.native_spec(), None
        return super().native_mlp()

    def make_mlp(self, cfg, store, p, i):
        # differs from llama: MoE unless listed in mlp_only_layers or off the sparse step
        if (
            cfg.num_experts > 0
            and i not in cfg.mlp_only_layers
            and (i + 1) % cfg.decoder_sparse_step == 0
        ):
            return MoeBlock(cfg, store, p, self.post_attention_layernorm)
        return super().make_mlp(cfg, store, p, i)


class Model(qwen3.Model):
    layer_cls = DecoderLayer
