"""An edge device on a bad link: slower than a call's deadline, cut again and again, or dead while it stops."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from links import LinkProxy
from processes import ENV, ROOT, SECRET, free_port, wait_for
from support import digits_agents, serve_aggregator, stored_update

from aggregator_service.config import FederationConfig
from client_agent.state import ClientState
from client_agent.transport import AggregatorClient, Backoff
from fedcore.tiers import CapabilityProfile

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def aggregator(tmp_path: Path, model: str, **method: object) -> Iterator[int]:
    """An aggregator in this process on a loopback port, with a real SQLite file; yields the port."""
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    _, server, port = serve_aggregator(
        url,
        enrollment_secret=SECRET,
        federation=FederationConfig(model=model, fraction=1.0, min_clients=2, rounds=2, batch_size=32, **method),
    )
    try:
        yield port
    finally:
        server.stop(grace=None)


@contextlib.contextmanager
def cut_link(
    port: int, give_up_after: float = 60, **link: int
) -> Iterator[tuple[LinkProxy, AggregatorClient, AggregatorClient, list[float]]]:
    """A link that drops every connection where ``link`` says (LinkProxy's cuts and rates), a client on it that
    retries at once and gives up after ``give_up_after`` s of failures, a client on the direct link, and the cut
    client's waits between retries; all closed at the end."""
    proxy = LinkProxy(port, **link)
    retries: list[float] = []
    cut = AggregatorClient(proxy.target, backoff=Backoff(base=0.05, max_elapsed=give_up_after), sleep=retries.append)
    direct = AggregatorClient(f"127.0.0.1:{port}")
    try:
        yield proxy, cut, direct, retries
    finally:
        cut.close()
        direct.close()
        proxy.close()


def two_members(direct: AggregatorClient) -> tuple[object, object]:
    """Register two clients through ``direct`` (the second keeps round 1 open for the first); ``(spec, its token)``."""
    direct.register(CapabilityProfile(num_samples=100), SECRET)
    _, spec = direct.register(CapabilityProfile(num_samples=100), SECRET)
    return spec, direct.token


def test_a_link_too_slow_for_the_call_deadline_still_fetches_and_pushes(tmp_path: Path) -> None:
    """At 200 KB/s the 605 KB model takes about 3 s, three times rpc_timeout: a fixed deadline would cut
    every attempt at the same place, forever. The deadline follows the transfer's size instead."""
    with aggregator(tmp_path, "digits-cnn") as port:
        proxy = LinkProxy(port, rate=200_000)
        retries: list[float] = []
        slow = AggregatorClient(
            proxy.target,
            rpc_timeout=1.0,
            min_link_bytes_per_second=100_000,
            backoff=Backoff(base=0.05, max_elapsed=30),
            sleep=retries.append,
        )
        direct = AggregatorClient(f"127.0.0.1:{port}")
        try:
            spec, slow.token = two_members(direct)
            task = slow.get_task()
            started = time.monotonic()
            fetched = slow.fetch(spec, {}, round_=task.train.round)
            took = time.monotonic() - started
            reference = direct.fetch(spec, {}, round_=task.train.round)
            assert retries == [] and took > 2 * slow.rpc_timeout  # one attempt, well past rpc_timeout
            assert fetched.model.keys() == reference.model.keys() == {t.name for t in spec.tensors}
            for name, (tensor, version) in reference.model.items():
                assert torch.equal(fetched.model[name][0], tensor) and fetched.model[name][1] == version

            update = {name: tensor + 0.001 for name, (tensor, _) in fetched.model.items()}
            started = time.monotonic()
            pushed = slow.push(task.train.round, "u-slow", 100, {}, update)
            assert pushed.accepted and not pushed.duplicate
            assert retries == [] and time.monotonic() - started > 2 * slow.rpc_timeout
        finally:
            slow.close()
            direct.close()
            proxy.close()


def test_a_working_link_slower_than_a_window_per_ping_timeout_moves_each_transfer_in_one_attempt(
    tmp_path: Path,
) -> None:
    """A keepalive ping's ack waits behind the data queued ahead of it, up to a receive window (256 KiB): at
    30 KB/s that is 9 s. With a ping every second and a timeout of two pings (the rule before, 30 s and 60 s
    in production), every push on this link was cut, and since a cut attempt keeps only whole 1 MiB chunks,
    the 606 KB update never got through (in production: any link under about 35 kbit/s). The timeout now
    allows for a window at the slowest link the client declares (16 KB/s: 20 s), so both transfers take one
    attempt each, and a dead link is still found by the ping."""
    with aggregator(tmp_path, "digits-cnn") as port:
        proxy = LinkProxy(port, rate=30_000)

        def never(delay: float) -> None:
            raise AssertionError(f"a transfer on a working link was retried after {proxy.connections} connection(s)")

        slow = AggregatorClient(proxy.target, keepalive_seconds=1.0, min_link_bytes_per_second=16_000, sleep=never)
        direct = AggregatorClient(f"127.0.0.1:{port}")
        try:
            spec, slow.token = two_members(direct)
            task = slow.get_task()
            fetched = slow.fetch(spec, {}, round_=task.train.round)
            reference = direct.fetch(spec, {}, round_=task.train.round)
            assert all(torch.equal(fetched.model[n][0], t) for n, (t, _) in reference.model.items())
            update = {name: tensor + 0.001 for name, (tensor, _) in fetched.model.items()}
            started = time.monotonic()
            assert slow.push(task.train.round, "u-slow-link", 100, {}, update).accepted
            assert time.monotonic() - started > 10  # the link really was that slow: 606 KB at 30 KB/s
            assert proxy.connections == 1
        finally:
            slow.close()
            direct.close()
            proxy.close()


def test_a_download_cut_again_and_again_resumes_with_the_tensors_it_completed(tmp_path: Path) -> None:
    """Every connection drops after 16 MB of the 45 MB ResNet-18: restarting from byte 0 never ends;
    keeping the completed tensors finishes in a few attempts, with the same model a clean link gets."""
    with aggregator(tmp_path, "resnet18") as port, cut_link(port, cut_down_after=16 * 2**20) as link:
        proxy, cut, direct, retries = link
        _, spec = direct.register(CapabilityProfile(num_samples=100), SECRET)
        cut.token = direct.token
        fetched = cut.fetch(spec, {})
        reference = direct.fetch(spec, {})
    total = sum(t.numel() * t.element_size() for t, _ in reference.model.values())
    # a retry per cut; a cut can also break the next connection before its first message (a CI run saw one)
    assert total > 40 * 2**20 and proxy.cuts >= 2 and proxy.cuts <= len(retries) <= 2 * proxy.cuts
    assert proxy.down_bytes < total + 2 * 16 * 2**20  # at most the two cut attempts' bytes were lost
    assert fetched.model.keys() == reference.model.keys()
    for name, (tensor, version) in reference.model.items():
        assert torch.equal(fetched.model[name][0], tensor) and fetched.model[name][1] == version, name
    # a 0-d buffer (BatchNorm's num_batches_tracked) came through as what it is
    assert any(t.dim() == 0 for t, _ in fetched.model.values())


def test_a_download_cut_more_often_than_its_largest_tensor_arrives_resumes_inside_it(tmp_path: Path) -> None:
    """Every connection drops after 3 MiB, and ResNet-18's layer-4 convs are 9.4 MB each: keeping whole tensors
    only, such a fetch moves data forever and never ends. Resumed inside the tensor it broke off in, it ends with
    the model a clean link gets."""
    with aggregator(tmp_path, "resnet18") as port, cut_link(port, cut_down_after=3 * 2**20) as link:
        proxy, cut, direct, retries = link
        _, spec = direct.register(CapabilityProfile(num_samples=100), SECRET)
        cut.token = direct.token
        largest = max(int(np.prod(t.shape)) * 4 for t in spec.tensors)
        fetched: list[object] = []
        fetching = threading.Thread(target=lambda: fetched.append(cut.fetch(spec, {})), daemon=True)
        fetching.start()
        fetching.join(timeout=120)
        done = not fetching.is_alive()
        if not done:
            cut.close()  # ends the endless retries
        reference = direct.fetch(spec, {})
    assert largest == 9 * 2**20 and done, f"no end after {len(retries)} retries and {proxy.down_bytes} bytes"
    (model,) = fetched
    total = sum(t.numel() * t.element_size() for t, _ in reference.model.values())
    # each cut loses the message it broke, and at times one the transport held: 1.1 MiB a cut where measured
    assert proxy.cuts >= 14 and proxy.down_bytes < total + proxy.cuts * 2 * 2**20
    for name, (tensor, version) in reference.model.items():
        assert torch.equal(model.model[name][0], tensor) and model.model[name][1] == version, name


def test_scaffolds_server_control_cut_midway_resumes_too(tmp_path: Path) -> None:
    """SCAFFOLD's fetch carries the server control after the model: McMahan's CNN's fc1 and its control are 6.4 MB
    each. On a link that drops every 3 MiB the control went whole with every attempt and the fetch never ended;
    kept and resumed like the model's tensors, it ends with what a clean link gets."""
    with (
        aggregator(tmp_path, "mnist-cnn", strategy="scaffold") as port,
        cut_link(port, cut_down_after=3 * 2**20) as link,
    ):
        proxy, cut, direct, retries = link
        spec, cut.token = two_members(direct)
        task = cut.get_task()
        fetched: list[object] = []
        fetching = threading.Thread(
            target=lambda: fetched.append(cut.fetch(spec, {}, round_=task.train.round, include_server_control=True)),
            daemon=True,
        )
        fetching.start()
        fetching.join(timeout=120)
        done = not fetching.is_alive()
        if not done:
            cut.close()
        reference = direct.fetch(spec, {}, round_=task.train.round, include_server_control=True)
    assert done, f"no end after {len(retries)} retries and {proxy.down_bytes} bytes"
    (got,) = fetched
    assert proxy.cuts >= 3 and got.control.keys() == reference.control.keys() and reference.control
    for name, tensor in reference.control.items():
        assert torch.equal(got.control[name], tensor), name
    for name, (tensor, version) in reference.model.items():
        assert torch.equal(got.model[name][0], tensor) and got.model[name][1] == version, name


def test_an_upload_cut_again_and_again_resumes_where_the_server_holds_it(tmp_path: Path) -> None:
    """Every connection drops after 16 MB up, and ResNet-18's update is 45 MB: a push restarted from byte 0
    never ends; resumed where the server holds it (GetUploadProgress), it is stored in a few attempts, as sent."""
    with aggregator(tmp_path, "resnet18") as port:
        with cut_link(port, cut_up_after=16 * 2**20) as (proxy, cut, direct, retries):
            direct.register(CapabilityProfile(num_samples=100), SECRET)  # a second member keeps round 1 open
            _, spec = direct.register(CapabilityProfile(num_samples=100), SECRET)
            cut.token = direct.token
            task = direct.get_task()
            fetched = direct.fetch(spec, {}, round_=task.train.round)
            generator = torch.Generator().manual_seed(0)
            update = {
                name: t + 0.01 * torch.randn(t.shape, generator=generator) if t.is_floating_point() else t
                for name, (t, _) in fetched.model.items()
            }
            reply = cut.push(task.train.round, "u-cut", 100, {"train_loss": 0.5}, update)
        total = sum(t.numel() * t.element_size() for t in update.values())
        assert reply.accepted and not reply.duplicate
        # a cut can break the next connection's first write too: a retry more than the cuts, losing nothing
        assert total > 40 * 2**20 and proxy.cuts >= 2 and proxy.cuts <= len(retries) <= 2 * proxy.cuts
        # each broken attempt loses at most what was in flight past the server's last whole message
        assert proxy.up_bytes < total + len(retries) * 2 * 2**20
        stored = stored_update(f"sqlite:///{tmp_path / 'agg.db'}", task.train.round)
    assert stored.keys() == update.keys()
    for name, tensor in update.items():
        np.testing.assert_array_equal(stored[name], tensor.numpy(), err_msg=name)


def test_a_link_that_breaks_before_a_whole_message_arrives_shrinks_its_messages_and_still_transfers(
    tmp_path: Path,
) -> None:
    """Every connection drops after 300 KB each way, less than one 1 MiB message: at the default size not one
    message of McMahan's CNN (6.6 MB) ever arrives, however often the client retries. Halving its messages after
    each attempt that carried fewer than four, the client fetches the model and pushes its update as a clean
    link carries them."""
    with aggregator(tmp_path, "mnist-cnn") as port:
        with cut_link(port, cut_down_after=300_000, cut_up_after=300_000) as (proxy, cut, direct, retries):
            spec, cut.token = two_members(direct)
            task = direct.get_task()
            fetched: list[object] = []
            fetching = threading.Thread(
                target=lambda: fetched.append(cut.fetch(spec, {}, round_=task.train.round)), daemon=True
            )
            fetching.start()
            fetching.join(timeout=90)
            done = not fetching.is_alive()
            if not done:
                cut.close()  # ends the endless retries
            assert done, f"no end after {len(retries)} retries and {proxy.down_bytes} bytes"
            reference = direct.fetch(spec, {}, round_=task.train.round)
            (got,) = fetched
            for name, (tensor, version) in reference.model.items():
                assert torch.equal(got.model[name][0], tensor) and got.model[name][1] == version, name
            size_after_fetch = cut.message_size.bytes
            total = sum(t.numel() * t.element_size() for t, _ in reference.model.values())
            assert proxy.cuts >= total // 300_000 and size_after_fetch <= 2**18
            generator = torch.Generator().manual_seed(0)
            update = {
                name: t + 0.01 * torch.randn(t.shape, generator=generator) if t.is_floating_point() else t
                for name, (t, _) in reference.model.items()
            }
            reply = cut.push(task.train.round, "u-small", 100, {"train_loss": 0.5}, update)
        assert reply.accepted and not reply.duplicate
        stored = stored_update(f"sqlite:///{tmp_path / 'agg.db'}", task.train.round)
    assert stored.keys() == update.keys()
    for name, tensor in update.items():
        np.testing.assert_array_equal(stored[name], tensor.numpy(), err_msg=name)


def test_a_server_that_is_down_leaves_the_chunk_size_as_it_was(tmp_path: Path) -> None:
    """Refused connections are no broken link: fetches and pushes that never reached a transfer keep 1 MiB, so a
    fleet retrying through an aggregator's restart comes back at full size."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = AggregatorClient(f"127.0.0.1:{port}", backoff=Backoff(base=0.01, max_elapsed=0.5), sleep=lambda _: None)
    client.token = "t"
    with aggregator(tmp_path, "digits-cnn") as live:
        spec = AggregatorClient(f"127.0.0.1:{live}").register(CapabilityProfile(num_samples=100), SECRET)[1]
    try:
        with pytest.raises(grpc.RpcError):
            client.fetch(spec, {})
        with pytest.raises(grpc.RpcError):
            client.push(1, "u-down", 10, {}, {"w": torch.zeros(4)})
        assert client.message_size.bytes == 2**20
    finally:
        client.close()


def test_a_fetch_resuming_on_a_small_grid_is_not_regrown_by_a_sibling_on_its_channel(tmp_path: Path) -> None:
    """Virtual clients share a channel and its chunk size. One resumes a cut tensor at 16 KiB steps while another
    finishes a clean transfer (the link's size doubles): the first goes on at its own size, on its own grid,
    and ends with a clean link's model (asked at the larger size, the server refused its offset)."""
    with aggregator(tmp_path, "mnist-cnn") as port, cut_link(port, cut_down_after=295_000) as link:
        proxy, cut, direct, retries = link
        spec, cut.token = two_members(direct)
        sibling = AggregatorClient.sharing(cut)
        assert sibling.message_size is cut.message_size

        def sibling_completes(_: float) -> None:
            retries.append(0.0)
            if cut.message_size.bytes < 2**20:
                sibling.message_size.completed()

        cut._sleep = sibling_completes
        got = cut.fetch(spec, {})
        reference = direct.fetch(spec, {})
    assert proxy.cuts >= 10
    for name, (tensor, version) in reference.model.items():
        assert torch.equal(got.model[name][0], tensor) and got.model[name][1] == version, name


@pytest.mark.parametrize("link", ["refused", "silent"])
def test_sigterm_while_the_agent_waits_on_a_dead_link_exits_130_at_once(tmp_path: Path, link: str) -> None:
    """``refused``: nothing listens, so Register is retried with backoff (up to 30 s between tries);
    ``silent``: the port accepts and never answers, so Register hangs in flight. Either way SIGTERM
    stops the agent now, with exit 130, not after the backoff or the call's deadline."""
    silent = socket.create_server(("127.0.0.1", 0)) if link == "silent" else None
    port = silent.getsockname()[1] if silent is not None else free_port()
    log = tmp_path / "agent.log"
    cmd = [sys.executable, "-m", "fedatoms", "client", "run", "--server", f"127.0.0.1:{port}"]
    cmd += ["--enrollment-secret", SECRET, "--partition-index", "0", "--state-dir", str(tmp_path / "d")]
    agent = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    held: socket.socket | None = None
    try:
        if silent is not None:
            silent.settimeout(120)
            held, _ = silent.accept()  # the agent's Register is on its way, and will get no answer
            time.sleep(1.0)
        else:
            wait_for(log, r"(?s)event=rpc_retry rpc=Register.*event=rpc_retry rpc=Register", proc=agent)
        agent.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = agent.wait(60)
        took = time.monotonic() - signalled
    finally:
        if agent.poll() is None:
            agent.kill()
        for sock in (silent, held):
            if sock is not None:
                sock.close()
    assert code == 130, log.read_text()[-3000:]
    assert took < 5.0, f"exited {took:.1f} s after SIGTERM"
    assert "event=stopped" in log.read_text()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_agent_waits_for_its_round_says_it_stopped(tmp_path: Path, sig: int) -> None:
    """Alone in a federation that needs two members, a registered agent waits for a round (a held GetTask, then
    the wait the server tells it). Ctrl-C or SIGTERM there ends it with exit 130 and an ``event=stopped`` line,
    as a signal during a call does: the line was missing when the stop came between calls."""
    log = tmp_path / "agent.log"
    with aggregator(tmp_path, "digits-cnn") as port:
        cmd = [sys.executable, "-m", "fedatoms", "client", "run", "--server", f"127.0.0.1:{port}"]
        cmd += ["--enrollment-secret", SECRET, "--partition-index", "0", "--state-dir", str(tmp_path / "d")]
        agent = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log.open("ab"), stderr=subprocess.STDOUT)
        try:
            wait_for(log, r"event=registered", proc=agent)
            time.sleep(2.0)  # into its wait: nothing to observe from outside but time
            agent.send_signal(sig)
            code = agent.wait(60)
        finally:
            if agent.poll() is None:
                agent.kill()
    text = log.read_text()
    assert code == 130, text[-3000:]
    assert "event=stopped" in text, text[-3000:]


def test_a_push_that_arrives_after_its_round_closed_leaves_the_clients_strategy_state_as_it_was(
    tmp_path: Path,
) -> None:
    """SCAFFOLD's server control is the mean of the clients' controls, c = (1/N) Σ c_i, only if a client keeps
    its new c_i when, and only when, the server folds its update. Client b's push crawls up a slow link and
    arrives after round 1 closed on a's update alone (quorum 0.5): refused, so b's c_i stays zero."""
    from datetime import timedelta

    url = f"sqlite:///{tmp_path / 'agg.db'}"
    coordinator, server, port = serve_aggregator(
        url,
        enrollment_secret=SECRET,
        quorum=0.5,
        poll_interval_seconds=0.01,
        federation=FederationConfig(
            model="digits-cnn", strategy="scaffold", fraction=1.0, min_clients=2, rounds=2, batch_size=32
        ),
    )
    proxy = LinkProxy(port, up_rate=200_000)  # b's 1.2 MB push (update and control delta) takes about 6 s
    links = {"a": AggregatorClient(f"127.0.0.1:{port}"), "b": AggregatorClient(proxy.target)}
    agents = digits_agents(links, tmp_path, SECRET, eval_poll_seconds=0.0)
    try:
        for agent in agents.values():
            agent.ensure_registered()
        a, b = agents["a"], agents["b"]
        for _ in range(20):
            a.step()
            if a.state is not None and a.state.evaluate_round == 1:
                break
        assert a.state is not None and a.state.evaluate_round == 1  # a pushed; round 1 waits for b
        late = threading.Thread(target=b.step)
        late.start()
        deadline = time.monotonic() + 120
        while proxy.up_bytes < 200_000 and late.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)  # b has trained and its push is on the wire
        assert proxy.up_bytes >= 200_000
        coordinator.tick(coordinator.shared.open.deadline + timedelta(seconds=1))  # quorum met: closes on a alone
        late.join(120)
        assert b.state is not None and b.state.pending is None and b.state.last_round == 1  # trained, refused
        assert a.state.taken is not None
        a.step()  # a learns round 1 closed: it keeps its c_i (and evaluates)
        assert a.state.taken is None and b.state.taken is None
        control = links["a"].fetch(a.spec, {}, include_server_control=True).control  # type: ignore[arg-type]
    finally:
        for link in links.values():
            link.close()
        proxy.close()
        server.stop(grace=None)
    saved = {name: ClientState.load(tmp_path / name) for name in agents}
    c_a = saved["a"].strategy_state["control"]  # type: ignore[union-attr]
    c_b = saved["b"].strategy_state.get("control", {})  # type: ignore[union-attr]
    assert c_a and any(bool(t.any()) for t in c_a.values())
    for name, c in control.items():  # N = 2 enrolled: c = (c_a + c_b) / 2, with c_b never kept
        mean = (c_a[name] + c_b.get(name, torch.zeros_like(c_a[name]))) / 2
        torch.testing.assert_close(c, mean, rtol=1e-5, atol=1e-7)
    assert all(not bool(t.any()) for t in c_b.values())


