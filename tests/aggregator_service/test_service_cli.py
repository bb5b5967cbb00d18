"""The operator's commands: `fedatoms db upgrade`, `fedatoms aggregator export`, `fedatoms aggregator revoke`."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch
from grpc_helpers import global_tensors, register, shards
from safetensors.torch import load_file
from sqlalchemy import create_engine, inspect
from sqlalchemy.engine import make_url

from aggregator_service import store
from aggregator_service.config import AggregatorSettings
from aggregator_service.database_url import shown
from fedatoms.cli import main
from fedcore.layers import reconstruct_filter

ROOT = Path(__file__).resolve().parents[2]


def test_db_upgrade_creates_the_schema(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'new.db'}"
    out = subprocess.run(
        [sys.executable, "-m", "fedatoms", "db", "upgrade", "--database-url", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "schema at" in out.stdout
    engine = create_engine(url)
    assert {"federations", "clients", "rounds", "global_tensors", "updates"} <= set(inspect(engine).get_table_names())
    engine.dispose()


def test_export_and_revoke(start_service, sqlite_url, tmp_path, capsys) -> None:
    svc = start_service(sqlite_url)
    data = shards(2, 60)
    a, b = register(svc.stub, 1.0, data[0]), register(svc.stub, 0.25, data[1])
    out = tmp_path / "model.safetensors"
    assert main(["aggregator", "export", "--round", "1", str(out), "--database-url", sqlite_url]) == 2
    assert "last closed round, 0" in capsys.readouterr().err
    for c in (a, b):
        c.round_trip()
    before = os.umask(0o022)  # the usual: a file a user hands on is readable by others
    try:
        assert main(["aggregator", "export", "--round", "1", str(out), "--database-url", sqlite_url]) == 0
    finally:
        os.umask(before)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644  # as any file the user writes (safetensors made it 0600)
    exported = load_file(str(out))
    served = global_tensors(sqlite_url)
    for name, (tensor, _version) in served.items():
        assert torch.equal(exported[name], tensor), name
    for module in ("conv1", "conv2"):
        expected = reconstruct_filter(served[f"{module}.coefficients"][0], served[f"{module}.atoms"][0])
        assert torch.allclose(exported[f"{module}.weight"], expected)
    assert exported["conv2.weight"].shape == (64, 32, 3, 3)

    assert main(["aggregator", "revoke", a.client_id, "--database-url", sqlite_url]) == 0
    with pytest.raises(grpc.RpcError) as info:
        a.task()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "token revoked" in info.value.details()
    assert b.task().WhichOneof("kind") in ("train", "wait")
    assert main(["aggregator", "revoke", "no-such-client", "--database-url", sqlite_url]) == 2


def test_export_reads_while_another_connection_holds_the_write_lock(start_service, sqlite_url, tmp_path) -> None:
    """A running aggregator's commit in progress (here a ``BEGIN IMMEDIATE`` held open) does not stall an
    export: it only reads, under WAL, and before took the write lock itself (waiting 30 s, then failing)."""
    svc = start_service(sqlite_url)
    for c in [register(svc.stub, 1.0, d) for d in shards(2, 60)]:
        c.round_trip()
    out, codes = tmp_path / "model.safetensors", []
    writer = sqlite3.connect(make_url(sqlite_url).database, timeout=30, isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")
        export = threading.Thread(
            target=lambda: codes.append(main(["aggregator", "export", str(out), "--database-url", sqlite_url]))
        )
        export.start()
        export.join(15)
        finished = not export.is_alive()
        writer.execute("ROLLBACK")
    finally:
        writer.close()
    export.join(60)
    assert finished and codes == [0]
    exported = load_file(str(out))
    assert all(torch.equal(exported[name], tensor) for name, (tensor, _v) in global_tensors(sqlite_url).items())


def test_settings_from_toml_env_and_overrides(tmp_path, monkeypatch) -> None:
    path = tmp_path / "f.toml"
    path.write_text('listen = "127.0.0.1:6000"\nquorum = 0.8\n[federation]\nrounds = 7\nlr = 0.1\n')
    monkeypatch.setenv("FEDATOMS_FEDERATION__ROUNDS", "9")
    s = AggregatorSettings.from_toml(path, listen="127.0.0.1:7000", database_url=None)
    assert (s.listen, s.quorum, s.federation.rounds, s.federation.lr) == ("127.0.0.1:7000", 0.8, 9, 0.1)
    with pytest.raises(ValueError, match="not a loopback address"):
        AggregatorSettings(listen="0.0.0.0:50051")
    assert AggregatorSettings(listen="0.0.0.0:50051", allow_insecure=True).listen == "0.0.0.0:50051"
    with pytest.raises(ValueError, match="tiers below 1"):
        AggregatorSettings(federation={"tiers": [1.0, 0.5]})


@pytest.mark.parametrize(
    ("env", "read"),
    [
        ({"TIERS": "[1.0, 0.25]"}, {"tiers": [1.0, 0.25]}),
        ({"TIERS": "1, 0.125"}, {"tiers": [1.0, 0.125]}),
        ({"FULL_RANK": "conv1,conv2"}, {"full_rank": ["conv1", "conv2"]}),
        ({"INPUT_SHAPE": "[1, 8, 8]"}, {"input_shape": [1, 8, 8]}),
        ({"NORMALIZATION": '{"mean": [0.5], "std": [0.25]}'}, {"normalization": {"mean": [0.5], "std": [0.25]}}),
    ],
)
def test_list_and_table_keys_come_from_the_environment(monkeypatch, env: dict, read: dict) -> None:
    """federation.example.toml: "Every key may also come from the environment". Lists were refused as not lists."""
    monkeypatch.setenv("FEDATOMS_FEDERATION__FACTORIZATION", "lowrank")
    for key, value in env.items():
        monkeypatch.setenv(f"FEDATOMS_FEDERATION__{key}", value)
    federation = AggregatorSettings().federation
    assert {k: getattr(federation, k) for k in read} == read


def test_settings_record_a_benchmarks_normalization_on_their_own_copy_of_the_federation() -> None:
    """The federation a caller passes stays as made: a second aggregator given it without eval_data was told
    the first one's recorded normalization."""
    from aggregator_service.config import FederationConfig

    mine = FederationConfig()
    settings = AggregatorSettings(federation=mine, eval_data="digits")
    assert settings.federation.normalization is not None and mine.normalization is None
    assert AggregatorSettings(federation=mine).federation.normalization is None


