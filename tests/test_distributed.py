"""Collectives inside recordings: equality with single-process eager, lockstep errors, shutdown.

* CPU (gloo): each test spawns 2 worker processes (``python tests/test_distributed.py
  --worker ...`` on 127.0.0.1 with a free port), with timeouts so that it can never hang.
* NCCL: marker ``nccl``; runs only under ``torchrun --nproc_per_node 2`` on a machine with 2
  CUDA GPUs (``bash benchmarks/run_multi_gpu.sh``), in every rank's process.

Each case trains or runs 20 steps with graphify on every rank and compares with single-process
eager of the same global batch (computed in every rank's process, without collectives).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List

import pytest
import torch

STEPS = 20
WS = 2
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# -- the cases (run inside each rank) ------------------------------------------------
def _params(device: str) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    p = {
        "w1": torch.randn(8, 16, generator=g, dtype=torch.float64) * 0.3,
        "b1": torch.zeros(16, dtype=torch.float64),
        "w2": torch.randn(16, 4, generator=g, dtype=torch.float64) * 0.3,
        "b2": torch.zeros(4, dtype=torch.float64),
    }
    return {k: v.to(device) for k, v in p.items()}


def _batch(step: int, device: str, n: int = 8 * WS):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, 8, generator=g, dtype=torch.float64)
    y = torch.randn(n, 4, generator=g, dtype=torch.float64)
    return x.to(device), y.to(device)


def _loss(p: Dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ p["w1"] + p["b1"])
    return ((h @ p["w2"] + p["b2"] - y) ** 2).mean()


def _eager_sgd(device: str, lr: float) -> Dict[str, torch.Tensor]:
    """Single-process eager SGD on the global batch (the reference)."""
    p = _params(device)
    for s in range(STEPS):
        x, y = _batch(s, device)
        g = torch.func.grad(_loss)(p, x, y)
        for k in p:
            p[k] -= lr * g[k]
    return p


def _shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    n = t.shape[0] // WS
    return t[rank * n:(rank + 1) * n].contiguous()


def _max_err(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def case_ddp(kind: str, device: str, rank: int, fuse: bool = False) -> Dict[str, Any]:
    """grad -> all_reduce of the gradients -> SGD update, graphified; 20 steps."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import gtransform as gt

    group = dist.group.WORLD
    lr = 0.1

    def step(p: Dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        g = torch.func.grad(_loss)(p, x, y)
        for k in p:
            if kind == "funcol":
                gk = funcol.all_reduce(g[k], "sum", group) / WS
            else:
                gk = g[k]
                dist.all_reduce(gk)
                gk = gk / WS
            p[k].sub_(lr * gk)
        return _loss(p, x, y)

    f = gt.graphify(step, fuse=fuse)
    p = _params(device)
    for s in range(STEPS):
        x, y = _batch(s, device)
        f(p, _shard(x, rank), _shard(y, rank))
    ref = _eager_sgd(device, lr)
    return {"err": _max_err(p, ref), "hits": f.cache_info().hits}


def case_grad_allgather(device: str, rank: int) -> Dict[str, Any]:
    """graphify(torch.func.grad(loss)) where the loss all-gathers the batch (global-batch gradient)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import gtransform as gt

    def loss(p: Dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        xa = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
        ya = funcol.all_gather_tensor(y, 0, dist.group.WORLD)
        return _loss(p, xa, ya)

    f = gt.graphify(torch.func.grad(loss))
    p = _params(device)
    err = 0.0
    for s in range(STEPS):
        x, y = _batch(s, device)
        g = f(p, _shard(x, rank), _shard(y, rank))
        ref = torch.func.grad(_loss)(p, x, y)
        err = max(err, _max_err(g, ref))
    return {"err": err}


def _rank_data(step: int, r: int, device: str, n: int = 6) -> torch.Tensor:
    return (torch.arange(n * WS, dtype=torch.float64, device=device) * (r + 1) + step * 0.5 - r).reshape(WS, n)


def case_inplace(op: str, device: str, rank: int, fuse: bool = False) -> Dict[str, Any]:
    """In-place c10d collectives (all_reduce, all_gather_into_tensor, reduce_scatter_tensor, broadcast)."""
    import torch.distributed as dist

    import gtransform as gt

    def fn(x: torch.Tensor) -> torch.Tensor:
        x = x * 2
        if op == "all_reduce":
            dist.all_reduce(x)
            return x + 1
        if op == "all_gather_into_tensor":
            out = torch.empty((WS * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x)
            return out - 1
        if op == "reduce_scatter_tensor":
            out = torch.empty((x.shape[0] // WS,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
            dist.reduce_scatter_tensor(out, x)
            return out * 3
        if op == "broadcast":
            dist.broadcast(x, 0)
            return x + 0.25
        raise ValueError(op)

    def ref(step: int) -> torch.Tensor:
        xs = [_rank_data(step, r, device) * 2 for r in range(WS)]
        if op == "all_reduce":
            return sum(xs) + 1  # type: ignore[return-value]
        if op == "all_gather_into_tensor":
            return torch.cat(xs) - 1
        if op == "reduce_scatter_tensor":
            return sum(xs)[rank:rank + 1] * 3  # type: ignore[index]
        return xs[0] + 0.25

    f = gt.graphify(fn, fuse=fuse)
    err = 0.0
    for s in range(STEPS):
        out = f(_rank_data(s, rank, device))
        err = max(err, float((out - ref(s)).abs().max()))
    return {"err": err, "hits": f.cache_info().hits}


def case_mismatch(device: str, rank: int) -> Dict[str, Any]:
    """Rank 0 records a new signature while rank 1 replays: GraphifyError on both, no hang."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import gtransform as gt

    def fn(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

    f = gt.graphify(fn)
    for _ in range(3):
        f(torch.ones(4, dtype=torch.float64, device=device))
    if os.environ.get("GT_DUMP_STACKS"):
        import faulthandler

        faulthandler.dump_traceback_later(20, exit=False)  # where a rank hangs, if it does
    n = 5 if rank == 0 else 4
    t0 = time.monotonic()
    try:
        for _ in range(3):
            out = f(torch.ones(n, dtype=torch.float64, device=device))
            if device != "cpu":
                out.sum().item()  # a replay is asynchronous on the GPU: wait for it
        return {"error": None, "seconds": time.monotonic() - t0}
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}


def case_disagree(device: str, rank: int) -> Dict[str, Any]:
    """Both ranks record at the same time but with different shapes: GraphifyError on both at once."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import gtransform as gt

    f = gt.graphify(lambda x: funcol.all_reduce(x, "sum", dist.group.WORLD))
    t0 = time.monotonic()
    try:
        f(torch.ones(3 + rank, dtype=torch.float64, device=device))
        return {"error": None, "seconds": time.monotonic() - t0}
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}


def case_arg_written(device: str, rank: int) -> Dict[str, Any]:
    """dist.all_reduce into an argument: the caller's tensor holds the sum after every call, as in eager."""
    import torch.distributed as dist

    import gtransform as gt

    def fn(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x * 1

    f = gt.graphify(fn)
    err = 0.0
    for s in range(STEPS):
        x = _rank_data(s, rank, device)
        out = f(x)
        want = sum(_rank_data(s, r, device) for r in range(WS))
        err = max(err, float((out - want).abs().max()), float((x - want).abs().max()))
    return {"err": err, "hits": f.cache_info().hits}


def _refused(fn: Any) -> Dict[str, Any]:
    try:
        fn()
        return {"error": None}
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e)}


