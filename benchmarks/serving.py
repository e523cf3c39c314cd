"""Serving benchmark: a stream of requests whose batch size varies, served by one model.

    python -m benchmarks.serving                                  # cuda: both models, every method
    python -m benchmarks.serving --device cpu --requests 30 --models gpt2 --methods eager,gt_buckets,gt_record

The stream is ``--requests`` batch sizes drawn uniformly from 1..64 (``--seed``), the same for
every method. Each request runs one model's inference, with autograd off around the calls
(``torch.set_grad_enabled(False)``, as a server would run it; gtransform decides at the call
whether to record a differentiable forward, so a ``no_grad`` inside the function would not do):

    gpt2        transformers GPT-2 (4 layers, width 256, random weights), input ids (batch, 32) -> logits
    resnet18    torchvision resnet18 (random weights, eval mode), images (batch, 3, 224, 224) -> logits

through one of the methods:

    eager             the plain function
    gt_buckets        gt.graphify(serve, buckets=(1, 2, 4, 8, 16, 32, 64), pad=0): padded to the next bucket
    gt_all            gt.graphify(serve): every size recorded (traced once symbolically: a new size costs a
                      recording, not a trace)
    gt_record         gt.graphify(serve, record_sizes=8): the 8 most frequent sizes recorded, the others eager
    compile_dynamic   torch.compile(serve, mode="reduce-overhead", dynamic=True)

Every (model, method) runs in its own process with empty compile caches, so neither memory nor
compiled code carries over from one to the next. The process builds the model and one input per
distinct batch size, computes eager's outputs for the batch sizes 1, 7 and 64, then serves the
stream. A request gets a fresh copy of its size's input (made before its clock starts: a server's
batch is a new tensor every time), then is timed: ``out = f(x); out[0, 0]``, a device
synchronisation; the output is dropped (a server hands it off). First calls (traces, recordings,
compiles) count.

Figures per method: the time spent serving (the sum of the requests' latencies); requests/s and
samples/s over it; latency p50, p99 and max over every request, and throughput, p50 and p99 over
the steady state (the last 500 requests, or the last half of a shorter stream); the books:
recordings (gtransform: the signatures kept, ``cache_info().currsize``; torch.compile: its CUDA
graph recordings, counted by torch._dynamo's callback handler), traces (gtransform: its tracer's
calls; torch.compile: dynamo's frame compiles) and replays (gtransform: the cache's hits); on
CUDA, the memory above the baseline (allocated once the model, inputs and references are built):
peak allocated during the stream, allocated still held after it, and reserved after it; and the
largest difference of the outputs for batch sizes 1, 7 and 64 from eager's, after the stream.

Prints one Markdown table per model; ``--json OUT`` writes every figure (and the latencies).
On a CPU, compile_dynamic runs only when named in ``--methods``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

MODELS = ("gpt2", "resnet18")
METHODS = ("eager", "gt_all", "gt_buckets", "gt_record", "compile_dynamic")
CPU_DEFAULT_METHODS = ("eager", "gt_all", "gt_buckets", "gt_record")
MAX_BATCH = 64
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
RECORD_TOP = 8  # gt_record: record_sizes=8
CHECK_SIZES = (1, 7, 64)  # outputs compared with eager's after the stream
STEADY = 500  # the steady state: the last STEADY requests (or the last half of a shorter stream)
SEQ_LEN = 32  # GPT-2's input length
MiB = 2**20


@dataclass
class Served:
    """One model's inference function and how to make its input of a batch size."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    make_input: Callable[[int], torch.Tensor]


