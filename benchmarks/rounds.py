"""Wall time per round, gRPC vs in-process transport, with a tiny model (the service dominates, not training).

The same federation is run twice per population size N (``--clients``, default 10 and 100),
in the same process run, one transport after the other:

- **in-process**: :func:`fedatoms.simulate.run_simulation` with ``transport="inprocess"`` —
  one Python loop in this process (``torch.set_num_threads(1)``) that plans, fetches, trains
  every client, folds, closes, evaluates on the server's test set, then has every client
  fetch and evaluate the new model.
- **gRPC**: the same with ``transport="grpc"`` — a real aggregator (gRPC server on a
  loopback port, SQLite database in a temporary directory) in this process, the N virtual
  clients registered, then run as real :class:`client_agent.agent.Agent` s in ``--workers``
  spawned worker processes (one torch thread each), as ``fedatoms simulate --transport grpc``
  runs them without ``--state-dir`` (a temporary state root: no client state written).

Both do the same work per round: N local trainings, one fold, one close with the server's
evaluation on the digits test split, N client evaluations of the new model.

Method. A round's wall time is the time **between consecutive round closes** (a steady-state
period, so work that overlaps round boundaries — the agents' evaluation of round r−1 running
while round r trains — is counted once in both transports):

- gRPC: the ``closed_at`` timestamps of the ``rounds`` table (written by the aggregator in
  the closing transaction), read from the database after the run;
- in-process: the loop is sequential, so the period is the time between the ends of
  consecutive iterations (stamped in the ``progress`` callback, which fires after the
  round closed and the clients evaluated).

Round 1 is skipped on both sides (the gRPC period before it includes worker start-up,
dataset loading and registration; the in-process one includes data partitioning), so R
rounds give R−1 periods. Each N runs ``--repeats`` times (default 2), in-process and gRPC
interleaved, so a noisy spell of a shared machine weighs on both; the periods of all
repetitions are pooled. The table shows each side's median period, and the ratio of the
medians (gRPC / in-process) per N. Target: ratio ≤ 1.5×. The ranges are printed too.

Model: ``digits-cnn`` on 8×8 digits, ``factorization="none"``, tiers [1.0], fraction 1.0
(every client every round), 1 local epoch, batch size 10.

    .venv/bin/python benchmarks/rounds.py [--clients 10,100] [--rounds 6] [--workers 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import itertools
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET = 1.5


def make_config(transport: str, clients: int, rounds: int, seed: int) -> Any:
    from fedatoms.simulate import SimulationConfig

    return SimulationConfig(
        transport=transport,
        dataset="digits",
        model="digits-cnn",
        factorization="none",
        clients=clients,
        fraction=1.0,
        min_clients=clients,
        rounds=rounds,
        local_epochs=1,
        batch_size=10,
        lr=0.05,
        tiers=[1.0],
        interval_policy="every_round",
        seed=seed,
        device="cpu",
    )


def say(text: str) -> None:
    print(text, flush=True)


def cpu_seconds() -> float:
    """CPU time of this process and of its reaped children (the gRPC workers, once their pool shut down)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_inprocess(clients: int, rounds: int, seed: int) -> tuple[list[float], float, float]:
    """``(periods after round 1, seconds until round 1 ended, total seconds)``."""
    from fedatoms.simulate import run_simulation

    ends: dict[int, float] = {}
    t0 = time.perf_counter()

    def progress(record: dict[str, Any]) -> None:
        ends[record["round"]] = time.perf_counter()
        say(f"    in-process round {record['round']}: +{ends[record['round']] - t0:6.2f} s")

    run_simulation(make_config("inprocess", clients, rounds, seed), progress=progress)
    total = time.perf_counter() - t0
    return _periods(ends), ends[1] - t0, total


