"""scratch: TurboQuant MSE with a vector quantizer over groups of g rotated coordinates (same bits:
a group's code is g*bits bits, stored as g packed fields)."""
import os, torch
from qjl.codecs.base import Codes
from qjl.codecs.params import Param, integer
from qjl.codecs.turboquant import TurboQuantMSE
from qjl.core.packing import pack_bits, unpack_bits

GROUP = {1: 8, 2: 4, 3: 2, 4: 2}

def kmeans(x, k, iters=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = x[torch.randperm(len(x), generator=g)[:k]].clone()
    for _ in range(iters):
        a = torch.cat([torch.cdist(x[i:i+65536], c).argmin(1) for i in range(0, len(x), 65536)])
        s = torch.zeros_like(c).index_add_(0, a, x); n = torch.bincount(a, minlength=k).float()
        c = torch.where(n[:, None] > 0, s / n.clamp(min=1)[:, None], c)
    return c

def codebook(n, bits, g):
    path = f"/tmp/scratch/vq/cb_{n}_{bits}_{g}.pt"
    if os.path.exists(path):
        return torch.load(path)
    gen = torch.Generator().manual_seed(1234)
    m = max(1, 400000 * g // n)
    u = torch.randn(m, n, generator=gen); u = u / u.norm(dim=1, keepdim=True)
    x = u.reshape(-1, g)[:400000]
    c = kmeans(x, 2 ** (bits * g))
    torch.save(c, path)
    return c

class TurboQuantVQ(TurboQuantMSE):
    name = "tq_vq"
    params = {**TurboQuantMSE.params}

    def __init__(self, dim, bits=2, rotation="haar", seed=0, norm_dtype="fp16", correct_norm=False, cycles=1):
        super().__init__(dim, bits, rotation, seed, norm_dtype, correct_norm, cycles)
        n = self.rotation.out_dim
        self.g = GROUP[bits]
        assert n % self.g == 0
        self.table = codebook(n, bits, self.g)  # [2^(g b), g]

    def cells(self, y, norm):
        g = self.g
        yg = y.reshape(*y.shape[:-1], -1, g)
        flat = yg.reshape(-1, g)
        gi = torch.cat([torch.cdist(flat[i:i+65536], self.table).argmin(1) for i in range(0, len(flat), 65536)]) if len(flat) else torch.zeros(0, dtype=torch.long)
        gi = gi.reshape(yg.shape[:-1])
        shifts = torch.arange(g) * self.bits
        idx = ((gi.unsqueeze(-1) >> shifts) & (2 ** self.bits - 1)).reshape(y.shape)
        cos = (y * self.table[gi].reshape(y.shape)).sum(-1) if self.correct_norm else None
        return idx, self.stored_norm(norm, cos)

    def norm_limit(self):
        return torch.finfo(self.norm_dtype).max * (0.05 if self.correct_norm else 1)

    def rotated(self, codes):
        packed = codes.fields["codes"]; n = self.rotation.out_dim; g = self.g
        idx = unpack_bits(packed, self.bits, n).long().reshape(*packed.shape[:-1], n // g, g)
        gi = (idx << (torch.arange(g) * self.bits)).sum(-1)
        return self.table[gi].reshape(*packed.shape[:-1], n) * codes.fields["norm"].float().unsqueeze(-1)

    def score_view(self): return None
    def mix_view(self): return None
    def quantize_view(self): return None

if __name__ == "__main__":
    import time
    for bits in (2, 3, 4):
        t = time.time()
        for n in (64,):
            c = TurboQuantVQ(n, bits); s = TurboQuantMSE(n, bits)
            x = torch.randn(20000, n)
            for cod in (s, c):
                xh = cod.dequantize(cod.quantize(x))
                print(n, bits, type(cod).__name__, round(((x - xh) ** 2).sum(1).mean().item() / (x ** 2).sum(1).mean().item(), 5), round(time.time() - t, 1), flush=True)