def build_gpt2(device: torch.device) -> Served:
    """GPT-2 with random weights: input ids (batch, SEQ_LEN) -> logits (batch, SEQ_LEN, vocab)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128, use_cache=False)
    model = GPT2LMHeadModel(cfg).to(device).eval()

    def serve(x: torch.Tensor) -> torch.Tensor:
        return model(x).logits

    return Served(serve, lambda n: torch.randint(0, cfg.vocab_size, (n, SEQ_LEN)).to(device))


def build_resnet18(device: torch.device) -> Served:
    """torchvision resnet18 with random weights, eval mode: images (batch, 3, 224, 224) -> logits (batch, 1000)."""
    from torchvision.models import resnet18

    model = resnet18(weights=None).to(device).eval()

    def serve(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    return Served(serve, lambda n: torch.randn(n, 3, 224, 224).to(device))


BUILDERS: Dict[str, Callable[[torch.device], Served]] = {"gpt2": build_gpt2, "resnet18": build_resnet18}
NEEDS = {"gpt2": "transformers", "resnet18": "torchvision"}


def request_stream(requests: int, seed: int) -> List[int]:
    """The batch sizes of the requests: uniform over 1..MAX_BATCH, the same for every method."""
    rng = random.Random(seed)
    return [rng.randint(1, MAX_BATCH) for _ in range(requests)]


# -- the methods: the function to serve with, and its books (recordings, traces, replays) after the stream

Books = Callable[[], Dict[str, Optional[int]]]


def build_method(method: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Tuple[Callable[..., Any], Books]:
    """The callable ``method`` serves with, and a function giving its books once the stream is served."""
    if method == "eager":
        return fn, lambda: {"recordings": None, "traces": None, "replays": None}
    if method in ("gt_buckets", "gt_record", "gt_all"):
        import gtransform as gt

        opts: Dict[str, Any] = ({"buckets": BUCKETS, "pad": 0} if method == "gt_buckets"
                                else {"record_sizes": RECORD_TOP} if method == "gt_record" else {})
        g = gt.graphify(fn, **opts)
        traced = count_traces()
        return g, lambda: graphify_books(g, traced)
    if method == "compile_dynamic":
        return torch.compile(fn, mode="reduce-overhead", dynamic=True), compile_books()
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def count_traces() -> List[int]:
    """Count gtransform's traces from now on (its tracer wrapped in this process): ``[count]``."""
    import gtransform._lookup as lookup

    made = [0]
    real = lookup.trace

    def counted(*a: Any, **kw: Any) -> Any:
        made[0] += 1
        return real(*a, **kw)

    lookup.trace = counted
    return made


def graphify_books(g: Any, traced: List[int]) -> Dict[str, Optional[int]]:
    """A graphified function's books, from ``cache_info()`` and the tracer.

    recordings: the signatures kept (``currsize``; none is evicted: at most 64 sizes, ``maxsize=64``);
    traces: the traces made (a signature that reads the model's parameters runs its first call
    eagerly and records at its second; a size recorded from a symbolic trace is not traced);
    replays: ``hits``.
    """
    info = g.cache_info()
    return {"recordings": info.currsize, "traces": traced[0], "replays": info.hits}


def compile_books() -> Books:
    """Count torch.compile's CUDA graph recordings and dynamo's compiles from now on (dynamo's callback handler)."""
    from torch._dynamo.callback import CallbackArgs, CallbackTrigger, callback_handler

    counts = {"recordings": 0, "traces": 0}
    keys = {CallbackTrigger.CUDAGRAPH_RECORDING: "recordings", CallbackTrigger.DYNAMO: "traces"}

    def on_end(args: CallbackArgs) -> None:
        if args.callback_trigger in keys:
            counts[keys[args.callback_trigger]] += 1

    callback_handler.register_end_callback(on_end)
    return lambda: {**counts, "replays": None}


# -- one (model, method): its own process


