"""Dataset layer: IDX reader, Fashion-MNIST search order, digits split, MNIST-1D, models.

Nothing here needs the real Fashion-MNIST files or the network: the IDX files are written by
the tests themselves.
"""

from __future__ import annotations

import gzip
import random
import struct
from pathlib import Path

import numpy as np
import pytest

from corrnoise.datasets import DATASETS, fashion, load, read_idx
from corrnoise.datasets import fashion_mnist, find_fashion_mnist, search_dirs
from corrnoise.errors import CorrnoiseError

CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(np.int16): 0x0B,
         np.dtype(np.int32): 0x0C, np.dtype(np.float32): 0x0D, np.dtype(np.float64): 0x0E}


def idx_bytes(arr: np.ndarray) -> bytes:
    """The IDX encoding of ``arr``, written independently of the reader."""
    head = bytes([0, 0, CODES[arr.dtype], arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape)
    return head + arr.astype(arr.dtype.newbyteorder(">")).tobytes()


def write_idx(path: Path, arr: np.ndarray, gz: bool = False) -> Path:
    data = idx_bytes(arr)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


# --- IDX reader -------------------------------------------------------------------------------

@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_uint8_images_and_labels(tmp_path, gz):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    labels = np.array([3, 0, 9, 1, 7], dtype=np.uint8)
    # the file names carry no .gz suffix on purpose: compression is detected from the content
    img = read_idx(write_idx(tmp_path / "images", images, gz))
    lab = read_idx(write_idx(tmp_path / "labels", labels, gz))
    assert img.dtype == np.uint8 and img.shape == (5, 28, 28)
    assert lab.dtype == np.uint8 and lab.shape == (5,)
    np.testing.assert_array_equal(img, images)
    np.testing.assert_array_equal(lab, labels)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.float32, np.float64])
@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_other_types_big_endian(tmp_path, dtype, gz):
    arr = (np.arange(24).reshape(2, 3, 4) * 7 - 60).astype(dtype)
    if np.dtype(dtype).kind == "f":
        arr = arr / 3
    out = read_idx(write_idx(tmp_path / "a.idx", arr, gz))
    assert out.dtype == np.dtype(dtype) and out.dtype.isnative
    assert out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out, arr)
    out[0, 0, 0] = 1  # a writable array, not a view of the file bytes


def test_read_idx_int16_byte_order(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(bytes([0, 0, 0x0B, 1, 0, 0, 0, 2, 0x01, 0x02, 0xFF, 0xFE]))
    np.testing.assert_array_equal(read_idx(p), np.array([0x0102, -2], dtype=np.int16))


def test_read_idx_missing_file(tmp_path):
    with pytest.raises(CorrnoiseError, match="file not found") as err:
        read_idx(tmp_path / "nope-idx1-ubyte")
    assert "nope-idx1-ubyte" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_truncated(tmp_path, gz):
    data = idx_bytes(np.zeros((4, 28, 28), dtype=np.uint8))
    cut = data[:-100]
    p = tmp_path / "short"
    p.write_bytes(gzip.compress(cut) if gz else cut)
    with pytest.raises(CorrnoiseError, match="truncated") as err:
        read_idx(p)
    assert str(p) in str(err.value) and "\n" not in str(err.value)


def test_read_idx_truncated_gzip_stream(tmp_path):
    blob = gzip.compress(idx_bytes(np.arange(1000, dtype=np.int32)))
    p = tmp_path / "cut.gz"
    p.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CorrnoiseError, match="gzip") as err:
        read_idx(p)
    assert str(p) in str(err.value)


def test_read_idx_trailing_bytes(tmp_path):
    p = tmp_path / "long"
    p.write_bytes(idx_bytes(np.zeros(3, dtype=np.uint8)) + b"\x00\x00")
    with pytest.raises(CorrnoiseError, match="2 unexpected bytes"):
        read_idx(p)


def test_read_idx_truncated_header(tmp_path):
    p = tmp_path / "hdr"
    p.write_bytes(bytes([0, 0, 8, 3, 0, 0, 0, 5]))
    with pytest.raises(CorrnoiseError, match="truncated IDX header"):
        read_idx(p)
    p.write_bytes(b"\x00\x00")
    with pytest.raises(CorrnoiseError, match="too short"):
        read_idx(p)


