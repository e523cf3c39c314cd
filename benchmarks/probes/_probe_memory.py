"""First calls' memory of one program and method, in its own process (issue #36 item 2).

Run: python benchmarks/probes/_probe_memory.py <resnet18|gpt2|adam> <eager|gt|gtfuse|tc>
12 calls, a new batch each; per call peak/allocated/reserved MiB above the set-up, then a SUMMARY line.
"""
import gc, json, os, sys, collections
import torch
import torch.nn.functional as F

MiB = 2 ** 20
dev = torch.device("cuda")


def build(name):
    torch.manual_seed(0)
    if name == "resnet18":
        import torchvision
        m = torchvision.models.resnet18().eval().to(dev)
        x = torch.randn(1, 3, 224, 224, device=dev)
        def fn(x):
            with torch.no_grad():
                return m(x)
        return fn, (x,), m
    if name == "gpt2":
        import transformers as tr
        cfg = tr.GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128, use_cache=False)
        m = tr.GPT2LMHeadModel(cfg).eval().to(dev)
        ids = torch.randint(0, 50257, (2, 32), device=dev)
        def fn(ids):
            with torch.no_grad():
                return m(ids).logits
        return fn, (ids,), m
    if name == "adam":
        layers = []
        for i in range(8):
            layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
        m = torch.nn.Sequential(*layers[:-1]).to(dev)
        opt = torch.optim.Adam(m.parameters(), lr=1e-3, capturable=True)
        x = torch.randn(256, 1024, device=dev); y = torch.randn(256, 1024, device=dev)
        def fn(x, y):
            opt.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            return loss
        # set-up: Adam's state exists (the eager baseline has it too)
        fn(x, y); torch.cuda.synchronize()
        return fn, (x, y), (m, opt)
    raise SystemExit(name)


def segs():
    out = collections.Counter()
    for s in torch.cuda.memory_snapshot():
        key = (s.get("stream"), tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))
        out[str(key)] += s["total_size"] // MiB
    return dict(out)


def main(name, method):
    fn, args, keep = build(name)
    if method == "gt":
        import gtransform as gt
        import gtransform._record as R
        orig = R.CUDARecording._capture_locked
        def wrapped(self, warmup, pool_id):
            torch.cuda.synchronize(); a0 = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
            r = orig(self, warmup, pool_id)
            torch.cuda.synchronize()
            print(f"   capture(warmup={warmup}): alloc {a0/MiB:.1f} -> {torch.cuda.memory_allocated()/MiB:.1f}, "
                  f"peak {torch.cuda.max_memory_allocated()/MiB:.1f}, reserved {torch.cuda.memory_reserved()/MiB:.1f}")
            return r
        R.CUDARecording._capture_locked = wrapped
        g = gt.graphify(fn)
    elif method == "gtfuse":
        import gtransform as gt
        g = gt.graphify(fn, fuse=True)
    elif method == "tc":
        g = torch.compile(fn, mode="reduce-overhead")
    else:
        g = fn
    sets = [tuple(a.clone() for a in args) for _ in range(12)]  # a new batch each call
    gc.collect(); torch.cuda.synchronize(); torch.cuda.empty_cache()
    base_a, base_r = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    print(f"== {name} {method}: base alloc {base_a/MiB:.1f} reserved {base_r/MiB:.1f}")
    out = None
    overall = 0
    for i in range(12):
        torch.cuda.reset_peak_memory_stats()
        out = g(*sets[i])
        if method == "tc":
            out = out.clone() if isinstance(out, torch.Tensor) else out
        torch.cuda.synchronize()
        pk = torch.cuda.max_memory_allocated() - base_a
        overall = max(overall, pk)
        if i < 4 or i == 11:
            print(f"  call {i}: peak {pk/MiB:.1f} alloc {(torch.cuda.memory_allocated()-base_a)/MiB:.1f} "
                  f"reserved {(torch.cuda.memory_reserved()-base_r)/MiB:.1f}")
    gc.collect(); torch.cuda.synchronize()
    print(f"  SUMMARY {name} {method}: peak {overall/MiB:.1f} held {(torch.cuda.memory_allocated()-base_a)/MiB:.1f} "
          f"reserved {(torch.cuda.memory_reserved()-base_r)/MiB:.1f}")
    print("  segments (stream, private) MiB:", segs())
    if method.startswith("gt"):
        try:
            print(g.describe())
        except Exception as e:
            print("describe failed", e)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
