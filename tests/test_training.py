"""A small transformer trained a few steps with flash_attention and with torch SDPA from the same
seed: the losses must agree within bf16 tolerance at every step."""

import pytest
import torch
import torch.nn.functional as F

import flash_cutlass
from helpers import requires_backward, requires_cuda

DEVICES = ["cpu", pytest.param("cuda", marks=[requires_cuda, requires_backward])]


class Block(torch.nn.Module):
    def __init__(self, hidden, heads, heads_k, attention):
        super().__init__()
        self.heads, self.heads_k, self.head_dim = heads, heads_k, hidden // heads
        self.attention = attention
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.q = torch.nn.Linear(hidden, hidden)
        self.kv = torch.nn.Linear(hidden, 2 * heads_k * self.head_dim)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        batch, seqlen, hidden = x.shape
        h = self.norm1(x)
        q = self.q(h).view(batch, seqlen, self.heads, self.head_dim)
        k, v = self.kv(h).view(batch, seqlen, 2, self.heads_k, self.head_dim).unbind(dim=2)
        if self.attention == "flash_cutlass":
            attended = flash_cutlass.flash_attention(q, k, v, causal=True)
        else:
            attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=True, enable_gqa=True).transpose(1, 2)
        x = x + self.proj(attended.reshape(batch, seqlen, hidden))
        return x + self.mlp(self.norm2(x))


def train_losses(attention, device, steps=5):
    torch.manual_seed(0)
    vocab, hidden = 64, 128
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, hidden), Block(hidden, 4, 2, attention),
                                Block(hidden, 4, 2, attention), torch.nn.Linear(hidden, vocab))
    model = model.to(device, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, vocab, (4, 97), device=device)
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("device", DEVICES)
def test_training_matches_sdpa(device):
    ours, sdpa = train_losses("flash_cutlass", device), train_losses("sdpa", device)
    assert ours[-1] < ours[0], f"the loss did not go down: {ours}"
    for step, (a, b) in enumerate(zip(ours, sdpa)):
        assert abs(a - b) <= 2e-2 * abs(b), f"step {step}: flash_cutlass {a:.4f} vs SDPA {b:.4f}"