def test_read_idx_wrong_magic(tmp_path):
    p = tmp_path / "img.png"
    p.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    with pytest.raises(CorrnoiseError, match="not an IDX file") as err:
        read_idx(p)
    assert str(err.value).startswith(str(p))


def test_read_idx_unknown_type(tmp_path):
    p = tmp_path / "t"
    p.write_bytes(bytes([0, 0, 0x0A, 1, 0, 0, 0, 1, 0]))
    with pytest.raises(CorrnoiseError, match="unknown IDX element type 0x0a"):
        read_idx(p)


# --- Fashion-MNIST search order --------------------------------------------------------------

def fake_fashion(directory: Path, n_train=6, n_test=4, gz=True, seed=0) -> Path:
    """The four Fashion-MNIST files with a few random images in ``directory``."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(directory / f"{prefix}-images-idx3-ubyte{suffix}",
                  rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8), gz)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte{suffix}",
                  rng.integers(0, 10, size=n, dtype=np.uint8), gz)
    return directory


@pytest.fixture
def no_fashion(tmp_path, monkeypatch):
    """No system copy, no ``.data`` in the cwd or the checkout: only $CORRNOISE_DATA counts."""
    monkeypatch.setattr(fashion, "SYSTEM_DIR", tmp_path / "system" / "fashion-mnist")
    monkeypatch.setattr(fashion, "_repo_root", lambda: None)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CORRNOISE_DATA", raising=False)
    return tmp_path


def test_search_order(no_fashion, monkeypatch):
    env = no_fashion / "env"
    monkeypatch.setenv("CORRNOISE_DATA", str(env))
    dirs = search_dirs()
    assert dirs == [env / "fashion-mnist", fashion.SYSTEM_DIR, env / "FashionMNIST" / "raw",
                    no_fashion / ".data/usr/share/datasets/fashion-mnist"]

    # the last one (make data in the cwd) is used when it is the only one
    local = fake_fashion(no_fashion / ".data/usr/share/datasets/fashion-mnist", seed=1)
    assert find_fashion_mnist("train")[0].parent == local
    # torchvision layout (plain files) beats .data
    raw = fake_fashion(env / "FashionMNIST" / "raw", gz=False, seed=2)
    assert find_fashion_mnist("test") == (raw / "t10k-images-idx3-ubyte", raw / "t10k-labels-idx1-ubyte")
    # the system directory beats the torchvision layout
    fake_fashion(fashion.SYSTEM_DIR, seed=3)
    assert find_fashion_mnist("train")[0].parent == fashion.SYSTEM_DIR
    # $CORRNOISE_DATA/fashion-mnist comes first
    first = fake_fashion(env / "fashion-mnist", n_train=3, n_test=2, seed=4)
    assert find_fashion_mnist("train")[1] == first / "train-labels-idx1-ubyte.gz"
    x, y = fashion_mnist("train")
    assert x.shape == (3, 28, 28) and y.shape == (3,)


def test_repo_root_data_dir(no_fashion, monkeypatch):
    repo = no_fashion / "checkout"
    monkeypatch.setattr(fashion, "_repo_root", lambda: repo)
    fake_fashion(repo / ".data/usr/share/datasets/fashion-mnist")
    assert search_dirs()[-1] == repo / ".data/usr/share/datasets/fashion-mnist"
    assert fashion_mnist("test")[0].shape == (4, 28, 28)


def test_fashion_mnist_values(no_fashion, monkeypatch):
    monkeypatch.setenv("CORRNOISE_DATA", str(no_fashion))
    d = fake_fashion(no_fashion / "fashion-mnist", gz=False)
    x, y = fashion_mnist("train")
    assert x.dtype == np.float32 and y.dtype == np.int64
    assert x.shape == (6, 28, 28) and 0.0 <= x.min() and x.max() <= 1.0
    np.testing.assert_array_equal(x * 255, read_idx(d / "train-images-idx3-ubyte").astype(np.float32))
    np.testing.assert_array_equal(y, read_idx(d / "train-labels-idx1-ubyte"))


def test_fashion_mnist_missing(no_fashion):
    with pytest.raises(CorrnoiseError, match="make data") as err:
        fashion_mnist("train")
    msg = str(err.value)
    assert "train-images-idx3-ubyte" in msg and "CORRNOISE_DATA" in msg and "\n" not in msg


def test_fashion_mnist_missing_partner(no_fashion, monkeypatch):
    monkeypatch.setenv("CORRNOISE_DATA", str(no_fashion))
    d = fake_fashion(no_fashion / "fashion-mnist")
    (d / "t10k-labels-idx1-ubyte.gz").unlink()
    assert fashion_mnist("train")[0].shape == (6, 28, 28)
    with pytest.raises(CorrnoiseError, match="t10k-labels-idx1-ubyte: missing"):
        fashion_mnist("test")


def test_fashion_mnist_corrupt_file_names_it(no_fashion, monkeypatch):
    monkeypatch.setenv("CORRNOISE_DATA", str(no_fashion))
    d = fake_fashion(no_fashion / "fashion-mnist", gz=False)
    f = d / "train-images-idx3-ubyte"
    f.write_bytes(f.read_bytes()[:-1])
    with pytest.raises(CorrnoiseError, match="truncated.*make data") as err:
        fashion_mnist("train")
    assert str(err.value).startswith(str(f))


def test_fashion_mnist_count_mismatch(no_fashion, monkeypatch):
    monkeypatch.setenv("CORRNOISE_DATA", str(no_fashion))
    d = fake_fashion(no_fashion / "fashion-mnist", gz=False)
    write_idx(d / "train-labels-idx1-ubyte", np.zeros(5, dtype=np.uint8))
    with pytest.raises(CorrnoiseError, match="5 labels but train-images-idx3-ubyte holds 6 images"):
        fashion_mnist("train")


def test_fashion_mnist_bad_split(no_fashion):
    with pytest.raises(CorrnoiseError, match="^split: must be 'train' or 'test'"):
        fashion_mnist("validation")


def test_load_fashion_standardizes_with_public_constants(no_fashion, monkeypatch):
    """Standardization uses the published constants, never statistics of the (private) data."""
    monkeypatch.setenv("CORRNOISE_DATA", str(no_fashion))
    fake_fashion(no_fashion / "fashion-mnist", n_train=8, n_test=5)
    ds = load("fashion-mnist")
    raw_tr, _ = fashion_mnist("train")
    raw_te, _ = fashion_mnist("test")
    assert (ds.info["standardize_mean"], ds.info["standardize_std"]) == (0.2860, 0.3530)
    np.testing.assert_allclose(ds.x_test, (raw_te - 0.2860) / 0.3530, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ds.x_train, (raw_tr - 0.2860) / 0.3530, rtol=1e-5, atol=1e-5)
    assert ds.x_train.dtype == np.float32 and ds.input_shape == (28, 28) and ds.num_classes == 10
    plain = load("fashion-mnist", standardize=False)
    np.testing.assert_array_equal(plain.x_train, raw_tr)
    assert "standardize_mean" not in plain.info


# --- digits, MNIST-1D, registry --------------------------------------------------------------

def test_digits_split_unchanged():
    """The fixed stratified 80/20 split (seed 0) and the constant 1/16 scaling, recomputed here."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    raw = load_digits()
    xtr, xte, ytr, yte = train_test_split((raw.data / 16.0).astype(np.float32), raw.target.astype(np.int64),
                                          test_size=0.2, random_state=0, stratify=raw.target)
    ds = load("digits")
    for a, b in zip(ds.arrays(), (xtr, ytr, xte, yte)):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    assert ds.x_train.shape == (1437, 64) and ds.x_test.shape == (360, 64)


