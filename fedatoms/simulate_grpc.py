"""`fedatoms simulate --transport grpc`: the same federation as the in-process simulator, through the real service.

It starts an aggregator in this process (a real gRPC server on a loopback port, with its
database — a new SQLite file unless ``database_url`` is given) or uses a running one
(``server``), registers the virtual clients in index order, runs them as real agents in
worker processes (:func:`client_agent.pool.run_grpc_pool`), and reads the per-round record
back from the aggregator's database, in the in-process simulator's format.
"""

from __future__ import annotations

import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from aggregator_service import store
from aggregator_service.config import AggregatorSettings, FederationConfig
from aggregator_service.database_url import check_url, shown
from aggregator_service.export import export_global_model
from client_agent.allowed_models import DEFAULT_ALLOWED_MODELS
from client_agent.pool import register_all, run_grpc_pool
from fedatoms.records import CATEGORY_TOTALS, TOTALS, accumulate, mean_or_none, summarize
from fedcore.reference import is_zoo

__all__ = ["federation_config", "records_from_store", "run_grpc_simulation"]


def federation_config(config: Any) -> FederationConfig:
    """The federation part of a :class:`fedatoms.simulate.SimulationConfig`."""
    return FederationConfig(**{f.name: getattr(config, f.name) for f in fields(FederationConfig)})


#: How long a simulation's registration retries an aggregator it cannot reach before it ends in one line.
REACH_SECONDS = 60.0