def test_a_table_key_that_is_not_json_is_refused_in_words(monkeypatch) -> None:
    monkeypatch.setenv("FEDATOMS_FEDERATION__MODEL_ARGS", "{width: 2}")
    with pytest.raises(ValueError, match=r"model_args: '\{width: 2\}' is not a JSON object"):
        AggregatorSettings()


def test_export_without_round_takes_the_last_closed_one_and_reads_only_the_store_keys_of_the_servers_file(
    start_service, sqlite_url, tmp_path, capsys
) -> None:
    """The server's file, as deploy/ ships it for another machine: listening on all interfaces without TLS,
    a spool directory and evaluation data that exist only there, a strategy plugin not installed here.
    Export reads its database_url and nothing else; before, it refused to "serve without TLS"."""
    svc = start_service(sqlite_url)
    clients = [register(svc.stub, 1.0, d) for d in shards(2, 60)]
    for c in clients:
        c.round_trip()
    server_file = tmp_path / "federation.toml"
    server_file.write_text(
        f'listen = "0.0.0.0:50051"\ndatabase_url = "{sqlite_url}"\nspool_dir = "/var/spool/fedatoms-absent"\n'
        'eval_data = "/srv/absent-eval-images"\n[federation]\nstrategy = "absent_plugin.strategies:Mine"\n'
    )
    out = tmp_path / "model.safetensors"
    assert main(["aggregator", "export", str(out), "--config", str(server_file)]) == 0
    assert "global model after round 1 written to" in capsys.readouterr().out
    served = global_tensors(sqlite_url)
    exported = load_file(str(out))
    assert all(torch.equal(exported[name], tensor) for name, (tensor, _v) in served.items())
    assert main(["aggregator", "revoke", clients[0].client_id, "--config", str(server_file)]) == 0


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_export_and_revoke_on_a_wrong_database_say_so_in_one_line_and_create_nothing(
    backend, tmp_path, capsys, request
) -> None:
    if backend == "sqlite":
        missing = tmp_path / "no-such.db"
        url, expected = f"sqlite:///{missing}", f"no database at {missing}"
    else:
        url, expected = request.getfixturevalue("postgres_url"), "never migrated"  # an empty schema
    for argv in (
        ["aggregator", "export", str(tmp_path / "m.safetensors"), "--database-url", url],
        ["aggregator", "revoke", "some-client", "--database-url", url],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "no-such.db").exists() and not (tmp_path / "m.safetensors").exists()
    assert main(["aggregator", "export", "m.safetensors", "--database-url", "/tmp/fedatoms.db"]) == 2
    assert "is not a database URL" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["no-server", "no-database"])
