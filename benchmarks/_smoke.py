import torch, time, gtransform as gt
print(torch.__version__, torch.cuda.get_device_name())
print(hasattr(torch.UntypedStorage, '_swap_data_ptr_'))
dev='cuda'
@gt.graphify
def f(p, x):
    return {'y': (x @ p['w']).relu() + p['b'], 'z': torch.randn(3, device=x.device), 'n': 3}
p = {'w': torch.randn(4,3, device=dev), 'b': torch.randn(3, device=dev)}
for i in range(4):
    x = torch.randn(2,4, device=dev)
    t=time.perf_counter(); out = f(p, x); torch.cuda.synchronize(); dt=time.perf_counter()-t
    ref = (x @ p['w']).relu() + p['b']
    print(torch.allclose(out['y'], ref), out['z'], f.cache_info(), f._tls.state.last.rec.static_idx, f'{dt*1e3:.1f}ms')
torch.manual_seed(0); a = f(p, x)['z'].clone()
torch.manual_seed(0); b = torch.randn(3, device=dev)
print('rng match', a, b)
old = out; v = old['y'][0]
new = f(p, torch.randn(2,4, device=dev))
try: print(old['y'] + 1)
except gt.OverwrittenOutputError as e: print('stale OK')
print('view kept', v, )
def g(x): return x * x.sum().item()
try: gt.graphify(g)(torch.ones(3, device=dev))
except gt.GraphifyError as e: print(e)
def h(x): return x + torch.arange(3).cuda()
try: gt.graphify(h)(torch.ones(3, device=dev))
except gt.GraphifyError as e: print(e)
# timing
import torch.nn as nn
xs = torch.randn(64, 512, device=dev)
ws = {f'w{i}': torch.randn(512,512, device=dev)/20 for i in range(8)}
def mlp(ws, x):
    for i in range(8): x = (x @ ws[f'w{i}']).relu()
    return x
m = gt.graphify(mlp)
for _ in range(5): y = m(ws, xs)
del y
torch.cuda.synchronize()
N=1000
t=time.perf_counter()
for _ in range(N): m(ws, xs)
torch.cuda.synchronize(); print('graphify mlp us', (time.perf_counter()-t)/N*1e6)
t=time.perf_counter()
for _ in range(N): mlp(ws, xs)
torch.cuda.synchronize(); print('eager mlp us', (time.perf_counter()-t)/N*1e6)
