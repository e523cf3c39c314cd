"""gtransform against eager on PyTorch's own operator database (OpInfo's ``op_db``).

For every op with float32 samples, each sample is graphified with its tensors as
inputs and its Python values static (closed over), called several times, and
compared with eager on identical copies:

* ``forward``: the same tensors twice (the second call reads them in place), then
  tensors of the same layout with fresh values, then new copies of the originals;
  every output and every input the op writes is compared;
* ``noncontig``: the same on OpInfo's non-contiguous version of each sample;
* ``out``: the ``out=`` variant, with the out tensors as inputs of the recording;
* ``inplace``: the in-place variant (``x.add_(y)``);
* ``grad``: ``torch.autograd.grad`` through the graphified op against eager's, for ops
  that support autograd (a fixed cotangent; the outputs OpInfo marks differentiable).

Random ops are compared under the same seed. Each sample lands in one class:
``match`` (eager's numbers, or the same exception type eager raises), ``refused`` (a
GraphifyError whose message gives the fix) or a failure: ``mismatch``, ``meta``
(shape, dtype or strides differ), ``alias`` (an output that is an input, or a view of
one, in eager but not here), ``crash`` (another exception), ``silent`` (eager raises,
graphify returns), ``segfault`` or ``timeout`` (the worker died or hung on it).

Run it (CPU, the whole database, every leg, all samples; about half an hour on two cores):

    python tests/opinfo_sweep.py --device cpu --legs all --samples 0 --jobs 2

On a GPU: ``--device cuda``. ``--report FILE`` writes the counts as markdown;
``--json FILE`` every sample's class. Workers run in subprocesses: a segfault, a hang
or a lost CUDA context is a failure of that sample and the sweep goes on after it.
``tests/test_opinfo.py`` runs a deterministic part in CI.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

# the gtransform of the checkout this file is in (run as `python tests/opinfo_sweep.py`, Python
# puts tests/ first on the path, and `import gtransform` found whatever copy the environment
# installs, an editable install of another checkout); the workers run this file too
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LEGS = ("forward", "noncontig", "out", "inplace", "grad")
FAILURES = ("mismatch", "meta", "alias", "crash", "silent", "segfault", "timeout")
# ops whose outputs are uninitialised memory (compared by shape and dtype only)
UNINITIALISED = frozenset({
    "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted",
    "resize_", "resize_as_", "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
})
# attention kernels return their random state (philox seed and offset) as CPU scalars eagerly
# and, inside a CUDA graph, as device scalars (the graph-safe form): compared by shape and dtype
RNG_STATE_OPS = frozenset({"torch.ops.aten._efficient_attention_forward", "torch.ops.aten._flash_attention_forward"})
SAMPLE_SECONDS = 120


# -- building calls ---------------------------------------------------------------------------
class _Slot:
    """Where the k-th tensor of a sample goes."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k


def _split(obj: Any, tensors: List[Any]) -> Any:
    """The structure of ``obj`` with its tensors replaced by slots (appended to ``tensors``)."""
    import torch

    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_split(x, tensors) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(x, tensors) for x in obj)
    if isinstance(obj, dict):
        return {k: _split(v, tensors) for k, v in obj.items()}
    return obj


def _fill(obj: Any, ts: Sequence[Any]) -> Any:
    if isinstance(obj, _Slot):
        return ts[obj.k]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_fill(x, ts) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(x, ts) for x in obj)
    if isinstance(obj, dict):
        return {k: _fill(v, ts) for k, v in obj.items()}
    return obj


def _same_layout(t: Any, scale: Optional[float] = None, seed: int = 0) -> Any:
    """A new tensor over a copy of ``t``'s whole storage, at its offset and strides.

    ``scale``: multiply floating values by factors in [1 - scale, 1 + scale] (fresh values
    of the same layout; integer and bool tensors, indices and masks, keep theirs).
    """
    import torch

    with torch.no_grad():
        storage = t.untyped_storage().clone()
        out = torch.empty(0, dtype=t.dtype, device=t.device)
        out.set_(storage, t.storage_offset(), t.shape, t.stride())
        if scale and (t.is_floating_point() or t.is_complex()) and storage.nbytes():
            flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage)
            gen = torch.Generator(device="cpu").manual_seed(seed)
            factor = 1 + scale * (2 * torch.rand(flat.shape, generator=gen, dtype=torch.float64) - 1)
            flat.mul_(factor.to(device=t.device, dtype=flat.real.dtype if t.is_complex() else t.dtype))
    if t.requires_grad:
        out.requires_grad_(True)
    return out


