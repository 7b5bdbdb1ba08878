# The decode step timed and profiled (one Llama-3-8B layer, 64k tokens, tq-k3v2, attend() 2,000 times after setup):
#   perf record -D 4500 -o p.data python docs/runs/kernel-pipes-20261130/profile.py
#   perf report -i p.data --stdio --no-children --sort sym
# (-D skips the setup; on the Zen 5 of 2026-11-30 setup took ~1.7 s and the sleep 1 s.)
import time, torch, sys
from qjl.tools.bench import _layer
from qjl.cache.attention import attend
torch.manual_seed(0)
n=65536; hq,hkv,d=32,8,128
k=torch.randn(1,hkv,n,d); v=torch.randn(1,hkv,n,d); q=torch.randn(1,hq,1,d)
t0=time.perf_counter()
store=_layer("tq-k3v2",k,v,"auto",0)
for _ in range(3): attend(store,q,None,d**-0.5)
print("setup", time.perf_counter()-t0, file=sys.stderr)
time.sleep(1.0)
t=time.perf_counter()
for _ in range(2000): attend(store,q,None,d**-0.5)
print((time.perf_counter()-t)/2000*1e3,"ms", file=sys.stderr)
