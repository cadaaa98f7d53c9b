"""Memory-efficient attention's logsumexp through Inductor and eager on CUDA, 16 rows (run7, call 8)."""
import torch, json
aten = torch.ops.aten
def sub(q, k, v):
    out, lse, seed, off = aten._scaled_dot_product_efficient_attention.default(q, k, v, None, True, 0.0, True)
    return out, lse
g = torch.fx.Graph()
q, k, v = (g.placeholder(n) for n in "qkv")
r = g.call_function(sub, (q, k, v))
g.output((g.call_function(__import__("operator").getitem, (r, 0)), g.call_function(__import__("operator").getitem, (r, 1))))
gm = torch.fx.GraphModule(torch.nn.Module(), g)
x = torch.randn(2, 2, 16, 16, device="cuda")
from torch._inductor import compile as ic
with torch.no_grad():
    c = ic(gm, [x, x, x])
    got = [tuple(t.shape) for t in c(x, x, x)]
    eager = [tuple(t.shape) for t in gm(x, x, x)]
print(json.dumps({"inductor": got, "eager": eager}))
