"""The benchmark of gtransform against its peers, as a package; `bench.py` is its command line.

    python benchmarks/bench.py --out DIR [--only ROWS] [--methods COLUMNS] [--quick] ...

What is where:

- `core`: the columns (METHODS), tolerances, float32 precision, a row (`Workload`) and one
  column's copy of a stateful program (`Instance`);
- `workloads/`: the rows by family: `synthetic` (DESIGN.md's seven), `vision` (resnet18),
  `training` (an Adam step), `language` (Hugging Face GPT-2 and a Llama decode step),
  `func_transforms` (per-sample gradients, an ensemble); `make_workloads` lists them;
- `methods/`: the peers' methods, one module per family: `eager`, `cuda_graph` (the
  hand-written capture: copy-in + replay, and replay alone, the floor),
  `graphed_callables`, `torch_compile`, `jax_jit`, `graphify` (gtransform default and
  fused, outputs dropped, held, or viewed);
- `trees`, `context`: walking pytrees, the error measure, a row's shared inputs and eager
  reference (`Ctx`), a built column (`Prepared`);
- the runner: `runner` (cells and rows), `timing` (repeats, the columns timed in turn),
  `caches` (cold compile caches per cell), `warm` (the warm-cache second process);
- the report: `report` (tables, plot, results files), `environment` (what a run records,
  the precision it sets), `cli` (flags and main).

Importing the package changes nothing: bench.py sets the environment (compile cache root,
jax's memory) before torch is imported. Method and columns: benchmarks/README.md.
"""
