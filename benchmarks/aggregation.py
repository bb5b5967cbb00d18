"""Aggregation benchmark: the streaming FedAvg fold against a numpy sum, and its peak memory against N.

Run from the repository root::

    .venv/bin/python benchmarks/aggregation.py                      # the defaults take minutes
    .venv/bin/python benchmarks/aggregation.py --models resnet18 --clients 10,100 --json out.json

For ``lenet-cifar10`` (≈0.3M parameters) and ``resnet18`` (≈11.2M, ≈45 MB in fp32) at the full
rank the server aggregates, and N = 10, 100 and 1000 client updates, it measures:

- **Throughput** of the real aggregation path, ``FedAvg().begin(global, due)``, then
  ``.fold(acc, ClientUpdate(...))`` once per client, then ``.finish(acc, global)``, in GB/s
  folded (bytes of the clients' fp32 tensors per second, 1 GB = 10⁹ B), as a ratio to a numpy
  baseline timed in the same run: per tensor ``np.sum(np.stack(arrays), axis=0)`` in float32.
  Where N whole models do not fit ``--stack-budget-gb`` (1000 × 45 MB), a pool of ``--pool``
  distinct random updates is reused cyclically by both sides: the fold gets client ``i`` the
  pool's update ``i mod P``, and numpy sums the stack of the same P arrays once per group of
  P clients, accumulating the groups' sums. Otherwise every client has its own update and
  numpy stacks all N at once. A second numpy figure sums arrays stacked beforehand
  (``np.sum(stacked, axis=0)`` alone, the memory-bandwidth ceiling of a float32 sum); it is
  context, not a target.
- **Peak memory** of the fold, in a fresh process per (model, N) (this script re-run with a
  hidden flag, forked by ``sh`` so that it does not inherit this process's peak):
  ``ru_maxrss`` after folding all N updates (and after ``finish``) minus the resident set
  measured after the imports, the pool of updates and the global tensors were built (and a
  tiny warm-up fold ran), divided by the model's fp32 bytes. A streaming mean
  keeps this flat in N (float64 running means are 2× the model, ``finish``'s cast copy 1×).

The fold runs with one torch thread by default (``--threads``), the resources numpy's
single-threaded stack and sum get: on a shared machine torch's OpenMP team waits for a
descheduled thread at every parallel op whenever a neighbour holds a core, which slows the
fold by one to two orders of magnitude and then measures the neighbour, not the code
(``--threads 0`` keeps torch's own choice, for a quiet machine).

Made for a shared, noisy machine: the fold and the numpy baselines are timed alternately,
group by group (a group is P clients, or all N when they are not pooled), in an order rotated
per group and per repeat, so a neighbour's burst of load hits all sides alike; each side's
throughput is the median over the repeats of whole rounds, and the fold/numpy ratio (the
target) the median over every (repeat, group) of the two sides' paired times; the ratio of
whole rounds' times is shown beside it. Big cases run fewer repeats (at most
``--repeat-budget-gb`` folded per case).

A "targets" section closes the report with PASS/FAIL lines (fold ≥ 0.5× numpy; peak memory
at the largest N within 1.2× the smallest N's plus a small slack); the exit status is 0
either way. Progress goes to stderr, the report to stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from aggregator_service.strategies import FedAvg
from aggregator_service.updates import ClientUpdate
from fedcore.models import model_info
from fedcore.spec import ModelSpec

MODELS = ("lenet-cifar10", "resnet18")
CLIENTS = (10, 100, 1000)
POOL = 8
REPEATS = 5
STACK_BUDGET_GB = 2.0  # stack N distinct updates when N × model bytes fit this, else reuse a pool
REPEAT_BUDGET_GB = 16.0  # fp32 GB folded per case at most (over all repeats), at least one repeat
TARGET_RATIO = 0.5  # fold throughput ≥ this × numpy's
MEMORY_GROWTH = 1.2  # peak ratio at the largest N ≤ this × the smallest N's + slack
MEMORY_SLACK_MODELS = 0.25  # slack, in model sizes …
MEMORY_SLACK_BYTES = 4 << 20  # … or 4 MiB, whichever is larger (allocator noise on a 1.2 MB model)
SIDES = ("fold", "numpy", "prestacked")
THREADS = 1  # like numpy's sum; torch's OpenMP team stalls whenever a neighbour holds one of the cores


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_list(values: list[str]) -> list[str]:
    """``["10,100", "1000"]`` → ``["10", "100", "1000"]``."""
    return [v for value in values for v in value.split(",") if v]


def full_spec(model: str) -> ModelSpec:
    return ModelSpec(model, model_info(model).default_classes).full()


def model_tensors(spec: ModelSpec, seed: int) -> dict[str, Tensor]:
    """Random values for every tensor of ``spec``: N(0, 1) floats, small ints for counters."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t in spec.tensors:
        dtype = getattr(torch, t.dtype)
        if dtype.is_floating_point:
            out[t.name] = torch.randn(t.shape, generator=gen, dtype=dtype)
        else:
            out[t.name] = torch.randint(0, 1000, t.shape, generator=gen, dtype=dtype)
    return out


