"""The mixture-of-experts MLP (Qwen3-MoE, GLM-4.5/4.6, gpt-oss, Granite, Qwen3-Next, Qwen3.5-MoE
and Nemotron-H).

A router scores every expert for every token and keeps the top k; each
expert is a gated MLP (with biases in gpt-oss; without a gate in Nemotron-H,
whose experts may also work in a latent projected in and out around them).
The experts' weights are held stacked ([E, 2I, H] for gate|up, or [E, I, H]
for up alone, [E, H, I] for down), the (token,
expert) pairs of a step are sorted by expert, and each expert that got any
runs one matmul over all its rows: a loop over the experts a step uses,
never over tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layer_kinds import MoEConfig


def _meta(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class MoE(nn.Module):
    def __init__(self, m: MoEConfig, hidden: int, glu):
        """`glu`: the experts' f(gate, up), or f(up) where they have no gate (`m.ungated`)."""
        super().__init__()
        self.config, self.glu = m, glu
        self.router = nn.Linear(hidden, m.num_experts, bias=m.router_linear_bias,
                                device="meta").requires_grad_(False)
        if m.scoring == "sigmoid":
            # GLM: added to the scores when choosing experts, not when weighting them
            self.router_bias = _meta(m.num_experts)
        #: the first projection's rows per unit of width: gate and up, or up alone
        rows = 1 if m.ungated else 2
        width = m.latent_size or hidden
        if m.latent_size:
            self.latent_in = nn.Linear(hidden, width, bias=m.latent_bias, device="meta").requires_grad_(False)
            self.latent_out = nn.Linear(width, hidden, bias=m.latent_bias, device="meta").requires_grad_(False)
        self.gate_up = _meta(m.num_experts, rows * m.intermediate_size, width)
        self.down = _meta(m.num_experts, width, m.intermediate_size)
        if m.expert_bias:
            self.gate_up_bias = _meta(m.num_experts, 2 * m.intermediate_size)
            self.down_bias = _meta(m.num_experts, hidden)
        if m.shared_intermediate_size:
            self.shared_gate_up = _meta(rows * m.shared_intermediate_size, hidden)
            self.shared_down = _meta(hidden, m.shared_intermediate_size)
            if m.shared_bias:
                self.shared_gate_up_bias = _meta(rows * m.shared_intermediate_size)
                self.shared_down_bias = _meta(hidden)
        if m.shared_expert_gate:
            self.shared_gate = _meta(1, hidden)

    def hold_blocks(self, gate_up: list[nn.Module], down: list[nn.Module]) -> None:
        """Run the experts on their quantized blocks (dtype="gguf"): per expert, a
        QuantLinear over its GGUF blocks instead of a slice of the stacked weights."""
        del self.gate_up, self.down
        self.gate_up_q, self.down_q = nn.ModuleList(gate_up), nn.ModuleList(down)

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        """f of the first projection's output (gate|up, or up alone)."""
        return self.glu(h) if self.config.ungated else self.glu(*h.chunk(2, dim=-1))

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        bias = self.config.expert_bias
        if hasattr(self, "gate_up_q"):
            gate_up = self.gate_up_q[e](rows)
            gate_up = gate_up + self.gate_up_bias[e] if bias else gate_up
            out = self.down_q[e](self._act(gate_up))
            return out + self.down_bias[e] if bias else out
        gate_up = F.linear(rows, self.gate_up[e], self.gate_up_bias[e] if bias else None)
        return F.linear(self._act(gate_up), self.down[e], self.down_bias[e] if bias else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] and their weights [T, k] (x's dtype)."""
        m = self.config
        if m.scoring == "softmax":
            probs = self.router(x).softmax(dim=-1, dtype=torch.float32)
            weights, experts = probs.topk(m.top_k, dim=-1)
        elif m.scoring == "softmax_topk":
            logits, experts = self.router(x).topk(m.top_k, dim=-1)
            weights = logits.softmax(dim=-1, dtype=torch.float32)
        else:
            scores = F.linear(x.float(), self.router.weight.float()).sigmoid()
            choice = scores + self.router_bias.float()
            if m.num_groups > 1:
                groups = choice.view(-1, m.num_groups, m.num_experts // m.num_groups)
                best = groups.topk(2, dim=-1)[0].sum(dim=-1).topk(m.topk_groups, dim=-1)[1]
                keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
                choice = choice.masked_fill(~keep.repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
            experts = choice.topk(m.top_k, dim=-1)[1]
            weights = scores.gather(1, experts)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if m.scoring == "sigmoid" else 0))
        return experts, (weights * m.routed_scaling).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        k = experts.shape[1]
        order = experts.view(-1).argsort(stable=True)
        counts = torch.bincount(experts.view(-1), minlength=self.config.num_experts).tolist()
        tokens = order // k
        inner = self.latent_in(x) if self.config.latent_size else x
        rows = inner.index_select(0, tokens)
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start:start + n] = self._expert(e, rows[start:start + n])
                start += n
        out *= weights.view(-1).index_select(0, order)[:, None]
        y = torch.zeros_like(inner).index_add_(0, tokens, out)
        if self.config.latent_size:
            y = self.latent_out(y)
        if self.config.shared_intermediate_size:
            biases = (self.shared_gate_up_bias, self.shared_down_bias) if self.config.shared_bias else (None, None)
            shared = F.linear(self._act(F.linear(x, self.shared_gate_up, biases[0])), self.shared_down, biases[1])
            if self.config.shared_expert_gate:
                shared = shared * F.linear(x, self.shared_gate).sigmoid()
            y = y + shared
        return y
