import torch, gtransform as gt, gc, weakref
D = "cuda"
torch.manual_seed(0)
# mutation of copied input
@gt.graphify
def mut(x, y):
    x.add_(1)
    y[0] = 5.
    return x * 2
a = torch.zeros(3, device=D); b = torch.zeros(3, device=D)
for i in range(3):
    a2 = torch.zeros(3, device=D); b2=torch.ones(3, device=D)
    r = mut(a2, b2)
    print('mut', a2, b2, r)
# output is input / view of input
@gt.graphify
def ident(x):
    return x, x[1:], x.t()
x = torch.randn(3, 3, device=D)
o = ident(x); print(o[0] is x, o[1]._base is x or o[1].untyped_storage().data_ptr()==x.untyped_storage().data_ptr())
x2 = torch.randn(3,3, device=D); o = ident(x2); print(o[0] is x2, torch.equal(o[2], x2.t()))
# aliasing input passed twice with mutation
@gt.graphify
def twice(x, y):
    x.add_(1)
    return y * 1
z = torch.zeros(2, device=D); print('twice', twice(z, z), z)
z = torch.zeros(2, device=D); print('twice', twice(z, z), z)
z = torch.zeros(2, device=D); w = torch.zeros(2, device=D); print('twice sep', twice(z, w), z)
# view held across calls
f = gt.graphify(lambda x: x * 2)
out = f(torch.ones(3, device=D)); v = out[1:]
out2 = f(torch.full((3,), 5., device=D))
print('view', v, out2)
try: out + 1
except gt.OverwrittenOutputError: print('stale out raises')
del out
out3 = f(torch.full((3,), 7., device=D)); print('view2', v, out3)
del v
out4 = f(torch.full((3,), 9., device=D)); print(out4)
# reuse object
f2 = gt.graphify(lambda x: x + 1)
i1 = id(f2(torch.ones(2, device=D))); i2 = id(f2(torch.ones(2, device=D))); print('reuse', i1 == i2)
# errors
try: gt.graphify(lambda x: x[x > 0])(torch.randn(4, device=D))
except gt.GraphifyError as e: print(e)
try: gt.graphify(lambda x, l: x)(torch.randn(4, device=D), [1, [2]])
except TypeError as e: print('TE', e)
try: gt.graphify(lambda x, l: x)(torch.randn(4, device=D), {'a': {1,2}})
except TypeError as e: print('TE', e)
# leak
g = gt.graphify(lambda x: x + 1); g(torch.ones(2, device=D)); wr = weakref.ref(g); del g; gc.collect(); print('leak free', wr() is None)
# static argnums
h = gt.graphify(lambda x, n: x * n, static_argnums=1)
print(h(torch.ones(2, device=D), 3), h(torch.ones(2, device=D), n=4), h.cache_info())
class M:
    def __init__(self): self.w = torch.ones(2, device=D)
    @gt.graphify
    def f(self, x): return x * self.w
m = M(); print(m.f(torch.ones(2, device=D)), m.f.cache_info())
# random
r = gt.graphify(lambda x: x + torch.randn_like(x))
torch.manual_seed(1); a = r(torch.zeros(3, device=D)).clone(); torch.manual_seed(1); b = torch.randn(3, device=D); print('rng', torch.equal(a, b))
a = r(torch.zeros(3, device=D)).clone(); b = r(torch.zeros(3, device=D)).clone(); print('fresh', not torch.equal(a, b))
# grad of graphify (fallback)
print(torch.func.grad(gt.graphify(lambda x: (x**2).sum()))(torch.ones(2, device=D)))
print(gt.graphify(torch.func.grad(lambda x: (x**2).sum()))(torch.ones(2, device=D)))
# None, namedtuple
import collections
P = collections.namedtuple('P', 'a b')
k = gt.graphify(lambda p, n=None: P(p.a + 1, None))
print(k(P(torch.ones(1, device=D), None)))
print(k(P(torch.ones(1, device=D), None)))
print('--- autograd cuda')
import torch.nn.functional as F
def loss(p, x, y):
    h = torch.tanh(x @ p['w1'] + p['b1'])
    return F.mse_loss(h @ p['w2'], y)
p = {'w1': torch.randn(4, 8, device=D), 'b1': torch.zeros(8, device=D), 'w2': torch.randn(8, 1, device=D)}
pe = {k: v.clone() for k, v in p.items()}
step = gt.graphify(torch.func.grad_and_value(loss))
for i in range(20):
    x = torch.randn(16, 4, device=D); y = torch.randn(16, 1, device=D)
    g, l = step(p, x, y)
    ge, le = torch.func.grad_and_value(loss)(pe, x, y)
    with torch.no_grad():
        for k in p: p[k].sub_(0.1 * g[k]); pe[k].sub_(0.1 * ge[k])
print('train', max((p[k]-pe[k]).abs().max().item() for k in p), step.cache_info())
gg = gt.graphify(loss)
for i in range(3):
    x = torch.randn(16, 4, device=D); y = torch.randn(16, 1, device=D)
    print(torch.allclose(torch.func.grad(gg)(p, x, y)['w1'], torch.func.grad(loss)(p, x, y)['w1'], atol=1e-5), gg.cache_info())
pr = {k: v.clone().requires_grad_() for k, v in p.items()}
for i in range(3):
    l = gg(pr, x, y); l.backward()
print('backward accum', torch.allclose(pr['w1'].grad, 3 * torch.func.grad(loss)(p, x, y)['w1'], atol=1e-5))
try: gt.graphify(lambda x: x + torch.arange(3).cuda())(torch.ones(3, device=D))
except gt.GraphifyError as e: print(e)
try: gt.graphify(lambda x: x + torch.ones(3))(torch.ones(3, device=D))
except Exception as e: print(type(e).__name__, e)
try: gt.graphify(lambda x, y: x + y)(torch.ones(3, device=D), torch.ones(3))
except Exception as e: print(type(e).__name__, e)
# capture failure: sync inside?
def bad(x):
    torch.cuda.synchronize()
    return x + 1
try: print(gt.graphify(bad)(torch.ones(3, device=D)))
except Exception as e: print(type(e).__name__, str(e)[:300])
print('eager ok after', (torch.ones(3, device=D) * 2).sum().item())
# threads
import threading
ff = gt.graphify(lambda x: (x * 2).sin())
errs = []
def worker():
    for i in range(200):
        x = torch.randn(64, device=D)
        r = ff(x)
        if not torch.allclose(r, (x * 2).sin()): errs.append(i)
ts = [threading.Thread(target=worker) for _ in range(8)]
[t.start() for t in ts]; [t.join() for t in ts]
print('threads errors', len(errs), ff.cache_info())
