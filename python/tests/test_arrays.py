"""Reading array arguments (numpy, DLPack, CUDA array interface) and stream
arguments into what the C calls take."""

import ml_dtypes
import sys
import types

import numpy as np
import pytest
from fakes import DLPackOnly, FakeCudaArray

from symm._arrays import view
from symm._stream import as_stream, operation_stream


def test_numpy_strides_are_in_elements():
    a = np.zeros((4, 6), np.float32)
    v = view(a)
    assert (v.ptr, v.shape, v.strides, v.dtype) == (a.ctypes.data, (4, 6), (6, 1), "float32")
    assert v.memory == "host" and v.writable
    t = view(a.T[1:, ::2])
    assert t.shape == (5, 2) and t.strides == (1, 12) and t.ptr == a.ctypes.data + 4
    a.flags.writeable = False
    assert not view(a).writable


def test_bfloat16_numpy_keeps_its_name():
    assert view(np.zeros(3, ml_dtypes.bfloat16)).dtype == "bfloat16"
    assert view(np.zeros(3, np.float16)).dtype == "float16"


def test_byte_strides_that_split_elements_are_rejected():
    raw = np.zeros(64, np.uint8)
    odd = np.ndarray((3,), np.float32, buffer=raw, strides=(6,))
    with pytest.raises(ValueError, match="not whole 4-byte elements"):
        view(odd)


@pytest.mark.parametrize("make", [lambda a: a, lambda a: a.T, lambda a: a[1:, 2:5], lambda a: a[::2]])
def test_dlpack_matches_numpy(make):
    a = make(np.arange(48, dtype=np.float64).reshape(6, 8))
    d, n = view(DLPackOnly(a)), view(a)
    assert (d.ptr, d.shape, d.strides, d.dtype, d.memory) == (n.ptr, n.shape, n.strides, n.dtype, n.memory)
    assert any(type(k).__name__ == "PyCapsule" for k in d.keepalive), "the capsule (and so the memory) is kept"


def test_cuda_array_interface():
    v = view(FakeCudaArray(shape=(3, 5), typestr="<f2", data=(0xDEAD00, False)))
    assert (v.ptr, v.shape, v.strides, v.dtype) == (0xDEAD00, (3, 5), (5, 1), "float16")
    assert v.memory == "cuda" and v.writable
    v = view(FakeCudaArray(shape=(3, 5), typestr="<f4", data=(0xDEAD00, True), strides=(4, 12)))
    assert v.strides == (1, 3) and not v.writable
    assert v.accessible_from("cuda") and not v.accessible_from("host")


def test_non_arrays_and_too_many_dimensions():
    with pytest.raises(TypeError, match="list is not an array"):
        view([1.0, 2.0])
    with pytest.raises(ValueError, match="up to 8 dimensions"):
        view(np.zeros((1,) * 9))


def test_masked_arrays_are_refused():
    with pytest.raises(TypeError, match="x is a masked array"):
        view(np.ma.masked_array(np.ones(3), mask=[0, 1, 0]), name="x")


def test_foreign_byte_order_is_refused():
    with pytest.raises(TypeError, match="not in this machine's byte order"):
        view(np.zeros(3, np.dtype(np.float32).newbyteorder("S")))
    assert view(np.zeros(3, "|u1")).dtype == "uint8"  # bytes have no order


def test_immutable_objects_are_refused_as_outputs():
    """Writes into a numpy scalar land in a temporary; a jax array must not
    change. As inputs they are read."""
    with pytest.raises(ValueError, match="out is a numpy scalar, which is immutable"):
        view(np.float32(3), output=True, name="out")
    assert view(np.float32(3)).shape == ()
    jnp = pytest.importorskip("jax.numpy")
    with pytest.raises(ValueError, match="out is a jax array, which is immutable"):
        view(jnp.ones(4), output=True, name="out")
    assert view(jnp.ones(4)).shape == (4,)


class TorchLikeStream:
    cuda_stream = 0x1000


class CupyLikeStream:
    ptr = 0x2000


class ProtocolStream:
    def __cuda_stream__(self):
        return (0, 0x3000)


def test_stream_arguments():
    assert as_stream(None) is None and as_stream(0) is None
    assert as_stream(0x1234) == 0x1234
    assert as_stream(TorchLikeStream()) == 0x1000
    assert as_stream(CupyLikeStream()) == 0x2000
    assert as_stream(ProtocolStream()) == 0x3000
    with pytest.raises(TypeError, match="bool"):
        as_stream(True)
    with pytest.raises(TypeError, match="str"):
        as_stream("stream")


class FakeTorch(types.ModuleType):
    """What operation_stream reads of torch: a CUDA tensor's device and the
    current raw stream per device."""

    class Tensor:
        def __init__(self, device):
            self.is_cuda, self._device = device >= 0, device

        def get_device(self):
            return self._device

    def __init__(self, current):
        super().__init__("torch")
        self._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda device: current[device])


class FakeCupy(types.ModuleType):
    """cupy's ndarray and its current stream per device: the array's device
    is a context manager making its id current, as cupy's Device is."""

    class ndarray:
        def __init__(self, device):
            self.device = device

    def __init__(self, streams):
        super().__init__("cupy")
        self.current = []  # the devices entered, innermost last
        stream = lambda: types.SimpleNamespace(ptr=streams[self.current[-1]])  # noqa: E731
        self.cuda = types.SimpleNamespace(get_current_stream=stream)

    def device(self, id):
        cupy = self

        class Device:
            def __enter__(self):
                cupy.current.append(id)

            def __exit__(self, *exc):
                cupy.current.pop()

        return Device()


def test_operations_default_to_their_arrays_current_stream(monkeypatch):
    """With no stream given, an operation runs where the caller's framework
    queues its own work (a torch or cupy stream of its own, say), not on
    the NULL stream, which would let the caller read outputs early."""
    torch = FakeTorch({0: 0xA0, 1: 0})
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert operation_stream(None, torch.Tensor(0)) == 0xA0
    assert operation_stream(None, torch.Tensor(1)) is None  # the default stream
    assert operation_stream(None, torch.Tensor(-1)) is None  # a CPU tensor
    assert operation_stream(0x1234, torch.Tensor(0)) == 0x1234  # given wins
    cupy = FakeCupy({0: 0xC0, 1: 0xC1})
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    assert operation_stream(None, cupy.ndarray(cupy.device(1))) == 0xC1
    assert operation_stream(None, cupy.ndarray(cupy.device(0))) == 0xC0
    assert cupy.current == []
    assert operation_stream(None, np.zeros(3)) is None
    assert operation_stream(TorchLikeStream(), np.zeros(3)) == 0x1000