def run_grpc(clients: int, rounds: int, seed: int, workers: int) -> tuple[list[float], float, float, list[float]]:
    """``(periods after round 1, seconds until round 1 closed, total seconds, open→close seconds of rounds ≥ 2)``."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from aggregator_service import store
    from fedatoms.simulate import run_simulation

    with tempfile.TemporaryDirectory(prefix="fedatoms-bench-rounds-") as tmp:
        url = f"sqlite:///{Path(tmp) / 'agg.db'}"
        # no --state-dir, as a researcher runs it: the clients' state root is a new temporary directory
        # (so they write no state), made in ``tmp`` so it goes with it
        saved_tempdir, tempfile.tempdir = tempfile.tempdir, tmp
        t0 = time.perf_counter()
        wall0 = time.time()

        def progress(record: dict[str, Any]) -> None:
            say(f"    gRPC round {record['round']} seen: +{time.perf_counter() - t0:6.2f} s")

        try:
            run_simulation(
                make_config("grpc", clients, rounds, seed),
                progress=progress,
                database_url=url,
                workers=workers,
                announce=lambda text: None,
            )
        finally:
            tempfile.tempdir = saved_tempdir
        total = time.perf_counter() - t0
        engine = store.create_engine_for(url)
        try:
            with Session(engine) as s:
                rows = s.execute(
                    select(store.Round.number, store.Round.opened_at, store.Round.closed_at)
                    .where(store.Round.state == "closed")
                    .order_by(store.Round.number)
                ).all()
        finally:
            engine.dispose()
    closes = {n: c.timestamp() for n, _, c in rows if c is not None}
    open_close = [c.timestamp() - o.timestamp() for n, o, c in rows if n >= 2 and c is not None]
    return _periods(closes), closes[1] - wall0, total, open_close


def _periods(stamps: dict[int, float]) -> list[float]:
    rounds = sorted(stamps)
    return [stamps[b] - stamps[a] for a, b in itertools.pairwise(rounds)]


def fmt_range(values: list[float]) -> str:
    return f"{min(values):.3f}–{max(values):.3f}" if values else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="10,100", help="comma-separated population sizes (default 10,100)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per run; round 1 is skipped (default 6)")
    parser.add_argument("--workers", type=int, default=2, help="gRPC client worker processes (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=2, help="interleaved in-process/gRPC repetitions per N, pooled (default 2)"
    )
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.clients.split(",") if x.strip()]
    if args.rounds < 3:
        parser.error("--rounds must be ≥ 3 (round 1 is skipped; a median wants ≥ 2 periods)")
    if args.repeats < 1:
        parser.error("--repeats must be ≥ 1")

    import torch

    torch.set_num_threads(1)  # the in-process loop (and the in-process aggregator) on one thread, like each worker
    say(
        f"rounds per run {args.rounds} (round 1 skipped), gRPC workers {args.workers}, "
        f"model digits-cnn, factorization none, fraction 1.0, 1 local epoch; target gRPC ≤ {TARGET}× in-process"
    )
    say("per-round wall time = time between consecutive round closes (gRPC: rounds.closed_at; in-process: loop ends)")
    results = []
    started = time.perf_counter()
    for n in sizes:
        ip: list[float] = []
        gp: list[float] = []
        open_close: list[float] = []
        ip_firsts: list[float] = []
        ip_totals: list[float] = []
        g_firsts: list[float] = []
        g_totals: list[float] = []
        cpu_ip: list[float] = []
        cpu_g: list[float] = []
        for rep in range(1, args.repeats + 1):  # interleaved, so a noisy spell weighs on both transports
            say(f"N={n}, repetition {rep}/{args.repeats}: in-process …")
            c0 = cpu_seconds()
            periods, first, total = run_inprocess(n, args.rounds, args.seed)
            c1 = cpu_seconds()
            ip += periods
            ip_firsts.append(first)
            ip_totals.append(total)
            say(f"N={n}, repetition {rep}/{args.repeats}: gRPC ({args.workers} workers) …")
            periods, first, total, oc = run_grpc(n, args.rounds, args.seed, args.workers)
            gp += periods
            open_close += oc
            g_firsts.append(first)
            g_totals.append(total)
            cpu_ip.append((c1 - c0) / args.rounds)
            cpu_g.append((cpu_seconds() - c1) / args.rounds)
        med = statistics.median
        cpu = (med(cpu_ip), med(cpu_g))
        results.append((n, ip, med(ip_firsts), med(ip_totals), gp, med(g_firsts), med(g_totals), open_close, cpu))
        say(f"N={n}: in-process median {med(ip):.3f} s/round, gRPC median {med(gp):.3f} s/round")

    say("")
    say(
        f"{'N':>5}  {'in-process s/round':>19} {'(range)':>13}  {'gRPC s/round':>13} {'(range)':>13}  "
        f"{'gRPC open→close':>15}  {'ratio':>6}  {'verdict':<12}  {'first round ip/gRPC':>20}  {'total ip/gRPC':>14}"
        f"  {'CPU s/round ip/gRPC':>20}"
    )
    failed = False
    for n, ip, ip_first, ip_total, gp, g_first, g_total, open_close, cpu in results:
        mi, mg = statistics.median(ip), statistics.median(gp)
        ratio = mg / mi
        ok = ratio <= TARGET
        failed |= not ok
        say(
            f"{n:>5}  {mi:>19.3f} {fmt_range(ip):>13}  {mg:>13.3f} {fmt_range(gp):>13}  "
            f"{statistics.median(open_close):>15.3f}  {ratio:>5.2f}×  {'PASS' if ok else 'BELOW TARGET':<12}  "
            f"{ip_first:>9.2f} / {g_first:>6.2f} s  {ip_total:>6.1f} / {g_total:>5.1f} s"
            f"  {cpu[0]:>9.2f} / {cpu[1]:>6.2f} s"
        )
    say("")
    say(
        f"ratio = median gRPC period / median in-process period (rounds 2..{args.rounds} of {args.repeats} interleaved "
        f"repetitions, pooled); target ≤ {TARGET}×. 'gRPC open→close' is the median of the database's per-round "
        "duration, for reference; first round and totals are medians over the repetitions."
    )
    say(
        "CPU s/round: CPU time of the whole run (start-up and registration included; gRPC: aggregator and "
        "workers) / rounds — steadier than wall time on a shared machine, and what 2 cores must fit."
    )
    say(f"benchmark wall time: {time.perf_counter() - started:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
