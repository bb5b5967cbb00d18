"""Operations over real gRPC on loopback: TLS and mutual TLS, pause/resume, ReportEvaluation bookkeeping."""

from __future__ import annotations

import hashlib
import os
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_helpers import SECRET, register, shards, snapshot
from sqlalchemy import event, func, select

from aggregator_service import store
from fedatoms.cli import main
from fedwire.v1 import aggregator_pb2 as pb
from fedwire.v1 import aggregator_pb2_grpc as pb_grpc

OPENSSL = shutil.which("openssl")


def _openssl(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _signed(cwd: Path, name: str, usage: str, san: str | None) -> None:
    """``name.key`` and ``name.pem`` signed by ``ca``; ``usage`` is the extended key usage."""
    ext = [f"extendedKeyUsage={usage}"] + ([f"subjectAltName={san}"] if san else [])
    (cwd / f"{name}.ext").write_text("\n".join(ext) + "\n")
    key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-new", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=cwd)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=cwd,
    )  # fmt: skip


def _ca(d: Path) -> None:
    """A self-signed CA (``ca.key``, ``ca.pem``) in ``d``."""
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=fedatoms test CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost and a client certificate, made by openssl."""
    if OPENSSL is None:
        pytest.skip("the openssl command-line tool is not installed: TLS service tests need it to make certificates")
    d = tmp_path / "pki"
    d.mkdir()
    _ca(d)
    _signed(d, "server", "serverAuth", "IP:127.0.0.1,DNS:localhost")
    _signed(d, "client", "clientAuth", None)
    _signed(d, "client2", "clientAuth", None)
    return d


def _register(channel: grpc.Channel) -> pb.RegisterReply:
    stub = pb_grpc.AggregatorStub(channel)
    return stub.Register(
        pb.RegisterRequest(profile=pb.CapabilityProfile(num_samples=10), enrollment_secret=SECRET), timeout=10
    )


def _refused(channel: grpc.Channel) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        _register(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    return info.value


def test_tls_register_and_plaintext_refused(start_service, sqlite_url, pki: Path) -> None:
    svc = start_service(sqlite_url, tls_cert=pki / "server.pem", tls_key=pki / "server.key")
    target = f"127.0.0.1:{svc.port}"
    creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())
    with grpc.secure_channel(target, creds) as channel:
        reply = _register(channel)
        assert reply.client_id and reply.token
    with grpc.insecure_channel(target) as channel:  # plaintext HTTP/2 against a TLS port
        _refused(channel)
    # a client that trusts another CA does not talk to this server either
    with grpc.secure_channel(
        target, grpc.ssl_channel_credentials(root_certificates=(pki / "client.pem").read_bytes())
    ) as channel:
        _refused(channel)


def test_the_images_health_probe_trusts_the_servers_own_certificate_even_one_a_ca_issued(
    start_service, sqlite_url, pki
) -> None:
    """deploy/images/grpc_health.py (the containers' health check and Kubernetes' liveness probe) trusts
    FEDATOMS_TLS_CERT itself: gRPC's TLS takes a trusted leaf as the chain's anchor, so a certificate a CA issued
    passes without the CA, as compose.tls.yaml's clients' `--tls-ca server.crt` does. Another certificate fails,
    and so does a draining server under `ready` (NOT_SERVING, exit 1) while `live` passes."""
    svc = start_service(sqlite_url, tls_cert=pki / "server.pem", tls_key=pki / "server.key")
    # installed as the image installs it: run as grpc_health.py, its own name would shadow grpc_health.v1
    probe = pki / "fedatoms-grpc-health"
    shutil.copy(Path(__file__).parents[2] / "deploy" / "images" / "grpc_health.py", probe)
    env = {**os.environ, "FEDATOMS_HEALTH_ADDR": f"127.0.0.1:{svc.port}", "FEDATOMS_HEALTH_TLS_NAME": "localhost"}

    def run(mode: str, cert: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, str(probe), mode]
        return subprocess.run(cmd, env={**env, "FEDATOMS_TLS_CERT": str(pki / cert)}, capture_output=True, text=True)

    ready = run("ready", "server.pem")
    assert ready.returncode == 0 and ready.stdout.strip().endswith(": SERVING"), ready
    other = run("live", "client.pem")
    assert other.returncode == 1 and "UNAVAILABLE" in other.stderr, other
    svc.server.health_servicer.enter_graceful_shutdown()  # what SIGTERM does first
    draining = run("ready", "server.pem")
    assert draining.returncode == 1 and draining.stdout.strip().endswith(": NOT_SERVING"), draining
    assert run("live", "server.pem").returncode == 0


def test_mutual_tls_needs_a_client_certificate_of_the_ca(start_service, sqlite_url, pki: Path) -> None:
    svc = start_service(
        sqlite_url, tls_cert=pki / "server.pem", tls_key=pki / "server.key", tls_client_ca=pki / "ca.pem"
    )
    target = f"127.0.0.1:{svc.port}"
    root = (pki / "ca.pem").read_bytes()
    with grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=root)) as channel:
        _refused(channel)  # no client certificate: the handshake fails
    with_cert = grpc.ssl_channel_credentials(
        root_certificates=root,
        private_key=(pki / "client.key").read_bytes(),
        certificate_chain=(pki / "client.pem").read_bytes(),
    )
    with grpc.secure_channel(target, with_cert) as channel:
        assert _register(channel).token
    with grpc.insecure_channel(target) as channel:
        _refused(channel)


def test_mutual_tls_binds_the_token_to_the_registering_certificate(start_service, sqlite_url, pki: Path) -> None:
    svc = start_service(
        sqlite_url, tls_cert=pki / "server.pem", tls_key=pki / "server.key", tls_client_ca=pki / "ca.pem"
    )
    target = f"127.0.0.1:{svc.port}"

    def creds(name: str) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=(pki / "ca.pem").read_bytes(),
            private_key=(pki / f"{name}.key").read_bytes(),
            certificate_chain=(pki / f"{name}.pem").read_bytes(),
        )

    with grpc.secure_channel(target, creds("client")) as channel:
        reply = _register(channel)
        auth = (("authorization", f"Bearer {reply.token}"),)
        beat = pb_grpc.AggregatorStub(channel).Heartbeat(pb.HeartbeatRequest(), metadata=auth, timeout=10)
        assert beat.server_time_unix > 0  # its own certificate: honoured
    engine = store.create_engine_for(sqlite_url)
    try:
        with store.session_factory(engine)() as s:
            row = s.get(store.Client, reply.client_id)
            assert row is not None
            der = ssl.PEM_cert_to_DER_cert((pki / "client.pem").read_text())
            assert row.cert_sha256 == hashlib.sha256(der).hexdigest()
            before = (row.last_seen, s.scalar(select(func.count()).select_from(store.Client)))
        # the same token from another enrolled device (another certificate of the CA) is refused
        with grpc.secure_channel(target, creds("client2")) as channel:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.AggregatorStub(channel).Heartbeat(pb.HeartbeatRequest(), metadata=auth, timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "bound to the client certificate it registered with" in info.value.details()
        with store.session_factory(engine)() as s:
            row = s.get(store.Client, reply.client_id)
            assert row is not None
            assert (row.last_seen, s.scalar(select(func.count()).select_from(store.Client))) == before

        # the device's certificate is renewed: the operator rebinds the token, with the server running
        assert (
            main(
                [
                    "aggregator",
                    "rebind",
                    reply.client_id,
                    "--client-cert",
                    str(pki / "client2.pem"),
                    "--database-url",
                    sqlite_url,
                ]
            )
            == 0
        )
        for name, ok in (("client2", True), ("client", False)):
            with grpc.secure_channel(target, creds(name)) as channel:
                call = lambda: pb_grpc.AggregatorStub(channel).Heartbeat(  # noqa: E731
                    pb.HeartbeatRequest(), metadata=auth, timeout=10
                )
                if ok:
                    assert call().server_time_unix > 0
                else:
                    with pytest.raises(grpc.RpcError) as info:
                        call()
                    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        engine.dispose()


def test_rebind_refuses_what_it_cannot_bind(sqlite_url, pki: Path, tmp_path: Path, capsys) -> None:
    """Unknown client, a file that is no certificate, a revoked client: exit 2, a clear message, nothing changed."""
    store.upgrade(sqlite_url)
    engine = store.create_engine_for(sqlite_url)
    try:
        with store.session_factory(engine).begin() as s:
            fed = store.create_federation(s, "default", {}, "s3cret", iterations=1_000)
            row, _ = store.register_client(s, fed, {}, 1.0, cert_sha256="a" * 64)
            client_id = row.id
        garbage = tmp_path / "not.pem"
        garbage.write_text("hello")
        url = ["--database-url", sqlite_url]
        cert = ["--client-cert", str(pki / "client2.pem")]
        assert main(["aggregator", "rebind", "no-such-client", *cert, *url]) == 2
        assert "no client 'no-such-client'" in capsys.readouterr().err
        assert main(["aggregator", "rebind", client_id, "--client-cert", str(garbage), *url]) == 2
        assert "is not a PEM certificate" in capsys.readouterr().err
        assert main(["aggregator", "revoke", client_id, *url]) == 0
        assert main(["aggregator", "rebind", client_id, *cert, *url]) == 2
        assert "is revoked" in capsys.readouterr().err
        with store.session_factory(engine)() as s:
            row = s.get(store.Client, client_id)
            assert row is not None and row.cert_sha256 == "a" * 64
    finally:
        engine.dispose()


def test_pause_answers_wait_and_resume_continues(start_service, sqlite_url) -> None:
    svc = start_service(sqlite_url)
    data = shards(2, 60)
    a, b = register(svc.stub, 0.25, data[0]), register(svc.stub, 1.0, data[1])
    svc.coordinator.set_paused(True)  # what the dashboard calls
    assert svc.coordinator.state == "paused"
    for c in (a, b):
        task = c.task()
        assert task.WhichOneof("kind") == "wait", task
        assert "paused" in task.wait.reason and task.wait.retry_after_seconds > 0
    assert svc.coordinator.open_round is None  # nothing opened while paused
    with store.session_factory(store.create_engine_for(sqlite_url)).begin() as s:
        assert store.get_federation(s, "default").state == "paused"  # durable, not only in memory

    svc.coordinator.set_paused(False)
    assert svc.coordinator.state == "running"
    rnd, reply = a.round_trip()
    assert rnd == 1 and reply.accepted
    # pausing an open round holds it: the member still to report waits, and trains again after resume
    svc.coordinator.set_paused(True)
    assert b.task().WhichOneof("kind") == "wait"
    plan = svc.coordinator.open_round
    assert plan is not None and plan.round == 1
    svc.coordinator.set_paused(False)
    rnd, reply = b.round_trip()
    assert rnd == 1 and reply.accepted
    assert svc.coordinator.open_round is None  # the cohort reported: round 1 closed
    assert svc.coordinator.federation.round == 1


def _a_pause_made_while_the_ticker_reads_the_state_stands(start_service, url: str) -> None:
    """The ticker follows a state another process wrote by reading it outside the lock. A pause this process
    commits after that read must not be undone by what the read saw ("running"), while a change another
    process makes is still followed."""
    svc = start_service(url)
    shared = svc.coordinator.shared
    reader = shared.reader
    fired: list[bool] = []
    paused: list[str] = []

    def after(conn, cursor, statement, parameters, context, executemany) -> None:
        # the read has run, and its row says "running" (on PostgreSQL the pause's own statements pass here too)
        if "federations.state" in statement and not fired:
            fired.append(True)
            svc.coordinator.set_paused(True)
            paused.append(shared.state)

    event.listen(reader, "after_cursor_execute", after)
    try:
        shared.refresh_state()  # what every tick does first
    finally:
        event.remove(reader, "after_cursor_execute", after)
    assert paused == ["paused"]
    assert svc.coordinator.state == "paused"
    engine = store.create_engine_for(url)
    try:
        with store.session_factory(engine).begin() as s:
            fed = store.get_federation(s, "default")
            assert fed.state == "paused"
            store.set_federation_state(s, fed, "running")  # the dashboard resumes it
        shared.refresh_state()
        assert svc.coordinator.state == "running"
    finally:
        engine.dispose()


def test_a_pause_made_while_the_ticker_reads_the_state_stands_sqlite(start_service, sqlite_url) -> None:
    _a_pause_made_while_the_ticker_reads_the_state_stands(start_service, sqlite_url)


@pytest.mark.usefixtures("postgres_url")
def test_a_pause_made_while_the_ticker_reads_the_state_stands_postgres(start_service, postgres_url) -> None:
    _a_pause_made_while_the_ticker_reads_the_state_stands(start_service, postgres_url)


def test_report_evaluation_recorded_once_per_round_and_client(start_service, sqlite_url) -> None:
    svc = start_service(sqlite_url)
    data = shards(2, 60)
    a, b = register(svc.stub, 0.25, data[0]), register(svc.stub, 1.0, data[1])

    def report(c, round_: int, acc: float, loss: float, personal: float | None, n: int) -> pb.EvaluationReply:
        request = pb.EvaluationReport(round=round_, global_accuracy=acc, global_loss=loss, num_samples=n)
        if personal is not None:
            request.personalized_accuracy = personal
        return c.stub.ReportEvaluation(request, metadata=c.auth)

    with pytest.raises(grpc.RpcError) as info:  # round 1 has not closed yet
        report(a, 1, 0.5, 1.0, None, 10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    for c in (a, b):
        _, reply = c.round_trip()
        assert reply.accepted
    assert svc.coordinator.federation.round == 1

    assert report(a, 1, 0.5, 1.5, 0.75, 30).recorded
    assert not report(a, 1, 0.9, 0.1, 0.95, 30).recorded  # a retry: the first report stands
    assert report(b, 1, 0.25, 2.0, None, 10).recorded
    with pytest.raises(grpc.RpcError) as info:
        report(b, 1, 1.5, 1.0, None, 10)  # invalid values are refused before the duplicate check
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    with store.session_factory(store.create_engine_for(sqlite_url)).begin() as s:
        fed = store.get_federation(s, "default")
        evals = {e.client_id: e for e in store.round_evaluations(s, fed, 1)}
        assert set(evals) == {a.client_id, b.client_id}
        ea, eb = evals[a.client_id], evals[b.client_id]
        assert (ea.global_accuracy, ea.global_loss, ea.personalized_accuracy, ea.num_samples) == (0.5, 1.5, 0.75, 30)
        assert (eb.global_accuracy, eb.global_loss, eb.personalized_accuracy, eb.num_samples) == (0.25, 2.0, None, 10)
        summary = store.evaluation_summary(s, fed, 1)
        assert summary["clients"] == 2
        assert summary["mean_client_accuracy"] == pytest.approx((0.5 * 30 + 0.25 * 10) / 40)
        assert summary["mean_client_loss"] == pytest.approx((1.5 * 30 + 2.0 * 10) / 40)
        assert summary["personalized_accuracy"] == pytest.approx(0.75)


def test_an_evaluation_sent_with_get_task_is_recorded_as_report_evaluation_records_it(
    start_service, sqlite_url
) -> None:
    """What client_agent does: one call fewer per round; a refused report fails the call and changes nothing."""
    svc = start_service(sqlite_url)
    data = shards(2, 60)
    a, b = register(svc.stub, 0.25, data[0]), register(svc.stub, 1.0, data[1])

    def ask(c, round_: int, acc: float, n: int = 30) -> pb.Task:
        report = pb.EvaluationReport(round=round_, global_accuracy=acc, global_loss=1.5, num_samples=n)
        return c.stub.GetTask(pb.GetTaskRequest(report=report), metadata=c.auth)

    before = snapshot(sqlite_url)
    with pytest.raises(grpc.RpcError) as info:  # round 1 has not closed yet
        ask(a, 1, 0.5)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "has not closed" in info.value.details()
    assert snapshot(sqlite_url) == before
    for c in (a, b):
        _, reply = c.round_trip()
        assert reply.accepted
    assert svc.coordinator.federation.round == 1

    before = snapshot(sqlite_url)
    with pytest.raises(grpc.RpcError) as info:
        ask(a, 1, 1.5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "global_accuracy" in info.value.details()
    assert snapshot(sqlite_url) == before

    assert ask(a, 1, 0.5).WhichOneof("kind") == "train"  # recorded, and the task for round 2 comes back
    assert ask(a, 1, 0.9).WhichOneof("kind") == "train"  # a retry: the first report stands
    with store.session_factory(store.create_engine_for(sqlite_url)).begin() as s:
        fed = store.get_federation(s, "default")
        evals = {e.client_id: e for e in store.round_evaluations(s, fed, 1)}
    assert set(evals) == {a.client_id}
    assert (evals[a.client_id].global_accuracy, evals[a.client_id].num_samples) == (0.5, 30)


def test_client_run_without_tls_ca_against_a_tls_server_says_it_speaks_tls(
    start_service, sqlite_url, pki: Path, tmp_path: Path, capsys
) -> None:
    """Before: "Socket closed" retried until --give-up-after, then exit 4 with no hint."""
    svc = start_service(sqlite_url, tls_cert=pki / "server.pem", tls_key=pki / "server.key")
    argv = ["client", "run", "--server", f"127.0.0.1:{svc.port}", "--enrollment-secret", SECRET]
    argv += ["--partition-index", "0", "--state-dir", str(tmp_path / "state"), "--give-up-after", "60"]
    assert main(argv) == 2  # told at the first failure: before, exit 4 after the 60 s give-up time
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if "speaks TLS" in ln]
    assert len(line) == 1 and "--tls-ca" in line[0] and f"127.0.0.1:{svc.port}" in line[0], err
    assert snapshot(sqlite_url)["clients"] == []  # nothing registered


def _serve(config: Path) -> subprocess.CompletedProcess[str]:
    """`fedatoms aggregator serve --config CONFIG`, expected to stop at once (exit 2)."""
    import sys

    cmd = [sys.executable, "-m", "fedatoms", "aggregator", "serve", "--config", str(config)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("files", "says"),
    [
        ({"tls_cert": "server.pem", "tls_key": "client.key"}, "is not the private key of tls_cert"),
        ({"tls_cert": "server.pem", "tls_key": "server.key", "tls_client_ca": "notes.txt"}, "is not a PEM bundle"),
        ({"tls_cert": "notes.txt", "tls_key": "server.key"}, "is not a PEM certificate"),
        ({"tls_cert": "server.pem", "tls_key": "notes.txt"}, "is not a PEM private key"),
    ],
)
def test_wrong_tls_files_are_named_not_taken_for_a_port_in_use(pki: Path, tmp_path: Path, files, says) -> None:
    """A key of another certificate, or a file that is not PEM, stops `aggregator serve` with exit 2 and a line
    naming the file and what is wrong with it (gRPC alone only fails to bind, which reads as a port in use)."""
    (pki / "notes.txt").write_text("not a certificate\n")
    config = tmp_path / "aggregator.toml"
    config.write_text(
        f'listen = "127.0.0.1:0"\ndatabase_url = "sqlite:///{tmp_path / "agg.db"}"\n'
        + "".join(f'{key} = "{pki / name}"\n' for key, name in files.items())
    )
    done = _serve(config)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert says in last and "port in use" not in done.stderr, last
    named = next(pki / name for key, name in files.items() if key in last.split(" ", 3)[2])
    assert str(named) in last, last


def test_evaluation_data_the_model_cannot_score_stops_serve_in_one_line(tmp_path: Path) -> None:
    """Before, the aggregator served, and every close failed twice on the labels and was abandoned."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from image_folders import write_folder

    images = write_folder(tmp_path / "eval", channels=1, size=8, count=60)
    config = tmp_path / "aggregator.toml"
    config.write_text(
        f'listen = "127.0.0.1:0"\ndatabase_url = "sqlite:///{tmp_path / "agg.db"}"\neval_data = "{images}"\n'
        'enrollment_secret = "s"\n[federation]\nmodel = "digits-cnn"\nnum_classes = 5\n'
    )
    done = _serve(config)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == [done.stderr.strip().splitlines()[-1]] and "Traceback" not in done.stderr, done.stderr
    assert f"eval_data '{images}': the data has labels 0..9 but the model has 5 classes" in errors[0]
    assert not (tmp_path / "agg.db").exists()  # refused before the database is created


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        (
            "deadline_seconds = -1\n",
            "invalid aggregator settings: deadline_seconds: Input should be greater than 0 (got -1)",
        ),
        ('listen = "0.0.0.0:0"\n', "invalid aggregator settings: refusing to serve without TLS on 0.0.0.0:0"),
        (  # an env file's FEDATOMS_ENROLLMENT_SECRET= left empty was taken: any device could enroll
            'enrollment_secret = "  "\n',
            "invalid aggregator settings: enrollment_secret: it is empty, and any device could enroll with it",
        ),
    ],
    ids=["a-key", "the-settings", "an-empty-secret"],
)
def test_invalid_settings_are_one_line_per_refused_key(tmp_path: Path, lines: str, said: str) -> None:
    """pydantic's own text spans four lines and ends in a link to its docs; the operator gets the key and why."""
    config = tmp_path / "aggregator.toml"
    config.write_text(lines + f'database_url = "sqlite:///{tmp_path / "agg.db"}"\n')
    done = _serve(config)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert said in done.stderr and "pydantic" not in done.stderr, done.stderr