def test_mnist1d_small_and_deterministic():
    pytest.importorskip("mnist1d")
    np.random.seed(123)
    random.seed(123)
    before = np.random.random(), random.random()
    np.random.seed(123)
    random.seed(123)
    ds = load("mnist1d", n_train=95, n_test=17)
    assert (np.random.random(), random.random()) == before  # global generators untouched
    assert ds.x_train.shape == (95, 40) and ds.x_test.shape == (17, 40)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert set(np.unique(np.concatenate([ds.y_train, ds.y_test]))) <= set(range(10))
    again = load("mnist1d", n_train=95, n_test=17)
    np.testing.assert_array_equal(ds.x_train, again.x_train)
    np.testing.assert_array_equal(ds.y_test, again.y_test)
    other = load("mnist1d", n_train=95, n_test=17, seed=7)
    assert not np.array_equal(ds.x_train, other.x_train)


def test_mnist1d_never_downloads(tmp_path, monkeypatch):
    pytest.importorskip("mnist1d")
    import mnist1d.data

    def refuse(*a, **k):
        raise AssertionError("network access")

    monkeypatch.setattr(mnist1d.data.requests, "get", refuse)
    monkeypatch.chdir(tmp_path)
    load("mnist1d", n_train=10, n_test=10)
    assert list(tmp_path.iterdir()) == []  # no pickle cache written either