def _copies(ts: Sequence[Any], scale: Optional[float] = None, seed: int = 0) -> List[Any]:
    return [_same_layout(t, scale, seed + i) for i, t in enumerate(ts)]


# -- comparing --------------------------------------------------------------------------------
class _Nondeterministic(Exception):
    """Eager ran a kernel that torch's deterministic mode warns of (GPU scatters: max_unpool)."""


def _watching(case: Any, run: Any) -> Any:
    """``run()``, raising _Nondeterministic where torch warns of a kernel without a deterministic version (GPU)."""
    if case.device == "cpu":
        return run()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = run()
    said = next((str(w.message) for w in seen if "does not have a deterministic implementation" in str(w.message)), "")
    if said:
        raise _Nondeterministic(said.splitlines()[0][:200])
    return out


class Differ(Exception):
    """A difference from eager: ``kind`` is a failure class."""

    def __init__(self, kind: str, what: str):
        super().__init__(what)
        self.kind = kind


def _leaves(x: Any) -> Tuple[List[Any], Any]:
    import torch.utils._pytree as pytree

    return pytree.tree_flatten(x)


def _tol(dtype: Any) -> Dict[str, float]:
    import torch

    return {torch.float16: dict(rtol=1e-3, atol=1e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
            torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.complex64: dict(rtol=1.3e-6, atol=1e-5),
            torch.float64: dict(rtol=1e-7, atol=1e-7), torch.complex128: dict(rtol=1e-7, atol=1e-7)}.get(
                dtype, dict(rtol=0, atol=0))


def compare(got: Any, want: Any, what: str, values: bool = True, strides: bool = True, rng_state: bool = False) -> None:
    """Raise :class:`Differ` where ``got`` is not eager's ``want``.

    ``rng_state``: 0-dim int64 outputs are random-number state (see RNG_STATE_OPS).
    """
    import torch

    lg, sg = _leaves(got)
    lw, sw = _leaves(want)
    if sg != sw:
        raise Differ("meta", f"{what}: structure {sg} vs eager's {sw}")
    for i, (a, b) in enumerate(zip(lg, lw)):
        where = f"{what}[{i}]"
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise Differ("meta", f"{where}: {type(a).__name__} vs eager's tensor")
            if rng_state and b.dim() == 0 and b.dtype == torch.int64 and a.dim() == 0 and a.dtype == torch.int64:
                continue
            if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
                raise Differ("meta", f"{where}: {tuple(a.shape)} {a.dtype} {a.device} vs eager's "
                                     f"{tuple(b.shape)} {b.dtype} {b.device}")
            if strides and b.numel() > 1 and a.layout == torch.strided and b.layout == torch.strided:
                sa = [s for s, n in zip(a.stride(), a.shape) if n > 1]
                sb = [s for s, n in zip(b.stride(), b.shape) if n > 1]
                if sa != sb:
                    raise Differ("meta", f"{where}: strides {a.stride()} vs eager's {b.stride()}")
            if a.requires_grad != b.requires_grad:
                raise Differ("meta", f"{where}: requires_grad {a.requires_grad} vs eager's {b.requires_grad}")
            if values:
                try:
                    torch.testing.assert_close(a.detach(), b.detach(), equal_nan=True, check_stride=False,
                                               **_tol(b.dtype))
                except AssertionError as e:
                    raise Differ("mismatch", f"{where}: {str(e).strip().splitlines()[0:4]}") from None
        elif isinstance(b, float) and isinstance(a, float) and b != b and a != a:
            continue
        elif a != b or type(a) is not type(b):
            raise Differ("mismatch", f"{where}: {a!r} vs eager's {b!r}")


def _aliases(out: Any, ins: Sequence[Any]) -> List[Tuple[int, Optional[int], bool]]:
    """Per tensor output: the input whose storage it shares (or None), and whether it is that input."""
    import torch

    res = []
    for o in _leaves(out)[0]:
        if not isinstance(o, torch.Tensor):
            continue
        src, same = None, False
        for k, t in enumerate(ins):
            if o is t:
                src, same = k, True
                break
            if o.layout == torch.strided and t.layout == torch.strided and o.numel() and t.numel() and \
                    o.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                src = k
        res.append((len(res), src, same))
    return res


# -- one sample -------------------------------------------------------------------------------
def _is_refusal(e: BaseException) -> bool:
    import gtransform as gt

    return isinstance(e, gt.GraphifyError) and "Fix" in str(e)


class Case:
    """One sample of one op in one leg: how to call it eagerly and through graphify."""

    def __init__(self, op: Any, sample: Any, leg: str, device: str):

        self.op, self.leg, self.device = op, leg, device
        self.tensors: List[Any] = []
        self.template = _split((sample.input, sample.args, sample.kwargs), self.tensors)
        self.post = sample.output_process_fn_grad if leg == "grad" else None
        self.fn = op.op if leg != "inplace" else op.inplace_variant
        # inputs compared after each call: all of them (in-place variants, running statistics,
        # out= tensors are written)
        self.written: List[int] = list(range(len(self.tensors)))
        self.n_out = 0
        self.uninit = op.name in UNINITIALISED
        self.rng_state = op.name in RNG_STATE_OPS

    def call(self, ts: Sequence[Any]) -> Any:
        inp, args, kwargs = _fill(self.template, ts[: len(self.tensors)])
        if self.leg == "out" and self.n_out:
            outs = list(ts[len(self.tensors):])
            kwargs = dict(kwargs, out=outs[0] if self.n_out == 1 else tuple(outs))
        return self.fn(inp, *args, **kwargs)

    def prepare_out(self, want: Any) -> bool:
        """Out tensors shaped as eager's outputs; False if the op has none to take."""
        import torch

        outs = [o for o in _leaves(want)[0]]
        if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
            return False
        self.n_out = len(outs)
        self.out_like = outs
        base = len(self.tensors)
        self.written += list(range(base, base + len(outs)))
        return True

    def fresh_outs(self) -> List[Any]:
        import torch

        res = []
        for o in self.out_like:
            t = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device)
            if t.is_floating_point() or t.is_complex():
                t.fill_(float("nan"))
            else:
                t.fill_(7)
            res.append(t)
        return res


