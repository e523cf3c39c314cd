"""``f.input_buffers(...)`` and ``donate_argnums`` / ``donate_argnames`` (issue #36 item 3).

Written as users write the loops: the next batch goes straight into the recording's
buffers, ``f(*bufs)`` is called, and every call is compared with eager. That no input is
copied is read from the recording's copy functions (counted), never from timings.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_close
from hypothesis import given
from hypothesis import strategies as st

import gtransform as gt
from gtransform._compat import DisableTorchFunctionSubclass

# ----------------------------------------------------------------------------- helpers


def _rec(f):
    """The recording of the function's current signature in this thread."""
    return f._tls.state.last.rec


class _Counted:
    """Counts the copy-in and copy-back of one recording (tensors copied by each)."""

    def __init__(self, rec):
        self.copied_in = self.copied_back = 0
        cin, cback = rec.copier, rec.cb_copier

        def copier(dsts, srcs):
            self.copied_in += len(dsts)
            return cin(dsts, srcs)

        def cb_copier(dsts, srcs):
            self.copied_back += len(dsts)
            return cback(dsts, srcs)

        rec.copier, rec.cb_copier = copier, cb_copier


def _generic_calls(f):
    """Count the calls the generated fast path did not serve."""
    box = [0]
    generic = f._call_generic

    def counting(*a):
        box[0] += 1
        return generic(*a)

    f._call_generic = counting
    return box


def _rand(*shape, device="cpu"):
    return torch.randn(*shape, device=device)


# ----------------------------------------------------------------------------- input_buffers


def test_loop_writes_batches_into_buffers_no_copy(device):
    def step(w, x, y):
        return ((x @ w).relu() - y).square().mean(), x.sum(0)

    f = gt.graphify(step)
    w = _rand(4, 3, device=device)
    bufs = f.input_buffers(w, _rand(8, 4, device=device), _rand(8, 3, device=device))
    assert isinstance(bufs, tuple) and len(bufs) == 3
    assert all(b is not None and b.device.type == device for b in bufs)
    rec = _rec(f)
    counted = _Counted(rec)
    generic = _generic_calls(f)
    for _ in range(6):
        x, y = _rand(8, 4, device=device), _rand(8, 3, device=device)
        bufs[1].copy_(x)
        bufs[2].copy_(y)
        bufs[0].copy_(w)
        assert_close(f(*bufs), step(w, x, y))
    assert counted.copied_in == 0  # no input copied, not even the first call's
    assert generic[0] == 1  # the first call installs the fast path, which serves the others
    st = f._tls.state
    assert st.fast_rec is rec and _rec(f) is rec
    assert f.cache_info().misses == 1


def test_fast_path_of_ordinary_recordings_unchanged():
    f = gt.graphify(lambda x: x + 1)
    for _ in range(3):
        f(torch.ones(3))
    src = _rec(f).fast.source
    assert "_hcopy_in" not in src and "_copy(BUFS" in src
    f.input_buffers(torch.ones(3))
    f(torch.ones(3))
    assert "_hcopy_in" in _rec(f).fast.source  # made again, with the buffers' identity checks


def test_mixing_buffer_calls_and_fresh_tensors(device):
    def fn(a, b):
        return a * 2 - b, (a * b).sum()

    f = gt.graphify(fn)
    bufs = f.input_buffers(torch.zeros(5, device=device), torch.zeros(5, device=device))
    counted = _Counted(_rec(f))
    expect_copies = 0
    for i in range(8):
        a, b = _rand(5, device=device), _rand(5, device=device)
        if i % 3 == 0:  # fresh tensors: copied into the buffers as usual
            out = f(a, b)
            expect_copies += 2
        elif i % 3 == 1:  # the buffers
            bufs[0].copy_(a)
            bufs[1].copy_(b)
            out = f(*bufs)
        else:  # one buffer, one fresh tensor
            bufs[0].copy_(a)
            out = f(bufs[0], b)
            expect_copies += 1
        assert_close(out, fn(a, b))
        assert counted.copied_in == expect_copies
    # a fresh call copies into the buffers: it overwrites what was written there
    a, b = _rand(5, device=device), _rand(5, device=device)
    f(a, b)
    assert torch.equal(bufs[0], a) and torch.equal(bufs[1], b)


