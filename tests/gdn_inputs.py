"""Input generators for tests: the hard cases of ../shared/bench/inputs.md."""
import torch


def random_cu_seqlens(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def hard_inputs(lengths, hq, hv, K, V, dtype=torch.float64, seed=0, unit_keys=True, strong_decay=True):
    """Packed varlen GDN inputs with strong decay, g = 0 heads and beta near 0 and 1."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(1, T, hq, K, generator=gen, dtype=torch.float64)
    k = torch.randn(1, T, hq, K, generator=gen, dtype=torch.float64)
    if unit_keys:
        k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(1, T, hv, V, generator=gen, dtype=torch.float64)
    # per-head decay strength: head 0 never decays, the last head decays by up to ~20 per token
    strength = torch.linspace(0.0, 16.0, hv, dtype=torch.float64)
    a = torch.nn.functional.softplus(0.5 * torch.randn(1, T, hv, generator=gen, dtype=torch.float64) + 1)
    g = -(strength if strong_decay else strength / 16) * a
    beta = torch.rand(1, T, hv, generator=gen, dtype=torch.float64)
    beta[..., 0] = 1e-4 + 1e-4 * beta[..., 0]        # beta near 0
    if hv > 1:
        beta[..., -1] = 1 - 1e-4 * beta[..., -1]      # beta near 1
    h0 = torch.randn(len(lengths), hv, K, V, generator=gen, dtype=torch.float64)
    cast = lambda x: x.to(dtype)
    return dict(q=cast(q), k=cast(k), v=cast(v), g=cast(g), beta=cast(beta), initial_state=cast(h0),
                cu_seqlens=random_cu_seqlens(lengths))
