"""fuse=True's small float32 products (gtransform/fuse/_gemm.py): the graph pass that swaps
mm/addmm and their epilogue for gtransform::gemm, and the op itself.

On the CPU the op is the same arithmetic in aten ops, so these tests check the graph
surgery (what is swapped, what is left, that the numbers stay eager's); under the
`cuda` marker the same tests run the Triton kernel, and fuse=True programs use it."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import gtransform as gt
from gtransform.fuse import _gemm

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _ieee():
    """Full float32 precision, the kernel's mode; restored after each test."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def mlp(p, x):
    for i in range(3):
        x = torch.addmm(p[f"b{i}"], x, p[f"w{i}"])
        if i < 2:
            x = torch.relu(x)
    return x


def mlp_loss(p, x):
    return mlp(p, x).pow(2).mean()


def mlp_args(device, batch=8, width=24):
    g = torch.Generator().manual_seed(0)
    p = {}
    for i in range(3):
        p[f"w{i}"] = (torch.randn(width, width, generator=g) / width**0.5).to(device)
        p[f"b{i}"] = torch.randn(width, generator=g).to(device)
    return p, torch.randn(batch, width, generator=g).to(device)


def traced(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_forward_layers_become_one_op_each():
    p, x = mlp_args("cpu")
    gm = traced(mlp, p, x)
    ref = gm(p, x)
    counts = _gemm.rewrite(gm, "cpu")
    assert counts == {"gemm": 3, "relu": 2, "mask": 0, "bias": 0}
    assert ops(gm) == [torch.ops.gtransform.gemm.default] * 3
    torch.testing.assert_close(gm(p, x), ref, rtol=0, atol=0)


def linear_mlp(p, x):
    for i in range(3):
        x = F.linear(x, p[f"w{i}"], p[f"b{i}"])  # x @ w.t(): a K-contiguous right operand
        if i < 2:
            x = torch.relu(x)
    return x


@pytest.mark.parametrize("fn, want", [
    # x @ w: forward products (2 with ReLU) and weight gradients swapped; the input gradients
    # g @ w.t() have a K-contiguous w.t() (where cuBLAS is faster): left to it
    (mlp, {"gemm": 6, "relu": 2, "mask": 0, "bias": 0}),
    # F.linear: the forward is x @ w.t() (left to cuBLAS); its input gradients g @ w take
    # the ReLU mask in, and the weight gradients are swapped
    (linear_mlp, {"gemm": 5, "relu": 0, "mask": 2, "bias": 0}),
], ids=["x_at_w", "linear"])
def test_backward_takes_the_relu_mask_into_the_product(fn, want):
    p, x = mlp_args("cpu")
    gm = traced(torch.func.grad(lambda p, x: fn(p, x).pow(2).mean()), p, x)
    ref = gm(p, x)
    counts = _gemm.rewrite(gm, "cpu")
    assert counts == want
    if counts["mask"]:
        assert torch.ops.aten.threshold_backward.default not in ops(gm)
    assert_close(gm(p, x), ref)


def test_matmul_plus_bias_vector_is_one_op():
    def f(x, w, b, c):
        return torch.relu(x @ w + b), x @ w + c  # c is a full matrix: not a bias vector

    args = (torch.randn(8, 16), torch.randn(16, 4), torch.randn(4), torch.randn(8, 4))
    gm = traced(f, *args)
    ref = gm(*args)
    counts = _gemm.rewrite(gm, "cpu")
    assert counts == {"gemm": 2, "relu": 1, "mask": 0, "bias": 1}
    assert ops(gm).count(torch.ops.aten.add.Tensor) == 1
    assert_close(gm(*args), ref)


@pytest.mark.parametrize(
    "case",
    ["scaled_addmm", "float64", "batched", "tf32", "switched_off", "too_large", "relu_of_shared_product"],
)
def test_what_is_left_alone(case, monkeypatch):
    x, w, b = torch.randn(8, 16), torch.randn(16, 4), torch.randn(4)
    fn, args, want = (lambda x, w, b: torch.addmm(b, x, w)), (x, w, b), 1
    if case == "scaled_addmm":
        fn, want = (lambda x, w, b: torch.addmm(b, x, w, beta=0.5)), 0
    elif case == "float64":
        args, want = (x.double(), w.double(), b.double()), 0
    elif case == "batched":
        fn, args, want = (lambda x, w, b: torch.bmm(x, w) + b), (x[None], w[None], b), 0
    elif case == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True  # the autouse fixture puts it back
        want = 0
    elif case == "switched_off":
        monkeypatch.setenv("GTRANSFORM_GEMM", "0")
        want = 0
    elif case == "too_large":
        monkeypatch.setattr(_gemm, "MAX_FLOPS", 8 * 16 * 4 - 1)
        want = 0
    elif case == "relu_of_shared_product":  # the product is used twice: swapped, its ReLU is not taken in
        fn = lambda x, w, b: (lambda y: (torch.relu(y), y.sum()))(torch.addmm(b, x, w))  # noqa: E731
    gm = traced(fn, *args)
    ref = gm(*args)
    counts = _gemm.rewrite(gm, "cpu")
    assert counts["gemm"] == want
    if case == "relu_of_shared_product":
        assert counts["relu"] == 0 and torch.ops.aten.relu.default in ops(gm)
    assert_close(gm(*args), ref)


def test_operands_reaching_past_int32_offsets_are_left_alone():
    """The kernel indexes in int32: a small view whose rows lie 2**31 elements apart stays aten's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        far = torch.empty_strided((2, 16), (2**31, 1))
        near = torch.empty(16, 8)
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    a.meta["val"], b.meta["val"] = far, near
    mm = graph.call_function(torch.ops.aten.mm.default, (a, b))
    mm.meta["val"] = near.new_empty((2, 8))
    graph.output(mm)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert _gemm.rewrite(gm, "cpu")["gemm"] == 0
    a.meta["val"] = near.new_empty((2, 16))
    assert _gemm.rewrite(gm, "cpu")["gemm"] == 1


def test_the_op_has_eager_gradients():
    """gtransform::gemm has an autograd formula (a graph holding it stays differentiable)."""
    a = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(5, 3, dtype=torch.float64)
    for act in (_gemm.ACT_NONE, _gemm.ACT_RELU):
        torch.autograd.gradcheck(lambda a, b, bias, act=act: _gemm.gemm(a, b, bias, mask, act, 0.0), (a, b, bias))


# --- the op against eager, any shape and layout (the Triton kernel under `cuda`) ----------


@st.composite
def products(draw):
    m, n, k = (draw(st.integers(1, 70)) for _ in range(3))
    return dict(
        m=m, n=n, k=k,
        a_t=draw(st.booleans()), b_t=draw(st.booleans()),
        bias=draw(st.sampled_from([None, "row", "row2d", "col", "full"])),
        act=draw(st.sampled_from([_gemm.ACT_NONE, _gemm.ACT_RELU])),
        mask=draw(st.booleans()),
    )


def _operands(c, device):
    g = torch.Generator().manual_seed(c["m"] * 10007 + c["n"] * 101 + c["k"])
    m, n, k = c["m"], c["n"], c["k"]
    a = torch.randn(k, m, generator=g).t() if c["a_t"] else torch.randn(m, k, generator=g)
    b = torch.randn(n, k, generator=g).t() if c["b_t"] else torch.randn(k, n, generator=g)
    bias = {None: None, "row": lambda: torch.randn(n, generator=g), "row2d": lambda: torch.randn(1, n, generator=g),
            "col": lambda: torch.randn(m, 1, generator=g), "full": lambda: torch.randn(m, n, generator=g)}[c["bias"]]
    bias = bias() if bias is not None else None
    mask = torch.randn(m, n, generator=g) if c["mask"] else None
    mv = lambda t: None if t is None else t.to(device)  # noqa: E731
    return mv(a), mv(b), mv(bias), mv(mask)


@settings(max_examples=25)
@given(c=products())
def test_op_matches_eager(device, c):
    a, b, bias, mask = _operands(c, device)
    got = _gemm.gemm(a, b, bias, mask, c["act"], 0.0)
    want = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
    if c["act"] == _gemm.ACT_RELU:
        want = want.relu()
    if mask is not None:
        want = torch.ops.aten.threshold_backward(want, mask, 0.0)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * (c["k"] ** 0.5))


@pytest.mark.cuda
@cuda
def test_the_kernel_is_launched_by_our_launcher_and_triton_s_still_works(monkeypatch):
    """gtransform.fuse._cubin launches the binary (no C launcher built by Triton); where it
    cannot (here: forced), Triton's own launch gives the same numbers."""
    from gtransform.fuse import _cubin

    calls = [0]
    real_call = _cubin.Launcher.__call__

    def counting(self, *args):
        calls[0] += 1
        return real_call(self, *args)

    monkeypatch.setattr(_cubin.Launcher, "__call__", counting)
    c = dict(m=33, n=40, k=70, a_t=False, b_t=False, bias="row", act=_gemm.ACT_RELU, mask=True)
    a, b, bias, mask = _operands(c, "cuda")
    want = torch.ops.aten.threshold_backward(torch.addmm(bias, a, b).relu(), mask, 0.0)
    torch.testing.assert_close(_gemm.gemm(a, b, bias, mask, c["act"], 0.0), want, rtol=1e-5, atol=1e-4)
    assert calls[0] == 1
    # an operand at an odd offset: another Triton variant (pointer alignment), our launch again
    a_odd = torch.empty(a.numel() + 1, device="cuda")[1:].view_as(a).copy_(a)
    torch.testing.assert_close(_gemm.gemm(a_odd, b, bias, mask, c["act"], 0.0), want, rtol=1e-5, atol=1e-4)
    assert calls[0] == 2
    monkeypatch.setattr(_cubin, "launcher", lambda compiled, device: None)
    torch.testing.assert_close(_gemm.gemm(a, b, bias, mask, c["act"], 0.0), want, rtol=1e-5, atol=1e-4)
    assert calls[0] == 2


# --- which arguments a kernel binary takes (gtransform.fuse._cubin.plan), without a GPU --------


class _FakeFn:
    arg_names = ["a_ptr", "n", "one", "x", "BLOCK"]


class _FakeMeta:
    def __init__(self, **kw):
        self.name, self.num_warps, self.num_ctas, self.shared = "k", 4, 1, 0
        self.__dict__.update(kw)


class _FakeSrc:
    fn = _FakeFn()

    def __init__(self, signature, constants):
        self.signature, self.constants = signature, constants


class _FakeCompiled:
    def __init__(self, signature, constants=None, **meta):
        self.src = _FakeSrc(signature, constants or {})
        self.metadata = _FakeMeta(**meta)


_SIG = {"a_ptr": "*fp32", "n": "i32", "one": "constexpr", "x": "fp32", "BLOCK": "constexpr"}


def test_cubin_plan_keeps_the_runtime_arguments_in_order_and_adds_the_scratch_pointers():
    from gtransform.fuse import _cubin

    steps, scratch = _cubin.plan(_FakeCompiled(_SIG, {(2,): 1, (4,): 64}, global_scratch_size=0,
                                               profile_scratch_size=0))
    assert [i for i, _ in steps] == [0, 1, 3] and scratch == 2
    t = torch.zeros(3)
    values = [conv(arg) for (i, conv), arg in zip(steps, (t, 7, 0.5))]
    assert values[0].value == t.data_ptr() and values[1].value == 7 and values[2].value == 0.5
    # an older Triton: constants named by index, the specialized `one` typed, no scratch fields
    old = {0: "*fp32", 1: "i32", 2: "i32", 3: "fp32", 4: "i32"}
    steps, scratch = _cubin.plan(_FakeCompiled(old, {2: 1, 4: 64}))
    assert [i for i, _ in steps] == [0, 1, 3] and scratch == 0


@pytest.mark.parametrize("bad", [dict(num_ctas=2), dict(launch_pdl=True), dict(global_scratch_size=128),
                                 dict(tensordesc_meta=[{}]), dict(sig={**_SIG, "x": "nvTmaDesc"}),
                                 dict(sig={**_SIG, "n": "i1"})])
def test_cubin_plan_refuses_what_it_does_not_know(bad):
    """None: the caller launches through Triton, as before."""
    from gtransform.fuse import _cubin

    sig = bad.pop("sig", _SIG)
    assert _cubin.plan(_FakeCompiled(sig, {(2,): 1, (4,): 64}, **bad)) is None


# --- fuse=True programs on the GPU -----------------------------------------------------


@pytest.fixture
def launches(monkeypatch):
    """How often the Triton kernel was launched (warm-up and capture; replays launch none)."""
    count = [0]
    real = _gemm._launch

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(_gemm, "_launch", counting)
    return count


@pytest.mark.cuda
@cuda
def test_fused_mlp_and_its_gradient_match_eager(launches):
    p, x = mlp_args("cuda", batch=64, width=512)
    f = gt.graphify(mlp, fuse=True)
    g = gt.graphify(torch.func.grad(mlp_loss), fuse=True)
    for i in range(3):
        x = torch.randn(64, 512, device="cuda") + i
        assert_close(f(p, x), mlp(p, x))
        assert_close(g(p, x), torch.func.grad(mlp_loss)(p, x))
    assert launches[0] > 0
    assert f.cache_info().misses == 1 and g.cache_info().misses == 1


@pytest.mark.cuda
@cuda
def test_fused_module_training_step_matches_eager(launches):
    """A closed-over nn.Module with an optimizer: the products in forward and backward."""
    torch.manual_seed(0)

    def make():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10)).cuda()
        return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    (m, opt), (m_ref, opt_ref) = make(), make()

    def step(model, opt, x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    f = gt.graphify(lambda x, y: step(m, opt, x, y), fuse=True)
    for _ in range(5):
        x, y = torch.randn(16, 32, device="cuda"), torch.randint(0, 10, (16,), device="cuda")
        assert_close(f(x, y), step(m_ref, opt_ref, x, y))
    for a, b in zip(m.parameters(), m_ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert launches[0] > 0


_TWO_PROCESSES = r'''
import os, sys, torch
sys.path.insert(0, os.environ["GT_TEST_TESTS"])
import gtransform as gt
from test_gemm import mlp, mlp_args
torch.backends.cuda.matmul.allow_tf32 = False
if sys.argv[1] == "first":
    # what inductor does when it compiles a kernel in this process (here: before ours),
    # not when all its kernels come from the cache: point Triton at torch's ptxas
    from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    _set_triton_ptxas_path()
p, x = mlp_args("cuda", batch=64, width=512)
f = gt.graphify(torch.func.grad(lambda p, x: mlp(p, x).pow(2).mean()), fuse=True)
f(p, x)
torch.cuda.synchronize()
'''


@pytest.mark.cuda
@cuda
def test_a_second_process_with_the_same_caches_compiles_no_kernel_again(tmp_path):
    """The kernel's Triton cache entries are found again by a process whose inductor
    kernels all come from the cache. Triton keys them on the ptxas version, and inductor
    points Triton at torch's ptxas only when it compiles in the process: the second
    process keyed them to Triton's own ptxas, missed, and built them again (0.6-1.4 s
    each on an H100)."""
    import os
    import subprocess
    import sys

    cache = tmp_path / "cache"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton"),
           "GT_TEST_TESTS": os.path.dirname(__file__)}
    env.pop("TRITON_PTXAS_PATH", None)
    script = tmp_path / "run.py"
    script.write_text(_TWO_PROCESSES)

    def run(which):
        r = subprocess.run([sys.executable, str(script), which], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return {d.name for d in (cache / "triton").iterdir()}

    first = run("first")
    second = run("second")
    new = sorted(f.name for d in second - first for f in (cache / "triton" / d).iterdir())
    assert second == first, f"the second process built Triton kernel(s) again: {new}"