def test_the_wait_before_the_last_attempt_ends_at_give_up_after() -> None:
    """Nothing listens; backoff waits of up to 30 s. ``give_up_after = 2``: the waits between attempts add up to 2 s
    at most, and the call gives up then (a 5.7 s draw used to run past it: exit 4 came 9 s after the first failure)."""
    import random

    waits: list[float] = []
    lost = AggregatorClient(
        f"127.0.0.1:{free_port()}",
        backoff=Backoff(base=30.0, cap=30.0, max_elapsed=2.0, rng=random.Random(0)),
        sleep=lambda s: (waits.append(s), time.sleep(s)),
    )
    lost.token = "a token from an earlier run"
    started = time.monotonic()
    try:
        with pytest.raises(grpc.RpcError):
            lost.heartbeat()
    finally:
        lost.close()
    assert waits and sum(waits) <= 2.0 + 1e-6
    assert time.monotonic() - started < 2.0 + 5.0  # the deadline, and one last attempt's refusal


def test_give_up_after_counts_from_the_first_failure_not_from_the_calls_start(tmp_path: Path) -> None:
    """An upload at 100 KB/s (605 KB: about 6 s) cut once, 3 s in: the link was up all along, yet a client giving
    up after 1.5 s ended there (``client run --give-up-after``: exit 4), counting the upload's own 3 s as down."""
    with aggregator(tmp_path, "digits-cnn") as port:
        proxy = LinkProxy(port, up_rate=100_000, cut_after=300_000)
        retries: list[float] = []
        slow = AggregatorClient(proxy.target, backoff=Backoff(base=0.05, max_elapsed=1.5), sleep=retries.append)
        direct = AggregatorClient(f"127.0.0.1:{port}")
        try:
            spec, slow.token = two_members(direct)
            task = direct.get_task()
            fetched = direct.fetch(spec, {}, round_=task.train.round)
            update = {name: tensor + 0.001 for name, (tensor, _) in fetched.model.items()}
            proxy.armed = True
            pushed = slow.push(task.train.round, "u-cut-once", 100, {}, update)
            assert pushed.accepted and proxy.cuts == 1 and len(retries) >= 1
        finally:
            slow.close()
            direct.close()
            proxy.close()