def test_some_buffers_and_some_fresh_tensors_of_several_dtypes(device):
    # the copy per dtype was made for all the buffers: a call passing some of them crashed
    def fn(x, m, s):
        return (x * m.float()).sum() + s

    f = gt.graphify(fn)
    x0, m0, s0 = torch.zeros(4, 3, device=device), torch.zeros(4, 3, dtype=torch.bool, device=device), \
        torch.zeros((), dtype=torch.float64, device=device)
    bufs = f.input_buffers(x0, m0, s0)
    for i in range(6):
        x, m = _rand(4, 3, device=device), _rand(4, 3, device=device) > 0
        s = torch.tensor(float(i), dtype=torch.float64, device=device)
        bufs[0].copy_(x)
        args = [bufs[0], m, s] if i % 2 else [x, bufs[1].copy_(m), s]
        assert_close(f(*args), fn(x, m, s))


def test_buffers_passed_in_each_others_places(device):
    fn = lambda a, b: a - 2 * b  # noqa: E731
    f = gt.graphify(fn)
    bufs = f.input_buffers(torch.zeros(4, device=device), torch.zeros(4, device=device))
    a, b = _rand(4, device=device), _rand(4, device=device)
    bufs[0].copy_(a)
    bufs[1].copy_(b)
    assert_close(f(bufs[1], bufs[0]), fn(b, a))
    bufs[0].copy_(a)
    bufs[1].copy_(b)
    assert_close(f(bufs[1], bufs[1]), fn(b, b))
    assert_close(f(*bufs), fn(a, b))


def test_function_updates_its_input_in_place_while_it_is_the_buffer(device):
    def fn(s, x):
        s.mul_(0.5).add_(x)
        return s * 2

    f = gt.graphify(fn)
    s0 = _rand(6, device=device)
    bufs = f.input_buffers(s0.clone(), torch.zeros(6, device=device))
    assert torch.equal(bufs[0], s0)  # the example values are copied in; nothing ran
    counted = _Counted(_rec(f))
    eager_s = s0.clone()
    for _ in range(5):
        x = _rand(6, device=device)
        bufs[1].copy_(x)
        out = f(*bufs)  # the state lives in the buffer: updated in place, as eager updates eager_s
        expected = fn(eager_s, x)
        assert_close(out, expected)
        assert_close(bufs[0], eager_s)
    assert counted.copied_in == 0 and counted.copied_back == 0  # no copy onto itself
    # a fresh tensor in its place still gets the update, as in eager
    mine, x = _rand(6, device=device), _rand(6, device=device)
    ref = mine.clone()
    assert_close(f(mine, x), fn(ref, x))
    assert_close(mine, ref)
    assert counted.copied_back == 1


def test_output_that_is_a_view_of_the_input_buffer(device):
    def fn(x):
        return x[1:], x.t(), x.sum()

    f = gt.graphify(fn)
    (buf,) = f.input_buffers(torch.zeros(3, 4, device=device))
    for _ in range(3):
        x = _rand(3, 4, device=device)
        buf.copy_(x)
        out = f(buf)
        assert_close(out, fn(x))
        # views of the caller's tensor, which is the buffer (as eager returns views of its input)
        assert out[0].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert out[1].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        view = out[0]
        buf.add_(1)  # the caller's next write shows through the view, as in eager
        assert_close(view, x[1:] + 1)
        del out, view