def sync(device: torch.device) -> None:
    """Wait for the device (nothing on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_baseline(device: torch.device) -> Dict[str, int]:
    """Allocated and reserved bytes now, with the peak reset (CUDA; empty on a CPU)."""
    if device.type != "cuda":
        return {}
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device)}


def memory_after(device: torch.device, base: Dict[str, int]) -> Dict[str, Optional[float]]:
    """MiB above the baseline: peak allocated since, allocated held now (outputs dropped), reserved now."""
    if device.type != "cuda":
        return {"peak_mib": None, "held_mib": None, "reserved_mib": None}
    gc.collect()
    return {"peak_mib": (torch.cuda.max_memory_allocated(device) - base["allocated"]) / MiB,
            "held_mib": (torch.cuda.memory_allocated(device) - base["allocated"]) / MiB,
            "reserved_mib": (torch.cuda.memory_reserved(device) - base["reserved"]) / MiB}


def serve_stream(f: Callable[..., Any], stream: List[int], inputs: Dict[int, torch.Tensor],
                 device: torch.device) -> Tuple[List[float], List[str]]:
    """Serve every request in turn: each request's latency (s), and the warnings raised.

    A request gets a fresh copy of its size's input, made before its clock starts (passed the
    same tensor again, gtransform would record again to read it in place, which no server sees).
    """
    latencies = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in stream:
            x = inputs[n].clone()
            sync(device)
            t = perf_counter()
            out = f(x)
            check = out[0, 0]
            sync(device)
            latencies.append(perf_counter() - t)
            del x, out, check
    return latencies, sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught})


def max_error(f: Callable[..., Any], inputs: Dict[int, torch.Tensor], refs: Dict[int, torch.Tensor]) -> float:
    """The largest absolute difference of ``f``'s outputs from eager's, over the checked batch sizes."""
    return max(float((f(inputs[n]).double().cpu() - ref).abs().max()) for n, ref in refs.items())


def set_precision(tf32: bool) -> None:
    """float32 precision for matmuls and convolutions, TF32 or not (as benchmarks.environment sets it)."""
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")


def run_child(model: str, method: str, opts: argparse.Namespace) -> Dict[str, Any]:
    """Build ``model``, serve the stream with ``method`` and return every figure (in the child process)."""
    set_precision(opts.tf32)
    device = torch.device(opts.device)
    torch.manual_seed(opts.seed)
    torch.set_grad_enabled(False)  # (see the module docstring)
    served = BUILDERS[model](device)
    stream = request_stream(opts.requests, opts.seed)
    inputs = {n: served.make_input(n) for n in sorted(set(stream) | set(CHECK_SIZES))}
    refs = {n: served.fn(inputs[n]).double().cpu() for n in CHECK_SIZES}
    f, books = build_method(method, served.fn)
    base = memory_baseline(device)
    latencies, caught = serve_stream(f, stream, inputs, device)
    result = {"model": model, "method": method, "device": device_name(device), "sizes": stream,
              "latencies_s": latencies, "warnings": caught,
              **summary(latencies, stream), **memory_after(device, base), **books()}
    result["max_err"] = max_error(f, inputs, refs)
    return result


def device_name(device: torch.device) -> str:
    """The GPU's name, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def summary(latencies: List[float], sizes: List[int]) -> Dict[str, Any]:
    """Throughput and latency percentiles over the whole stream and its steady state (seconds in, ms out)."""
    total = sum(latencies)
    steady = min(STEADY, len(latencies) // 2) or len(latencies)
    tail = latencies[-steady:]
    return {"total_s": total, "req_per_s": len(latencies) / total, "samples_per_s": sum(sizes) / total,
            **percentiles(latencies, ""), "steady_requests": steady,
            "steady_req_per_s": steady / sum(tail), "steady_samples_per_s": sum(sizes[-steady:]) / sum(tail),
            **percentiles(tail, "steady_")}


def percentiles(latencies: List[float], prefix: str) -> Dict[str, float]:
    """p50, p99 and max of ``latencies`` (s), in ms, named with ``prefix``."""
    if len(latencies) < 2:
        p50 = p99 = latencies[0]
    else:
        q = statistics.quantiles(latencies, n=100, method="inclusive")
        p50, p99 = q[49], q[98]
    return {f"{prefix}p50_ms": p50 * 1e3, f"{prefix}p99_ms": p99 * 1e3, f"{prefix}max_ms": max(latencies) * 1e3}


# -- the parent: one child per (model, method), then the tables


def spawn(model: str, method: str, opts: argparse.Namespace) -> Dict[str, Any]:
    """Run one (model, method) in a fresh process with empty compile caches; its figures, or its error."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    scratch = tempfile.mkdtemp(prefix=f"gt-serving-{model}-{method}-")
    out = os.path.join(scratch, "result.json")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": scratch, "TRITON_CACHE_DIR": os.path.join(scratch, "triton")}
    cmd = [sys.executable, "-m", "benchmarks.serving", "--_child", model, method, "--_out", out,
           "--device", opts.device, "--requests", str(opts.requests), "--seed", str(opts.seed)]
    cmd += ["--tf32"] if opts.tf32 else []
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            print(f"{model} / {method}: failed (exit {proc.returncode})\n{tail}", file=sys.stderr)
            return {"model": model, "method": method, "error": tail.splitlines()[-1] if tail else "no output"}
        with open(out) as fh:
            return json.load(fh)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def cell(value: Any, fmt: str) -> str:
    """One table cell: the number formatted, or "n/a"."""
    return "n/a" if value is None else format(value, fmt)


COLUMNS = [  # (header, key, format)
    ("total s", "total_s", ".2f"), ("req/s", "req_per_s", ".1f"), ("samples/s", "samples_per_s", ".0f"),
    ("p50 ms", "p50_ms", ".2f"), ("p99 ms", "p99_ms", ".2f"), ("max ms", "max_ms", ".1f"),
    ("steady req/s", "steady_req_per_s", ".1f"), ("steady p50 ms", "steady_p50_ms", ".2f"),
    ("steady p99 ms", "steady_p99_ms", ".2f"), ("recordings", "recordings", "d"), ("traces", "traces", "d"),
    ("replays", "replays", "d"), ("peak MiB", "peak_mib", ".0f"), ("held MiB", "held_mib", ".0f"),
    ("reserved MiB", "reserved_mib", ".0f"), ("max err", "max_err", ".2e"),
]


def table(model: str, rows: List[Dict[str, Any]]) -> str:
    """The Markdown table of one model, a row per method, and the warnings each method raised."""
    lines = ["| method | " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for r in rows:
        cells = ([f"failed: {r['error']}"] + [""] * (len(COLUMNS) - 1) if "error" in r
                 else [cell(r.get(k), fmt) for _, k, fmt in COLUMNS])
        lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
    said = [f"{r['method']}: {w}" for r in rows for w in r.get("warnings", ())]
    lines += [""] + said if said else []
    device = next((r["device"] for r in rows if "device" in r), "?")
    steady = next((r["steady_requests"] for r in rows if "steady_requests" in r), "?")
    return f"### {model} ({device}; steady state: the last {steady} requests)\n\n" + "\n".join(lines)


def available(model: str) -> bool:
    """Whether the package ``model`` needs is installed (else the model is skipped, said so)."""
    if importlib.util.find_spec(NEEDS[model]) is not None:
        return True
    print(f"skipping {model}: {NEEDS[model]} is not installed", file=sys.stderr)
    return False


def run_all(opts: argparse.Namespace) -> Dict[str, List[Dict[str, Any]]]:
    """Every (model, method) in its own process; the figures per model."""
    results: Dict[str, List[Dict[str, Any]]] = {}
    for model in [m for m in opts.models if available(m)]:
        rows = results.setdefault(model, [])
        for method in opts.methods:
            rows.append(spawn(model, method, opts))
            if "error" not in rows[-1]:
                print(f"{model} / {method}: {rows[-1]['total_s']:.1f} s", file=sys.stderr)
    return results


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line (``--_child``/``--_out``: one (model, method), run by the parent)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated, of {', '.join(METHODS)} (default: all; on a CPU, all but compile_dynamic)")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls and convolutions (default: off)")
    p.add_argument("--_child", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    opts.models = opts.models.split(",")
    default = CPU_DEFAULT_METHODS if opts.device == "cpu" else METHODS
    opts.methods = opts.methods.split(",") if opts.methods else list(default)
    for name, allowed in (("model", MODELS), ("method", METHODS)):
        unknown = set(getattr(opts, name + "s")) - set(allowed)
        if unknown:
            p.error(f"unknown {name}(s) {', '.join(sorted(unknown))}; choose from {', '.join(allowed)}")
    if opts.requests < 1:
        p.error("--requests must be 1 or more")
    return opts


def main(argv: Optional[List[str]] = None) -> None:
    """Run the benchmark (or, with ``--_child``, one of its processes)."""
    opts = parse(argv)
    if opts._child:
        with open(opts._out, "w") as fh:
            json.dump(run_child(*opts._child, opts), fh)
        return
    results = run_all(opts)
    for model, rows in results.items():
        print(table(model, rows) + "\n")
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump({"argv": sys.argv, "torch": torch.__version__, "requests": opts.requests, "seed": opts.seed,
                       "tf32": opts.tf32, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
