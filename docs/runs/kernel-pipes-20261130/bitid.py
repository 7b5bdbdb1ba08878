import sys, torch, os
os.environ["QJL_CPU_IMPL"]="c-int"
from qjl.tools.bench import _layer
from qjl.cache.attention import attend
out={}
for preset in ["tq-k3v2","tq-k45v3","qjl-paper","tqv-k3v2"]:
    for (hq,hkv,d) in [(32,8,128),(9,3,64)]:
        for n in [1001, 4099]:
            for layer in [0, 20, 29]:
                g=torch.Generator().manual_seed(n+d+layer)
                k=torch.randn(1,hkv,n,d,generator=g); v=torch.randn(1,hkv,n,d,generator=g); q=torch.randn(1,hq,1,d,generator=g)
                st=_layer(preset,k,v,"auto",layer)
                out[(preset,d,n,layer)]=attend(st,q,None,d**-0.5).clone()
torch.save(out, sys.argv[1])
print(len(out))