def case_refused_c10d_differentiated(device: str, rank: int) -> Dict[str, Any]:
    """A row-parallel layer with dist.all_reduce, differentiated outside: refused (it raced)."""
    import torch.distributed as dist

    import gtransform as gt

    w = torch.randn(6, 3, dtype=torch.float64, device=device, requires_grad=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x @ w
        dist.all_reduce(y)
        return torch.tanh(y)

    f = gt.graphify(fn)

    def calls() -> None:
        for s in range(3):
            f(_rank_data(s, rank, device).reshape(-1, 6)).sum().backward()

    return _refused(calls)


def case_refused_ddp_forward(device: str, rank: int) -> Dict[str, Any]:
    """DDP's forward graphified with the backward outside: refused (gradients were not reduced)."""
    import gtransform as gt

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(6, 2).double().to(device))
    f = gt.graphify(lambda x: ddp(x))

    def calls() -> None:
        for s in range(4):
            f(_rank_data(s, rank, device).reshape(-1, 6)).sum().backward()

    return _refused(calls)


def _run_case(name: str, device: str, rank: int) -> Dict[str, Any]:
    if name == "arg_written":
        return case_arg_written(device, rank)
    if name == "refused_c10d_differentiated":
        return case_refused_c10d_differentiated(device, rank)
    if name == "refused_ddp_forward":
        return case_refused_ddp_forward(device, rank)
    if name == "ddp_funcol":
        return case_ddp("funcol", device, rank)
    if name == "ddp_c10d":
        return case_ddp("c10d", device, rank)
    if name == "ddp_funcol_fuse":
        return case_ddp("funcol", device, rank, fuse=True)
    if name == "ddp_c10d_fuse":
        return case_ddp("c10d", device, rank, fuse=True)
    if name == "grad_allgather":
        return case_grad_allgather(device, rank)
    if name.startswith("inplace_"):
        return case_inplace(name[len("inplace_"):], device, rank)
    if name == "mismatch":
        return case_mismatch(device, rank)
    if name == "disagree":
        return case_disagree(device, rank)
    raise ValueError(name)