def _differentiable(out: Any) -> List[Any]:
    import torch

    return [o for o in _leaves(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad
            and (o.is_floating_point() or o.is_complex())]


def _grads(case: Case, ts: Sequence[Any], out: Any, seed: int) -> Any:
    import torch

    if case.post is not None:
        out = case.post(out)
    outs = _differentiable(out)
    wrt = [t for t in ts if t.requires_grad]
    if not outs or not wrt:
        return None
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cots = [torch.randn(o.shape, generator=gen, dtype=o.real.dtype if o.is_complex() else o.dtype)
            .to(o.device, o.dtype) for o in outs]
    return torch.autograd.grad(outs, wrt, cots, allow_unused=True)


def _deterministic(case: Case, again: Sequence[Any], want: Any, want_grads: Any, seed: int) -> bool:
    """Whether eager gives the same numbers again on ``again``, copies of the inputs (GPU scatters may not)."""
    import torch

    if case.uninit:
        return True
    torch.manual_seed(seed)
    try:
        out = case.call(again)
        compare(out, want, "eager again", strides=False, rng_state=True)
        if case.leg == "grad":
            compare(_grads(case, again, out, seed), want_grads, "eager again", strides=False)
    except Differ:
        return False
    except Exception:
        return True  # (raised on the second run: the comparison with graphify tells)
    return True


def run_case(case: Case) -> Tuple[str, str]:
    """Call the case eagerly and graphified several times; its class and a note."""
    import torch

    import gtransform as gt

    def eager(ts: Sequence[Any], seed: int) -> Any:
        torch.manual_seed(seed)
        return _watching(case, lambda: case.call(ts))

    g = gt.graphify(lambda *ts: case.call(ts))

    def graphed(ts: Sequence[Any], seed: int) -> Any:
        torch.manual_seed(seed)
        return g(*ts)

    base = case.tensors
    # the first eager run decides whether the sample is valid
    try:
        want0 = eager(_copies(base), 0)
    except _Nondeterministic as e:
        return "skip", f"a kernel torch says is nondeterministic: {e}"
    except Exception as e:
        return "skip", f"eager raises on the sample: {type(e).__name__}"
    if case.leg == "out":
        if not case.prepare_out(want0):
            return "skip", "no tensor outputs"
        # eager's own out= variant must agree with its functional result: where it does not
        # (fft.ihfftn with s= reads its out tensor instead of writing it), it is torch's bug
        try:
            te = _copies(base) + case.fresh_outs()
            eager(te, 0)
            compare(te[len(base):], _leaves(want0)[0], "eager's out=", strides=False)
        except Differ as d:
            return "skip", f"eager's out= variant differs from its functional result (a torch bug): {str(d)[:200]}"
        except Exception as e:
            return "skip", f"eager's out= variant raises: {type(e).__name__}"
    if case.leg == "grad" and not _differentiable(case.post(want0) if case.post else want0):
        return "skip", "no differentiable output"
    same_g, same_e = _copies(base), _copies(base)
    calls = [("the first call", same_g, same_e, 1),
             ("the same tensors again", same_g, same_e, 2),
             ("fresh values of the same layout", _copies(base, 0.1, 11), _copies(base, 0.1, 11), 3),
             ("new tensors", _copies(base), _copies(base), 4)]
    note = ""
    compared = 0
    for what, tg, te, seed in calls:
        if case.leg == "out":
            tg, te = list(tg[: len(base)]) + case.fresh_outs(), list(te[: len(base)]) + case.fresh_outs()
        again = [_same_layout(t) for t in te] if case.device != "cpu" else []  # (before in-place ops write te)
        try:
            want = eager(te, seed)
            want_grads = _watching(case, functools.partial(_grads, case, te, want, seed)) if case.leg == "grad" else None
        except _Nondeterministic as e:
            return "skip", f"{what}: a kernel torch says is nondeterministic: {e}"
        except Exception as e:
            err: Optional[BaseException] = e
        else:
            err = None
            if again and not _deterministic(case, again, want, want_grads, seed):
                return "skip", f"{what}: eager itself gives other numbers on a second run (a nondeterministic kernel)"
        try:
            got = graphed(tg, seed)
            got_grads = _grads(case, tg, got, seed) if case.leg == "grad" else None
        except Exception as e:
            if _is_refusal(e):
                lines = str(e).splitlines()
                op = next((ln.strip() for ln in lines[1:3] if ln.strip().startswith("operation ")), "")
                return "refused", lines[0][:300] + (f" [{op[:160]}]" if op else "")
            if err is not None and type(e) is type(err):
                note = f"{what}: raises {type(e).__name__} as eager does"
                continue
            if "CUDA error" in str(e) or "CUDA graph capture failed" in str(e) and "Fix" not in str(e):
                raise
            return "crash", f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}" + (
                f" (eager raises {type(err).__name__})" if err is not None else "")
        if err is not None:
            return "silent", f"{what}: eager raises {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        try:
            compare(got, want, f"{what}: output", values=not case.uninit, rng_state=case.rng_state)
            ins_g, ins_e = list(tg), list(te)
            for k in case.written:
                compare(ins_g[k], ins_e[k], f"{what}: input {k} after the call", values=not case.uninit,
                        strides=False)
            ag, ae = _aliases(got, ins_g), _aliases(want, ins_e)
            if ag != ae:
                raise Differ("alias", f"{what}: outputs aliasing inputs (index, input, is it) {ag} vs eager's {ae}")
            if case.leg == "grad":
                compare(got_grads, want_grads, f"{what}: gradient", strides=False)
        except Differ as d:
            return d.kind, str(d)[:400]
        del got, want
        compared += 1
    info = g.cache_info()
    if not compared:
        return "match", note  # every call raised as eager's did
    if info.hits < 1:
        return "mismatch", f"never replayed: {info}"
    return "match", note


