"""Qwen3: per-head RMSNorm on q and k before RoPE; head_dim from the config."""

from kestrel_cli.models import llama


class Attention(llama.Attention):
    def __init__(self, cfg, store, p, norm):
        super().__init__(cfg, store, p, norm)
        self.q_norm = store.vector(f"{p}.q_norm.weight", (cfg.head_dim,))  # (hd,)
        self.k_norm = store.vector(f"{p}.k_norm.weight", (cfg.head_dim,))  # (hd,)
        self.eps = cfg.rms_norm_eps

    def pre_rope(self, q, k, threads):
        # differs from llama: RMSNorm over each head's vector of q and k
        T = q.shape[0]
        qn = llama.rms_norm(q.reshape(-1, self.head_dim), self.q_norm, self.eps, threads)
        kn = llama.rms_norm(k.reshape(-1, self.head_dim), self.k_norm, self.eps, threads)
        return qn.reshape(T, self.n_heads, self.head_dim), kn.reshape(
            T, self.n_kv_heads, self.head_dim
        )

    def head_norms(self):
        return self.q_norm, self.k_norm


class Model(llama.Model):
    attention_cls = Attention