def run_grpc_simulation(
    config: Any,
    progress: Callable[[dict[str, Any]], None] | None = None,
    *,
    server: str | None = None,
    database_url: str | None = None,
    enrollment_secret: str | None = None,
    federation_name: str = "default",
    workers: int | None = None,
    state_dir: str | None = None,
    tls_ca: str | None = None,
    give_up_after: float | None = None,
    announce: Callable[[str], None] | None = None,
    model_out: str | Path | None = None,
    on_start: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run the federation through gRPC; returns ``{"config", "rounds", "summary"}`` like the in-process run.

    ``on_start``: called once the aggregator serves and every client registered, as the agents start.
    ``give_up_after``: how long registering retries an aggregator it cannot reach (``--server``) before the run
    ends in one line (:data:`REACH_SECONDS` unset)."""
    say = announce or (lambda text: print(text, file=sys.stderr))
    if workers is not None and config.engine == "ray":
        raise ValueError("--workers is the local engine's; with --engine ray, [simulation.resources] places clients")
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be ≥ 1, got {workers}")
    if server is None and (enrollment_secret is not None or tls_ca is not None):
        given = " and ".join(f for f, v in (("--enrollment-secret", enrollment_secret), ("--tls-ca", tls_ca)) if v)
        verb = "apply" if " and " in given else "applies"
        raise ValueError(f"{given} {verb} only with --server: the aggregator started here makes its own")
    if give_up_after is not None and not give_up_after > 0:
        raise ValueError(f"--give-up-after must be > 0, got {give_up_after}")
    config.check_device()  # as in process, before anything starts
    if tls_ca is not None and not Path(tls_ca).is_file():  # before an aggregator starts, not at the first connection
        raise ValueError(f"--tls-ca {tls_ca}: no such file")
    if server is not None and database_url is None:
        raise ValueError("with --server, give --database-url of that aggregator's database to read the record from")
    if server is not None and not enrollment_secret:
        raise ValueError("with --server, give the federation's --enrollment-secret")
    if database_url is not None:
        check_url(database_url)
    if state_dir is not None:
        try:
            Path(state_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--state-dir {state_dir}: cannot create it ({exc.strerror})") from None
    if config.download:
        from fedcore.data import load_dataset

        load_dataset(config.dataset, config.data_dir, download=True)  # once, before the workers look for it
    started = time.perf_counter()
    root = Path(state_dir or tempfile.mkdtemp(prefix="fedatoms-sim-"))
    temporary = state_dir is None  # made here: removed at the end with what it holds (a run leaves ~80 MB)
    try:
        owned = None
        pop = config.population()
        clients = pop.build(fit=())  # a split the data cannot make fails here, before anything starts or is said
        if server is None:
            if database_url is None:
                database_url = f"sqlite:///{root / 'aggregator.db'}"  # inside the root: kept or removed with it
            enrollment_secret = enrollment_secret or secrets.token_urlsafe(16)
            settings = AggregatorSettings(
                listen="127.0.0.1:0",
                database_url=database_url,
                federation_name=federation_name,
                enrollment_secret=enrollment_secret,
                deadline_seconds=3600.0,  # a simulated client is never late: its worker may just be busy
                heartbeat_timeout_seconds=3600.0,
                poll_interval_seconds=0.05,
                history_rounds=None,  # the records read every round's detail back
                eval_data=config.data or config.dataset,
                eval_data_dir=config.data_dir,
                federation=federation_config(config),
            )
            owned = _start_aggregator(settings)
            target = f"127.0.0.1:{owned[1]}"
            say(f"aggregator: {target}, database {shown(database_url)}")
        else:
            target = server
        say(f"client state: {root}")
        seen: set[int] = set()
        faults: dict[int, list[dict[str, Any]]] = {}

        reader = store.create_engine_for(database_url, sqlite_begin="DEFERRED")  # reads: never wait for the aggregator

        def poll() -> None:
            """Report rounds closed since the last poll (twice a second; one cheap read when none did). The last
            round waits for the end of the run: the final evaluation fetches still add to its bytes."""
            shown = max(seen, default=0)
            if progress is None or min(_last_closed(reader, federation_name), config.rounds - 1) <= shown:
                return
            for record in records_from_store(reader, federation_name, after=shown):
                if record["round"] not in seen and record["round"] < config.rounds:
                    seen.add(record["round"])
                    progress(record)

        try:
            keep_state = state_dir is not None  # a temporary root is never resumed from: spare the writes
            # the agents import the model this command names: its user chose that code
            allowed = DEFAULT_ALLOWED_MODELS if is_zoo(config.model) else (*DEFAULT_ALLOWED_MODELS, config.model)
            ids = register_all(
                target,
                pop,
                clients,
                enrollment_secret,
                root,
                tls_ca,
                keep_state,
                allowed_models=allowed,
                give_up_after=REACH_SECONDS if give_up_after is None else give_up_after,
            )
            del clients  # the pools rebuild theirs from pop
            # how every pool runs the agents
            agents: dict[str, Any] = dict(
                tls_ca=tls_ca,
                poll=poll,
                torch_threads=config.threads,
                keep_state=keep_state,
                allowed_models=allowed,
                device=config.device,  # every agent trains there, as the in-process clients do
            )
            if on_start is not None:
                on_start()
            if config.engine == "ray":
                from client_agent.ray_pool import run_ray_grpc_pool

                def replaced(indices: Any) -> None:  # agents restarted: the open round's record says so
                    open_round = _last_closed(reader, federation_name) + 1
                    faults.setdefault(open_round, []).extend(
                        {"client": ids[i], "phase": "agent", "outcome": "retried", "cause": "actor died"}
                        for i in indices
                    )

                run_ray_grpc_pool(target, pop, root, resources=config.resources, on_replaced=replaced, **agents)
            else:
                run_grpc_pool(target, pop, root, workers=2 if workers is None else workers, **agents)
        finally:
            reader.dispose()
            if owned is not None:
                owned[2].coordinator.shared.stop_waiting()  # held GetTask calls (of agents a failure ended) answer now
                owned[0].stop(grace=5).wait()
                owned[0].aggregator_servicer.close()  # the kept pushes' spool files
                owned[2].stop()
                owned[2].join(timeout=10)
        if owned is not None:
            owned[2].coordinator.flush()  # the last download counts, before the record is read
        records = records_from_store(database_url, federation_name)
        if not records:
            raise RuntimeError(f"no round closed in {shown(database_url)}")
        if model_out is not None:
            export_global_model(database_url, None, model_out, federation_name)
        for r in records:
            if faults.get(r["round"]):
                r["faults"] = faults[r["round"]]
        for r in records:
            if r["round"] not in seen and progress is not None:
                progress(r)
        totals = {k: records[-1][f"cumulative_{k}"] for k in TOTALS}
        summary = summarize(records, totals, time.perf_counter() - started)
        out = config.to_dict()
        if temporary:
            shutil.rmtree(root)
            held = "client state, database" if _inside(database_url, root) else "client state"
            say(f"removed the temporary directory {root} ({held})")
        _say_kept(say, root, database_url, temporary)
    except BaseException:
        if temporary:  # a failed run leaves nothing behind either
            shutil.rmtree(root, ignore_errors=True)
        _say_kept(say, root, database_url, temporary)  # a refused or failed run's too: the user's to resume
        raise
    return {"config": out, "rounds": records, "summary": summary}


def _say_kept(say: Callable[[str], None], root: Path, database_url: str | None, temporary: bool) -> None:
    """The run's last lines: what it leaves behind (all but what a temporary directory held)."""
    if not temporary:
        say(f"kept: client state in {root}")
    if database_url is not None and not (temporary and _inside(database_url, root)):
        say(f"kept: the database {shown(database_url)}")


def _inside(database_url: str, root: Path) -> bool:
    return database_url.startswith(f"sqlite:///{root}")


def _start_aggregator(settings: AggregatorSettings) -> tuple[Any, int, Any]:
    from aggregator_service.server import DeadlineTicker, build_server
    from fedwire.allocator import reuse_message_buffers

    reuse_message_buffers()  # as `fedatoms aggregator serve` does
    server, port, coordinator = build_server(settings)
    ticker = DeadlineTicker(coordinator, housekeeping=server.aggregator_servicer.housekeeping)
    server.start()
    ticker.start()
    return server, port, ticker


def _last_closed(engine: Engine, federation_name: str) -> int:
    with Session(engine) as s:
        last = s.scalar(
            select(func.max(store.Round.number))
            .join(store.Federation, store.Federation.id == store.Round.federation_id)
            .where(store.Federation.name == federation_name, store.Round.state == "closed")
        )
    return int(last or 0)


def records_from_store(url: str | Engine, federation_name: str = "default", after: int = 0) -> list[dict[str, Any]]:
    """Closed rounds after round ``after`` as the simulator's per-round records (docs/simulation.md).

    Rounds up to ``after`` are read only for the cumulative byte counts. Those count every round's
    transfers, as the dashboard's do: an abandoned round has no record, but what it moved is in the
    cumulative counts of the records after it.
    """
    own = not isinstance(url, Engine)
    engine = url if isinstance(url, Engine) else store.create_engine_for(url, sqlite_begin="DEFERRED")
    records: list[dict[str, Any]] = []
    try:
        with Session(engine) as s:
            fed = store.get_federation(s, federation_name)
            if fed is None:
                return []
            personal = FederationConfig.reports_personalized(fed.config)
            totals = dict.fromkeys(TOTALS, 0)
            rows = s.execute(
                select(store.Round, store.RoundMetrics)
                .join(
                    store.RoundMetrics,
                    (store.RoundMetrics.federation_id == store.Round.federation_id)
                    & (store.RoundMetrics.round == store.Round.number),
                )
                .where(store.Round.federation_id == fed.id, store.Round.state == "closed")
                .order_by(store.Round.number)
            ).all()
            moved = _transfers(s, fed.id)
            closed = {rnd.number for rnd, _ in rows}
            unrecorded = sorted(k for k in moved if k not in closed)  # abandoned rounds: bytes, no record
            for rnd, m in rows:
                n = rnd.number
                while unrecorded and unrecorded[0] < n:
                    abandoned = moved[unrecorded.pop(0)]
                    for key in TOTALS:
                        totals[key] += abandoned[key]
                bandwidth = moved.get(n, dict.fromkeys(TOTALS, 0))
                if n <= after:
                    for key in TOTALS:
                        totals[key] += bandwidth[key]
                    continue
                evals = s.execute(
                    select(store.Evaluation.global_accuracy, store.Evaluation.personalized_accuracy)
                    .join(store.Client, store.Client.id == store.Evaluation.client_id)
                    .where(store.Evaluation.federation_id == fed.id, store.Evaluation.round == n)
                    .order_by(store.Client.number)
                ).all()
                extra = m.extra or {}
                record: dict[str, Any] = {
                    "round": n,
                    "cohort_size": len(rnd.cohort),
                    "reported": rnd.reported,
                    "test_accuracy": m.test_accuracy,
                    "test_loss": m.test_loss,
                    "local_accuracy": mean_or_none([g for g, _ in evals if g is not None]),
                    "bytes_up": bandwidth["bytes_up"],
                    "bytes_down": bandwidth["bytes_down"],
                    **{key: bandwidth[key] for key in CATEGORY_TOTALS},
                    "dispersion": m.dispersion,
                    "effective_dispersion": dict(extra.get("effective_dispersion", {})),
                    "latent_clients": m.latent_clients,
                    "tensors": _tensors(s, fed.id, n, set(rnd.due)),
                }
                if "tier_accuracy" in extra:
                    record["tier_accuracy"] = dict(extra["tier_accuracy"])
                if personal:
                    record["personalized_accuracy"] = mean_or_none([p for _, p in evals if p is not None])
                record["fedavg_equivalent_bytes"] = bandwidth["fedavg_equivalent_bytes"]
                record["wall_seconds"] = round(float(m.duration_seconds or 0.0), 4)
                accumulate(record, totals)
                records.append(record)
    finally:
        if own:
            engine.dispose()
    return records


def _transfers(s: Session, federation_id: int) -> dict[int, dict[str, int]]:
    """Round → the record's bandwidth counts (:data:`TOTALS`), from ``round_bytes``: the ledger's per-round sums."""
    b = store.RoundBytes
    rows = s.execute(
        select(b.round, b.category, b.bytes, b.fedavg_equivalent_bytes).where(b.federation_id == federation_id)
    ).all()
    out: dict[int, dict[str, int]] = {}
    for r, category, nbytes, fedavg in rows:
        counts = out.setdefault(r, dict.fromkeys(TOTALS, 0))
        counts[f"bytes_{store.TRANSFER_CATEGORIES[category]}"] += int(nbytes)
        counts[f"bytes_{category}"] += int(nbytes)
        counts["fedavg_equivalent_bytes"] += int(fedavg)
    return out


def _tensors(s: Session, federation_id: int, round_: int, due: set[str]) -> dict[str, dict[str, Any]]:
    rows = s.scalars(
        select(store.TensorMetric)
        .where(store.TensorMetric.federation_id == federation_id, store.TensorMetric.round == round_)
        .order_by(store.TensorMetric.ordinal)
    ).all()
    return {
        t.name: {
            "role": t.role,
            "interval": t.interval,
            "due": t.name in due,
            "version": t.version,
            "d_l": t.d_l,
            "dispersion": t.dispersion,
            "bytes_down": t.bytes_down,
            "bytes_up": t.bytes_up,
        }
        for t in rows
    }