@pytest.mark.parametrize("direction", ["down", "up"])
def test_a_transfer_that_moves_data_between_cuts_never_gives_up(tmp_path: Path, direction: str) -> None:
    """Every connection drops after 16 MB at 8 MB/s, 2 s an attempt, and the client gives up after 1 s of
    failures: ResNet-18's 45 MB still arrives in a few attempts. The failure clock ran from the first cut and
    never stopped, so the second cut, 2 s later, ended the run (``client run``: exit 4, "unreachable") although
    every attempt moved 16 MB."""
    rate = {"rate": 8 * 2**20} if direction == "down" else {"up_rate": 8 * 2**20}
    with aggregator(tmp_path, "resnet18") as port:
        link = cut_link(port, give_up_after=1.0, **rate, **{f"cut_{direction}_after": 16 * 2**20})
        with link as (proxy, slow, direct, retries):
            spec, slow.token = two_members(direct)
            task = direct.get_task()
            reference = direct.fetch(spec, {}, round_=task.train.round)
            if direction == "down":
                fetched = slow.fetch(spec, {}, round_=task.train.round)
                assert all(torch.equal(fetched.model[n][0], t) for n, (t, _) in reference.model.items())
            else:
                update = {n: t + 1 if t.is_floating_point() else t for n, (t, _) in reference.model.items()}
                assert slow.push(task.train.round, "u-cuts", 100, {}, update).accepted
            assert proxy.cuts >= 2 and len(retries) >= 2


