"""`fedatoms client run --data`: a device's own ImageFolder or data reference, federated over real gRPC.

Three devices train digits-cnn (1×8×8 inputs) on their own pictures, none of them 8×8: a 3-channel
ImageFolder of 13×13 PNGs, a 1-channel ImageFolder of 11×11 PNGs, and a reference in a test module
returning PIL images. The server evaluates an ImageFolder of its own (``eval_data``). Bad ``--data``
is refused in one line, with exit 2, before anything is registered.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pytest
from image_folders import digits_images, write_folder
from processes import ENV, ROOT, SECRET, Aggregator, wait_closed
from sqlalchemy import select
from sqlalchemy.orm import Session
from support import free_port, postgres_base, postgres_schema

from aggregator_service import store
from fedatoms.cli import main

HERE = Path(__file__).resolve().parent


def _config(path: Path, eval_data: Path, **federation: object) -> Path:
    lines = [f'enrollment_secret = "{SECRET}"', "deadline_seconds = 600", "poll_interval_seconds = 0.1"]
    lines += [f'eval_data = "{eval_data}"', "", "[federation]"]
    lines += [f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"' for k, v in federation.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _kept(labels: np.ndarray) -> int:
    """Training images of a plain folder: every class less round(20 %) of it (independent of the code's split)."""
    return sum(int((labels == c).sum()) - round(0.2 * int((labels == c).sum())) for c in np.unique(labels))


def _client(target: str, state: Path, data: str, log: Path):
    import subprocess
    import sys

    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
    cmd = [sys.executable, "-m", "fedatoms", "client", "run", "--server", target, "--enrollment-secret", SECRET]
    cmd += ["--data", data, "--state-dir", str(state), "--no-progress"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def test_three_devices_with_their_own_pictures_train_and_the_server_evaluates_its_own(tmp_path: Path) -> None:
    rgb = write_folder(tmp_path / "rgb", channels=3, size=13, start=0, count=400)
    gray = write_folder(tmp_path / "gray", channels=1, size=11, start=400, count=400)
    held = write_folder(tmp_path / "eval", channels=3, size=16, start=1200, count=500)
    config = _config(
        tmp_path / "fed.toml", held, model="digits-cnn", rounds=2, fraction=1.0, min_clients=3, local_epochs=2
    )
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    server = Aggregator(config, free_port(), url, tmp_path / "server.log").start()
    logs = [tmp_path / f"c{i}.log" for i in range(3)]
    procs = [
        _client(server.target, tmp_path / f"s{i}", data, log)
        for i, (data, log) in enumerate(zip([str(rgb), str(gray), "data_refs:load"], logs, strict=True))
    ]
    try:
        wait_closed(url, 2, timeout=300)
        codes = [p.wait(120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.stop()
    assert codes == [0, 0, 0], [log.read_text()[-2000:] for log in logs]
    for log in logs:
        text = log.read_text()
        assert "event=data_fitted input=1x8x8 normalization=computed" in text, text[-2000:]
        assert "event=pushed round=2" in text

    _, labels = digits_images(1, 8)
    engine = store.create_engine_for(url)
    try:
        with Session(engine) as s:
            samples = sorted(c.profile["num_samples"] for c in s.scalars(select(store.Client)))
            accuracy = [
                m.test_accuracy for m in s.scalars(select(store.RoundMetrics).order_by(store.RoundMetrics.round))
            ]
    finally:
        engine.dispose()
    # num_samples is each device's training set: the folders less their holdout, the reference's 320
    assert samples == sorted([_kept(labels[0:400]), _kept(labels[400:800]), 320])
    assert len(accuracy) == 2 and all(a is not None for a in accuracy)
    assert accuracy[-1] > 0.3  # ten classes: chance is 0.1


def test_the_federations_normalization_reaches_the_client(tmp_path: Path) -> None:
    pictures = write_folder(tmp_path / "rgb", channels=3, size=10, count=200)
    # evaluated on the same kind of pictures: the digits benchmark brings its own normalization, which a
    # different federation one would contradict (refused)
    config = _config(tmp_path / "fed.toml", pictures, model="digits-cnn", rounds=1, min_clients=1)
    with config.open("a") as f:
        f.write("normalization = { mean = [0.5], std = [0.25] }\n")
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    server = Aggregator(config, free_port(), url, tmp_path / "server.log").start()
    log = tmp_path / "c.log"
    proc = _client(server.target, tmp_path / "s", str(pictures), log)
    try:
        code = proc.wait(300)
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()
    text = log.read_text()
    assert code == 0, text[-2000:]
    assert "event=data_fitted input=1x8x8 normalization=federation mean=0.5000 std=0.2500" in text


def test_a_normalization_for_other_channels_than_the_model_takes_is_refused() -> None:
    from aggregator_service.config import FederationConfig

    with pytest.raises(ValueError, match="normalization has 3 channels but model 'digits-cnn' takes 1"):
        FederationConfig(model="digits-cnn", normalization={"mean": [0.5] * 3, "std": [0.2] * 3})
    with pytest.raises(ValueError, match="std must be > 0"):
        FederationConfig(model="digits-cnn", normalization={"mean": [0.5], "std": [0.0]})


def _registered(url: str) -> int:
    engine = store.create_engine_for(url)
    try:
        with Session(engine) as s:
            return len(s.scalars(select(store.Client)).all())
    finally:
        engine.dispose()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def aggregator(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("refusals")
    config = _config(tmp / "fed.toml", Path("digits"), model="digits-cnn", rounds=1)
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp / 'agg.db'}"
        else:
            url = stack.enter_context(postgres_schema(postgres_base()))
        server = Aggregator(config, free_port(), url, tmp / "server.log").start()
        stack.callback(server.stop)
        yield server


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ("{tmp}/nowhere", "is not a directory, not a bundled dataset"),
        ("{tmp}/empty", "no class subfolders"),
        ("no_such_pkg.data:load", "cannot import 'no_such_pkg.data'"),
        ("data_refs:missing", "has no attribute 'missing'"),
        ("data_refs:not_a_pair", "not a (train, test) pair"),
        ("digits", "give --partition-index"),
    ],
)
def test_bad_data_is_refused_in_one_line_and_registers_nothing(
    aggregator, tmp_path: Path, capsys, monkeypatch, data: str, needle: str
) -> None:
    (tmp_path / "empty").mkdir()
    monkeypatch.syspath_prepend(str(HERE))
    argv = ["client", "run", "--server", aggregator.target, "--enrollment-secret", SECRET]
    argv += ["--data", data.format(tmp=tmp_path), "--state-dir", str(tmp_path / "state")]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert _registered(aggregator.url) == 0


def test_a_missing_benchmark_suggests_a_flag_client_run_takes(aggregator, tmp_path: Path, capsys) -> None:
    """The refusal says "or allow downloading (--download …)": ``client run`` had no such flag."""
    from fedatoms.cli import build_parser

    argv = ["client", "run", "--server", aggregator.target, "--enrollment-secret", SECRET, "--data", "cifar10"]
    argv += ["--data-dir", str(tmp_path), "--partition-index", "0", "--state-dir", str(tmp_path / "state")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "dataset 'cifar10' not found in" in err and "--download" in err and len(err.strip().splitlines()) == 1
    assert build_parser().parse_args([*argv, "--download"]).download is True
    assert _registered(aggregator.url) == 0


def test_a_device_without_some_named_class_folders_is_refused(aggregator, tmp_path: Path, capsys) -> None:
    """Named folders are numbered in sorted order: a device holding only digit-3 and digit-7 would train them
    as classes 0 and 1. Numbered folders (0..9) keep their labels, so a subset of those is a device's right."""
    pictures = write_folder(tmp_path / "named", channels=1, size=8, count=200, classes="named")
    for folder in pictures.iterdir():
        if folder.name not in ("digit-3", "digit-7"):
            for png in folder.iterdir():
                png.unlink()
            folder.rmdir()
    argv = ["client", "run", "--server", aggregator.target, "--enrollment-secret", SECRET]
    argv += ["--data", str(pictures), "--state-dir", str(tmp_path / "state")]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("fedatoms: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "2 class folders (digit-3, digit-7) but the model has 10 classes" in errors[0]


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ("data_refs:labels_past_the_classes", "the data has labels 0..11 but the model has 10 classes"),
        ("data_refs:uint8_images", "the training inputs are torch.uint8 tensors"),
        ("data_refs:dict_items", "dataset items are dict, not (image, label) pairs"),
    ],
    ids=["labels", "uint8", "dicts"],
)
def test_data_the_model_cannot_take_is_refused_in_one_line(
    aggregator, tmp_path: Path, capsys, monkeypatch, data: str, needle: str
) -> None:
    """Checked once the model is known, before any training: each failed in the first step with a traceback."""
    monkeypatch.syspath_prepend(str(HERE))
    argv = ["client", "run", "--server", aggregator.target, "--enrollment-secret", SECRET]
    argv += ["--data", data, "--state-dir", str(tmp_path / "state")]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("fedatoms: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert needle in errors[0]
