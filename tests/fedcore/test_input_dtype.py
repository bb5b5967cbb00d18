"""Models of integer inputs (``ModelSpec.input_dtype``: token ids for an ``nn.Embedding``): the spec carries the
dtype, every probe of the model feeds it, and data of the other kind is refused in words naming ``input_dtype``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from aggregator_service.config import FederationConfig
from fedcore.macs import count_macs
from fedcore.model_input import Normalization, fit_to_model
from fedcore.spec import ModelSpec
from fedcore.training.config import TrainConfig
from fedcore.training.evaluate import evaluate
from fedcore.training.update import local_update

LSTM = ModelSpec("token_models:lstm", 4, input_shape=(8,), input_dtype="int64")


def test_the_spec_json_carries_an_integer_input_dtype_and_omits_the_default() -> None:
    data = json.loads(LSTM.to_json())
    assert data["input_dtype"] == "int64"
    back = ModelSpec.from_json(LSTM.to_json())
    assert back == LSTM and back.input_dtype == "int64" and back.torch_input_dtype == torch.int64
    assert ModelSpec.from_json(ModelSpec("token_models:lstm", 4, input_shape=(8,), input_dtype="int32").to_json())
    float_ref = ModelSpec("token_models:embed_mlp", 5, input_shape=(6,))
    assert "input_dtype" not in float_ref.to_dict() and float_ref.input_dtype == "float32"
    # a zoo spec's JSON keeps its keys, and one written before the key reads as float32
    zoo = ModelSpec("digits-cnn", 10).to_dict()
    assert set(zoo) == {"model", "num_classes", "factorization", "num_atoms", "rank_ratio", "tensors"}
    assert ModelSpec.from_dict(zoo).input_dtype == "float32"
    assert ModelSpec.from_dict({k: v for k, v in data.items() if k != "input_dtype"}).input_dtype == "float32"


def test_an_unknown_input_dtype_and_an_integer_zoo_model_are_refused() -> None:
    with pytest.raises(ValueError, match="input_dtype must be one of float32, int64, int32"):
        ModelSpec("token_models:lstm", 4, input_shape=(8,), input_dtype="long")
    with pytest.raises(ValueError, match="takes float32 inputs"):
        ModelSpec("digits-cnn", 10, input_dtype="int64")


def test_the_federation_config_sets_input_dtype_and_stores_it_only_when_set() -> None:
    config = FederationConfig(model="token_models:lstm", num_classes=4, input_shape=[8], input_dtype="int64")
    assert config.spec.input_dtype == "int64" and config.spec.macs == LSTM.macs
    assert config.to_dict()["input_dtype"] == "int64"
    assert "input_dtype" not in FederationConfig().to_dict()
    with pytest.raises(ValueError, match="never normalized"):
        FederationConfig(
            model="token_models:lstm", num_classes=4, input_shape=[8], input_dtype="int64",
            normalization={"mean": [0.5], "std": [0.2]},
        )  # fmt: skip


def test_a_federation_file_sets_input_dtype_next_to_input_shape(tmp_path: Path) -> None:
    from aggregator_service.config import AggregatorSettings

    path = tmp_path / "federation.toml"
    path.write_text(
        'enrollment_secret = "s"\n[federation]\nmodel = "token_models:lstm"\nnum_classes = 4\n'
        'input_shape = [8]\ninput_dtype = "int64"\n'
    )
    spec = AggregatorSettings.from_toml(path).federation.spec
    assert spec.input_dtype == "int64" and ModelSpec.from_json(spec.to_json()).input_dtype == "int64"


def test_every_probe_feeds_token_ids_and_counts_an_embedding_models_macs_by_hand() -> None:
    spec = ModelSpec("token_models:embed_mlp", 5, input_shape=(6,), input_dtype="int64")
    spec.check_forward()
    by_hand = 6 * 8 * 16 + 16 * 5  # the two linears; the lookup multiplies nothing
    assert spec.macs == by_hand
    assert count_macs(spec.build(), (6,), torch.int64) == by_hand  # on real tensors as on the meta device
    per_sample, _ = spec.activation_bytes
    assert per_sample > 0
    assert LSTM.macs > 0 and LSTM.activation_bytes[0] > 0


def test_a_float_model_spec_of_an_embedding_model_is_refused_naming_input_dtype() -> None:
    spec = ModelSpec("token_models:embed_mlp", 5, input_shape=(6,))
    with pytest.raises(ValueError, match=r'cannot take inputs of shape \[6\] \(float32\) .*input_dtype = "int64"'):
        spec.check_forward()


def _ids(dtype: torch.dtype = torch.long, n: int = 40) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 12, (n, 8), generator=g)
    return TensorDataset(x.to(dtype), x[:, -1] % 4)


def test_integer_data_fit_an_integer_model_and_train() -> None:
    train, test, used = fit_to_model(_ids(), _ids(torch.int32), (8,), input_dtype="int64")
    assert used is None and train is not None
    model = LSTM.build()
    config = TrainConfig(local_epochs=1, batch_size=8, lr=0.1, device="cpu")
    local_update(model, train, config, seed=0)
    assert 0.0 <= evaluate(model, test, device="cpu").accuracy <= 1.0


def test_data_of_the_other_kind_is_refused_naming_input_dtype() -> None:
    float_model = r'int64 tensors but the model takes floating-point inputs \(input_dtype = "float32"\)'
    with pytest.raises(ValueError, match=float_model):
        fit_to_model(_ids(), None, (8,))
    with pytest.raises(ValueError, match=r'float32 tensors but the model takes integer inputs \(input_dtype = "int64"'):
        fit_to_model(_ids(torch.float32), None, (8,), input_dtype="int64")
    with pytest.raises(ValueError, match='input_dtype = "int64"'):  # uint8 ids: no nn.Embedding looks them up
        fit_to_model(_ids(torch.uint8), None, (8,), input_dtype="int64")
    with pytest.raises(ValueError, match="never normalized"):
        fit_to_model(_ids(), None, (8,), Normalization((0.5,), (0.2,)), input_dtype="int64")


def test_images_are_refused_for_an_integer_model() -> None:
    from PIL import Image

    images = [(Image.new("L", (8, 8)), 0), (Image.new("L", (8, 8)), 1)]
    with pytest.raises(ValueError, match=r'gives images but the model takes int64 inputs \(input_dtype = "int64"'):
        fit_to_model(images, None, (1, 8, 8), input_dtype="int64")


def test_uint8_images_keep_the_totensor_hint() -> None:
    data = TensorDataset(torch.zeros(4, 1, 8, 8, dtype=torch.uint8), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"ToTensor scales uint8 images to \[0, 1\]"):
        fit_to_model(data, None, (1, 8, 8))