CPU_CASES = [
    "ddp_funcol", "ddp_c10d", "grad_allgather", "inplace_all_reduce", "inplace_all_gather_into_tensor",
    "inplace_reduce_scatter_tensor", "inplace_broadcast", "arg_written", "disagree",
    "refused_c10d_differentiated", "refused_ddp_forward",
]
EQUALITY_CASES = CPU_CASES[:-3]


# -- the worker process (CPU / gloo) --------------------------------------------------
def _gloo_threads() -> Any:
    """How many of gloo's threads this process still runs (Linux; ``None`` elsewhere)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    n = 0
    for t in tids:
        try:
            with open(f"/proc/self/task/{t}/comm") as fh:
                n += "gloo" in fh.read()
        except OSError:  # the thread has exited
            pass
    return n


def _worker(rank: int, port: int, cases: List[str], timeout_s: float) -> None:
    import torch.distributed as dist

    import gtransform  # noqa: F401  (routes destroy_process_group once collectives are traced)

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WS,
        timeout=timedelta(seconds=timeout_s),
    )
    res: Dict[str, Any] = {}
    for c in cases:
        try:
            res[c] = _run_case(c, "cpu", rank)
        except Exception as e:  # reported, not raised: the parent checks every case
            res[c] = {"error": type(e).__name__, "message": str(e)[:2000]}
    t0 = time.monotonic()
    dist.destroy_process_group()
    res["destroy_s"] = time.monotonic() - t0
    res["watch_threads"] = [t.name for t in threading.enumerate() if t.name.startswith("gtransform")]
    res["gloo_threads"] = _gloo_threads()
    print("RESULT " + json.dumps(res), flush=True)
    res["_"] = time.time()
    print(f"LASTSTEP {time.time()}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(cases: List[str], timeout_s: float = 30.0, env: Dict[str, str] | None = None, wall: float = 90.0) -> List[Dict[str, Any]]:
    port = _free_port()
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", str(r), str(port), ",".join(cases), str(timeout_s)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e,
        )
        for r in range(WS)
    ]
    out = []
    deadline = time.monotonic() + wall
    for r, p in enumerate(procs):
        try:
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {r} did not finish within {wall} s (a hang)")
        exited = time.time()
        res = next((json.loads(line[7:]) for line in so.splitlines() if line.startswith("RESULT ")), None)
        last = next((float(line.split()[1]) for line in so.splitlines() if line.startswith("LASTSTEP ")), None)
        assert res is not None, f"rank {r} exited with {p.returncode} and no result:\n{so[-3000:]}\n{se[-3000:]}"
        res["returncode"] = p.returncode
        res["stderr_tail"] = se[-3000:] if p.returncode else ""
        res["exit_s"] = exited - last if last is not None else None
        out.append(res)
    return out


@pytest.fixture(scope="module")
def gloo_results() -> List[Dict[str, Any]]:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    return _spawn(CPU_CASES)


@pytest.mark.parametrize("case", EQUALITY_CASES)
def test_gloo_matches_single_process_eager(gloo_results: List[Dict[str, Any]], case: str) -> None:
    for rank, res in enumerate(gloo_results):
        r = res[case]
        assert r.get("error") is None, f"rank {rank}: {r}"
        assert r["err"] < 1e-9, f"rank {rank}: {case} differs from eager by {r['err']}"
        if "hits" in r:
            assert r["hits"] >= STEPS - 2, f"rank {rank}: {case} did not replay: {r}"


@pytest.mark.parametrize("case, fix", [
    ("refused_c10d_differentiated", r"differentiated.*in-place collectives.*Fix: use the functional collectives"),
    ("refused_ddp_forward", r"DistributedDataParallel's forward.*backend=\"gtransform\""),
])
def test_gloo_what_a_replay_would_get_wrong_is_refused_with_the_fix(
        gloo_results: List[Dict[str, Any]], case: str, fix: str) -> None:
    import re

    for rank, res in enumerate(gloo_results):
        r = res[case]
        assert r.get("error") == "GraphifyError" and re.search("(?s)" + fix, r["message"]), f"rank {rank}: {r}"


def test_gloo_clean_shutdown(gloo_results: List[Dict[str, Any]]) -> None:
    for rank, res in enumerate(gloo_results):
        assert res["returncode"] == 0, f"rank {rank} exited with {res['returncode']}:\n{res['stderr_tail']}"
        assert res["destroy_s"] < 5, f"rank {rank}: destroy_process_group took {res['destroy_s']:.1f} s"
        assert res["exit_s"] is not None and res["exit_s"] < 10, f"rank {rank}: exit took {res['exit_s']} s"
        # nothing graphify made (recordings, FakeTensor's dispatch cache keyed on the group's C++
        # object by the traces of c10d's in-place collectives) keeps the destroyed group's worker
        # threads alive until interpreter exit, where one can abort the process (SIGABRT, rarely)
        assert res["gloo_threads"] in (None, 0), f"rank {rank}: {res['gloo_threads']} gloo threads after destroy"
        # gtransform's store-watching thread has ended: left in store.check at interpreter exit it
        # aborts the process (SIGABRT, about 1 run in 5 under torchrun's agent store)
        assert res["watch_threads"] == [], f"rank {rank}: still running after destroy: {res['watch_threads']}"


def test_gloo_fuse() -> None:
    pytest.importorskip("torch._inductor")
    res = _spawn(["ddp_funcol_fuse", "ddp_c10d_fuse"], wall=240.0)
    for rank, r in enumerate(res):
        for c in ("ddp_funcol_fuse", "ddp_c10d_fuse"):
            if r[c].get("error") is not None and "InvalidCxxCompiler" in r[c].get("message", ""):
                pytest.skip("no C++ compiler for TorchInductor's CPU backend")
            assert r[c].get("error") is None, f"rank {rank}: {r[c]}"
            assert r[c]["err"] < 1e-9, f"rank {rank}: {c}: {r[c]}"


def test_gloo_replay_against_recording_is_an_error_on_every_rank() -> None:
    res = _spawn(["mismatch"], timeout_s=60.0, env={"GTRANSFORM_COLLECTIVE_TIMEOUT": "3"}, wall=60.0)
    for rank, r in enumerate(res):
        m = r["mismatch"]
        assert m["error"] == "GraphifyError", f"rank {rank}: {m}"
        assert "graphify(" in m["message"] and f"rank {rank}" in m["message"], m["message"]
        assert m["seconds"] < 20, f"rank {rank}: took {m['seconds']:.1f} s"
        assert r["returncode"] == 0 and r["destroy_s"] < 5
        # destroy_process_group freed the group and joined gloo's worker threads: none is left to
        # release the failed collective during interpreter exit (SIGABRT there, about 1 run in 20)
        assert r["gloo_threads"] in (None, 0), f"rank {rank}: {r['gloo_threads']} gloo threads after destroy"


def test_gloo_different_signatures_is_an_error_on_every_rank(gloo_results: List[Dict[str, Any]]) -> None:
    for rank, r in enumerate(gloo_results):
        m = r["disagree"]
        assert m["error"] == "GraphifyError", f"rank {rank}: {m}"
        assert "different signatures" in m["message"] and f"rank {rank}" in m["message"], m["message"]
        assert "float64[3]" in m["message"] and "float64[4]" in m["message"]
        assert m["seconds"] < 10
        assert r["returncode"] == 0



def test_destroy_waits_for_the_store_watch_thread() -> None:
    """The watch thread, caught in a slow ``store.check`` (torchrun's agent store), has ended when
    ``destroy_process_group`` returns: left running into interpreter exit it aborts the process."""
    import threading
    import types

    from gtransform import _distributed

    stop = threading.Event()
    in_check = threading.Event()

    def watch() -> None:
        while not stop.wait(0.01):
            in_check.set()
            time.sleep(0.3)  # a store round trip with the interpreter lock released

    t = threading.Thread(target=watch, name="gtransform-collectives-watch", daemon=True)
    t.start()
    assert in_check.wait(5)
    _distributed._stop_monitor(types.SimpleNamespace(stop=stop, monitor=t))  # type: ignore[arg-type]
    assert not t.is_alive()

# -- NCCL: under torchrun --nproc_per_node 2 on 2 GPUs ------------------------------
def _under_torchrun() -> bool:
    return (
        os.environ.get("WORLD_SIZE") == str(WS) and "LOCAL_RANK" in os.environ
        and torch.cuda.is_available() and torch.cuda.device_count() >= WS
    )


nccl = pytest.mark.skipif(not _under_torchrun(), reason="needs torchrun --nproc_per_node 2 with 2 CUDA GPUs")


@pytest.fixture(scope="module")
def nccl_group() -> Any:
    import torch.distributed as dist

    import gtransform  # noqa: F401

    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank), timeout=timedelta(seconds=120))
    yield dist.get_rank()
    print(f"LAST_STEP_AT {time.time():.3f} rank {rank}", flush=True)
    t0 = time.monotonic()
    dist.destroy_process_group()
    print(f"[rank {rank}] destroy_process_group took {time.monotonic() - t0:.3f} s", flush=True)


NCCL_CASES = EQUALITY_CASES + ["ddp_funcol_fuse", "ddp_c10d_fuse"]


@pytest.mark.nccl
@nccl
@pytest.mark.parametrize("case", NCCL_CASES)
def test_nccl_matches_single_process_eager(nccl_group: int, case: str) -> None:
    r = _run_case(case, "cuda", nccl_group)
    assert r.get("error") is None, r
    assert r["err"] < 1e-9, f"rank {nccl_group}: {case} differs from eager by {r['err']}"
    print(f"[rank {nccl_group}] {case}: max |graphify - eager| = {r['err']:.3g}", flush=True)


@pytest.mark.nccl
@nccl
def test_nccl_different_signatures(nccl_group: int) -> None:
    m = case_disagree("cuda", nccl_group)
    assert m["error"] == "GraphifyError", m
    assert "different signatures" in m["message"] and f"rank {nccl_group}" in m["message"]


@pytest.mark.nccl
@nccl
@pytest.mark.skipif(os.environ.get("GT_NCCL_MISMATCH") != "1", reason="aborts the group: run alone (GT_NCCL_MISMATCH=1)")
def test_nccl_replay_against_recording(nccl_group: int) -> None:
    m = case_mismatch("cuda", nccl_group)
    print(f"[rank {nccl_group}] mismatch: {m.get('error')} after {m['seconds']:.1f} s", flush=True)
    assert m["error"] == "GraphifyError", m
    assert f"rank {nccl_group}" in m["message"]


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    sys.path.insert(0, ROOT)
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(","), float(sys.argv[5]))