def test_module_parameters_are_read_in_place_not_buffers(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    f = gt.graphify(model)
    with torch.no_grad():
        f(_rand(5, 4, device=device))  # a first call that reads state runs eagerly: it has no recording yet
        (buf,) = f.input_buffers(_rand(5, 4, device=device))
    counted = _Counted(_rec(f))
    for _ in range(4):
        x = _rand(5, 4, device=device)
        buf.copy_(x)
        with torch.no_grad():
            out = f(buf)
            assert_close(out, model(x))
        # an optimizer step between calls: the recording reads the parameters where they are
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert counted.copied_in == 0


def test_parameters_and_same_objects_are_the_callers_own(device):
    params = {"w": torch.nn.Parameter(_rand(3, 3, device=device)), "b": _rand(3, device=device)}

    def fn(p, x):
        return x @ p["w"] + p["b"]

    f = gt.graphify(fn)
    with torch.no_grad():
        f(params, _rand(2, 3, device=device))
        f(params, _rand(2, 3, device=device))  # b passed again as the same object: read in place
        bp, bx = f.input_buffers(params, _rand(2, 3, device=device))
    assert bp["w"] is params["w"] and bp["b"] is params["b"]
    assert bx is not None and bx.data_ptr() != params["b"].data_ptr()
    counted = _Counted(_rec(f))
    with torch.no_grad():
        for _ in range(3):
            x = _rand(2, 3, device=device)
            bx.copy_(x)
            params["b"].add_(1)
            assert_close(f(bp, bx), fn(params, x))
    assert counted.copied_in == 0


def test_buffers_asked_before_the_second_call_keep_later_recordings(device):
    w = _rand(3, device=device)  # a plain tensor passed as the same object: read in place from call 2

    def fn(w, x):
        return w * x

    f = gt.graphify(fn)
    bw, bx = f.input_buffers(w, _rand(3, device=device))
    for _ in range(4):
        x = _rand(3, device=device)
        bx.copy_(x)
        assert_close(f(w, bx), fn(w, x))
    # the signature re-recorded (w read in place), on the buffers handed out
    assert 1 not in _rec(f).static_idx and bx is _rec(f).full_bufs[_rec(f).copy_idx.index(1)]
    counted = _Counted(_rec(f))
    x = _rand(3, device=device)
    bx.copy_(x)
    assert_close(f(w, bx), fn(w, x))
    assert counted.copied_in == 0


def test_kwargs_and_static_arguments(device):
    def fn(x, k, *, y, scale=1.0):
        return (x + y) * scale * k

    f = gt.graphify(fn, static_argnums=1)
    got = f.input_buffers(torch.zeros(3, device=device), 2, y=torch.zeros(3, device=device), scale=0.5)
    args, kwargs = got
    assert args[1] == 2 and kwargs["scale"] == 0.5 and set(kwargs) == {"y", "scale"}
    counted = _Counted(_rec(f))
    for _ in range(3):
        x, y = _rand(3, device=device), _rand(3, device=device)
        args[0].copy_(x)
        kwargs["y"].copy_(y)
        assert_close(f(*args, **kwargs), fn(x, 2, y=y, scale=0.5))
    assert counted.copied_in == 0


def test_buffers_after_cache_clear_are_copied_as_usual():
    f = gt.graphify(lambda x: x * 3)
    (buf,) = f.input_buffers(torch.zeros(3))
    buf.copy_(torch.arange(3.0))
    f.cache_clear()
    assert torch.equal(f(buf), torch.arange(3.0) * 3)
    assert torch.equal(buf, torch.arange(3.0))


def test_input_buffers_refusals_and_disable():
    f = gt.graphify(lambda x: x * 2)
    with pytest.raises(ValueError, match="no_grad"):
        f.input_buffers(torch.ones(2, requires_grad=True))
    with torch.no_grad():
        (b,) = f.input_buffers(torch.ones(2, requires_grad=True))
    assert b.shape == (2,)
    state = {"t": torch.ones(2)}
    g = gt.graphify(lambda x: x + state["t"])
    with pytest.raises(gt.GraphifyError, match="call the function once"):
        g.input_buffers(torch.ones(2))
    g(torch.ones(2))
    (b,) = g.input_buffers(torch.ones(2))
    b.fill_(2)
    assert torch.equal(g(b), torch.full((2,), 3.0))
    x = torch.ones(2)
    with gt.disable():
        (c,) = f.input_buffers(x)
    assert c is not x and torch.equal(c, x)


@given(data=st.data(), n=st.integers(1, 6), steps=st.integers(1, 5))
def test_property_random_data_written_into_buffers(data, n, steps):
    def fn(a, b):
        a.add_(b)  # an in-place update of an input that is its buffer
        return (a * b).cumsum(0), a.amax(), b[::2]

    f = gt.graphify(fn)
    bufs = f.input_buffers(torch.zeros(n), torch.zeros(n))
    counted = _Counted(_rec(f))
    floats = st.floats(-1e3, 1e3, allow_nan=False, width=32)
    ref_a = bufs[0].clone()
    for _ in range(steps):
        b = torch.tensor(data.draw(st.lists(floats, min_size=n, max_size=n)))
        if data.draw(st.booleans()):
            a = torch.tensor(data.draw(st.lists(floats, min_size=n, max_size=n)))
            bufs[0].copy_(a)
            ref_a = a.clone()
        bufs[1].copy_(b)
        assert_close(f(*bufs), fn(ref_a, b.clone()))
        assert_close(bufs[0], ref_a)
    assert counted.copied_in == 0 and counted.copied_back == 0


# ----------------------------------------------------------------------------- donation


def test_donated_input_is_invalidated_and_gives_its_memory_back(device):
    def fn(x, y):
        return x * 2 + y

    f = gt.graphify(fn, donate_argnums=0)
    for _ in range(3):
        x, y = _rand(4, device=device), _rand(4, device=device)
        expected = fn(x, y)
        out = f(x, y)
        assert_close(out, expected)
        with DisableTorchFunctionSubclass():
            assert x.untyped_storage().nbytes() == 0  # its memory went back at the call
        with pytest.raises(gt.OverwrittenOutputError, match=r"(?s)donated.*Fix: do not use"):
            x + 1
        with pytest.raises(gt.OverwrittenOutputError, match="donated"):
            print(x)
        assert_close(y, y.clone())  # not donated: untouched and usable
        with pytest.raises(gt.OverwrittenOutputError, match="donated"):
            f(x, y)  # passing it again


def test_donation_skips_the_copy_back_of_an_in_place_update(device):
    def fn(s, x):
        s.mul_(2).add_(x)
        return s.sum()

    f = gt.graphify(fn, donate_argnames="s")
    x = _rand(3, device=device)
    f(_rand(3, device=device), x)
    f(_rand(3, device=device), x)  # x, the same object again: read in place from now on
    counted = _Counted(_rec(f))
    for _ in range(3):
        s = _rand(3, device=device)
        expected = fn(s.clone(), x)
        assert_close(f(s, x), expected)
        with pytest.raises(gt.OverwrittenOutputError):
            s.sum()
    assert counted.copied_back == 0 and counted.copied_in == 3  # s copied in, never back


def test_donated_tensor_exported_through_dlpack_keeps_its_memory(device):
    # torch.from_dlpack(x) (or a JAX / CuPy array over it) holds the tensor, not its storage:
    # the memory was given back under that alias, which then read freed memory
    f = gt.graphify(lambda x: x * 2, donate_argnums=0)
    for _ in range(2):
        f(_rand(100, 10, device=device))
    x = torch.full((100, 10), 3.0, device=device)
    alias = torch.from_dlpack(x)
    assert_close(f(x), torch.full((100, 10), 6.0, device=device))
    _junk = [torch.full((100, 10), -1.0, device=device) for _ in range(4)]
    assert_close(alias, torch.full((100, 10), 3.0, device=device))


def test_donated_tensor_with_views_kept_is_updated_not_freed(device):
    def fn(s):
        s.add_(1)
        return s * 3

    f = gt.graphify(fn, donate_argnums=0)
    base = _rand(2, 3, device=device)
    ref = base.clone()
    s = base[0]  # the caller keeps another view of the memory: it is not given back
    assert_close(f(s), fn(ref[0]))
    assert_close(base, ref)
    with pytest.raises(gt.OverwrittenOutputError):
        s.sum()


def test_donation_leaves_returned_parameters_and_buffers_valid(device):
    f = gt.graphify(lambda x, y: (x, y + 1), donate_argnums=(0, 1))
    x, y = _rand(3, device=device), _rand(3, device=device)
    out = f(x, y)
    assert out[0] is x and torch.equal(x, out[0])  # returned: it is the output
    with pytest.raises(gt.OverwrittenOutputError):
        y.sum()
    w = torch.nn.Parameter(_rand(3, device=device))
    g = gt.graphify(lambda w, x: w * x, donate_argnums=(0, 1))
    with torch.no_grad():
        g(w, _rand(3, device=device))
        assert_close(w * 1, w.detach().clone())  # a parameter is read in place: not donated
    h = gt.graphify(lambda a: a * 2, donate_argnums=0)
    (buf,) = h.input_buffers(torch.zeros(3, device=device))
    for _ in range(3):
        a = _rand(3, device=device)
        buf.copy_(a)
        assert_close(h(buf), a * 2)
        assert torch.equal(buf, a)  # the recording's buffer is not given up


def test_donation_of_a_same_object_input_keeps_copying():
    f = gt.graphify(lambda x, k: x + k, donate_argnums=0)
    k = torch.ones(3)
    for _ in range(4):
        x = torch.randn(3)
        expected = x + k
        assert_close(f(x, k), expected)
    assert 0 in _rec(f).copy_idx and 1 in _rec(f).static_idx


# ----------------------------------------------------------------------------- options


def test_donate_options_validated():
    def fn(x, y, *, z=None):
        return x

    with pytest.raises(TypeError, match=r"donate_argnums=\.\.\.\): expected an int"):
        gt.graphify(fn, donate_argnums="x")
    with pytest.raises(TypeError, match=r"donate_argnames=\.\.\.\): expected a string"):
        gt.graphify(fn, donate_argnames=[1])
    with pytest.raises(ValueError, match=r"donate_argnums=5 is out of range.*donate_argnames"):
        gt.graphify(fn, donate_argnums=5)
    with pytest.raises(ValueError, match=r"donate_argnames \['w'\] name no parameter"):
        gt.graphify(fn, donate_argnames="w")
    with pytest.raises(ValueError, match="both static and donated"):
        gt.graphify(fn, static_argnums=1, donate_argnums=1)
    with pytest.raises(ValueError, match="both static and donated"):
        gt.graphify(fn, static_argnames="y", donate_argnums=(1,))
    f = gt.graphify(fn, donate_argnums=-2, donate_argnames="z")
    assert f._options.donate_argnums == (0,) and set(f._options.donate_argnames) == {"x", "z"}
    g = copy.copy(f)
    assert g._options == f._options
    dec = gt.graphify(donate_argnums=0)(fn)
    assert dec._options.donate_argnums == (0,)


def test_donated_output_fed_back_loop(device):
    fn = lambda x: x * 0.5 + 1  # noqa: E731
    f = gt.graphify(fn, donate_argnums=0)
    x = _rand(4, device=device)
    ref = x.clone()
    for _ in range(6):
        x = f(x)  # the previous output, donated: pool memory is never given back
        ref = fn(ref)
        assert_close(x, ref)

    def upd(s):
        s.add_(1)
        return s * 2

    g = gt.graphify(upd, donate_argnums=0)
    y = g(torch.zeros(3, device=device))
    assert_close(g(y), torch.full((3,), 6.0, device=device))


def test_a_graphified_method_has_the_functions_methods():
    """`obj.step` (a graphified method, bound): trace, explain, describe, cache_info, cache_clear and
    input_buffers work as on the function, the bound object passed first and left out of the buffers."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        @gt.graphify
        def step(self, x, scale=1.0):
            return self.lin(x) * scale

    m = M()
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(2):  # (the first call reaches state: it runs eagerly)
            assert_close(m.step(x), m.lin(x))
        assert isinstance(m.step.trace(x), torch.fx.GraphModule)
        assert "replays" in m.step.explain(x)
        assert "signature" in m.step.describe()
        (buf,) = m.step.input_buffers(x)
        for _ in range(3):
            new = torch.randn(3, 4)
            buf.copy_(new)
            assert_close(m.step(buf), m.lin(new))
        m.step(x, scale=2.0)
        (bx,), kw = m.step.input_buffers(x, scale=2.0)
        assert kw == {"scale": 2.0} and bx.shape == (3, 4)
        m.step.cache_clear()
        assert m.step.cache_info().currsize == 0


def test_describe_says_which_buffers_were_handed_out_and_which_inputs_are_donated():
    f = gt.graphify(lambda x, y: x * 2 + y, donate_argnums=1)
    f.input_buffers(torch.randn(3), torch.randn(3))
    lines = [ln for ln in f.describe().splitlines() if ln.strip().startswith("in ")]
    assert len(lines) == 2 and all("handed out by input_buffers" in ln for ln in lines)
    assert "donated" not in lines[0] and "donated" in lines[1]


def test_asking_for_a_new_signatures_buffers_is_refused_until_a_call_ran_it(device):
    """Before: the first ask was refused but counted as the signature's eager first call, so the
    very same ask right after handed buffers out, though nothing had run."""
    lin = torch.nn.Linear(3, 2).to(device)

    def fn(x, *, scale=1.0, mask=None):
        return lin(x) * scale * (mask if mask is not None else 1)

    f = gt.graphify(fn)
    with torch.no_grad():
        f(torch.randn(4, 3, device=device))
        ask = (torch.randn(4, 3, device=device),)
        kw = {"scale": 2.0, "mask": torch.ones(4, 1, device=device)}
        for _ in range(2):
            with pytest.raises(gt.GraphifyError, match="call the function once with these arguments first"):
                f.input_buffers(*ask, **kw)
        f(*ask, **kw)  # (its first call: eager)
        args, kwargs = f.input_buffers(*ask, **kw)
        assert tuple(kwargs["mask"].shape) == (4, 1)