def fp32_names(spec: ModelSpec) -> list[str]:
    return [t.name for t in spec.tensors if t.dtype == "float32"]


def fp32_bytes(spec: ModelSpec) -> int:
    return sum(4 * math.prod(t.shape) for t in spec.tensors if t.dtype == "float32")


def num_samples(i: int) -> int:
    return 50 + 37 * i % 451  # unequal client weights, deterministic


def pool_size(n: int, model_bytes: int, pool: int, stack_budget: float) -> int:
    """Distinct updates: all N when N models fit the stack budget, else the pool."""
    return n if n * model_bytes <= stack_budget else min(pool, n)


# --------------------------------------------------------------------------- throughput


@dataclass
class Case:
    model: str
    clients: int
    pool: int
    repeats: int
    model_bytes: int
    groups: int = 1
    times: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SIDES})  # per repeat
    group_times: list[dict[str, float]] = field(default_factory=list)  # per (repeat, group)
    memory: dict | None = None

    @property
    def folded_bytes(self) -> int:
        return self.clients * self.model_bytes

    def rate(self, side: str) -> float:
        """Median GB/s over the repeats."""
        return statistics.median(self.folded_bytes / t / 1e9 for t in self.times[side])

    def ratio(self, side: str) -> float:
        """Fold throughput / ``side``'s: the median over every (repeat, group) of the paired times' ratio."""
        return statistics.median(g[side] / g["fold"] for g in self.group_times)

    def end_to_end(self, side: str) -> float:
        """Fold throughput / ``side``'s over whole rounds: the median over the repeats of the total times' ratio."""
        return statistics.median(t / f for t, f in zip(self.times[side], self.times["fold"], strict=True))