def test_a_retry_of_an_update_already_stored_is_answered_from_its_header(tmp_path: Path) -> None:
    """The acknowledgement of a stored push was lost: the client pushes the same update_id again, whole (nothing is
    kept of a stored update to resume). It was read to its end before being answered as a duplicate, so a bad link
    carried the 45 MB again; answered from its header, the retry moves what the transport sent ahead of the answer."""
    with aggregator(tmp_path, "resnet18") as port:
        with cut_link(port) as (proxy, link, direct, _):
            direct.register(CapabilityProfile(num_samples=100), SECRET)  # a second member keeps round 1 open
            _, spec = direct.register(CapabilityProfile(num_samples=100), SECRET)
            link.token = direct.token
            task = direct.get_task()
            fetched = direct.fetch(spec, {}, round_=task.train.round)
            update = {n: t + 1 if t.is_floating_point() else t for n, (t, _) in fetched.model.items()}
            size = sum(t.numel() * t.element_size() for t in update.values())
            first = link.push(task.train.round, "u-once", 100, {}, update)
            assert first.accepted and not first.duplicate and proxy.up_bytes > size
            before = proxy.up_bytes
            again = link.push(task.train.round, "u-once", 100, {}, update)
            assert (again.accepted, again.duplicate, again.round) == (True, True, task.train.round)
            assert again.move_scale == first.move_scale
            assert proxy.up_bytes - before < size / 2