def test_load_rejects_unknown_names_and_options():
    with pytest.raises(CorrnoiseError, match="^dataset: must be one of digits, mnist1d, fashion-mnist"):
        load("cifar10")
    with pytest.raises(CorrnoiseError, match="^n_train: is not an option"):
        load("digits", n_train=5)
    with pytest.raises(CorrnoiseError, match="^n_train: must be >= 1"):
        load("mnist1d", n_train=0)


def test_registry_metadata_and_tensors():
    assert set(DATASETS) == {"digits", "mnist1d", "fashion-mnist"}
    for spec in DATASETS.values():
        assert {"epochs", "batch_size", "lr", "clip_norm", "optimizer"} <= set(spec.defaults)
        assert spec.source and spec.num_classes == 10
    assert DATASETS["fashion-mnist"].defaults == {"epochs": 40, "batch_size": 2048, "optimizer": "sgd",
                                                  "lr": 4.0, "momentum": 0.9, "clip_norm": 0.1}
    ds = load("digits")
    xtr, ytr, xte, yte = ds.tensors()
    assert tuple(xtr.shape) == (1437, 64) and str(ytr.dtype) == "torch.int64"
    assert len(ds.train_dataset()) == 1437


# --- models -----------------------------------------------------------------------------------

def test_fashion_cnn_has_26010_parameters():
    import torch

    from corrnoise.models import fashion_cnn, model_for, num_parameters

    model = fashion_cnn()
    assert num_parameters(model) == 26_010
    assert num_parameters(model_for("fashion-mnist")) == 26_010
    assert model(torch.zeros(3, 28, 28)).shape == (3, 10)
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_small_models_match_their_datasets():
    import torch

    from corrnoise.models import mlp, model_for, num_parameters

    torch.manual_seed(0)  # the digits model: Linear(64, 32), Tanh, Linear(32, 10) (the former train._model)
    a = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
    torch.manual_seed(0)
    b = model_for("digits")
    assert [p.shape for p in a.parameters()] == [p.shape for p in b.parameters()]
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert num_parameters(mlp(64, 0, 10)) == 650
    m = model_for("mnist1d")
    assert num_parameters(m) == 11_658 and m(torch.zeros(4, 40)).shape == (4, 10)
    with pytest.raises(CorrnoiseError, match="^dataset:"):
        model_for("mnist")


def test_models_work_with_the_clipping_engine():
    """Training clips with the hook engine (corrnoise.torch.clipping): every built-in model must
    attach (no layer mixing examples) and give one norm per example after one backward."""
    import torch

    from corrnoise.models import model_for
    from corrnoise.torch.clipping import ClippingEngine

    for name, shape in (("fashion-mnist", (28, 28)), ("mnist1d", (40,))):
        model = model_for(name)
        engine = ClippingEngine(model, loss_reduction="mean", max_grad_norm=1.0)
        x, y = torch.randn(3, *shape), torch.tensor([1, 2, 3])
        torch.nn.functional.cross_entropy(model(x), y).backward()
        sums, norms = engine.clipped_sum(3)
        engine.detach()
        assert norms.shape == (3,) and bool(torch.isfinite(norms).all())
        assert [s.shape for s in sums] == [p.shape for p in model.parameters() if p.requires_grad]