def bench_throughput(case: Case, seed: int) -> None:
    spec = full_spec(case.model)
    names = fp32_names(spec)
    n, k = case.clients, case.pool
    t0 = time.perf_counter()
    global_tensors = model_tensors(spec, seed)
    pool = [model_tensors(spec, seed + 1 + j) for j in range(k)]
    arrays = {name: [update[name].numpy() for update in pool] for name in names}
    prestacked = {name: np.stack(arrays[name]) for name in names}
    groups = [(lo, min(lo + k, n)) for lo in range(0, n, k)]
    log(f"[{case.model} N={n}] {k} distinct updates built in {time.perf_counter() - t0:.1f} s; {len(groups)} group(s)")

    strategy = FedAvg()
    state: dict = {}

    def fold_group(lo: int, hi: int) -> None:
        acc = state["acc"]
        for i in range(lo, hi):
            strategy.fold(acc, ClientUpdate(f"client-{i}", num_samples(i), 1.0, spec, pool[i % k]))

    def numpy_group(lo: int, hi: int) -> None:
        totals = state["numpy"]
        for name in names:
            part = np.sum(np.stack(arrays[name][: hi - lo]), axis=0)
            if name in totals:
                np.add(totals[name], part, out=totals[name])
            else:
                totals[name] = part

    def prestacked_group(lo: int, hi: int) -> None:
        totals = state["prestacked"]
        for name in names:
            part = np.sum(prestacked[name][: hi - lo], axis=0)
            if name in totals:
                np.add(totals[name], part, out=totals[name])
            else:
                totals[name] = part

    run: dict[str, Callable[[int, int], None]] = {
        "fold": fold_group,
        "numpy": numpy_group,
        "prestacked": prestacked_group,
    }

    # warm-up: two clients through every side (first-call costs, allocator pools), untimed
    state.update(acc=strategy.begin(global_tensors, list(global_tensors)), numpy={}, prestacked={})
    for side in SIDES:
        run[side](0, min(2, n))
    strategy.finish(state["acc"], global_tensors)

    every = max(1, len(groups) // 10)
    for r in range(case.repeats):
        state.clear()
        gc.collect()
        timed: list[dict[str, float]] = [dict.fromkeys(SIDES, 0.0) for _ in groups]
        start = time.perf_counter()
        state.update(acc=strategy.begin(global_tensors, list(global_tensors)), numpy={}, prestacked={})
        timed[0]["fold"] += time.perf_counter() - start  # begin counts with the first group …
        for g, (lo, hi) in enumerate(groups):
            shift = (g + r) % len(SIDES)
            for side in SIDES[shift:] + SIDES[:shift]:
                start = time.perf_counter()
                run[side](lo, hi)
                timed[g][side] += time.perf_counter() - start
            if len(groups) > 1 and (g + 1) % every == 0:
                log(f"[{case.model} N={n} repeat {r + 1}/{case.repeats}] {hi}/{n} clients")
        start = time.perf_counter()
        result = strategy.finish(state["acc"], global_tensors)
        timed[-1]["fold"] += time.perf_counter() - start  # … and finish with the last
        assert result.num_clients == n
        case.group_times += timed
        elapsed = {side: math.fsum(t[side] for t in timed) for side in SIDES}
        for side in SIDES:
            case.times[side].append(elapsed[side])
        gb = case.folded_bytes / 1e9
        log(
            f"[{case.model} N={n} repeat {r + 1}/{case.repeats}] fold {gb / elapsed['fold']:.2f} GB/s, "
            f"numpy {gb / elapsed['numpy']:.2f} GB/s, pre-stacked {gb / elapsed['prestacked']:.2f} GB/s"
        )
    state.clear()


# --------------------------------------------------------------------------- memory


def current_rss() -> int:
    """Resident set size now, in bytes (Linux ``/proc``; falls back to the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss()


def peak_rss() -> int:
    """``ru_maxrss`` in bytes (kilobytes on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def probe_memory(model: str, n: int, k: int, seed: int) -> dict:
    """Fold N updates in this (fresh) process; peaks relative to the RSS before the first fold."""
    spec = full_spec(model)
    global_tensors = model_tensors(spec, seed)
    pool = [model_tensors(spec, seed + 1 + j) for j in range(k)]
    # warm-up on the smallest tensor only: loads torch's kernels and thread pool, not model-sized buffers
    small = min(fp32_names(spec), key=lambda name: global_tensors[name].numel())
    strategy = FedAvg()
    acc = strategy.begin(global_tensors, [small])
    for i in range(2):
        strategy.fold(acc, ClientUpdate(f"warm-{i}", 1, 1.0, spec, {small: pool[0][small]}))
    strategy.finish(acc, global_tensors)
    del acc
    gc.collect()
    baseline, baseline_peak = current_rss(), peak_rss()

    start = time.perf_counter()
    acc = strategy.begin(global_tensors, list(global_tensors))
    for i in range(n):
        strategy.fold(acc, ClientUpdate(f"client-{i}", num_samples(i), 1.0, spec, pool[i % k]))
    fold_peak = peak_rss()
    result = strategy.finish(acc, global_tensors)
    finish_peak = peak_rss()
    assert result.num_clients == n
    return {
        "model": model,
        "clients": n,
        "pool": k,
        "model_bytes": fp32_bytes(spec),
        "baseline_rss": baseline,
        "baseline_peak": baseline_peak,
        "fold_peak": fold_peak,
        "finish_peak": finish_peak,
        "fold_s": time.perf_counter() - start,
    }


def run_memory_probe(model: str, n: int, k: int, seed: int, threads: int) -> dict:
    """Run :func:`probe_memory` in a fresh process, a grandchild forked by a small ``sh``.

    Linux carries a process's peak RSS across ``exec`` (``ru_maxrss`` of a child that this big
    process spawns directly starts at this process's high-water mark, or its RSS at the fork),
    so the probe is forked from a shell instead, whose own peak is a few megabytes.
    """
    cmd = [sys.executable, os.path.abspath(__file__), "--_probe-memory", model, str(n), str(k), str(seed)]
    cmd += ["--threads", str(threads)]
    launcher = ["/bin/sh", "-c", '"$@" & wait $!', "sh"] if os.path.exists("/bin/sh") else []
    proc = subprocess.run(launcher + cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe {model} N={n} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def memory_ratio(m: dict, key: str) -> float:
    return (m[key] - m["baseline_rss"]) / m["model_bytes"]


# --------------------------------------------------------------------------- report


def report(cases: list[Case], args: argparse.Namespace) -> list[dict]:
    pooled = [c for c in cases if c.pool < c.clients]
    if pooled:
        listed = ", ".join(f"{c.model} N={c.clients}" for c in pooled)
        print(
            f"pooled: {listed} reuse {args.pool} distinct updates cyclically (N models exceed the "
            f"{args.stack_budget_gb:g} GB stack budget); numpy there stacks the same P arrays once per group "
            "of P clients and accumulates the group sums"
        )
    else:
        print("pooled: none (every client has its own update; numpy stacks all N at once)")
    print()

    print("throughput (GB/s: 10⁹ bytes of fp32 client tensors per second, whole rounds, median over repeats)")
    header = (
        f"{'model':<14} {'N':>5} {'pool':>5} {'groups':>6} {'reps':>4} {'model MB':>8} {'fold':>6} {'numpy':>6} "
        f"{'fold/numpy':>10} {'end-to-end':>10} {'prestacked':>10} {'fold/pre':>8}"
    )
    print(header)
    print("-" * len(header))
    for c in cases:
        print(
            f"{c.model:<14} {c.clients:>5} {c.pool:>5} {c.groups:>6} {c.repeats:>4} {c.model_bytes / 1e6:>8.2f} "
            f"{c.rate('fold'):>6.2f} {c.rate('numpy'):>6.2f} {c.ratio('numpy'):>9.2f}× {c.end_to_end('numpy'):>9.2f}× "
            f"{c.rate('prestacked'):>10.2f} {c.ratio('prestacked'):>7.2f}×"
        )
    print(
        "fold/numpy: median over every (repeat, group) of numpy's time / the fold's for the same clients, timed "
        "back to back (begin counts with a round's first group, finish with its last); end-to-end: median over the "
        "repeats of the whole rounds' times; prestacked: np.sum over arrays stacked before timing (context only)"
    )
    print()

    print("peak memory (fresh process per case; × model: (ru_maxrss − RSS before the first fold) / model fp32 bytes)")
    header = (
        f"{'model':<14} {'N':>5} {'pool':>5} {'model MB':>8} {'base MB':>8} "
        f"{'fold +MB':>8} {'finish +MB':>10} {'fold ×':>7} {'finish ×':>8} {'fold s':>7}"
    )
    print(header)
    print("-" * len(header))
    for c in cases:
        m = c.memory
        if m is None:
            continue
        print(
            f"{c.model:<14} {c.clients:>5} {m['pool']:>5} {m['model_bytes'] / 1e6:>8.2f} "
            f"{m['baseline_rss'] / 1e6:>8.1f} {(m['fold_peak'] - m['baseline_rss']) / 1e6:>8.1f} "
            f"{(m['finish_peak'] - m['baseline_rss']) / 1e6:>10.1f} {memory_ratio(m, 'fold_peak'):>6.2f}× "
            f"{memory_ratio(m, 'finish_peak'):>7.2f}× {m['fold_s']:>7.1f}"
        )
    for c in cases:
        m = c.memory
        if m is not None and m["baseline_peak"] > m["baseline_rss"] + max(0.05 * m["model_bytes"], 1 << 20):
            before = m["baseline_peak"] / 1e6
            print(
                f"warning: {c.model} N={c.clients}: the probe's peak before folding ({before:.1f} MB) "
                "exceeds its baseline RSS, so that peak may hide the fold's"
            )
    print(
        "the probe process builds min(N, pool) distinct updates (memory does not depend on which update a client "
        "sends); float64 running means are 2× the model, finish's float32 result 1×"
    )
    print()

    print("targets")
    targets = []

    def check(name: str, ok: bool, detail: str) -> None:
        targets.append({"target": name, "pass": ok, "detail": detail})
        print(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}")

    for c in cases:
        ratio = c.ratio("numpy")
        check(
            f"{c.model} N={c.clients} fold ≥ {TARGET_RATIO:g}× numpy",
            ratio >= TARGET_RATIO,
            f"{ratio:.2f}× ({c.rate('fold'):.2f} vs {c.rate('numpy'):.2f} GB/s)",
        )
    for model in dict.fromkeys(c.model for c in cases):
        probed = sorted((c for c in cases if c.model == model and c.memory), key=lambda c: c.clients)
        if len(probed) < 2:
            continue
        lo, hi = probed[0], probed[-1]
        assert lo.memory is not None and hi.memory is not None
        slack = max(MEMORY_SLACK_MODELS, MEMORY_SLACK_BYTES / lo.model_bytes)
        base, top = memory_ratio(lo.memory, "finish_peak"), memory_ratio(hi.memory, "finish_peak")
        limit = MEMORY_GROWTH * base + slack
        series = ", ".join(f"N={c.clients}: {memory_ratio(c.memory, 'finish_peak'):.2f}×" for c in probed if c.memory)
        check(
            f"{model} peak memory independent of N",
            top <= limit,
            f"{series} model (limit at N={hi.clients}: {MEMORY_GROWTH:g} × {base:.2f} + {slack:.2f} = {limit:.2f}×)",
        )
    return targets


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--models", nargs="+", default=list(MODELS), help=f"models, space or comma separated ({','.join(MODELS)})"
    )
    p.add_argument(
        "--clients", nargs="+", default=[",".join(map(str, CLIENTS))], help="numbers of client updates (10,100,1000)"
    )
    p.add_argument("--pool", type=int, default=POOL, help=f"distinct updates reused when N models do not fit ({POOL})")
    p.add_argument("--repeats", type=int, default=REPEATS, help=f"timed repeats per case, at most ({REPEATS})")
    p.add_argument("--stack-budget-gb", type=float, default=STACK_BUDGET_GB, help="pool above this N × model size")
    p.add_argument(
        "--repeat-budget-gb", type=float, default=REPEAT_BUDGET_GB, help="fewer repeats above this much folded per case"
    )
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory probes")
    p.add_argument(
        "--threads", type=int, default=THREADS, help=f"torch threads for the fold; 0: torch's own choice ({THREADS})"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--_probe-memory", nargs=4, metavar=("MODEL", "N", "POOL", "SEED"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    if args._probe_memory:
        model, n, k, seed = args._probe_memory
        print(json.dumps(probe_memory(model, int(n), int(k), int(seed))))
        return

    models = parse_list(args.models)
    clients = sorted({int(n) for n in parse_list(args.clients)})
    for model in models:
        model_info(model)  # fail early on an unknown name
    if not clients or min(clients) < 1 or args.pool < 1 or args.repeats < 1:
        p.error("--clients, --pool and --repeats must be ≥ 1")

    stack_budget, repeat_budget = args.stack_budget_gb * 1e9, args.repeat_budget_gb * 1e9
    cases = []
    for model in models:
        model_bytes = fp32_bytes(full_spec(model))
        for n in clients:
            repeats = max(1, min(args.repeats, int(repeat_budget // (n * model_bytes))))
            k = pool_size(n, model_bytes, args.pool, stack_budget)
            cases.append(Case(model, n, k, repeats, model_bytes, groups=math.ceil(n / k)))

    print(
        f"fedatoms aggregation benchmark: torch {torch.__version__}, numpy {np.__version__}, "
        f"{torch.get_num_threads()} torch thread(s) for the fold, {os.cpu_count()} CPUs "
        f"({platform.processor() or platform.machine()}), Python {platform.python_version()}"
    )
    print(
        "fold: FedAvg().begin(global, all tensors), .fold(acc, ClientUpdate(...)) per client, .finish(acc, global); "
        "numpy: np.sum(np.stack(arrays), axis=0) per fp32 tensor"
    )
    print(
        "GB/s: 10⁹ bytes of fp32 client tensors per second (resnet18's int64 num_batches_tracked scalars are folded "
        "too but not counted)"
    )

    t0 = time.perf_counter()
    for case in cases:
        if not args.no_memory:
            log(f"[{case.model} N={case.clients}] memory probe (fresh process)")
            case.memory = run_memory_probe(case.model, case.clients, min(case.pool, args.pool), args.seed, args.threads)
            peak = case.memory["finish_peak"] - case.memory["baseline_rss"]
            log(
                f"[{case.model} N={case.clients}] peak +{peak / 1e6:.1f} MB "
                f"= {memory_ratio(case.memory, 'finish_peak'):.2f}× model"
            )
        log(f"[{case.model} N={case.clients}] throughput, {case.repeats} repeat(s), pool {case.pool}")
        bench_throughput(case, args.seed)
        gc.collect()
    log(f"done in {time.perf_counter() - t0:.0f} s")
    print()

    targets = report(cases, args)

    if args.json:
        payload = {
            "torch": torch.__version__,
            "numpy": np.__version__,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
            "cases": [
                {
                    "model": c.model,
                    "clients": c.clients,
                    "pool": c.pool,
                    "repeats": c.repeats,
                    "model_bytes": c.model_bytes,
                    "fold_gbps": c.rate("fold"),
                    "numpy_gbps": c.rate("numpy"),
                    "prestacked_gbps": c.rate("prestacked"),
                    "fold_over_numpy": c.ratio("numpy"),
                    "fold_over_prestacked": c.ratio("prestacked"),
                    "fold_over_numpy_end_to_end": c.end_to_end("numpy"),
                    "groups": c.groups,
                    "times_s": c.times,
                    "group_times_s": c.group_times,
                    "memory": c.memory,
                    "peak_over_model": memory_ratio(c.memory, "finish_peak") if c.memory else None,
                }
                for c in cases
            ],
            "targets": targets,
        }
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
