"""Pairwise-preference rewards (Pref-GRPO, arXiv 2508.20751): a group's reward as each sample's win rate against
the rest of its group, from a judge that compares two samples, instead of near-equal normalised scalar scores.

A preference matrix P [G, G] holds P_ij = P(sample i beats sample j), with P_ij + P_ji = 1 (the diagonal unused)."""

from __future__ import annotations

import torch
from torch import Tensor


def win_rates(prefs: Tensor) -> Tensor:
    """[G, G] preferences -> [G]: w_i = mean over j != i of P_ij (0.5 for a group of one)."""
    G = prefs.shape[0]
    if prefs.shape != (G, G):
        raise ValueError(f"a preference matrix is square, got {tuple(prefs.shape)}")
    if G == 1:
        return torch.full((1,), 0.5, dtype=prefs.dtype)
    off = ~torch.eye(G, dtype=torch.bool, device=prefs.device)
    return (prefs * off).sum(1) / (G - 1)


def scalar_preferences(scores: Tensor) -> Tensor:
    """A scalar reward as a judge: [G] scores -> [G, G], P_ij = 1 if s_i > s_j, 0.5 if equal, 0 if below."""
    s = scores.double()
    return ((s[:, None] > s[None, :]).double() + 0.5 * (s[:, None] == s[None, :]).double()).to(torch.float32)


def clause_preferences(holds: Tensor) -> Tensor:
    """Clause-by-clause judging: [G, C] bool (clause c holds in sample i) -> [G, G], P_ij = (#clauses that hold in
    i and not in j + half the clauses on which they agree) / C."""
    h = holds.bool()
    C = h.shape[1]
    if C == 0:
        return torch.full((h.shape[0],) * 2, 0.5)
    wins = (h[:, None, :] & ~h[None, :, :]).sum(-1).double()
    ties = (h[:, None, :] == h[None, :, :]).sum(-1).double()
    return ((wins + 0.5 * ties) / C).to(torch.float32)
