"""Objects that speak one array protocol only, to test how symm reads each."""


class DLPackOnly:
    """Hides every protocol of a numpy array but DLPack, like a torch tensor."""

    def __init__(self, arr):
        self._arr = arr

    def __dlpack__(self, stream=None):
        return self._arr.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


class FakeCudaArray:
    def __init__(self, **cai):
        self.__cuda_array_interface__ = {"version": 3, "strides": None, **cai}