# -- the sweep --------------------------------------------------------------------------------
def _unseeded(op: Any, *args: Any, **kwargs: Any) -> Any:
    return op(*args, **kwargs)


def _ops(device: str) -> List[Any]:
    import torch
    from torch.testing._internal.common_methods_invocations import op_db

    # OpInfo wraps random ops in wrapper_set_seed (torch.manual_seed(42) around each call);
    # the sweep seeds before each call instead, the same seed for eager and graphify
    for name, mod in list(sys.modules.items()):
        if name.startswith("torch.testing._internal") and getattr(mod, "wrapper_set_seed", None) is not None:
            mod.wrapper_set_seed = _unseeded  # type: ignore[attr-defined]
    return [op for op in op_db if torch.float32 in op.supported_dtypes(device)]


def _samples(op: Any, leg: str, device: str, limit: int) -> Iterator[Any]:
    import torch

    if leg == "out" and not op.supports_out:
        return
    if leg == "inplace" and op.inplace_variant is None:
        return
    if leg == "grad" and not op.supports_autograd:
        return
    rg = leg == "grad"
    try:
        it = op.sample_inputs(device, torch.float32, requires_grad=rg)
    except Exception:
        return
    n = 0
    for s in it:
        if leg == "inplace" and getattr(s, "broadcasts_input", False):
            continue  # the in-place variant cannot write a broadcast result into its input
        if leg == "noncontig":
            s = s.noncontiguous()
        yield s
        n += 1
        if limit and n >= limit:
            return