def test_serve_and_db_upgrade_on_a_database_they_cannot_reach_say_so_in_one_line(where, capsys) -> None:
    """Both printed SQLAlchemy's 114-line traceback (exit 1); export already said it in one line."""
    from support import free_port, postgres_base

    if where == "no-server":  # a port nothing listens on
        url = f"postgresql+psycopg://fedatoms:hunter2@127.0.0.1:{free_port()}/fed"
        said = "Connection refused"
    else:  # the tests' server, a database it does not have
        url = (
            make_url(postgres_base())
            .set(password="hunter2", database="fedatoms_absent_db")
            .render_as_string(hide_password=False)
        )
        said = 'database "fedatoms_absent_db" does not exist'
    for argv in (["aggregator", "serve", "--database-url", url], ["db", "upgrade", "--database-url", url]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("fedatoms: error:")]
        assert len(errors) == 1 and "Traceback" not in err and "hunter2" not in err, err
        assert errors[0].startswith(f"fedatoms: error: cannot read the database {shown(url)}: ") and said in errors[0]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("/var/lib/fedatoms.db", "'/var/lib/fedatoms.db' is not a database URL"),
        (
            "postgresql+psycopg//fedatoms:hunter2@db/fed",
            "'postgresql+psycopg//fedatoms:***@db/fed' is not a database URL",
        ),
        ("mysql://fedatoms:hunter2@db/fed", "mysql://fedatoms:***@db/fed: the store runs on sqlite or postgresql"),
        ("postgres://fedatoms:hunter2@db/fed", "postgres://fedatoms:***@db/fed: write postgresql+psycopg://"),
        ("postgresql+asyncpg://fedatoms:hunter2@db/fed", "asyncpg is an asyncio driver"),
        ("postgresql+psycopg//fedatoms:hun/ter2@db/fed", "'postgresql+psycopg//fedatoms:***@db/fed' is not a"),
        ("postgresql+psycopg//fedatoms:hun@t:er2@db/fed", "'postgresql+psycopg//fedatoms:***@db/fed' is not a"),
    ],
)
def test_every_command_refuses_a_mistyped_database_url_in_one_line_without_its_password(
    url, expected, tmp_path, capsys
) -> None:
    for argv in (
        ["aggregator", "serve"],
        ["dashboard", "serve"],
        ["db", "upgrade"],
        ["aggregator", "export", str(tmp_path / "m.safetensors")],
        ["aggregator", "revoke", "some-client"],
    ):
        assert main([*argv, "--database-url", url]) == 2, argv
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("fedatoms: error: ") and expected in lines[0], (argv, err)
        assert "hunter2" not in err and "er2" not in err
    assert list(tmp_path.iterdir()) == []


def test_export_to_a_directory_names_the_mistake(start_service, sqlite_url, tmp_path, capsys) -> None:
    start_service(sqlite_url)
    assert main(["aggregator", "export", str(tmp_path), "--database-url", sqlite_url]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_a_database_password_never_reaches_an_error_line(postgres_url, tmp_path, capsys) -> None:
    """PostgreSQL here trusts every connection, so a URL with a password connects and the refusals come from the
    store itself: no such federation, no such client."""
    url = make_url(postgres_url).set(password="hunter2").render_as_string(hide_password=False)
    store.upgrade(url)
    for argv, expected in (
        (["aggregator", "export", str(tmp_path / "m.safetensors")], "no federation 'default'"),
        (["aggregator", "revoke", "some-client"], "no client 'some-client'"),
        (["db", "upgrade"], "schema at"),
    ):
        code = main([*argv, "--database-url", url])
        out = capsys.readouterr()
        assert code == (0 if argv[0] == "db" else 2), out
        assert expected in out.out + out.err and ":***@" in out.out + out.err, out
        assert "hunter2" not in out.out + out.err


@pytest.mark.parametrize("tier", ["0", "-1", "2", "nan", "1/0", "abc"])
def test_export_refuses_what_is_no_tier_before_it_opens_the_store(tier, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["aggregator", "export", str(tmp_path / "m.safetensors"), "--tier", tier, "--database-url", "nonsense"])
    assert exit_.value.code == 2
    assert f"argument --tier: {tier!r} is not a tier" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