def _op_id(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def worker(args: argparse.Namespace) -> None:
    """Run the sweep's share of ops in this process, one JSON line per case (flushed)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (cuBLAS's deterministic mode)
    import signal
    import warnings

    import torch

    warnings.simplefilter("ignore")
    import logging

    logging.getLogger("gtransform").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    # float32 as float32: TF32 matrix products and convolutions differ from run to run of layout
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.device != "cpu":
        # kernels without a deterministic implementation warn (and their samples are left out:
        # which of two writes to one place wins differs from run to run); the others run their
        # deterministic variants, in eager and in graphify alike
        torch.use_deterministic_algorithms(True, warn_only=True)
    legs = LEGS if args.legs == "all" else tuple(args.legs.split(","))
    ops = _ops(args.device)
    only = set(args.ops.split(",")) if args.ops else None
    skip_to = args.resume

    def alarm(*_: Any) -> None:
        raise TimeoutError("sample timed out")

    signal.signal(signal.SIGALRM, alarm)
    out = open(args.worker_out, "a", buffering=1)
    for idx, op in enumerate(ops):
        if idx % args.nshards != args.shard:
            continue
        name = _op_id(op)
        if only is not None and name not in only and op.name not in only:
            continue
        for leg in legs:
            try:
                samples = list(_samples(op, leg, args.device, args.samples))
            except Exception as e:
                samples = []
                out.write(json.dumps({"op": name, "leg": leg, "i": -1, "cls": "skip",
                                      "note": f"samples: {type(e).__name__}"}) + "\n")
            for i, s in enumerate(samples):
                key = f"{name}|{leg}|{i}"
                if skip_to:
                    if key == skip_to:
                        skip_to = None
                    continue
                out.write(json.dumps({"start": key}) + "\n")
                t0 = time.perf_counter()
                signal.alarm(SAMPLE_SECONDS)
                try:
                    cls, note = run_case(Case(op, s, leg, args.device))
                except TimeoutError:
                    cls, note = "timeout", f"over {SAMPLE_SECONDS} s"
                except Exception as e:  # the harness itself, or a CUDA error
                    cls, note = "crash", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                    if "CUDA" in str(e):
                        out.write(json.dumps({"op": name, "leg": leg, "i": i, "cls": cls, "note": note,
                                              "s": time.perf_counter() - t0}) + "\n")
                        out.close()
                        os._exit(3)  # a lost CUDA context: the parent starts a new worker after this case
                finally:
                    signal.alarm(0)
                out.write(json.dumps({"op": name, "leg": leg, "i": i, "cls": cls, "note": note,
                                      "s": round(time.perf_counter() - t0, 3)}) + "\n")
        torch._dynamo.reset() if "torch._dynamo" in sys.modules else None
    out.write(json.dumps({"done": True}) + "\n")
    out.close()


def _run_shard(argv: List[str], shard: int, nshards: int, log_dir: str) -> List[Dict[str, Any]]:
    """Run one shard in workers, starting a new one after each case that killed the last."""
    path = os.path.join(log_dir, f"shard{shard}.jsonl")
    results: List[Dict[str, Any]] = []
    resume = ""
    for _attempt in range(200):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--worker-out", path,
               "--shard", str(shard), "--nshards", str(nshards)] + argv
        if resume:
            cmd += ["--resume", resume]
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines = [json.loads(x) for x in open(path) if x.strip()] if os.path.exists(path) else []
        open(path, "w").close()
        done = any(x.get("done") for x in lines)
        last_start = None
        for x in lines:
            if "start" in x:
                last_start = x["start"]
            elif "cls" in x:
                results.append(x)
                last_start = None
        if done:
            break
        if last_start is None and proc.returncode != 3:
            # the worker died outside a case
            results.append({"op": "?", "leg": "?", "i": -1, "cls": "crash",
                            "note": f"worker exit {proc.returncode}: {proc.stderr[-500:]}"})
            break
        if last_start is not None:
            op, leg, i = last_start.split("|")
            sig = -proc.returncode if proc.returncode < 0 else proc.returncode
            results.append({"op": op, "leg": leg, "i": int(i), "cls": "segfault",
                            "note": f"the worker died (signal/exit {sig}): {proc.stderr.strip()[-300:]}"})
            resume = last_start
        else:
            resume = f"{results[-1]['op']}|{results[-1]['leg']}|{results[-1]['i']}"
    return results


def sweep(argv: List[str], jobs: int) -> List[Dict[str, Any]]:
    """The whole sweep in ``jobs`` parallel shards; every case's record."""
    from concurrent.futures import ThreadPoolExecutor

    with tempfile.TemporaryDirectory() as d, ThreadPoolExecutor(jobs) as ex:
        parts = list(ex.map(lambda s: _run_shard(argv, s, jobs, d), range(jobs)))
    return [r for p in parts for r in p]


def summarize(results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    by_cls = collections.Counter(r["cls"] for r in results)
    ops = {r["op"] for r in results if r["cls"] != "skip"}
    op_cls: Dict[str, set] = collections.defaultdict(set)
    for r in results:
        op_cls[r["op"]].add(r["cls"])
    refused_ops = sorted(o for o, c in op_cls.items() if "refused" in c)
    failed = [r for r in results if r["cls"] in FAILURES]
    return {"cases": by_cls, "ops": len(ops), "refused_ops": refused_ops, "failed": failed}


def report(results: Sequence[Dict[str, Any]], device: str) -> str:
    """The counts as markdown: per leg and class, the refusals by reason, the failures."""
    s = summarize(results)
    legs = sorted({r["leg"] for r in results})
    classes = ["match", "refused"] + list(FAILURES) + ["skip"]
    lines = [f"OpInfo sweep on {device}: {s['ops']} ops, {sum(s['cases'].values())} cases", "",
             "| leg | " + " | ".join(classes) + " |", "|---" * (len(classes) + 1) + "|"]
    for leg in legs:
        c = collections.Counter(r["cls"] for r in results if r["leg"] == leg)
        lines.append(f"| {leg} | " + " | ".join(str(c.get(k, 0)) for k in classes) + " |")
    reasons: Dict[str, set] = collections.defaultdict(set)
    for r in results:
        if r["cls"] == "refused":
            text = r["note"].split(": ", 1)[-1]
            reasons[text[:110]].add(r["op"])
    lines += ["", "Refusals (reason: ops):", ""]
    for text, ops in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"- {text}: {', '.join(sorted(ops)[:12])}{' ...' if len(ops) > 12 else ''} ({len(ops)} ops)")
    if s["failed"]:
        lines += ["", "Failures:", ""]
        for r in s["failed"]:
            lines.append(f"- {r['cls']}: {r['op']} [{r['leg']} sample {r['i']}]: {r['note']}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--legs", default="forward", help=f"comma-separated of {LEGS}, or 'all'")
    p.add_argument("--samples", type=int, default=0, help="samples per op and leg (0: all)")
    p.add_argument("--ops", default="", help="comma-separated op names (default: every op)")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--json", default="")
    p.add_argument("--report", default="")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    p.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--nshards", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--resume", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    passed = ["--device", args.device, "--legs", args.legs, "--samples", str(args.samples)]
    if args.ops:
        passed += ["--ops", args.ops]
    t0 = time.time()
    results = sweep(passed, max(1, args.jobs))
    text = report(results, args.device)
    print(text)
    print(f"\n({time.time() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=0)
    if args.report:
        with open(args.report, "w") as f:
            f.write(text + "\n")
    return 1 if summarize(results)["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
